//! `voiceclone train` / `voiceclone export` end to end on the tiny fixture models: the loss
//! falls below half its start, frozen tensors stay bit-identical and every trained one changes,
//! incompatible checkpoints are refused, bad data is reported by line, and the export has the
//! official CustomVoice layout and loads. Interrupted runs and their recovery are tested in
//! `train_recovery`, which shares the workspace and run helpers here.

use std::collections::BTreeMap;
use std::path::Path;

use crate::train_support::*;
use candle_core::{DType, Device};
use serde_json::Value;
use vc_core::hub::ModelSource;
use vc_model::files::ModelFiles;
use vc_model::ops::Numerics;
use vc_model::talker::Talker;

const MODEL: &str = "tiny-0b6";
/// Six utterances, batches of 3, 2 micro-batches per step: one optimizer step per epoch.
pub(crate) const TRAIN: &[&str] = &["--batch-size", "3", "--grad-accum", "2", "--epochs", "100"];

pub(crate) fn workspace(rows: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    make_workspace(
        dir.path(),
        MODEL,
        &synthetic_rows(rows, 11),
        &xvector(hidden(MODEL), 5),
        "",
    );
    dir
}

pub(crate) fn train(ws: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["train"];
    // Flags in `extra` win over the defaults of TRAIN.
    for pair in TRAIN.chunks(2) {
        if !extra.contains(&pair[0]) {
            args.extend_from_slice(pair);
        }
    }
    args.extend_from_slice(extra);
    voiceclone(ws, &args)
}

pub(crate) fn ok(o: &std::process::Output) {
    assert!(o.status.success(), "{}", text(o));
}

