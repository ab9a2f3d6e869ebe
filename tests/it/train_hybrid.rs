//! Hybrid sharding and overlapped communication end to end (docs/distributed.md §4.6, §4.7,
//! docs/distributed.md §8): `voiceclone train --cpu-ranks N --shard-group S` trains like one device, its
//! checkpoints continue in any layout, `--prefetch 0` and the default give the same bits, and
//! every step's metrics say what crossed which link.

use std::path::Path;

use crate::dist_support::*;

/// Trains `ws` with the shared flags and `extra`, and returns stdout.
fn run(ws: &Path, extra: &[&str]) -> String {
    let o = train(ws, extra);
    ok(&o);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Shard groups train like one device, on both backends: 4 ranks as 2 × 2 and 6 as 2 × 3 and
/// 3 × 2; a run saved in groups continues in one group and the reverse, like an uninterrupted
/// one.
#[test]
fn shard_groups_train_like_one_device_and_resume_in_any_layout() {
    let model = "tiny-0b6";
    for backend in ["kernels", "autograd"] {
        let single = workspace(model);
        let steps = [
            "--max-steps",
            "4",
            "--save-every",
            "4",
            "--backend",
            backend,
        ];
        run(single.path(), &steps);
        let layouts: &[(&str, &str)] = if backend == "kernels" {
            &[("4", "2"), ("6", "3"), ("6", "2")]
        } else {
            &[("4", "2")]
        };
        for &(ranks, group) in layouts {
            for shard in ["full", "grad-op"] {
                let ws = workspace(model);
                let mut a = steps.to_vec();
                a.extend([
                    "--cpu-ranks",
                    ranks,
                    "--shard-group",
                    group,
                    "--shard",
                    shard,
                ]);
                let out = run(ws.path(), &a);
                let n: usize = ranks.parse().unwrap();
                let s: usize = group.parse().unwrap();
                assert!(
                    out.contains(&format!("{} shard groups of {s} ranks", n / s)),
                    "{out}"
                );
                assert_same_run(
                    &format!("{model} {backend} {ranks} ranks in groups of {group}, {shard}"),
                    ws.path(),
                    single.path(),
                    4,
                    SHARDED_TOLERANCE,
                );
                // A checkpoint of groups holds one group's rank files.
                let dir = ws.path().join("checkpoints/step-0000004");
                assert!(dir.join(format!("rank-{:05}.safetensors", s - 1)).exists());
                assert!(!dir.join(format!("rank-{s:05}.safetensors")).exists());
            }
        }
        if backend != "kernels" {
            continue;
        }
        // Groups → one group, and one group → groups, at step 2.
        for (first, then) in [
            (
                &["--cpu-ranks", "4", "--shard-group", "2"][..],
                &["--cpu-ranks", "4"][..],
            ),
            (
                &["--cpu-ranks", "3"][..],
                &["--cpu-ranks", "6", "--shard-group", "3"][..],
            ),
        ] {
            let ws = workspace(model);
            let mut a = vec![
                "--max-steps",
                "2",
                "--save-every",
                "2",
                "--backend",
                backend,
            ];
            a.extend(first);
            run(ws.path(), &a);
            let mut b = steps.to_vec();
            b.extend(then);
            let out = run(ws.path(), &b);
            assert!(
                out.contains("resuming from checkpoints/step-0000002"),
                "{out}"
            );
            assert_same_run(
                &format!("{model} resumed from {first:?} as {then:?}"),
                ws.path(),
                single.path(),
                4,
                SHARDED_TOLERANCE,
            );
        }
    }
}

/// The rank files of a checkpoint, byte for byte.
fn rank_files(ws: &Path, step: usize) -> Vec<Vec<u8>> {
    let dir = ws.join(format!("checkpoints/step-{step:07}"));
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".safetensors"))
        .collect();
    files.sort();
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// `--prefetch 0` (every collective waited for where it is issued) and the default overlap give
/// the same metrics and the same checkpoint bytes, in one group and in groups, both modes.
#[test]
fn overlapping_communication_changes_no_bit_end_to_end() {
    for layout in [
        &["--cpu-ranks", "3"][..],
        &["--cpu-ranks", "4", "--shard-group", "2"][..],
    ] {
        for shard in ["full", "grad-op"] {
            let mut results = Vec::new();
            for prefetch in ["0", "1", "2"] {
                let ws = workspace("tiny-1b7");
                let mut a = vec!["--max-steps", "3", "--save-every", "3", "--shard", shard];
                a.extend(layout);
                a.extend(["--prefetch", prefetch]);
                let out = run(ws.path(), &a);
                let said = if prefetch == "0" {
                    "not overlapped (train.prefetch 0)".to_string()
                } else {
                    format!("prefetch {prefetch}: gathers run ahead")
                };
                assert!(out.contains(&said), "{out}");
                results.push((metrics(ws.path()), rank_files(ws.path(), 3), ws));
            }
            for r in &results[1..] {
                assert_eq!(r.0, results[0].0, "{layout:?} {shard}: metrics");
                assert!(r.1 == results[0].1, "{layout:?} {shard}: checkpoint bytes");
            }
        }
    }
}

