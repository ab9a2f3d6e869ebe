//! Sharded training on CPU ranks (issue 12; docs/distributed.md): `voiceclone train --cpu-ranks N`
//! equals single-device training on the same global batches, resumes at any world size, and
//! stops cleanly on failures and signals.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::train_support::*;

/// Flags shared by every run of these tests: 7 utterances in micro-batches of 2, three
/// micro-batches per step (so the last rank of 4 has none), a high learning rate so that steps
/// move the weights visibly.
const BASE: &[&str] = &[
    "--batch-size",
    "2",
    "--grad-accum",
    "3",
    "--lr",
    "5e-3",
    "--warmup-steps",
    "1",
    "--epochs",
    "100",
    "--no-export",
];

fn workspace(model: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    make_workspace(dir.path(), model, &synthetic_rows(7, 21), &xvector(hidden(model), 3), "");
    dir
}

fn train(ws: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["train"];
    args.extend_from_slice(BASE);
    args.extend_from_slice(extra);
    voiceclone(ws, &args)
}

fn ok(o: &std::process::Output) {
    assert!(o.status.success(), "{}", text(o));
}

fn metrics(ws: &Path) -> Vec<Value> {
    std::fs::read_to_string(ws.join("checkpoints/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Every tensor of a checkpoint, reassembled from its rank files, as f32 values: kind.name →
/// (shape, values).
fn state(ws: &Path, step: usize) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let dir = ws.join(format!("checkpoints/step-{step:07}"));
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).unwrap()).unwrap();
    let world = index["world_size"].as_u64().unwrap() as usize;
    let files: Vec<_> = (0..world)
        .map(|r| read_raw(&dir.join(format!("rank-{r:05}.safetensors"))))
        .collect();
    let mut out = BTreeMap::new();
    for (name, info) in index["params"].as_object().unwrap() {
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone()).unwrap();
        let mut shards: Vec<(usize, usize)> = info["shards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["rows"][0].as_u64().unwrap() as usize, s["rank"].as_u64().unwrap() as usize))
            .collect();
        shards.sort();
        for kind in ["master", "exp_avg", "exp_avg_sq"] {
            let mut values = Vec::new();
            for (_, rank) in &shards {
                let (_, _, bytes) = &files[*rank][&format!("{kind}.{name}")];
                values.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
            }
            assert_eq!(values.len(), shape.iter().product::<usize>(), "{kind}.{name}");
            out.insert(format!("{kind}.{name}"), (shape.clone(), values));
        }
    }
    out
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// Worst max|a−b| / ‖b‖ over the masters of two states.
fn worst_master_diff(
    a: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    b: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> (f64, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = (0f64, String::new());
    for (k, (shape, va)) in a.iter().filter(|(k, _)| k.starts_with("master.")) {
        let (shape_b, vb) = &b[k];
        assert_eq!(shape, shape_b, "{k}");
        let norm = vb.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
        let d = va
            .iter()
            .zip(vb)
            .map(|(&x, &y)| (x as f64 - y as f64).abs())
            .fold(0f64, f64::max);
        let e = d / norm.max(1e-30);
        if e > worst.0 {
            worst = (e, k.clone());
        }
    }
    worst
}

fn assert_same_run(tag: &str, got: &Path, want: &Path, step: usize) {
    let (mg, mw) = (metrics(got), metrics(want));
    assert_eq!(mg.len(), mw.len(), "{tag}: steps");
    for (g, w) in mg.iter().zip(&mw) {
        for key in ["loss", "loss_talker", "loss_sub", "grad_norm"] {
            let (x, y) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
            assert!(rel(x, y) <= 1e-5, "{tag}: step {}: {key} {x} vs {y}", g["step"]);
        }
        assert_eq!(g["frames"], w["frames"], "{tag}");
    }
    let (e, name) = worst_master_diff(&state(got, step), &state(want, step));
    eprintln!("{tag}: losses within 1e-5; masters after step {step}: worst {e:.1e} ({name})");
    assert!(e <= 1e-5, "{tag}: {name} differs by {e:.2e} of its norm");
}

#[test]
fn cpu_ranks_train_like_one_device() {
    for model in ["tiny-0b6", "tiny-1b7"] {
        let single = workspace(model);
        ok(&train(single.path(), &["--max-steps", "4", "--save-every", "4"]));
        let reference = state(single.path(), 4);
        for ranks in ["2", "3", "4"] {
            for shard in ["full", "grad-op"] {
                let ws = workspace(model);
                let o = train(
                    ws.path(),
                    &["--max-steps", "4", "--save-every", "4", "--cpu-ranks", ranks, "--shard", shard],
                );
                ok(&o);
                let out = String::from_utf8_lossy(&o.stdout);
                assert!(out.contains(&format!("{ranks} ranks (CPU, TCP)")), "{out}");
                let n: usize = ranks.parse().unwrap();
                if n == 3 {
                    // The split covers tensors whose rows do not divide by the rank count.
                    assert!(reference.values().any(|(s, _)| s[0] % 3 != 0));
                }
                assert_same_run(&format!("{model} ×{ranks} {shard}"), ws.path(), single.path(), 4);
            }
        }
    }
}