pub(crate) fn metrics(ws: &Path) -> Vec<Value> {
    std::fs::read_to_string(ws.join("checkpoints/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub(crate) fn latest(ws: &Path) -> String {
    std::fs::read_to_string(ws.join("checkpoints/latest"))
        .unwrap()
        .trim()
        .to_string()
}

/// Every tensor of a checkpoint's rank file (masters and moments), as raw bytes.
pub(crate) fn state(ws: &Path, step: usize) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    read_raw(&ws.join(format!("checkpoints/step-{step:07}/rank-00000.safetensors")))
}

#[test]
fn training_lowers_the_loss_freezes_and_exports_the_official_layout() {
    let ws = workspace(6);
    let ws = ws.path();
    let freeze = "talker.model.layers.1.mlp.*";
    let o = train(
        ws,
        &[
            "--max-steps",
            "30",
            "--lr",
            "1e-2",
            "--warmup-steps",
            "2",
            "--save-every",
            "10",
            "--freeze",
            freeze,
            "--speaker-name",
            "Alice",
        ],
    );
    ok(&o);
    let m = metrics(ws);
    assert_eq!(m.len(), 30);
    let first = m[0]["loss"].as_f64().unwrap();
    let last = m[29]["loss"].as_f64().unwrap();
    eprintln!("loss {first:.3} -> {last:.3}");
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    for (i, row) in m.iter().enumerate() {
        assert_eq!(row["step"].as_u64().unwrap() as usize, i + 1);
        for k in ["loss_talker", "loss_sub", "grad_norm", "lr", "seconds"] {
            assert!(row[k].as_f64().unwrap().is_finite(), "{k} in {row}");
        }
        assert_eq!(
            row["frames"].as_u64().unwrap(),
            m[0]["frames"].as_u64().unwrap()
        );
    }
    // Warm-up then cosine decay.
    assert_eq!(m[0]["lr"].as_f64().unwrap(), 5e-3);
    assert_eq!(m[1]["lr"].as_f64().unwrap(), 1e-2);
    assert!(m[29]["lr"].as_f64().unwrap() < 1e-3);
    let svg = std::fs::read_to_string(ws.join("checkpoints/loss.svg")).unwrap();
    assert!(svg.contains("<polyline"), "{svg}");
    // keep = 2 (default): the last two checkpoints remain.
    assert_eq!(latest(ws), "step-0000030");
    assert!(ws.join("checkpoints/step-0000020").is_dir());
    assert!(!ws.join("checkpoints/step-0000010").exists());

    // Frozen tensors are not trained (not in the checkpoint) and bit-identical in the export;
    // every trained tensor changed.
    let base = read_raw(&model_dir(MODEL).join("model.safetensors"));
    let ckpt = state(ws, 30);
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(ws.join("checkpoints/step-0000030/index.json")).unwrap(),
    )
    .unwrap();
    let params = index["params"].as_object().unwrap();
    let frozen: Vec<&String> = base
        .keys()
        .filter(|n| n.starts_with("talker.model.layers.1.mlp."))
        .collect();
    assert_eq!(frozen.len(), 3);
    let talker: Vec<&String> = base.keys().filter(|n| n.starts_with("talker.")).collect();
    assert_eq!(params.len(), talker.len() - frozen.len());
    let f32_of = |(dtype, _, bytes): &(String, Vec<usize>, Vec<u8>)| -> Vec<f32> {
        match dtype.as_str() {
            "BF16" => bytes
                .chunks(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            "F32" => bytes
                .chunks(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            d => panic!("{d}"),
        }
    };
    for name in params.keys() {
        let trained = f32_of(&ckpt[&format!("master.{name}")]);
        assert_ne!(trained, f32_of(&base[name]), "{name} did not change");
    }
    let export = read_raw(&ws.join("model/model.safetensors"));
    for name in &frozen {
        assert!(!params.contains_key(*name));
        assert_eq!(export[*name], base[*name], "frozen {name} changed");
    }
    assert!(export.keys().all(|n| !n.starts_with("speaker_encoder.")));
    assert_eq!(
        export.len(),
        base.keys()
            .filter(|n| !n.starts_with("speaker_encoder."))
            .count()
    );
    assert!(export.values().all(|(d, _, _)| d == "BF16"));
    // Row 3000 of the codec embedding is the x-vector (bf16).
    let h = hidden(MODEL);
    let emb = f32_of(&export["talker.model.codec_embedding.weight"]);
    let want: Vec<f32> = xvector(h, 5)
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    assert_eq!(&emb[3000 * h..3001 * h], &want[..]);
    // A trained tensor in the export is the checkpoint master rounded to bf16.
    let name = "talker.codec_head.weight";
    let master = f32_of(&ckpt[&format!("master.{name}")]);
    let rounded: Vec<f32> = master
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    assert_eq!(f32_of(&export[name]), rounded);

    // config.json: the CustomVoice layout with the lower-cased speaker name.
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(ws.join("model/config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["tts_model_type"], "custom_voice");
    assert_eq!(
        cfg["talker_config"]["spk_id"],
        serde_json::json!({"alice": 3000})
    );
    assert_eq!(
        cfg["talker_config"]["spk_is_dialect"],
        serde_json::json!({"alice": false})
    );
    for f in [
        "generation_config.json",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "speech_tokenizer/config.json",
        "speech_tokenizer/model.safetensors",
        "voiceclone-export.json",
    ] {
        assert!(ws.join("model").join(f).is_file(), "model/{f} missing");
    }
    // It loads like any model directory, and the talker runs.
    let files = ModelFiles::resolve(&ModelSource::Local(ws.join("model"))).unwrap();
    assert_eq!(files.config.tts_model_type, "custom_voice");
    let weights = files
        .load_weights(DType::F32, &Device::Cpu, |_| true)
        .unwrap();
    let talker = Talker::load(&weights, &files.config, Numerics::Fused).unwrap();
    let row = talker
        .codec_embedding
        .get(3000)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(row, want);

    // The marker records the speaker's pace on the manifest (docs/model.md §7.2): all its frames
    // over all its text tokens.
    let marker: Value = serde_json::from_str(
        &std::fs::read_to_string(ws.join("model/voiceclone-export.json")).unwrap(),
    )
    .unwrap();
    let tokenizer =
        vc_model::text::TextTokenizer::from_model(&ModelSource::Local(model_dir(MODEL))).unwrap();
    let tokens = |t: &str| tokenizer.assistant_prompt(t).unwrap().text().len();
    let (mut frames, mut text_tokens) = (0, 0);
    for line in std::fs::read_to_string(ws.join("data/train.jsonl"))
        .unwrap()
        .lines()
    {
        let row: Value = serde_json::from_str(line).unwrap();
        frames += row["audio_codes"].as_array().unwrap().len();
        text_tokens += tokens(row["text"].as_str().unwrap());
    }
    let pace = &marker["speaking_pace"]["alice"];
    assert_eq!(pace["utterances"], 6, "{marker}");
    let frames_per_token = pace["frames_per_token"].as_f64().unwrap();
    assert_eq!(frames_per_token, frames as f64 / text_tokens as f64);
    // `speak` sizes the speaker's budgets by it: a chunk whose end token never comes (the
    // `test-hooks` seam) stops at max(8 s, 3 × its tokens at that pace).
    if cfg!(feature = "test-hooks") {
        let long = "This sentence goes on for a good while, with enough words in it that three \
                    times the frames it should take are well beyond the eight seconds below \
                    which no budget ever goes, whatever the pace of the voice that speaks it.";
        let budget =
            ((3.0 * frames_per_token * tokens(long) as f64 - 1e-6).ceil() as usize).max(100);
        assert!(budget > 100, "a text long enough to pass the floor");
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_voiceclone"))
            .arg("--workdir")
            .arg(ws)
            .args(["speak", long, "--seed", "1", "-o"])
            .arg(ws.join("paced.wav"))
            .env(crate::speak_cli::NO_EOS.0, crate::speak_cli::NO_EOS.1)
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        ok(&o);
        let want = format!("no end of speech within its budget of {budget} frames");
        assert!(text(&o).contains(&want), "no {want:?} in: {}", text(&o));
    }

    // Running train again has nothing to do; export again replaces our own export.
    let o = train(
        ws,
        &[
            "--max-steps",
            "30",
            "--freeze",
            freeze,
            "--speaker-name",
            "Alice",
        ],
    );
    ok(&o);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("already finished"), "{}", text(&o));
    assert!(stdout.contains("model is up to date"), "{}", text(&o));
    // (-o is relative to the current directory, like every path flag.)
    let other = ws.join("other");
    // (A leftover of an interrupted export to the same place is cleaned up.)
    std::fs::create_dir_all(ws.join(".other.tmp-export-1")).unwrap();
    let o = voiceclone(
        ws,
        &[
            "export",
            "--speaker-name",
            "Bob",
            "-o",
            other.to_str().unwrap(),
        ],
    );
    ok(&o);
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(ws.join("other/config.json")).unwrap())
            .unwrap();
    assert_eq!(
        cfg["talker_config"]["spk_id"],
        serde_json::json!({"bob": 3000})
    );
    assert!(!ws.join(".other.tmp-export-1").exists());
    // A directory that is not an export is never replaced.
    std::fs::create_dir_all(ws.join("mine")).unwrap();
    std::fs::write(ws.join("mine/notes.txt"), "keep me").unwrap();
    let o = voiceclone(ws, &["export", "-o", ws.join("mine").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("not written by `voiceclone export`"),
        "{}",
        text(&o)
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("mine/notes.txt")).unwrap(),
        "keep me"
    );
}

#[test]
fn incompatible_checkpoints_are_refused_and_fresh_moves_them_aside() {
    let ws = workspace(6);
    let ws = ws.path();
    // No speaker embedding yet: train computes it from data/ref.wav first.
    std::fs::remove_file(ws.join("data/speaker.safetensors")).unwrap();
    std::fs::copy(fixtures().join("audio/ref24k.wav"), ws.join("data/ref.wav")).unwrap();
    let o = train(ws, &["--max-steps", "2", "--lr", "1e-3"]);
    ok(&o);
    assert!(
        String::from_utf8_lossy(&o.stdout)
            .contains("running `voiceclone embed data/ref.wav` first"),
        "{}",
        text(&o)
    );
    assert!(ws.join("data/speaker.safetensors").is_file());
    // Changing what the math depends on is refused with the reason.
    let o = train(ws, &["--max-steps", "4", "--batch-size", "2"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("train.batch_size was 3, now 2") && t.contains("--fresh"),
        "{t}"
    );
    let o = train(ws, &["--max-steps", "4", "--freeze", "talker.codec_head.*"]);
    assert!(text(&o).contains("another set of tensors"), "{}", text(&o));
    // Another model of the same shape: a copy of the fixture whose config.json differs.
    let other = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(model_dir(MODEL)).unwrap() {
        let e = e.unwrap();
        let to = other.path().join(e.file_name());
        if e.file_name() == "config.json" {
            let cfg: Value =
                serde_json::from_str(&std::fs::read_to_string(e.path()).unwrap()).unwrap();
            std::fs::write(&to, serde_json::to_string(&cfg).unwrap()).unwrap();
        } else {
            std::os::unix::fs::symlink(e.path(), &to).unwrap();
        }
    }
    let o = train(
        ws,
        &[
            "--max-steps",
            "4",
            "--model",
            other.path().to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("another base model"), "{}", text(&o));
    // A model of another size: its speaker embedding width already differs.
    let o = train(
        ws,
        &[
            "--max-steps",
            "4",
            "--model",
            model_dir("tiny-1b7").to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    assert!(
        text(&o).contains("run `voiceclone embed` again"),
        "{}",
        text(&o)
    );
    // The learning rate and the step budget may change.
    let o = train(ws, &["--max-steps", "3", "--lr", "2e-3"]);
    ok(&o);
    assert_eq!(latest(ws), "step-0000003");
    // New data: the run continues, restarting the current epoch with it.
    let manifest = ws.join("data/train.jsonl");
    let extra = synthetic_rows(7, 11).pop().unwrap();
    let body = std::fs::read_to_string(&manifest).unwrap() + &format!("{extra}\n");
    std::fs::write(&manifest, body).unwrap();
    let o = train(ws, &["--max-steps", "4", "--lr", "2e-3"]);
    ok(&o);
    assert!(
        text(&o).contains("changed since that checkpoint"),
        "{}",
        text(&o)
    );
    assert_eq!(latest(ws), "step-0000004");
    // A fresh start that the run's own checks refuse (choosing by the samples' score with
    // nothing held out to speak) leaves the old run where it was.
    let o = train(ws, &["--max-steps", "1", "--select", "score", "--fresh"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("there are no samples"), "{}", text(&o));
    assert!(!ws.join("checkpoints.1").exists());
    assert_eq!(latest(ws), "step-0000004");
    // Restarts are for sharded runs: on one device the setting is named, not silently ignored.
    let o = train(
        ws,
        &["--max-steps", "5", "--lr", "2e-3", "--max-restarts", "2"],
    );
    ok(&o);
    assert!(
        text(&o).contains("train.max_restarts (2) applies to sharded runs"),
        "{}",
        text(&o)
    );
    // --fresh keeps the old run.
    let o = train(ws, &["--max-steps", "1", "--batch-size", "2", "--fresh"]);
    ok(&o);
    assert!(ws.join("checkpoints.1/step-0000005/index.json").is_file());
    assert_eq!(latest(ws), "step-0000001");
}

#[test]
fn bad_data_is_reported_by_line() {
    let ws = workspace(4);
    let ws = ws.path();
    let manifest = ws.join("data/train.jsonl");
    let mut lines: Vec<Value> = std::fs::read_to_string(&manifest)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    lines[1]["audio_codes"][0] = serde_json::json!([1, 2, 3]);
    lines[2]["audio_codes"][1][4] = serde_json::json!(5000);
    lines[3].as_object_mut().unwrap().remove("text");
    let mut body: String = lines.iter().map(|l| format!("{l}\n")).collect();
    // A line cut off mid-write is one more bad line of the list, not an error of its own.
    let full = lines[0].to_string();
    body.push_str(&format!("{}\n", &full[..full.len() / 2]));
    std::fs::write(&manifest, body).unwrap();
    let o = train(ws, &["--max-steps", "1"]);
    assert!(!o.status.success());
    let t = text(&o);
    let path = manifest.display().to_string();
    assert!(t.contains("4 line(s)"), "{t}");
    assert!(
        t.contains(&format!("{path}:5: not a valid JSON object")),
        "{t}"
    );
    assert!(
        t.contains(&format!("{path}:2: \"audio_codes\" frame 0 has 3 codes")),
        "{t}"
    );
    assert!(
        t.contains(&format!("{path}:3: \"audio_codes\" frame 1 has code 5000")),
        "{t}"
    );
    assert!(t.contains(&format!("{path}:4: no \"text\"")), "{t}");
    assert!(!t.contains(&format!("{path}:1:")), "{t}");
    assert!(!ws.join("checkpoints/latest").exists());

    // A line without codes whose audio is missing: `codes` runs first and reports it, then
    // training names the line.
    let ws2 = workspace(3);
    let ws2 = ws2.path();
    let manifest = ws2.join("data/train.jsonl");
    let mut lines: Vec<Value> = std::fs::read_to_string(&manifest)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    lines[2].as_object_mut().unwrap().remove("audio_codes");
    let body: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&manifest, body).unwrap();
    let o = train(ws2, &["--max-steps", "1"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("running `voiceclone codes` first"), "{t}");
    assert!(
        t.contains(&format!(
            "{}:3: no \"audio_codes\": its audio file",
            manifest.display()
        )),
        "{t}"
    );

    // No speaker embedding and no reference clip: the missing file is named.
    std::fs::remove_file(ws2.join("data/speaker.safetensors")).unwrap();
    let o = train(ws2, &["--max-steps", "1"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("ref_audio") && t.contains("data/ref.wav") && t.contains(":1:"),
        "{t}"
    );
}
