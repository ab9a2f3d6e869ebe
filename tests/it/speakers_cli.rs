//! Several voices in one workspace and one fine-tune (docs/training.md §3.3), on the fixture
//! model with synthetic codes: every batch row carries its own speaker's x-vector at position 6
//! (against a batch built by hand), checkpoints record the speaker set and refuse a changed one,
//! `--speaker-balance` reaches the sampler, the export holds one row per speaker equal to its
//! x-vector (bf16), `speak --speaker` differs per speaker, and bad multi-speaker manifests are
//! refused by line. The workspace and output helpers here are shared with `speakers_prep_embed`.

use std::path::Path;

use crate::train_support::*;
use candle_core::{Device, IndexOp, Tensor};
use serde_json::{json, Value};
use vc_core::hub::ModelSource;
use vc_model::files::ModelFiles;
use vc_train::batch::{Batch, SPEAKER_POS};
use vc_train::hooks::NoHooks;
use vc_train::step::loss;
use vc_train::{Backend, TrainOptions, Trainer};

pub(crate) const MODEL: &str = "tiny-0b6";

/// Speaker of synthetic row i: six of "Bob", two of "alice" (sorted: alice = 0, Bob = 1).
const SPEAKERS: &[&str] = &["Bob", "alice", "Bob", "Bob", "Bob", "alice", "Bob", "Bob"];

fn seed_of(name: &str) -> u64 {
    name.bytes().map(u64::from).sum()
}

/// A workspace of `names.len()` synthetic rows, row i spoken by `names[i]`, and one x-vector
/// file per speaker in `data/speakers/`.
pub(crate) fn named_workspace(names: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let h = hidden(MODEL);
    let rows: Vec<Value> = synthetic_rows(names.len(), 11)
        .into_iter()
        .zip(names)
        .map(|(mut r, n)| {
            r["speaker"] = json!(n);
            r["ref_audio"] = json!(format!("data/ref/{n}.wav"));
            r
        })
        .collect();
    make_workspace(dir.path(), MODEL, &rows, &xvector(h, 1), "");
    std::fs::remove_file(dir.path().join("data/speaker.safetensors")).unwrap();
    let mut uniq: Vec<&str> = names.to_vec();
    uniq.sort();
    uniq.dedup();
    for n in uniq {
        write_xvector(dir.path(), n, &xvector(h, seed_of(n)));
    }
    dir
}

fn write_xvector(ws: &Path, name: &str, x: &[f32]) {
    let path = ws.join(format!("data/speakers/{name}.safetensors"));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(
        path,
        vc_core::artifacts::speaker::to_bytes(x, None).unwrap(),
    )
    .unwrap();
}

pub(crate) fn ok(o: &std::process::Output) {
    assert!(o.status.success(), "{}", text(o));
}

