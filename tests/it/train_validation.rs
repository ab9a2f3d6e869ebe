//! The held-out set and the validation loss (docs/training.md §14): chosen deterministically,
//! recorded, refused on change, never trained on; the validation loss is the training
//! objective on the held-out utterances, on both compute backends, on one device and sharded;
//! the checkpoint of the lowest one is kept, exported and stops the run early.

use std::path::Path;

use serde_json::Value;
use vc_train::{Backend, Storage, Trainer};

use crate::dist_support::{ok, rel, train as train_cli};
use crate::train_support::*;

const BACKENDS: [Backend; 3] = [
    Backend::Kernels,
    Backend::Autograd(Storage::Bf16),
    Backend::Autograd(Storage::F32),
];

/// The fixture model (stored in bf16) and its copy stored in f32, with their labels.
fn models() -> (tempfile::TempDir, Vec<(String, &'static str)>) {
    let f32_copy = f32_model_copy("tiny-0b6");
    let path = f32_copy.path().to_str().unwrap().to_string();
    let list = vec![("tiny-0b6".to_string(), "bf16"), (path, "f32")];
    (f32_copy, list)
}

/// A workspace of `rows` synthetic utterances on `model` in `dir`, with `toml` in its
/// voiceclone.toml.
fn workspace_in(dir: &Path, model: &str, rows: &[Value], toml: &str) {
    make_workspace(dir, model, rows, &xvector(hidden("tiny-0b6"), 3), toml);
}

/// A trainer on `dir` with micro-batches of 2, one per step, shuffled, holding out
/// `val_fraction`.
fn trainer(
    dir: &Path,
    model: &str,
    backend: Backend,
    val_fraction: f64,
) -> anyhow::Result<Trainer> {
    let mut config = vc_core::config::resolve_layers(vec![])
        .unwrap()
        .config
        .train;
    config.batch_size = 2;
    config.grad_accum = 1;
    config.lr = 5e-3;
    config.epochs = 3;
    config.val_fraction = val_fraction;
    Trainer::new(train_options(dir, model, config, backend), false)
}

fn heldout_lines(t: &Trainer) -> Vec<usize> {
    t.run.heldout.as_ref().map_or(Vec::new(), |h| {
        h.samples.iter().map(|s| s.line).collect::<Vec<_>>()
    })
}

#[test]
fn the_heldout_set_is_deterministic_recorded_refused_on_change_and_never_trained() {
    const M: &str = "tiny-0b6";
    let rows = synthetic_rows(12, 4);
    let a = tempfile::tempdir().unwrap();
    workspace_in(a.path(), M, &rows, "");
    let mut t = trainer(a.path(), M, Backend::Kernels, 0.25).unwrap();
    let held = heldout_lines(&t);
    assert_eq!(held.len(), 3, "a quarter of 12");
    assert_eq!(t.run.dataset.samples.len(), 9);
    // The same data and seed choose the same utterances in another workspace, also with the
    // manifest's lines in reverse order (line l of 12 becomes line 13 - l).
    let b = tempfile::tempdir().unwrap();
    workspace_in(b.path(), M, &rows, "");
    assert_eq!(
        heldout_lines(&trainer(b.path(), M, Backend::Kernels, 0.25).unwrap()),
        held
    );
    let reversed: Vec<Value> = rows.iter().rev().cloned().collect();
    let r = tempfile::tempdir().unwrap();
    workspace_in(r.path(), M, &reversed, "");
    let mut mirrored: Vec<usize> =
        heldout_lines(&trainer(r.path(), M, Backend::Kernels, 0.25).unwrap())
            .iter()
            .map(|l| rows.len() + 1 - l)
            .collect();
    mirrored.sort_unstable();
    let mut sorted = held.clone();
    sorted.sort_unstable();
    assert_eq!(
        mirrored, sorted,
        "the split follows the content, not the line order"
    );
    // Every batch of every step of the run (3 shuffled epochs) leaves them out.
    let total = t.run.total_steps();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..total {
        for batch in t.run.sampler.next_step(1) {
            for i in batch {
                let line = t.run.dataset.samples[i].line;
                assert!(!held.contains(&line), "held-out line {line} in a batch");
                seen.insert(line);
            }
        }
    }
    assert_eq!(seen.len(), 9, "every other utterance trains");
    // Recorded in the checkpoint: continued with the same split, refused with another.
    let micro = t.run.sampler.next_step(1);
    t.step(&micro).unwrap();
    t.save().unwrap();
    drop(t);
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(a.path().join("checkpoints/step-0000001/index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["identity"]["heldout"]["utterances"], 3);
    assert_eq!(
        trainer(a.path(), M, Backend::Kernels, 0.25)
            .unwrap()
            .run
            .step,
        1
    );
    for fraction in [0.0, 0.5] {
        let e = trainer(a.path(), M, Backend::Kernels, fraction)
            .err()
            .unwrap_or_else(|| panic!("val_fraction {fraction} resumed another split"));
        let e = format!("{e:#}");
        assert!(e.contains("it held out 3 utterance(s)"), "{e}");
        assert!(e.contains("train.val_fraction"), "{e}");
    }
}

#[test]
fn the_validation_loss_is_the_training_objective_on_the_heldout_utterances() {
    let rows = synthetic_rows(12, 4);
    let (_keep, models) = models();
    for ((model, stored), backend) in models
        .iter()
        .flat_map(|m| BACKENDS.iter().map(move |b| (m, *b)))
    {
        let model = model.as_str();
        let a = tempfile::tempdir().unwrap();
        workspace_in(a.path(), model, &rows, "");
        let mut t = trainer(a.path(), model, backend, 0.25).unwrap();
        let v = t.validate().unwrap().expect("a held-out set");
        assert_eq!(v.val_utterances, 3);
        // The same utterances as a training manifest of their own, through the training loss
        // in the same micro-batches (2 of the shortest, then the longest).
        let held = heldout_lines(&t);
        let b = tempfile::tempdir().unwrap();
        let only: Vec<Value> = held.iter().map(|&l| rows[l - 1].clone()).collect();
        workspace_in(b.path(), model, &only, "");
        let mut r = trainer(b.path(), model, backend, 0.0).unwrap();
        assert!(r.run.heldout.is_none());
        let mut order: Vec<usize> = (0..3).collect();
        order.sort_by_key(|&i| (r.run.dataset.samples[i].seq_len(), i));
        let (mut total, mut talker, mut sub) = (0.0, 0.0, 0.0);
        for batch in [&order[..2], &order[2..]] {
            let (l, _) = r.batch_loss(batch).unwrap();
            total += l.total.to_scalar::<f32>().unwrap() as f64 / 2.0;
            talker += l.talker.to_scalar::<f32>().unwrap() as f64 / 2.0;
            sub += l.sub.to_scalar::<f32>().unwrap() as f64 / 2.0;
        }
        let tag = format!("{} on {stored}", backend.name());
        assert!(
            rel(v.val_loss, total) < 1e-6,
            "{tag}: {} vs {total}",
            v.val_loss
        );
        assert!(rel(v.val_loss_talker, talker) < 1e-6, "{tag}");
        assert!(rel(v.val_loss_sub, sub) < 1e-6, "{tag}");
        // No update: the next step is the step of a twin that never validated.
        let c = tempfile::tempdir().unwrap();
        workspace_in(c.path(), model, &rows, "");
        let mut twin = trainer(c.path(), model, backend, 0.25).unwrap();
        let micro = t.run.sampler.next_step(1);
        let twin_micro = twin.run.sampler.next_step(1);
        assert_eq!(micro, twin_micro);
        let (m, w) = (t.step(&micro).unwrap(), twin.step(&twin_micro).unwrap());
        assert_eq!((m.loss, m.grad_norm), (w.loss, w.grad_norm), "{tag}");
        // And after the update the loss on the held-out set has moved.
        let after = t.validate().unwrap().unwrap();
        assert_ne!(after.val_loss, v.val_loss, "{tag}");
    }
}

/// The eval lines of a run's metrics.
#[test]
fn runs_validate_at_checkpoints_and_sharded_runs_agree_with_one_device() {
    let rows = synthetic_rows(12, 21);
    let toml = "[train]\nval_fraction = 0.25\n";
    let (_keep, models) = models();
    for ((model, stored), backend) in models
        .iter()
        .flat_map(|m| ["kernels", "autograd"].into_iter().map(move |b| (m, b)))
    {
        let model = model.as_str();
        let single = tempfile::tempdir().unwrap();
        workspace_in(single.path(), model, &rows, toml);
        let run = [
            "--max-steps",
            "3",
            "--save-every",
            "2",
            "--backend",
            backend,
        ];
        let o = train_cli(single.path(), &run);
        ok(&o);
        let out = text(&o);
        assert!(
            out.contains("3 held out for validation")
                && out.contains("step 2/3: loss")
                && out.contains("validation"),
            "{out}"
        );
        // At the checkpoint of step 2 and at the end.
        let want = evals(single.path());
        let steps: Vec<u64> = want.iter().map(|e| e["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, [2, 3], "{backend} on {stored}");
        assert!(want.iter().all(|e| e["val_utterances"] == 3), "{want:?}");
        for shard in ["full", "grad-op"] {
            let ws = tempfile::tempdir().unwrap();
            workspace_in(ws.path(), model, &rows, toml);
            let mut args = run.to_vec();
            args.extend(["--cpu-ranks", "2", "--shard", shard]);
            ok(&train_cli(ws.path(), &args));
            let got = evals(ws.path());
            assert_eq!(got.len(), want.len(), "{backend} {shard} on {stored}");
            for (g, w) in got.iter().zip(&want) {
                for key in ["val_loss", "val_loss_talker", "val_loss_sub"] {
                    let (x, y) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
                    assert!(
                        rel(x, y) <= 1e-5,
                        "{backend} {shard} on {stored} step {}: {key} {x} vs {y}",
                        g["step"]
                    );
                }
            }
        }
    }
}

#[test]
fn a_heldout_manifest_is_validated_on_and_left_out_of_training() {
    let rows = synthetic_rows(6, 8);
    let ws = tempfile::tempdir().unwrap();
    workspace_in(
        ws.path(),
        "tiny-0b6",
        &rows,
        "[train]\nval_manifest = \"data/val.jsonl\"\neval_every = 1\n",
    );
    let extra = synthetic_rows(9, 30).pop().unwrap();
    let val = format!("{}\n{}\n", rows[2], extra);
    std::fs::write(ws.path().join("data/val.jsonl"), val).unwrap();
    let o = train_cli(ws.path(), &["--max-steps", "2", "--save-every", "0"]);
    ok(&o);
    let out = text(&o);
    assert!(
        out.contains("line(s) 3 of") && out.contains("also in the held-out manifest"),
        "{out}"
    );
    let e = evals(ws.path());
    let steps: Vec<u64> = e.iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2], "eval_every = 1");
    assert!(e.iter().all(|e| e["val_utterances"] == 2), "{e:?}");
    // A held-out manifest that is not there is an error naming the key.
    std::fs::remove_file(ws.path().join("data/val.jsonl")).unwrap();
    let o = train_cli(ws.path(), &["--max-steps", "3", "--fresh"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("train.val_manifest"), "{}", text(&o));
}

fn eval_losses(ws: &Path) -> Vec<(u64, f64)> {
    evals(ws)
        .iter()
        .map(|e| (e["step"].as_u64().unwrap(), e["val_loss"].as_f64().unwrap()))
        .collect()
}

#[test]
fn the_lowest_validation_loss_is_kept_exported_and_stops_the_run_early() {
    // At a learning rate this high the held-out loss of the fixture rises and falls, so the
    // lowest one is not the last.
    let train = |ws: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--batch-size",
            "2",
            "--grad-accum",
            "1",
            "--lr",
            "5e-1",
            "--warmup-steps",
            "1",
            "--epochs",
            "100",
            "--max-steps",
            "24",
        ];
        args.extend_from_slice(extra);
        voiceclone(ws, &args)
    };
    let rows = synthetic_rows(12, 21);
    let toml = "[train]\nval_fraction = 0.25\nsave_every = 1\nkeep = 1\n";
    let (_keep, models) = models();
    let mut runs: Vec<(String, Vec<&str>)> = Vec::new();
    for (model, stored) in &models {
        for backend in ["kernels", "autograd"] {
            runs.push((format!("{stored} {backend}"), vec![model.as_str(), backend]));
        }
    }
    runs.push((
        "bf16 kernels, 2 ranks".into(),
        vec![models[0].0.as_str(), "kernels", "2"],
    ));
    runs.push((
        "bf16 autograd, 2 ranks".into(),
        vec![models[0].0.as_str(), "autograd", "2"],
    ));
    for (tag, run) in &runs {
        let mut flags = vec!["--backend", run[1]];
        if let Some(n) = run.get(2) {
            flags.extend(["--cpu-ranks", n]);
        }
        let ws = tempfile::tempdir().unwrap();
        workspace_in(ws.path(), run[0], &rows, toml);
        let mut first = flags.clone();
        first.extend(["--early-stop", "2"]);
        let o = train(ws.path(), &first);
        ok(&o);
        let losses = eval_losses(ws.path());
        let (stop, best) = early_stop_of(&losses, 2, |a, b| a < b)
            .unwrap_or_else(|| panic!("{tag}: no early stop in {losses:?}"));
        assert_eq!(losses.last().unwrap().0, stop, "{tag}: ran past the stop");
        assert!(
            text(&o).contains(&format!("early stop after step {stop}")),
            "{tag}: {}",
            text(&o)
        );
        // checkpoints/best names the lowest loss, kept beside the newest although keep = 1.
        let root = ws.path().join("checkpoints");
        assert_eq!(
            std::fs::read_to_string(root.join("best")).unwrap().trim(),
            step_name(best)
        );
        assert_eq!(
            step_dirs(ws.path()),
            [step_name(best), step_name(stop)],
            "{tag}"
        );
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(root.join(step_name(stop)).join("index.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(index["selection"]["best_step"], best, "{tag}");
        assert_eq!(index["selection"]["since_best"], 2, "{tag}");
        let svg = std::fs::read_to_string(root.join("loss.svg")).unwrap();
        assert!(
            svg.contains(">val_loss</text>"),
            "{tag}: no validation line in loss.svg"
        );
        // The run exported the chosen checkpoint; `export` the newest, `export --best` the chosen.
        assert_eq!(export_step(&ws.path().join("model")), best, "{tag}");
        let (newest, chosen) = (ws.path().join("newest"), ws.path().join("chosen"));
        ok(&voiceclone(
            ws.path(),
            &["export", "-o", newest.to_str().unwrap()],
        ));
        assert_eq!(export_step(&newest), stop, "{tag}");
        ok(&voiceclone(
            ws.path(),
            &["export", "--best", "-o", chosen.to_str().unwrap()],
        ));
        assert_eq!(export_step(&chosen), best, "{tag}");
        // Run again with the same patience, it stays stopped (and exported)...
        let o = train(ws.path(), &first);
        ok(&o);
        assert!(
            text(&o).contains("training stopped early at step"),
            "{tag}: {}",
            text(&o)
        );
        assert_eq!(eval_losses(ws.path()).len(), losses.len(), "{tag}");
        // ...and resumed with a longer patience, the count goes on from the checkpoint's.
        let mut again = flags.clone();
        again.extend(["--early-stop", "3"]);
        let o = train(ws.path(), &again);
        ok(&o);
        let losses = eval_losses(ws.path());
        let (stop3, best3) = early_stop_of(&losses, 3, |a, b| a < b)
            .unwrap_or_else(|| panic!("{tag}: no early stop at 3 in {losses:?}"));
        assert_eq!(losses.last().unwrap().0, stop3, "{tag}: {losses:?}");
        assert_eq!(export_step(&ws.path().join("model")), best3, "{tag}");
        eprintln!(
            "{tag}: patience 2 stopped at step {stop} (best {best}), 3 at {stop3} (best {best3})"
        );
        // Under select = last the newest is the chosen one.
        let last = tempfile::tempdir().unwrap();
        workspace_in(last.path(), run[0], &rows, toml);
        let mut select_last = first.clone();
        select_last.extend(["--select", "last"]);
        ok(&train(last.path(), &select_last));
        assert_eq!(
            eval_losses(last.path()),
            eval_losses(ws.path())[..losses.iter().position(|l| l.0 == stop).unwrap() + 1]
        );
        assert_eq!(
            std::fs::read_to_string(last.path().join("checkpoints/best"))
                .unwrap()
                .trim(),
            step_name(stop)
        );
        assert_eq!(step_dirs(last.path()), [step_name(stop)], "{tag}");
        assert_eq!(export_step(&last.path().join("model")), stop, "{tag}");
    }
    // Refusals: --best on one checkpoint, and where no run chose one.
    let ws = tempfile::tempdir().unwrap();
    workspace_in(
        ws.path(),
        "tiny-0b6",
        &rows,
        "[train]\nval_fraction = 0\nsave_every = 1\n",
    );
    let o = voiceclone(
        ws.path(),
        &[
            "train",
            "--max-steps",
            "1",
            "--select",
            "val_loss",
            "--early-stop",
            "1",
        ],
    );
    ok(&o);
    assert!(text(&o).contains("cannot stop the run"), "{}", text(&o));
    let one = ws.path().join("checkpoints/step-0000001");
    let o = voiceclone(
        ws.path(),
        &["export", "--best", "--checkpoint", one.to_str().unwrap()],
    );
    assert!(
        !o.status.success() && text(&o).contains("is one checkpoint"),
        "{}",
        text(&o)
    );
    std::fs::remove_file(ws.path().join("checkpoints/best")).unwrap();
    let o = voiceclone(ws.path(), &["export", "--best"]);
    assert!(
        !o.status.success() && text(&o).contains("names no complete checkpoint"),
        "{}",
        text(&o)
    );
    let o = train(ws.path(), &["--select", "lowest"]);
    assert!(
        !o.status.success() && text(&o).contains("train.select"),
        "{}",
        text(&o)
    );
}
