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
    make_workspace(
        dir.path(),
        model,
        &synthetic_rows(7, 21),
        &xvector(hidden(model), 3),
        "",
    );
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

/// The metrics of every step, without their timing.
fn metrics(ws: &Path) -> Vec<Value> {
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
            .map(|s| {
                (
                    s["rows"][0].as_u64().unwrap() as usize,
                    s["rank"].as_u64().unwrap() as usize,
                )
            })
            .collect();
        shards.sort();
        for kind in ["master", "exp_avg", "exp_avg_sq"] {
            let mut values = Vec::new();
            for (_, rank) in &shards {
                let (_, _, bytes) = &files[*rank][&format!("{kind}.{name}")];
                values.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
            }
            assert_eq!(
                values.len(),
                shape.iter().product::<usize>(),
                "{kind}.{name}"
            );
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

fn assert_same_run(tag: &str, got: &Path, want: &Path, step: usize) {
    let (mg, mw) = (metrics(got), metrics(want));
    assert_eq!(mg.len(), mw.len(), "{tag}: steps");
    for (g, w) in mg.iter().zip(&mw) {
        for key in ["loss", "loss_talker", "loss_sub", "grad_norm"] {
            let (x, y) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
            assert!(
                rel(x, y) <= 1e-5,
                "{tag}: step {}: {key} {x} vs {y}",
                g["step"]
            );
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
        ok(&train(
            single.path(),
            &["--max-steps", "4", "--save-every", "4"],
        ));
        let reference = state(single.path(), 4);
        for ranks in ["2", "3", "4"] {
            for shard in ["full", "grad-op"] {
                let ws = workspace(model);
                let o = train(
                    ws.path(),
                    &[
                        "--max-steps",
                        "4",
                        "--save-every",
                        "4",
                        "--cpu-ranks",
                        ranks,
                        "--shard",
                        shard,
                    ],
                );
                ok(&o);
                let out = String::from_utf8_lossy(&o.stdout);
                assert!(out.contains(&format!("{ranks} ranks (CPU, TCP)")), "{out}");
                let n: usize = ranks.parse().unwrap();
                if n == 3 {
                    // The split covers tensors whose rows do not divide by the rank count.
                    assert!(reference.values().any(|(s, _)| s[0] % 3 != 0));
                }
                assert_same_run(
                    &format!("{model} ×{ranks} {shard}"),
                    ws.path(),
                    single.path(),
                    4,
                );
            }
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
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
fn as_of(ws: &Path, step: usize, later: usize) -> tempfile::TempDir {
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
fn rows_of(values: &[f32], shape: &[usize], rows: std::ops::Range<usize>) -> Vec<f32> {
    let w: usize = shape.iter().skip(1).product();
    values[rows.start * w..rows.end * w].to_vec()
}

#[test]
fn checkpoints_resume_at_any_world_size() {
    use std::sync::Arc;
    use voiceclone::dist::shard::RowSplit;
    use voiceclone::dist::tcp::{Endpoint, TcpCollective};
    use voiceclone::train::sharded::ShardedTrainer;

    let model = "tiny-0b6";
    let six = ["--max-steps", "6", "--save-every", "3"];
    // The uninterrupted 4-rank run; its step-3 checkpoint is the one the others resume.
    let a = workspace(model);
    let mut args = six.to_vec();
    args.extend(["--cpu-ranks", "4"]);
    ok(&train(a.path(), &args));
    let saved = state(a.path(), 3);

    // 4 → 4: bit-identical.
    let b = as_of(a.path(), 3, 6);
    ok(&train(b.path(), &args));
    assert!(
        state(b.path(), 6) == state(a.path(), 6),
        "4 ranks resumed at 4 ranks differ"
    );
    assert_eq!(metrics(b.path()), metrics(a.path()));

    // 4 → 2 and 4 → 1: the restored state is bit-identical to what was saved...
    let c = as_of(a.path(), 3, 6);
    let opts = |ws: &Path| {
        let files = voiceclone::model::files::ModelFiles::resolve(
            &voiceclone::hub::ModelSource::Local(model_dir(model)),
        )
        .unwrap();
        let mut config = voiceclone::config::resolve_layers(vec![])
            .unwrap()
            .config
            .train;
        (
            config.batch_size,
            config.grad_accum,
            config.lr,
            config.warmup_steps,
            config.epochs,
        ) = (2, 3, 5e-3, 1, 100);
        config.max_steps = 6;
        config.save_every = 3;
        voiceclone::train::TrainOptions {
            files,
            model_spec: model.into(),
            manifest: ws.join("data/train.jsonl"),
            base_dir: ws.to_path_buf(),
            speaker: ws.join("data/speaker.safetensors"),
            checkpoints: ws.join("checkpoints"),
            config,
            device: candle_core::Device::Cpu,
            backend: voiceclone::train::Backend::CpuKernels,
            hooks: Arc::new(voiceclone::train::hooks::NoHooks),
        }
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // Per rank: (name, master, exp_avg, exp_avg_sq) of every shard it restored.
    type Restored = Vec<(String, Vec<f32>, Vec<f32>, Vec<f32>)>;
    let restored: Vec<Restored> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (ws, opts) = (c.path(), &opts);
                s.spawn(move || {
                    let ep = Endpoint {
                        rank,
                        world: 2,
                        master: format!("127.0.0.1:{port}"),
                        timeout: std::time::Duration::from_secs(30),
                    };
                    let coll = Arc::new(TcpCollective::connect(&ep, vec![]).unwrap());
                    let t = ShardedTrainer::new(
                        opts(ws),
                        coll.clone(),
                        voiceclone::config::Shard::Full,
                        "test".into(),
                        false,
                    )
                    .unwrap();
                    assert_eq!(t.step, 3);
                    let v = |t: &candle_core::Tensor| -> Vec<f32> {
                        t.flatten_all().unwrap().to_vec1().unwrap()
                    };
                    let out = t
                        .params
                        .iter()
                        .enumerate()
                        .map(|(i, p)| {
                            (
                                p.name.clone(),
                                v(&p.master()),
                                v(&t.adam.m[i]),
                                v(&t.adam.v[i]),
                            )
                        })
                        .collect();
                    voiceclone::dist::Collective::finish(coll.as_ref()).unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, shards) in restored.iter().enumerate() {
        for (name, m, ea, eas) in shards {
            let (shape, _) = &saved[&format!("master.{name}")];
            let own = RowSplit::new(shape[0], 2).owned(rank);
            for (kind, got) in [("master", m), ("exp_avg", ea), ("exp_avg_sq", eas)] {
                let want = rows_of(&saved[&format!("{kind}.{name}")].1, shape, own.clone());
                assert!(
                    got == &want,
                    "rank {rank}: {kind}.{name} not restored bit for bit"
                );
            }
        }
    }
    let single = voiceclone::train::Trainer::new(opts(c.path()), false).unwrap();
    assert_eq!(single.step, 3);
    for (i, p) in single.params.params.iter().enumerate() {
        for (kind, t) in [
            ("master", p.master()),
            ("exp_avg", single.adam.m[i].clone()),
            ("exp_avg_sq", single.adam.v[i].clone()),
        ] {
            let got: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            assert!(
                got == saved[&format!("{kind}.{}", p.name)].1,
                "1 rank: {kind}.{} not restored bit for bit",
                p.name
            );
        }
    }
    drop(single);
    // ... and the run continues as the 4-rank one did.
    let mut two = six.to_vec();
    two.extend(["--cpu-ranks", "2"]);
    ok(&train(c.path(), &two));
    assert_same_run("4 → 2 ranks", c.path(), a.path(), 6);
    let d = as_of(a.path(), 3, 6);
    ok(&train(d.path(), &six));
    assert_same_run("4 ranks → 1 device", d.path(), a.path(), 6);

    // A single-device checkpoint continues on 3 ranks.
    let s = workspace(model);
    ok(&train(s.path(), &six));
    let e = as_of(s.path(), 3, 6);
    let mut three = six.to_vec();
    three.extend(["--cpu-ranks", "3"]);
    let o = train(e.path(), &three);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stdout).contains("resuming from checkpoints/step-0000003"));
    assert_same_run("1 device → 3 ranks", e.path(), s.path(), 6);
}

/// The rank processes of a run whose command line names `ws` (to check none outlives it).
fn processes_of(ws: &Path) -> Vec<u32> {
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

fn no_orphans(ws: &Path) {
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
/// (then `act(pid of the line's process or of the launcher)`), and returns the output, the exit
/// status and how long it ran after `act`.
fn run_until(
    ws: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    marker: &str,
    act: impl FnOnce(&std::process::Child, &str),
) -> (String, std::process::ExitStatus, std::time::Duration) {
    use std::io::{BufRead, BufReader};
    let mut a = vec!["train"];
    a.extend_from_slice(BASE);
    a.extend_from_slice(args);
    let mut cmd = command(ws, &a);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let mut lines = BufReader::new(err).lines();
    let mut seen = String::new();
    let mut acted = None;
    let mut act = Some(act);
    for line in lines.by_ref() {
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

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn a_failing_rank_stops_every_rank() {
    let model = "tiny-0b6";
    let args = ["--max-steps", "6", "--cpu-ranks", "3"];
    // A rank that panics in the middle of a step.
    let ws = workspace(model);
    let started = std::time::Instant::now();
    let mut a = vec!["train"];
    a.extend_from_slice(BASE);
    a.extend_from_slice(&args);
    let o = command(ws.path(), &a)
        .env("VOICECLONE_TEST_PANIC_AT_STEP", "2:1")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("error: rank 1 failed: rank 1 panicked") && err.contains("panics at step 2"),
        "{err}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    no_orphans(ws.path());

    // A rank killed with SIGKILL.
    let ws = workspace(model);
    let (err, status, took) = run_until(
        ws.path(),
        &args,
        &[("VOICECLONE_TEST_PAUSE_AT_STEP", "2:2")],
        "rank 2 paused at step 2",
        |_, line| {
            let pid: i32 = line
                .rsplit("(pid ")
                .next()
                .and_then(|s| s.trim_end_matches(')').parse().ok())
                .unwrap();
            unsafe { libc::kill(pid, libc::SIGKILL) };
        },
    );
    assert!(!status.success());
    assert!(
        err.contains("error: rank 2 was killed by signal 9"),
        "{err}"
    );
    assert!(
        took < std::time::Duration::from_secs(30),
        "the run took {took:?} to stop"
    );
    no_orphans(ws.path());
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn sigterm_to_the_launcher_saves_and_the_run_resumes_exactly() {
    let model = "tiny-0b6";
    let args = ["--max-steps", "6", "--save-every", "6", "--cpu-ranks", "2"];
    let full = workspace(model);
    ok(&train(full.path(), &args));
    let ws = workspace(model);
    let (err, status, took) = run_until(
        ws.path(),
        &args,
        &[("VOICECLONE_TEST_PAUSE_AFTER_STEP", "3")],
        "paused after step 3",
        |child, _| unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        },
    );
    assert!(
        !status.success(),
        "an interrupted run must not report success"
    );
    assert!(
        err.contains("training interrupted after step 3 of 6"),
        "{err}"
    );
    assert!(took < std::time::Duration::from_secs(30));
    no_orphans(ws.path());
    assert_eq!(
        std::fs::read_to_string(ws.path().join("checkpoints/latest"))
            .unwrap()
            .trim(),
        "step-0000003"
    );
    ok(&train(ws.path(), &args));
    assert!(
        state(ws.path(), 6) == state(full.path(), 6),
        "SIGTERM + resume differs"
    );
}

#[test]
fn a_rendezvous_with_a_missing_rank_times_out_naming_it() {
    let ws = tempfile::tempdir().unwrap();
    make_workspace(
        ws.path(),
        "tiny-0b6",
        &synthetic_rows(7, 21),
        &xvector(hidden("tiny-0b6"), 3),
        "[train]\ndist_timeout = 3",
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = std::time::Instant::now();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut a = vec!["train"];
            a.extend_from_slice(BASE);
            let mut c = command(ws.path(), &a);
            c.env("RANK", rank.to_string())
                .env("WORLD_SIZE", "3")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", (port - 1).to_string());
            c.spawn_output()
        })
        .collect();
    let outs: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    for (rank, o) in outs.iter().enumerate() {
        assert!(!o.status.success(), "rank {rank}");
    }
    let err0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        err0.contains(&format!("127.0.0.1:{port}")) && err0.contains("rank(s) 2 never connected"),
        "{err0}"
    );
    let err1 = String::from_utf8_lossy(&outs[1].stderr);
    assert!(err1.contains("rank 1"), "{err1}");
}

#[test]
fn a_torchrun_launch_equals_cpu_ranks() {
    let model = "tiny-0b6";
    let ours = workspace(model);
    ok(&train(
        ours.path(),
        &["--max-steps", "3", "--save-every", "3", "--cpu-ranks", "2"],
    ));
    let ws = workspace(model);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut a = vec!["train"];
            a.extend_from_slice(BASE);
            a.extend(["--max-steps", "3", "--save-every", "3"]);
            let mut c = command(ws.path(), &a);
            // As torchrun sets them; the rendezvous uses MASTER_PORT + 1.
            c.env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", (port - 1).to_string());
            c.spawn_output()
        })
        .collect();
    for (rank, h) in ranks.into_iter().enumerate() {
        let o = h.join().unwrap();
        assert!(o.status.success(), "rank {rank}: {}", text(&o));
    }
    assert!(
        state(ws.path(), 3) == state(ours.path(), 3),
        "torchrun-style launch differs"
    );
    assert_eq!(metrics(ws.path()), metrics(ours.path()));
}

/// Runs a command on a thread, returning its output when joined.
trait SpawnOutput {
    fn spawn_output(self) -> std::thread::JoinHandle<std::process::Output>;
}

impl SpawnOutput for std::process::Command {
    fn spawn_output(mut self) -> std::thread::JoinHandle<std::process::Output> {
        std::thread::spawn(move || self.output().unwrap())
    }
}