pub(crate) fn fails_with(o: &std::process::Output, what: &str) {
    assert!(!o.status.success(), "expected a failure: {}", text(o));
    assert!(text(o).contains(what), "expected {what:?} in: {}", text(o));
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn every_batch_row_carries_its_own_speakers_x_vector() {
    let ws = named_workspace(SPEAKERS);
    let dir = ws.path();
    let mut config = vc_core::config::resolve_layers(vec![])
        .unwrap()
        .config
        .train;
    config.batch_size = 4;
    config.shuffle = false;
    let opts = TrainOptions {
        files: ModelFiles::resolve(&ModelSource::Local(model_dir(MODEL))).unwrap(),
        model_spec: MODEL.into(),
        manifest: dir.join("data/train.jsonl"),
        base_dir: dir.to_path_buf(),
        speaker: dir.join("data/speakers"),
        checkpoints: dir.join("checkpoints"),
        config,
        device: Device::Cpu,
        backend: Backend::Kernels,
        hooks: std::sync::Arc::new(NoHooks),
        evaluator: evaluator(),
    };
    let mut tr = Trainer::new(opts, false).unwrap();
    let h = hidden(MODEL);
    // Speakers sorted by lower-cased name; each sample knows its own.
    assert_eq!(tr.run.dataset.speakers, ["alice", "Bob"]);
    let by_hand: Vec<usize> = SPEAKERS.iter().map(|&n| usize::from(n == "Bob")).collect();
    let got: Vec<usize> = tr.run.dataset.samples.iter().map(|s| s.speaker).collect();
    assert_eq!(got, by_hand);
    // The speaker table: row s is speaker s's file.
    assert_eq!(tr.run.speaker.dims(), &[2, h]);
    let table: Vec<Vec<f32>> = tr.run.speaker.to_vec2().unwrap();
    assert_eq!(table[0], xvector(h, seed_of("alice")));
    assert_eq!(table[1], xvector(h, seed_of("Bob")));

    // A batch mixing both speakers: rows 1, 0, 5, 2 of the manifest.
    let pick = [1usize, 0, 5, 2];
    let samples: Vec<_> = pick.iter().map(|&i| &tr.run.dataset.samples[i]).collect();
    let batch = Batch::build(&samples, &tr.run.layout);
    let want: Vec<u32> = pick.iter().map(|&i| by_hand[i] as u32).collect();
    assert_eq!(batch.speakers, want);
    let bt = batch.to_tensors(&Device::Cpu).unwrap();
    assert_eq!(bt.speaker_index.to_vec1::<u32>().unwrap(), want);

    // The embeddings with the table, against those with no x-vector at all plus, by hand,
    // each row's own x-vector at position 6 (and nothing anywhere else).
    let e = loss::input_embeddings(&tr.talker, &bt, &tr.run.speaker).unwrap();
    let zeros = Tensor::zeros((2, h), candle_core::DType::F32, &Device::Cpu).unwrap();
    let e0 = loss::input_embeddings(&tr.talker, &bt, &zeros).unwrap();
    let diff = (&e - &e0).unwrap();
    let n = batch.len;
    for (r, &i) in pick.iter().enumerate() {
        let x = Tensor::new(table[by_hand[i]].as_slice(), &Device::Cpu).unwrap();
        let at = diff.i((r, SPEAKER_POS)).unwrap();
        let d = max_abs(&at, &x);
        assert!(
            d <= 1e-6,
            "row {r}: position 6 differs from its x-vector by {d}"
        );
        for p in (0..n).filter(|&p| p != SPEAKER_POS) {
            let z = diff.i((r, p)).unwrap().abs().unwrap().max(0).unwrap();
            assert_eq!(z.to_scalar::<f32>().unwrap(), 0.0, "row {r} position {p}");
        }
    }
    // The table's order matters: swapped rows give every row the other speaker's vector.
    let swapped = Tensor::new(vec![table[1].clone(), table[0].clone()], &Device::Cpu).unwrap();
    let es = loss::input_embeddings(&tr.talker, &bt, &swapped).unwrap();
    assert!(
        max_abs(
            &es.i((.., SPEAKER_POS)).unwrap(),
            &e.i((.., SPEAKER_POS)).unwrap()
        ) > 0.1
    );
    assert_eq!(
        max_abs(
            &es.i((.., 0..SPEAKER_POS)).unwrap(),
            &e.i((.., 0..SPEAKER_POS)).unwrap()
        ),
        0.0
    );
    // And the loss sees it.
    let (l, _) = tr.batch_loss(&pick).unwrap();
    let l_swapped = loss::sft_loss(&tr.talker, &bt, &swapped).unwrap();
    assert_ne!(
        l.total.to_scalar::<f32>().unwrap(),
        l_swapped.total.to_scalar::<f32>().unwrap()
    );
}

fn train(ws: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "train",
        "--batch-size",
        "2",
        "--grad-accum",
        "1",
        "--epochs",
        "100",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "0",
    ];
    args.extend_from_slice(extra);
    voiceclone(ws, &args)
}

