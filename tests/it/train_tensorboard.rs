//! TensorBoard event files of training runs (docs/training.md §9.1), read back by TensorBoard's
//! own reader (`scripts/ci/tensorboard_events.py` in the test assets' venv): every scalar at
//! every step equals its number in `metrics.jsonl` (as a float32), no step appears twice after a
//! killed run is resumed, and each sample's audio is its WAV file on disk. Once on one device
//! (killed after a step past its last checkpoint, then resumed by a second `voiceclone train`)
//! and once on two CPU ranks (a rank killed, every rank restarted by `train.max_restarts`).
//! The event writing is the same for every backend (it sees only the metrics), so the default
//! one runs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine;
use serde_json::Value;

use crate::common::{assets, have_assets, whisper_model};
use crate::dist_support::{ok, run_command_until, signal_pid_in};
use crate::train_samples::{workspace, M};
use crate::train_support::{command, text};

/// The flags of every run here: batches of 2 of the 9 training utterances, one per step, an
/// evaluation with samples at every checkpoint (every 2 steps), every checkpoint kept so that
/// every evaluation's samples are still on disk at the end. Six steps, unless a test says
/// otherwise.
const FLAGS: &[&str] = &[
    "--batch-size",
    "2",
    "--grad-accum",
    "1",
    "--warmup-steps",
    "1",
    "--epochs",
    "100",
    "--lr",
    "2e-3",
    "--save-every",
    "2",
    "--keep",
    "10",
    "--no-export",
];

/// The test assets' Python, if it has the `tensorboard` package
/// (`scripts/assets/fetch_test_assets.sh` installs it).
fn tensorboard_python() -> Option<PathBuf> {
    let py = assets().join("venv/bin/python");
    let present = py.is_file()
        && Command::new(&py)
            .args(["-c", "import tensorboard"])
            .output()
            .is_ok_and(|o| o.status.success());
    if !present {
        let msg = format!(
            "no Python with the tensorboard package at {}: run scripts/assets/fetch_test_assets.sh",
            py.display()
        );
        assert!(
            std::env::var_os("VOICECLONE_REQUIRE_ASSETS").is_none_or(|v| v != "1"),
            "{msg}"
        );
        eprintln!("skipped: {msg}");
    }
    present.then_some(py)
}

