//! The model card of every export (docs/training.md §10): `README.md` with YAML front matter and
//! the run's numbers, the samples beside it. Every number is checked against the test's own
//! reading of `metrics.jsonl`, the checkpoint's index and the manifest; the sample files against
//! the evaluation's WAVs. A full export of the bf16- and the f32-stored fixture (the first from
//! a base in the Hugging Face cache's layout with a README of its own, so the card's
//! `base_model` and `license` come from the base), and an adapter-only export of a run with
//! nothing held out (the card says there is no evaluation).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::dist_support::ok;
use crate::train_samples::{train, workspace};
use crate::train_support::*;

const HUB_ID: &str = "Qwen/Qwen3-TTS-12Hz-0.6B-Base";

/// A tiny reader of the front matter's YAML subset the card uses: `key: scalar` and `key:`
/// followed by `- item` lines; `None` when the file does not open with `---`.
fn front_matter(card: &str) -> Option<BTreeMap<String, Vec<String>>> {
    let mut lines = card.lines();
    if lines.next()? != "---" {
        return None;
    }
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut last = None;
    for line in lines {
        if line == "---" {
            return Some(out);
        }
        if let Some(item) = line.strip_prefix("- ") {
            out.get_mut(last.as_ref()?)?.push(item.to_string());
        } else {
            let (k, v) = line.split_once(':')?;
            let v = v.trim().trim_matches('"');
            out.insert(
                k.to_string(),
                if v.is_empty() { vec![] } else { vec![v.into()] },
            );
            last = Some(k.to_string());
        }
    }
    None
}

/// The cells of the card's table rows whose first cell is `first`.
fn rows<'a>(card: &'a str, first: &str) -> Vec<Vec<&'a str>> {
    card.lines()
        .filter_map(|l| l.strip_prefix("| ")?.strip_suffix(" |"))
        .map(|l| l.split(" | ").collect::<Vec<_>>())
        .filter(|cells| cells[0] == first)
        .collect()
}

fn row<'a>(card: &'a str, first: &str) -> Vec<&'a str> {
    let mut r = rows(card, first);
    assert_eq!(r.len(), 1, "one row {first:?} in\n{card}");
    r.remove(0)
}

