//! Samples switched on and off, and the checkpoint chosen by their score
//! (docs/training.md §14.3 and §14.4): `--samples true` with a text of its own, `--samples
//! false` and a run with nothing held out do what they say, a choice by score without samples
//! is refused up front, and `--select score` with `--early-stop` keeps, names
//! (`checkpoints/best`) and exports the best-scoring checkpoint, stops the run early and stays
//! stopped, and `export --best` exports it again, for each stored precision and backend, on one
//! device and on two ranks.

use std::path::Path;

use serde_json::Value;

use crate::dist_support::ok;
use crate::train_samples::{models, score_of, train, workspace, M};
use crate::train_support::{
    early_stop_of, evals, export_step, hidden, make_workspace, step_dirs, synthetic_rows, text,
    voiceclone, xvector,
};

/// Samples on by the flag, custom texts, samples off, and the refusal of a choice by score
/// without samples.
#[test]
fn sample_texts_are_spoken_by_the_speaker_and_samples_can_be_turned_off() {
    let none = Path::new("/nonexistent/ggml.bin");
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    workspace(ws, M, none, "");
    let o = train(
        ws,
        &[
            "--max-steps",
            "2",
            "--save-every",
            "2",
            "--samples",
            "true",
            "--sample-text",
            "A text of its own.",
        ],
    );
    ok(&o);
    assert!(text(&o).contains("no WER"), "{}", text(&o));
    let e = &evals(ws)[0];
    let samples = e["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 1);
    assert_eq!(samples[0]["text"], "A text of its own.");
    assert!(samples[0]["recording"].is_null() && samples[0]["wer"].is_null());
    // Off: evaluations without samples; and a choice by score is refused up front.
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    workspace(ws, M, none, "");
    let o = train(
        ws,
        &[
            "--max-steps",
            "2",
            "--save-every",
            "2",
            "--samples",
            "false",
        ],
    );
    ok(&o);
    assert!(text(&o).contains("no samples at evaluations: train.samples is false"));
    assert!(evals(ws)[0].get("samples").is_none());
    assert!(!ws.join("checkpoints/step-0000002/samples").exists());
    let o = train(
        ws,
        &[
            "--max-steps",
            "4",
            "--samples",
            "false",
            "--select",
            "score",
        ],
    );
    assert!(!o.status.success());
    assert!(
        text(&o).contains("train.select = \"score\" chooses by the samples' score"),
        "{}",
        text(&o)
    );
    // Nothing held out: no evaluations, so no samples, even with texts of their own; said at
    // the start, and a choice by score refused.
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    make_workspace(
        ws,
        M,
        &synthetic_rows(12, 21),
        &xvector(hidden(M), 3),
        "[train]\nval_fraction = 0\n",
    );
    let own = [
        "--max-steps",
        "2",
        "--save-every",
        "2",
        "--sample-text",
        "Words.",
    ];
    let o = train(ws, &own);
    ok(&o);
    assert!(
        text(&o).contains("no samples at evaluations: nothing is held out"),
        "{}",
        text(&o)
    );
    assert!(!ws.join("checkpoints/step-0000002/samples").exists());
    let o = train(ws, &[&own[..], &["--select", "score", "--fresh"]].concat());
    assert!(
        !o.status.success() && text(&o).contains("nothing is held out"),
        "{}",
        text(&o)
    );
}

#[test]
fn the_best_scoring_checkpoint_is_kept_exported_and_stops_the_run_early() {
    let none = Path::new("/nonexistent/ggml.bin");
    let (_keep, models) = models();
    let mut runs: Vec<(String, &str, &str, Option<&str>)> = Vec::new();
    for (model, stored) in &models {
        for backend in ["kernels", "autograd"] {
            runs.push((format!("{stored} {backend}"), model, backend, None));
        }
    }
    for backend in ["kernels", "autograd"] {
        runs.push((
            format!("bf16 {backend}, 2 ranks"),
            &models[0].0,
            backend,
            Some("2"),
        ));
    }
    for (tag, model, backend, ranks) in &runs {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path();
        // Evaluated at every step (every evaluation with samples saves), one checkpoint kept.
        workspace(ws, model, none, "eval_every = 1\nkeep = 1\n");
        let mut flags = vec![
            "--max-steps",
            "16",
            "--lr",
            "5e-1",
            "--backend",
            backend,
            "--select",
            "score",
            "--early-stop",
            "2",
        ];
        if let Some(n) = ranks {
            flags.extend(["--cpu-ranks", n]);
        }
        let o = train(ws, &flags);
        ok(&o);
        let scores: Vec<(u64, f64)> = evals(ws)
            .iter()
            .map(|e| {
                (
                    e["step"].as_u64().unwrap(),
                    score_of(e["samples"].as_array().unwrap()),
                )
            })
            .collect();
        let (stop, best) = early_stop_of(&scores, 2, |a, b| a > b)
            .unwrap_or_else(|| panic!("{tag}: no early stop in {scores:?}"));
        assert_eq!(scores.last().unwrap().0, stop, "{tag}: ran past the stop");
        assert!(
            text(&o).contains(&format!("early stop after step {stop}")),
            "{tag}: {}",
            text(&o)
        );
        let root = ws.join("checkpoints");
        let name = |s: u64| format!("step-{s:07}");
        assert_eq!(
            std::fs::read_to_string(root.join("best")).unwrap().trim(),
            name(best),
            "{tag}"
        );
        let mut kept = vec![name(best), name(stop)];
        kept.dedup();
        assert_eq!(step_dirs(ws), kept, "{tag}");
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(root.join(name(stop)).join("index.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(index["selection"]["best_score_step"], best, "{tag}");
        assert_eq!(index["selection"]["since_best_score"], 2, "{tag}");
        // The run exported the chosen one; `export` the newest, `export --best` the chosen.
        assert_eq!(export_step(&ws.join("model")), best, "{tag}");
        let (newest, chosen) = (ws.join("newest"), ws.join("chosen"));
        ok(&voiceclone(ws, &["export", "-o", newest.to_str().unwrap()]));
        assert_eq!(export_step(&newest), stop, "{tag}");
        ok(&voiceclone(
            ws,
            &["export", "--best", "-o", chosen.to_str().unwrap()],
        ));
        assert_eq!(export_step(&chosen), best, "{tag}");
        // Run again with the same patience: it stays stopped.
        let again = train(ws, &flags);
        ok(&again);
        assert!(
            text(&again).contains("no higher sample score"),
            "{tag}: {}",
            text(&again)
        );
    }
}