/// What TensorBoard reads from the workspace's `checkpoints/tensorboard/`.
fn read_events(py: &Path, ws: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/ci/tensorboard_events.py");
    let o = Command::new(py)
        .arg(script)
        .arg(ws.join("checkpoints/tensorboard"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// A number as the reader prints it ("nan" and the infinities as strings).
fn number(v: &Value) -> f64 {
    match v {
        Value::String(s) => s.parse().unwrap(),
        v => v.as_f64().unwrap_or_else(|| panic!("{v} is not a number")),
    }
}

/// A number of `metrics.jsonl` (null for one that was not finite).
fn metric(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The scalars docs/training.md §9.1 says the event files hold, computed here from
/// `metrics.jsonl`: tag → [(step, value)], and the audio tags with each one's (step, WAV path).
#[allow(clippy::type_complexity)]
fn expected(
    ws: &Path,
) -> (
    BTreeMap<String, Vec<(u64, f64)>>,
    BTreeMap<String, Vec<(u64, PathBuf)>>,
) {
    let (mut scalars, mut audio) = (BTreeMap::new(), BTreeMap::new());
    let mut put = |tag: String, step: u64, v: f64| {
        scalars.entry(tag).or_insert_with(Vec::new).push((step, v));
    };
    for line in std::fs::read_to_string(ws.join("checkpoints/metrics.jsonl"))
        .unwrap()
        .lines()
    {
        let m: Value = serde_json::from_str(line).unwrap();
        let step = m["step"].as_u64().unwrap();
        if m.get("val_loss").is_none() {
            for k in [
                "loss",
                "loss_talker",
                "loss_sub",
                "lr",
                "grad_norm",
                "epoch",
            ] {
                put(format!("train/{k}"), step, metric(&m[k]));
            }
            put(
                "train/frames_per_second".into(),
                step,
                metric(&m["frames"]) / metric(&m["seconds"]),
            );
            for (k, tag) in [
                ("sent_within_node", "sent_bytes_within_node"),
                ("sent_across_nodes", "sent_bytes_across_nodes"),
            ] {
                if let Some(v) = m.get(k) {
                    put(format!("train/{tag}"), step, metric(v));
                }
            }
            continue;
        }
        for k in ["val_loss", "val_loss_talker", "val_loss_sub"] {
            put(format!("eval/{k}"), step, metric(&m[k]));
        }
        if let Some(score) = m.get("score") {
            put("eval/score".into(), step, metric(score));
        }
        let mut per_voice: BTreeMap<String, usize> = BTreeMap::new();
        for s in m["samples"].as_array().into_iter().flatten() {
            let voice = s["voice"].as_str().unwrap();
            let n = per_voice.entry(voice.to_string()).or_default();
            *n += 1;
            let prefix = format!("samples/{voice}/{n:02}");
            for k in ["similarity", "rate_ratio", "wer"] {
                if !s[k].is_null() {
                    put(format!("{prefix}/{k}"), step, metric(&s[k]));
                }
            }
            audio
                .entry(format!("{prefix}/audio"))
                .or_insert_with(Vec::new)
                .push((step, ws.join(s["wav"].as_str().unwrap())));
        }
    }
    (scalars, audio)
}

/// The event files against `metrics.jsonl` and the samples on disk; returns the tags read.
fn check(tag: &str, py: &Path, ws: &Path) -> Vec<String> {
    let events = read_events(py, ws);
    let (want, want_audio) = expected(ws);
    let got = events["scalars"].as_object().unwrap();
    assert_eq!(
        got.keys().collect::<BTreeSet<_>>(),
        want.keys().collect::<BTreeSet<_>>(),
        "{tag}: the scalar tags"
    );
    for (name, points) in &want {
        let read: Vec<(u64, f64)> = got[name]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), number(&p[1])))
            .collect();
        let steps: Vec<u64> = read.iter().map(|p| p.0).collect();
        assert!(
            steps.windows(2).all(|w| w[0] < w[1]),
            "{tag}: {name} has a step twice or out of order: {steps:?}"
        );
        assert_eq!(
            steps,
            points.iter().map(|p| p.0).collect::<Vec<_>>(),
            "{tag}: {name}"
        );
        for ((step, got), (_, want)) in read.iter().zip(points) {
            // The event stores a float32: the metric rounded once.
            let want = *want as f32;
            assert!(
                *got as f32 == want || (got.is_nan() && want.is_nan()),
                "{tag}: {name} at step {step}: {got} read, {want} in metrics.jsonl"
            );
        }
    }
    let got_audio = events["audio"].as_object().unwrap();
    assert_eq!(
        got_audio.keys().collect::<BTreeSet<_>>(),
        want_audio.keys().collect::<BTreeSet<_>>(),
        "{tag}: the audio tags"
    );
    for (name, clips) in &want_audio {
        let read = got_audio[name].as_array().unwrap();
        assert_eq!(
            read.iter()
                .map(|a| a["step"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            clips.iter().map(|c| c.0).collect::<Vec<_>>(),
            "{tag}: {name}"
        );
        for (a, (step, wav)) in read.iter().zip(clips) {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(a["wav_base64"].as_str().unwrap())
                .unwrap();
            assert!(
                bytes == std::fs::read(wav).unwrap(),
                "{tag}: {name} at step {step} is not {}",
                wav.display()
            );
            let r = hound::WavReader::new(std::io::Cursor::new(&bytes)).unwrap();
            let spec = r.spec();
            assert_eq!((spec.sample_rate, spec.channels), (24_000, 1), "{tag}");
            assert_eq!(a["sample_rate"].as_f64(), Some(24_000.0), "{tag}");
            assert_eq!(
                a["length_frames"].as_u64(),
                Some(u64::from(r.len())),
                "{tag}"
            );
            assert_eq!(a["content_type"], "audio/wav", "{tag}");
        }
    }
    // One file, of our naming.
    let files: Vec<String> = std::fs::read_dir(ws.join("checkpoints/tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        files.len() == 1
            && files[0].starts_with("events.out.tfevents.")
            && files[0].ends_with(".voiceclone"),
        "{tag}: {files:?}"
    );
    got.keys().cloned().collect()
}

/// The steps TensorBoard reads for `train/loss`.
fn loss_steps(py: &Path, ws: &Path) -> Vec<u64> {
    read_events(py, ws)["scalars"]["train/loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect()
}

fn train_command(ws: &Path, extra: &[&str]) -> Command {
    let mut args = vec!["train"];
    args.extend_from_slice(FLAGS);
    if !extra.contains(&"--max-steps") {
        args.extend(["--max-steps", "6"]);
    }
    args.extend_from_slice(extra);
    command(ws, &args)
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn event_files_hold_every_metric_once_through_killed_and_resumed_runs() {
    let Some(py) = tensorboard_python() else {
        return;
    };
    // With the Whisper model of the assets the samples have a WER; without, none.
    let whisper = if have_assets() {
        whisper_model()
    } else {
        PathBuf::from("/nonexistent/ggml.bin")
    };

    // One device: killed after step 3, past the checkpoint of step 2; the next run resumes from
    // step 2 and must not keep the killed run's step 3.
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    workspace(ws, M, &whisper, "");
    let mut first = train_command(ws, &[]);
    first.env("VOICECLONE_TEST_PAUSE_AFTER_STEP", "3");
    let (err, _, _) = run_command_until(first, "paused after step 3", |child, _| {
        // SAFETY: kill(2) on our own child process.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    });
    assert_eq!(loss_steps(&py, ws), [1, 2, 3], "{err}");
    let o = train_command(ws, &[]).output().unwrap();
    ok(&o);
    assert!(
        text(&o).contains("resuming from checkpoints/step-0000002"),
        "{}",
        text(&o)
    );
    let tags = check("one device", &py, ws);
    for t in [
        "train/loss",
        "train/lr",
        "train/frames_per_second",
        "eval/val_loss",
        "eval/score",
        "samples/speaker/01/similarity",
        "samples/speaker/02/rate_ratio",
    ] {
        assert!(tags.iter().any(|g| g == t), "{t} missing from {tags:?}");
    }
    if have_assets() {
        assert!(
            tags.iter().any(|g| g == "samples/speaker/01/wer"),
            "{tags:?}"
        );
    }

    // Two CPU ranks: rank 1 killed at the start of step 4 (the reporting rank has written step
    // 3); the launcher restarts every rank from step 2.
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    workspace(ws, M, Path::new("/nonexistent/ggml.bin"), "");
    let mut run = train_command(ws, &["--cpu-ranks", "2", "--max-restarts", "1"]);
    run.env("VOICECLONE_TEST_PAUSE_AT_STEP", "4:1")
        .env("VOICECLONE_TEST_FIRST_ATTEMPT_ONLY", "1");
    let (err, status, _) = run_command_until(run, "rank 1 paused at step 4", |_, line| {
        signal_pid_in(line, libc::SIGKILL)
    });
    assert!(
        status.success() && err.contains("restarting every rank"),
        "{err}"
    );
    let tags = check("2 ranks", &py, ws);
    assert!(
        tags.iter().any(|g| g == "train/sent_bytes_within_node"),
        "{tags:?}"
    );
}

/// `train.tensorboard = false`: no event files.
#[test]
fn the_key_turns_the_event_files_off() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    workspace(
        ws,
        M,
        Path::new("/nonexistent/ggml.bin"),
        "tensorboard = false\n",
    );
    let o = train_command(ws, &["--max-steps", "1", "--samples", "false"])
        .output()
        .unwrap();
    ok(&o);
    assert!(ws.join("checkpoints/metrics.jsonl").is_file());
    assert!(!ws.join("checkpoints/tensorboard").exists());
}