/// Nodes come from the emulated network (docs/distributed.md §8.3) or the launcher:
/// `--shard-group node` takes the ranks of one node, the start line says so, and every step's
/// metrics report the most bytes a rank sent within its node and across; hybrid groups send
/// less across nodes than one group spanning them. A group that does not divide the ranks is
/// refused naming the key.
#[test]
fn groups_of_a_node_send_less_across_nodes_and_every_step_says_how_much() {
    let emulate = "ranks-per-node=2,bandwidth=20gbyte,latency=0us";
    let across = |ws: &Path| -> Vec<(u64, u64)> {
        metrics(ws)
            .iter()
            .map(|m| {
                (
                    m["sent_within_node"].as_u64().expect("sent_within_node"),
                    m["sent_across_nodes"].as_u64().expect("sent_across_nodes"),
                )
            })
            .collect()
    };
    let mut sent = Vec::new();
    for group in ["0", "node"] {
        let ws = workspace("tiny-0b6");
        let mut args = vec!["train"];
        args.extend_from_slice(BASE);
        args.extend([
            "--max-steps",
            "2",
            "--cpu-ranks",
            "4",
            "--shard-group",
            group,
        ]);
        let o = command(ws.path(), &args)
            .env("VOICECLONE_EMULATE_NETWORK", emulate)
            .output()
            .unwrap();
        ok(&o);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("2 emulated nodes of 2 ranks"), "{out}");
        if group == "node" {
            assert!(out.contains("2 shard groups of 2 ranks"), "{out}");
        } else {
            assert!(out.contains("one shard group of 4 ranks"), "{out}");
        }
        let s = across(ws.path());
        assert_eq!(s.len(), 2);
        assert!(s.iter().all(|&(w, a)| w > 0 && a > 0), "{group}: {s:?}");
        sent.push(s[0]);
    }
    eprintln!(
        "per step, the most a rank sent (within, across nodes): flat {:?}, groups {:?}",
        sent[0], sent[1]
    );
    assert!(
        sent[1].1 * 2 < sent[0].1,
        "groups send less across nodes: {sent:?}"
    );
    // Without emulation and on one machine every byte stays on the node.
    let ws = workspace("tiny-0b6");
    run(ws.path(), &["--max-steps", "1", "--cpu-ranks", "2"]);
    assert!(across(ws.path()).iter().all(|&(w, a)| w > 0 && a == 0));
    let o = train(
        ws.path(),
        &["--max-steps", "2", "--cpu-ranks", "4", "--shard-group", "3"],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("train.shard_group") && err.contains("--shard-group"),
        "{err}"
    );
}
