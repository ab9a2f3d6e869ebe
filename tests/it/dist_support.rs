//! Helpers of the sharded-training tests (train_dist, train_dist_failures, train_launchers):
//! fixture workspaces, runs of `voiceclone train`, the metrics and checkpoint state they leave,
//! and the processes they start.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;

use serde_json::Value;

pub use crate::train_support::*;

/// Flags shared by every run of these tests: 7 utterances in micro-batches of 2, three
/// micro-batches per step (so the last rank of 4 has none), a high learning rate so that steps
/// move the weights visibly.
pub const BASE: &[&str] = &[
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

pub fn workspace(model: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    make_workspace(
        dir.path(),
        model,
        &synthetic_rows(7, 21),
        &xvector(hidden(model), 3),
        "",
    );
    dir
}

pub fn train(ws: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["train"];
    args.extend_from_slice(BASE);
    args.extend_from_slice(extra);
    voiceclone(ws, &args)
}

pub fn ok(o: &std::process::Output) {
    assert!(o.status.success(), "{}", text(o));
}

/// The metrics of every step, without their timing.
pub fn metrics(ws: &Path) -> Vec<Value> {
    std::fs::read_to_string(ws.join("checkpoints/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("seconds");
            v
        })
        .collect()
}

/// Every tensor of a checkpoint, reassembled from its rank files, as f32 values: kind.name →
/// (shape, values).
pub fn state(ws: &Path, step: usize) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
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
            .map(|s| {
                (
                    s["rows"][0].as_u64().unwrap() as usize,
                    s["rank"].as_u64().unwrap() as usize,
                )
            })
            .collect();
        shards.sort();
        // Every mode's entries (docs/training.md §7): bf16 weights and 8-bit codes read as
        // f32 values.
        for kind in [
            "master",
            "comp",
            "exp_avg",
            "exp_avg_scale",
            "exp_avg_sq",
            "exp_avg_sq_scale",
        ] {
            let key = format!("{kind}.{name}");
            if !files[shards[0].1].contains_key(&key) {
                continue;
            }
            let mut values = Vec::new();
            for (_, rank) in &shards {
                let (dtype, _, bytes) = &files[*rank][&key];
                match dtype.as_str() {
                    "F32" => values.extend(
                        bytes
                            .chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                    ),
                    "BF16" => values.extend(
                        bytes
                            .chunks_exact(2)
                            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                    ),
                    "U8" => values.extend(bytes.iter().map(|&b| b as f32)),
                    other => panic!("{key} is {other}"),
                }
            }
            if !kind.ends_with("_scale") {
                assert_eq!(values.len(), shape.iter().product::<usize>(), "{key}");
            }
            out.insert(key, (shape.clone(), values));
        }
    }
    out
}

pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// Worst max|a−b| / ‖b‖ over the masters of two states.
pub fn worst_master_diff(
    a: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    b: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> (f64, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = (0f64, String::new());
    for (k, (shape, va)) in a.iter().filter(|(k, _)| k.starts_with("master.")) {
        let (shape_b, vb) = &b[k];
        assert_eq!(shape, shape_b, "{k}");
        let norm = vb
            .iter()
            .map(|&x| (x as f64) * (x as f64))
            .sum::<f64>()
            .sqrt();
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

/// Sharded against one device on the same backend: per-step losses and gradient norms
/// (relative), master weights (max |diff| over the tensor's norm).
pub const SHARDED_TOLERANCE: (f64, f64) = (1e-5, 1e-5);

/// The autograd backend with bf16 weight storage against the f32 CPU kernels, over 4 steps at
/// lr 5e-3 (docs/distributed.md §9): the first step agrees to 1e-5 (the fixtures store bf16, so
/// the first compute copies are exact), later ones compute with the updated masters rounded to
/// bf16 (2⁻⁹ relative), which the fixtures' large, peaked logits amplify to a few percent of
/// the loss (measured: 2.9e-2 and 3.3e-3; masters 4.5e-3 and 4.3e-3 of their norms).
pub const BF16_STORAGE_TOLERANCE: (f64, f64) = (5e-2, 1e-2);

/// Asserts that two runs' metrics and step-`step` masters agree within `(losses, masters)`.
pub fn assert_same_run(tag: &str, got: &Path, want: &Path, step: usize, tol: (f64, f64)) {
    let (mg, mw) = (metrics(got), metrics(want));
    let mut worst_metric = 0f64;
    assert_eq!(mg.len(), mw.len(), "{tag}: steps");
    for (g, w) in mg.iter().zip(&mw) {
        for key in ["loss", "loss_talker", "loss_sub", "grad_norm"] {
            let (x, y) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
            worst_metric = worst_metric.max(rel(x, y));
            assert!(
                rel(x, y) <= tol.0,
                "{tag}: step {}: {key} {x} vs {y}",
                g["step"]
            );
        }
        assert_eq!(g["frames"], w["frames"], "{tag}");
    }
    let (e, name) = worst_master_diff(&state(got, step), &state(want, step));
    eprintln!(
        "{tag}: losses and gradient norms within {worst_metric:.1e}; masters after step {step}: \
         worst {e:.1e} ({name})"
    );
    assert!(e <= tol.1, "{tag}: {name} differs by {e:.2e} of its norm");
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// A copy of workspace `ws` as it was when step `step` was its newest checkpoint.
pub fn as_of(ws: &Path, step: usize, later: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(ws, dir.path());
    std::fs::remove_dir_all(dir.path().join(format!("checkpoints/step-{later:07}"))).unwrap();
    std::fs::write(
        dir.path().join("checkpoints/latest"),
        format!("step-{step:07}\n"),
    )
    .unwrap();
    // The config names the model by absolute path, so the copy trains the same model.
    dir
}

/// The rows `rows` of a reassembled tensor.
pub fn rows_of(values: &[f32], shape: &[usize], rows: std::ops::Range<usize>) -> Vec<f32> {
    let w: usize = shape.iter().skip(1).product();
    values[rows.start * w..rows.end * w].to_vec()
}

/// The rank processes of a run whose command line names `ws` (to check none outlives it).
pub fn processes_of(ws: &Path) -> Vec<u32> {
    let needle = ws.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (cmd.contains("voiceclone") && cmd.contains(&needle) && pid != std::process::id())
                .then_some(pid)
        })
        .collect()
}

pub fn no_orphans(ws: &Path) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !processes_of(ws).is_empty() {
        assert!(
            std::time::Instant::now() < until,
            "rank processes outlived the run: {:?}",
            processes_of(ws)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Runs `voiceclone train` with `env`, reading its error output until a line contains `marker`
/// (then `act(the launcher, the line)`), and returns the error output, the exit status and how
/// long it ran after `act`.
pub fn run_until(
    ws: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    marker: &str,
    act: impl FnOnce(&std::process::Child, &str),
) -> (String, std::process::ExitStatus, std::time::Duration) {
    let mut a = vec!["train"];
    a.extend_from_slice(BASE);
    a.extend_from_slice(args);
    let mut cmd = command(ws, &a);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_command_until(cmd, marker, act)
}

/// [`run_until`] for any command (a launcher that starts voiceclone).
pub fn run_command_until(
    mut cmd: std::process::Command,
    marker: &str,
    act: impl FnOnce(&std::process::Child, &str),
) -> (String, std::process::ExitStatus, std::time::Duration) {
    use std::io::{BufRead, BufReader};
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let mut seen = String::new();
    let mut acted = None;
    let mut act = Some(act);
    for line in BufReader::new(err).lines() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.contains(marker) {
            if let Some(act) = act.take() {
                act(&child, &line);
                acted = Some(std::time::Instant::now());
            }
        }
    }
    let status = child.wait().unwrap();
    let took = acted.map(|t| t.elapsed()).unwrap_or_default();
    assert!(acted.is_some(), "never saw {marker:?}:\n{seen}");
    (seen, status, took)
}

/// `span` consecutive free loopback ports, the first returned, for ranks started the way
/// torchrun starts them (the port is named to them, not bound before). They are drawn from below
/// the range the system hands out for `bind(0)` and outgoing connections
/// (`/proc/sys/net/ipv4/ip_local_port_range`): a port from that range could be taken by another
/// test's connection between this check and its use. They start at 20000, above the ports Ray
/// gives its workers (10002–19999), since a Ray head takes its own from them.
pub fn free_ports(span: u16) -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Where the system's range starts too low to leave room, the ports are drawn from 20000 to
    // 30000 and may collide (rarely) with its.
    let first = 20_000u16;
    let last = match low.checked_sub(span) {
        Some(end) if end > first + 1000 => end,
        _ => 30_000,
    };
    let mut x = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    for _ in 0..1000 {
        // SplitMix64 steps over the seed the standard library draws per process.
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let p = first + (z % u64::from(last - first)) as u16;
        if (p..p + span).all(|q| std::net::TcpListener::bind(("0.0.0.0", q)).is_ok()) {
            return p;
        }
    }
    panic!("no {span} consecutive free ports below {low}");
}

/// Two consecutive free loopback ports `(p, p + 1)`: MASTER_PORT for a launcher's own store and
/// the rendezvous voiceclone opens on MASTER_PORT + 1.
pub fn two_free_ports() -> u16 {
    free_ports(2)
}

/// Runs a command on a thread, returning its output when joined.
pub trait SpawnOutput {
    fn spawn_output(self) -> std::thread::JoinHandle<std::process::Output>;
}

impl SpawnOutput for std::process::Command {
    fn spawn_output(mut self) -> std::thread::JoinHandle<std::process::Output> {
        std::thread::spawn(move || self.output().unwrap())
    }
}

/// The process id a test hook printed in `line` (`… (pid P)`).
pub fn pid_in(line: &str) -> i32 {
    line.rsplit("(pid ")
        .next()
        .and_then(|s| s.trim_end_matches(')').parse().ok())
        .unwrap_or_else(|| panic!("no pid in {line:?}"))
}

/// Sends `sig` to the process a test hook named in `line`.
pub fn signal_pid_in(line: &str, sig: i32) {
    // SAFETY: kill(2) on a process id this test's run printed; at worst ESRCH.
    unsafe { libc::kill(pid_in(line), sig) };
}