fn f32_rows(path: &Path, name: &str, rows: std::ops::Range<usize>, h: usize) -> Vec<Vec<f32>> {
    let raw = read_raw(path);
    let (dtype, _, bytes) = &raw[name];
    assert_eq!(dtype, "BF16");
    rows.map(|r| {
        bytes[r * h * 2..(r + 1) * h * 2]
            .chunks(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    })
    .collect()
}

pub(crate) fn wav(path: &Path) -> Vec<i16> {
    let mut r = hound::WavReader::open(path).unwrap();
    r.samples::<i16>().map(|s| s.unwrap()).collect()
}

/// Model rows 3000 and 3001 against the two x-vectors: max |diff| and whether each row is the
/// x-vector rounded to bf16 exactly.
pub(crate) fn check_rows(ws: &Path, names: [&str; 2]) -> f32 {
    let h = hidden(MODEL);
    let rows = f32_rows(
        &ws.join("model/model.safetensors"),
        "talker.model.codec_embedding.weight",
        3000..3002,
        h,
    );
    let mut worst = 0f32;
    for (row, name) in rows.iter().zip(names) {
        let x = vc_core::artifacts::speaker::read(
            &ws.join(format!("data/speakers/{name}.safetensors")),
        )
        .unwrap();
        let rounded: Vec<f32> = x
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(row, &rounded, "row of {name} is not its x-vector in bf16");
        for (a, b) in row.iter().zip(&x) {
            worst = worst.max((a - b).abs());
            assert!(
                (a - b).abs() <= b.abs() * 2f32.powi(-8),
                "{name}: {a} vs {b}"
            );
        }
    }
    worst
}

#[test]
fn two_speakers_train_export_and_speak_apart() {
    let ws = named_workspace(SPEAKERS);
    let ws = ws.path();
    let o = train(ws, &["--max-steps", "3", "--save-every", "3"]);
    ok(&o);
    // The checkpoint records the speaker set and keeps the speakers' x-vectors.
    let step = ws.join("checkpoints/step-0000003");
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(step.join("index.json")).unwrap()).unwrap();
    let names: Vec<&str> = index["identity"]["speakers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["alice", "Bob"]);
    assert!(index["identity"].get("speaker_balance").is_none());
    assert!(step.join("speakers.safetensors").is_file());
    assert!(!step.join("speaker.safetensors").exists());

    // The export: one spk_id per speaker, rows 3000 and 3001 their x-vectors (bf16).
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(ws.join("model/config.json")).unwrap())
            .unwrap();
    assert_eq!(
        cfg["talker_config"]["spk_id"],
        json!({"alice": 3000, "bob": 3001})
    );
    assert_eq!(
        cfg["talker_config"]["spk_is_dialect"],
        json!({"alice": false, "bob": false})
    );
    let worst = check_rows(ws, ["alice", "Bob"]);
    eprintln!("export rows vs x-vectors: max |diff| {worst:.3e} (bf16 rounding)");
    // VOICECLONE_KEEP_WORKSPACE=DIR keeps a copy of this workspace, so that the official package
    // can be run on its export by hand (`scripts/reference/check_export.py DIR/model --speaker
    // alice --xvector DIR/data/speakers/alice.safetensors`; docs/usage.md §6).
    if let Some(keep) = std::env::var_os("VOICECLONE_KEEP_WORKSPACE") {
        let st = std::process::Command::new("cp")
            .arg("-r")
            .arg(ws)
            .arg(&keep)
            .status()
            .unwrap();
        assert!(st.success(), "copying the workspace to {keep:?}");
    }
    // Training again has nothing to do, and the export is up to date.
    let o = train(ws, &["--max-steps", "3"]);
    ok(&o);
    assert!(text(&o).contains("model is up to date"), "{}", text(&o));

    // speak --speaker NAME: each speaker speaks, differently; without --speaker the names.
    let speak = |who: Option<&str>, out: &str| {
        let out = ws.join(out);
        let mut args = vec!["speak", "Hello there.", "-o", out.to_str().unwrap()];
        args.extend(["--greedy", "--max-frames", "10", "--save-codes"]);
        let codes = format!("{}.json", out.display());
        args.push(&codes);
        let who = who.map(|w| ["--speaker", w]);
        if let Some(w) = &who {
            args.extend(w);
        }
        let o = voiceclone(ws, &args);
        (o, out)
    };
    let (a, alice) = speak(Some("alice"), "alice.wav");
    ok(&a);
    let (b, bob) = speak(Some("BOB"), "bob.wav");
    ok(&b);
    let (wa, wb) = (wav(&alice), wav(&bob));
    assert!(!wa.is_empty() && !wb.is_empty());
    let codes = |p: &Path| std::fs::read_to_string(format!("{}.json", p.display())).unwrap();
    assert_ne!(
        codes(&alice),
        codes(&bob),
        "both speakers gave the same codes"
    );
    assert!(wa != wb, "both speakers gave the same audio");
    let (none, _) = speak(None, "none.wav");
    fails_with(
        &none,
        "several speakers (alice, bob); choose one with --speaker",
    );

    // `voiceclone speakers` sees both, with their rows.
    let o = voiceclone(ws, &["speakers", "--json"]);
    ok(&o);
    let rows: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["speaker"], "alice");
    assert_eq!(rows[0]["utterances"], 2);
    assert_eq!(rows[0]["coded"], 2);
    assert_eq!(rows[0]["model_row"], 3000);
    assert_eq!(rows[0]["x_vector"], "data/speakers/alice.safetensors");
    assert_eq!(rows[1]["speaker"], "Bob");
    assert_eq!(rows[1]["utterances"], 6);
    assert_eq!(rows[1]["model_row"], 3001);
    let o = voiceclone(ws, &["speakers"]);
    ok(&o);
    let table = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(table.starts_with("speaker"), "{table}");
    assert!(table.contains("row 3001"), "{table}");

    // --speaker-name belongs to single-speaker workspaces.
    fails_with(
        &train(ws, &["--max-steps", "3", "--speaker-name", "x"]),
        "names its speakers (alice, Bob)",
    );
    fails_with(
        &voiceclone(ws, &["export", "--speaker-name", "x"]),
        "holds the named speakers alice, Bob",
    );

    // Resuming with another speaker set, or another x-vector of one speaker, is refused.
    let manifest = ws.join("data/train.jsonl");
    let original = std::fs::read_to_string(&manifest).unwrap();
    let mut extra: Value = synthetic_rows(1, 99).remove(0);
    extra["speaker"] = json!("carol");
    std::fs::write(&manifest, format!("{original}{extra}\n")).unwrap();
    write_xvector(ws, "carol", &xvector(hidden(MODEL), 77));
    fails_with(
        &train(ws, &["--max-steps", "6"]),
        "the speaker set changed: alice, Bob then, alice, Bob, carol now",
    );
    std::fs::write(&manifest, &original).unwrap();
    let bob_file = ws.join("data/speakers/Bob.safetensors");
    let bob_x = std::fs::read(&bob_file).unwrap();
    write_xvector(ws, "Bob", &xvector(hidden(MODEL), 1234));
    fails_with(
        &train(ws, &["--max-steps", "6"]),
        "the x-vector of speaker \"Bob\" (data/speakers/Bob.safetensors) changed",
    );
    std::fs::write(&bob_file, bob_x).unwrap();
    fails_with(
        &train(ws, &["--max-steps", "6", "--speaker-balance"]),
        "train.speaker_balance was false, now true",
    );
    ok(&train(ws, &["--max-steps", "4", "--no-export"]));

    // --speaker-balance reaches the sampler: 6 + 2 utterances in batches of 2 are 4 steps an
    // epoch; balanced, alice's two are repeated to six (rounds of 8, 2, 2): 6 steps.
    let o = train(ws, &["--fresh", "--max-steps", "1", "--no-export"]);
    ok(&o);
    assert!(text(&o).contains("100 epochs × 4 steps"), "{}", text(&o));
    let o = train(
        ws,
        &[
            "--fresh",
            "--max-steps",
            "1",
            "--no-export",
            "--speaker-balance",
        ],
    );
    ok(&o);
    assert!(text(&o).contains("100 epochs × 6 steps"), "{}", text(&o));
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(ws.join("checkpoints/step-0000001/index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["identity"]["speaker_balance"], true);
}

#[test]
fn bad_multi_speaker_manifests_are_refused_by_line_and_write_nothing() {
    // A line without a speaker among named ones.
    let ws = named_workspace(&["Bob", "alice", "Bob"]);
    let ws = ws.path();
    let manifest = ws.join("data/train.jsonl");
    let text_of = std::fs::read_to_string(&manifest).unwrap();
    let mut lines: Vec<Value> = text_of
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    lines[1].as_object_mut().unwrap().remove("speaker");
    let write = |lines: &[Value]| {
        let t: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&manifest, t).unwrap();
    };
    write(&lines);
    let o = train(ws, &["--max-steps", "1"]);
    fails_with(
        &o,
        "train.jsonl:2: no \"speaker\" field, but other lines name speakers (Bob)",
    );
    assert!(!ws.join("checkpoints").exists());
    // Two names that differ only in case.
    lines[1]["speaker"] = json!("bob");
    write(&lines);
    fails_with(
        &train(ws, &["--max-steps", "1"]),
        "train.jsonl:2: the speaker \"bob\" differs from \"Bob\" (line 1) only in case",
    );
    // A name with a path separator.
    lines[1]["speaker"] = json!("../alice");
    write(&lines);
    fails_with(
        &train(ws, &["--max-steps", "1"]),
        "the speaker name \"../alice\" starts with a dot",
    );
    lines[1]["speaker"] = json!("al/ice");
    write(&lines);
    fails_with(
        &train(ws, &["--max-steps", "1"]),
        "the speaker name \"al/ice\" contains a path separator",
    );
    assert!(!ws.join("checkpoints").exists());
    // A speaker without an x-vector and without a reference clip to compute it from.
    lines[1]["speaker"] = json!("dee");
    write(&lines);
    fails_with(
        &train(ws, &["--max-steps", "1"]),
        "no reference clip for speaker \"dee\": data/ref/dee.wav does not exist",
    );
    assert!(!ws.join("checkpoints").exists());
    assert!(!ws.join("data/speakers/dee.safetensors").exists());
    // embed for a speaker without utterances names it.
    fails_with(
        &voiceclone(ws, &["embed", "--speaker", "eve"]),
        "speaker \"eve\" has no utterances in data/train.jsonl (its speakers: Bob, dee)",
    );
    fails_with(
        &voiceclone(ws, &["embed", "--speaker", "e/ve"]),
        "the speaker name \"e/ve\" contains a path separator",
    );
    // A fine-tuned workspace whose manifest names speakers refuses an unnamed prep before any
    // work (no Whisper model needed to say so).
    fails_with(
        &voiceclone(ws, &["prep", ws.join("data").to_str().unwrap()]),
        "holds the named speakers Bob, dee; `voiceclone prep` without --speaker would replace",
    );
}