fn f4(v: &Value) -> String {
    format!("{:.4}", v.as_f64().unwrap())
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A copy of the fixture model in the Hugging Face cache's layout, with a README of its own.
fn cached_base(root: &Path) -> std::path::PathBuf {
    let snap = root.join("hub/models--Qwen--Qwen3-TTS-12Hz-0.6B-Base/snapshots/0123abc");
    std::fs::create_dir_all(&snap).unwrap();
    for e in std::fs::read_dir(model_dir("tiny-0b6")).unwrap() {
        let e = e.unwrap();
        let target = std::fs::canonicalize(e.path()).unwrap();
        std::os::unix::fs::symlink(target, snap.join(e.file_name())).unwrap();
    }
    std::fs::write(
        snap.join("README.md"),
        "---\nlicense: test-license\npipeline_tag: text-to-speech\n---\n# The base\n",
    )
    .unwrap();
    snap
}

/// What every card of a merged export says, checked against the run's files.
fn check_model_card(ws: &Path, out: &Path, tag: &str) -> String {
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    // Kept for a look by eye (`VOICECLONE_CARD_COPY=DIR`: DIR/<tag>.md).
    if let Some(dest) = std::env::var_os("VOICECLONE_CARD_COPY") {
        let dest = std::path::PathBuf::from(dest);
        std::fs::create_dir_all(&dest).unwrap();
        std::fs::write(dest.join(format!("{tag}.md")), &card).unwrap();
    }
    let fm = front_matter(&card).unwrap_or_else(|| panic!("{tag}: no front matter\n{card}"));
    assert_eq!(fm["base_model_relation"], ["finetune"], "{tag}");
    assert_eq!(fm["pipeline_tag"], ["text-to-speech"], "{tag}");
    assert_eq!(fm["library_name"], ["qwen-tts"], "{tag}");
    for t in ["voiceclone", "qwen3-tts"] {
        assert!(fm["tags"].iter().any(|x| x == t), "{tag}: {fm:?}");
    }
    let marker = json(&out.join("voiceclone-export.json"));
    let step = marker["step"].as_u64().unwrap();
    let ckpt = ws.join(format!("checkpoints/{}", step_name(step)));
    let index = json(&ckpt.join("index.json"));

    // Data per speaker, from the manifest read here: 12 utterances of the one speaker.
    let manifest: Vec<Value> = std::fs::read_to_string(ws.join("data/train.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let frames: usize = manifest
        .iter()
        .map(|r| r["audio_codes"].as_array().unwrap().len())
        .sum();
    let seconds = frames as f64 / 12.5;
    let speaker_rows = rows(&card, "speaker");
    let data_row = speaker_rows.iter().find(|r| r[1] == "3000").unwrap();
    assert_eq!(
        *data_row,
        [
            "speaker",
            "3000",
            &manifest.len().to_string(),
            &frames.to_string(),
            &format!("{seconds:.1} s")
        ],
        "{tag}"
    );
    let held = index["identity"]["heldout"]["utterances"].as_u64().unwrap();
    assert!(
        card.contains(&format!("{held} utterance(s) were held out")),
        "{tag}"
    );

    // Training, from the index and metrics.jsonl.
    assert_eq!(row(&card, "optimizer steps")[1], step.to_string(), "{tag}");
    assert_eq!(
        row(&card, "world size")[1],
        index["world_size"].to_string(),
        "{tag}"
    );
    let lines: Vec<Value> = std::fs::read_to_string(ws.join("checkpoints/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let lrs: Vec<(u64, f64)> = lines
        .iter()
        .filter(|l| l.get("lr").is_some() && l["step"].as_u64().unwrap() <= step)
        .map(|l| (l["step"].as_u64().unwrap(), l["lr"].as_f64().unwrap()))
        .collect();
    let peak = lrs.iter().map(|l| l.1).fold(f64::MIN, f64::max);
    let peak_step = lrs.iter().find(|l| l.1 == peak).unwrap().0;
    let at = lrs.iter().find(|l| l.0 == step).unwrap().1;
    // "peak P (first at step N), R at step S: …", to 4 significant digits.
    let lr = row(&card, "learning rate")[1];
    let words: Vec<&str> = lr
        .split([' ', ',', '(', ')', ':'])
        .filter(|w| !w.is_empty())
        .collect();
    let close = |w: &str, want: f64| (w.parse::<f64>().unwrap() - want).abs() <= 5e-4 * want;
    assert!(close(words[1], peak) && close(words[6], at), "{tag}: {lr}");
    assert_eq!(
        (words[5], words[9]),
        (peak_step.to_string().as_str(), step.to_string().as_str()),
        "{tag}: {lr}"
    );

    // The evaluation of the exported step and its samples.
    let eval = lines
        .iter()
        .rfind(|l| l.get("val_loss").is_some() && l["step"] == step)
        .unwrap_or_else(|| panic!("{tag}: no evaluation of step {step}"));
    assert_eq!(
        row(&card, "validation loss")[1],
        f4(&eval["val_loss"]),
        "{tag}"
    );
    assert_eq!(row(&card, "sample score")[1], f4(&eval["score"]), "{tag}");
    let samples = eval["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 2, "{tag}");
    for (i, s) in samples.iter().enumerate() {
        let r = row(&card, &(i + 1).to_string());
        let file = format!("samples/speaker-{}.wav", i + 1);
        assert_eq!(
            r[1..],
            [
                "speaker",
                s["text"].as_str().unwrap(),
                &format!("[speaker-{}.wav]({file})", i + 1),
                &f4(&s["similarity"]),
                &f4(&s["rate_ratio"]),
                "—",
                if s["eos"].as_bool().unwrap() {
                    "yes"
                } else {
                    "no (frame limit)"
                }
            ],
            "{tag}"
        );
        assert_eq!(
            std::fs::read(out.join(&file)).unwrap(),
            std::fs::read(ws.join(s["wav"].as_str().unwrap())).unwrap(),
            "{tag}: {file}"
        );
    }
    // The marker lists what the card wrote.
    assert_eq!(
        marker["card"],
        serde_json::json!([
            "README.md",
            "samples/speaker-1.wav",
            "samples/speaker-2.wav"
        ]),
        "{tag}"
    );
    card
}

#[test]
fn full_exports_carry_a_card_of_the_runs_own_numbers() {
    let (_keep, models) = crate::train_samples::models();
    for (model, stored) in &models {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        let base_dir = tempfile::tempdir().unwrap();
        // The bf16 fixture from a base in the hub cache's layout, the f32 copy from a plain
        // local directory.
        let (base, hub) = if *stored == "bf16" {
            (cached_base(base_dir.path()).display().to_string(), true)
        } else {
            (model.clone(), false)
        };
        std::fs::create_dir_all(&ws).unwrap();
        workspace(
            &ws,
            &base,
            Path::new("/nonexistent/ggml.bin"),
            "save_every = 2\n",
        );
        let tag = format!("{stored}-stored");
        ok(&train(
            &ws,
            &["--max-steps", "4", "--lr", "5e-2", "--backend", "kernels"],
        ));
        let model_dir = ws.join("model");
        let card = check_model_card(&ws, &model_dir, &tag);
        let fm = front_matter(&card).unwrap();
        if hub {
            assert_eq!(fm["base_model"], [HUB_ID], "{tag}");
            assert_eq!(fm["license"], ["test-license"], "{tag}: the base's own");
        } else {
            assert!(!fm.contains_key("base_model"), "{tag}: {fm:?}");
            assert!(card.contains("names no `base_model`"), "{tag}");
            assert_eq!(fm["license"], ["apache-2.0"], "{tag}");
        }
        // Training's own end knows its session.
        assert_eq!(
            row(&card, "backend")[1],
            "kernels on the CPU, weights computed in f32"
        );
        assert!(card.contains("`checkpoints/best` names it"), "{tag}");
        // Re-exported by `export` (the newest): card and samples are replaced with the export,
        // and the card says what the checkpoint does not record.
        ok(&voiceclone(&ws, &["export"]));
        let again = check_model_card(&ws, &model_dir, &tag);
        assert!(
            again.contains("is the newest checkpoint of the run"),
            "{tag}"
        );
        assert!(again.contains("not recorded in the checkpoint"), "{tag}");
        assert!(rows(&again, "backend").is_empty(), "{tag}");
    }
}

#[test]
fn an_adapter_only_export_carries_a_card_and_says_what_is_missing() {
    let ws = crate::train_cli::workspace(6);
    let ws = ws.path();
    ok(&crate::train_cli::train(
        ws,
        &["--lora-rank", "4", "--max-steps", "2"],
    ));
    let out = ws.join("adapter");
    ok(&voiceclone(ws, &["export", "--adapter-only"]));
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    let fm = front_matter(&card).unwrap();
    assert_eq!(fm["base_model_relation"], ["adapter"]);
    assert_eq!(fm["library_name"], ["peft"]);
    assert!(fm["tags"].iter().any(|t| t == "lora"), "{fm:?}");
    assert!(!fm.contains_key("base_model"), "{fm:?}");
    let index = json(&ws.join("checkpoints/step-0000002/index.json"));
    let targets = index["params"]
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.ends_with(".lora_A.weight"))
        .count();
    assert!(
        row(&card, "method")[1].starts_with(&format!("LoRA, rank 4, α 8, on {targets} matrices")),
        "{card}"
    );
    // Six utterances: nothing held out, so no evaluation and no samples; said, not left empty.
    assert!(
        card.contains("Nothing was held out for validation."),
        "{card}"
    );
    assert!(card.contains("no evaluation of step 2"), "{card}");
    assert!(rows(&card, "validation loss").is_empty());
    assert!(!out.join("samples").exists());
    let marker = json(&out.join("voiceclone-export.json"));
    assert_eq!(marker["card"], serde_json::json!(["README.md"]));
}
