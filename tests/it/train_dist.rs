//! Sharded training on CPU ranks (docs/distributed.md §9): `voiceclone train --cpu-ranks N`
//! equals single-device training on the same global batches, on both compute backends, and
//! resumes at any world size.

use std::path::Path;

use crate::dist_support::*;

/// The sharded runs of `model` on `backend` (N = 2, 3, 4; `full` and `grad-op`) against one
/// device on the same backend.
fn sharded_equals_one_device(model: &str, backend: &str) -> tempfile::TempDir {
    let single = workspace(model);
    ok(&train(
        single.path(),
        &[
            "--max-steps",
            "4",
            "--save-every",
            "4",
            "--backend",
            backend,
        ],
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
                    "--backend",
                    backend,
                ],
            );
            ok(&o);
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains(&format!("{ranks} ranks (CPU, TCP)")), "{out}");
            if backend != "kernels" {
                assert!(out.contains(&format!("backend {backend} on Cpu")), "{out}");
            }
            let n: usize = ranks.parse().unwrap();
            if n == 3 {
                // The split covers tensors whose rows do not divide by the rank count.
                assert!(reference.values().any(|(s, _)| s[0] % 3 != 0));
            }
            assert_same_run(
                &format!("{model} {backend} ×{ranks} {shard}"),
                ws.path(),
                single.path(),
                4,
                SHARDED_TOLERANCE,
            );
        }
    }
    single
}

#[test]
fn cpu_ranks_train_like_one_device() {
    for model in ["tiny-0b6", "tiny-1b7"] {
        let kernels = sharded_equals_one_device(model, "kernels");
        // The code path CUDA runs (autograd over plain ops, bf16 weight storage from fp32
        // masters), sharded as a GPU run shards it.
        let autograd = sharded_equals_one_device(model, "autograd");
        // What bf16 storage costs against the f32 kernels (docs/distributed.md §9).
        assert_same_run(
            &format!("{model} autograd (bf16 storage) vs kernels (f32)"),
            autograd.path(),
            kernels.path(),
            4,
            BF16_STORAGE_TOLERANCE,
        );
    }
}

/// A workspace whose utterances all say the same short sentence: its text ids fall into few of
/// the text table's row ranges.
fn one_sentence_workspace(model: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<_> = synthetic_rows(7, 21)
        .into_iter()
        .map(|mut r| {
            r["text"] = "Hello world.".into();
            r
        })
        .collect();
    make_workspace(dir.path(), model, &rows, &xvector(hidden(model), 3), "");
    dir
}

/// N = 8 ranks: most own none of a step's text rows (the text table is split into 8 ranges of
/// 18 992 rows; the data uses a handful of ids), none of the 4-row tensors of tiny-1b7 beyond
/// the first 4 ranks, and ranks 3..8 have no micro-batch in a step of 3.
#[test]
fn eight_ranks_most_of_which_own_nothing_train_like_one_device() {
    let model = "tiny-1b7";
    let ids = step_text_ids(model);
    let split = vc_dist::shard::RowSplit::new(151_936, 8);
    let owners: std::collections::BTreeSet<usize> = ids
        .iter()
        .map(|&i| {
            (0..8)
                .find(|&q| split.owned(q).contains(&(i as usize)))
                .unwrap()
        })
        .collect();
    eprintln!("ranks owning text rows of the data: {owners:?}");
    assert!(owners.len() <= 3, "{owners:?}");
    for backend in ["kernels", "autograd"] {
        let single = one_sentence_workspace(model);
        let args = [
            "--max-steps",
            "3",
            "--save-every",
            "3",
            "--backend",
            backend,
        ];
        ok(&train(single.path(), &args));
        for shard in ["full", "grad-op"] {
            let ws = one_sentence_workspace(model);
            let mut a = args.to_vec();
            a.extend(["--cpu-ranks", "8", "--shard", shard]);
            ok(&train(ws.path(), &a));
            assert_same_run(
                &format!("{model} {backend} ×8 {shard}"),
                ws.path(),
                single.path(),
                3,
                SHARDED_TOLERANCE,
            );
        }
    }
}

/// Every text id the batches of [`one_sentence_workspace`] use (its text and the layout's
/// specials).
fn step_text_ids(model: &str) -> Vec<u32> {
    let ws = one_sentence_workspace(model);
    let files =
        vc_model::files::ModelFiles::resolve(&vc_core::hub::ModelSource::Local(model_dir(model)))
            .unwrap();
    let tok = files.text_tokenizer().unwrap();
    let data =
        vc_train::data::load(&ws.path().join("data/train.jsonl"), ws.path(), &tok, 2048).unwrap();
    let layout = vc_train::batch::LayoutIds::from_config(&files.config);
    let mut ids: Vec<u32> = data
        .samples
        .iter()
        .flat_map(|s| s.text_ids.iter().copied())
        .chain(layout.text_specials())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[test]
fn checkpoints_resume_at_any_world_size() {
    use std::sync::Arc;
    use vc_dist::shard::RowSplit;
    use vc_dist::tcp::{Endpoint, TcpCollective};
    use vc_train::sharded::ShardedTrainer;

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
        let files = vc_model::files::ModelFiles::resolve(&vc_core::hub::ModelSource::Local(
            model_dir(model),
        ))
        .unwrap();
        let mut config = vc_core::config::resolve_layers(vec![])
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
        vc_train::TrainOptions {
            files,
            model_spec: model.into(),
            manifest: ws.join("data/train.jsonl"),
            base_dir: ws.to_path_buf(),
            speaker: ws.join("data/speaker.safetensors"),
            checkpoints: ws.join("checkpoints"),
            config,
            device: candle_core::Device::Cpu,
            backend: vc_train::Backend::Kernels,
            hooks: Arc::new(vc_train::hooks::NoHooks),
            evaluator: evaluator(),
        }
    };
    // Bound before the ranks start, as the launcher binds it.
    let listener = Arc::new(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let port = listener.local_addr().unwrap().port();
    // Per rank: (name, master, exp_avg, exp_avg_sq) of every shard it restored.
    type Restored = Vec<(String, Vec<f32>, Vec<f32>, Vec<f32>)>;
    let restored: Vec<Restored> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (ws, opts) = (c.path(), &opts);
                let listener = (rank == 0).then(|| listener.clone());
                s.spawn(move || {
                    let mut ep = Endpoint::new(
                        rank,
                        2,
                        format!("127.0.0.1:{port}"),
                        std::time::Duration::from_secs(30),
                    );
                    ep.listener = listener;
                    let coll: Arc<dyn vc_dist::Collective> =
                        Arc::new(TcpCollective::connect(&ep, vec![]).unwrap());
                    let t = ShardedTrainer::new(
                        opts(ws),
                        vc_dist::Mesh::flat(coll.clone()),
                        vc_core::config::Shard::Full,
                        "test".into(),
                        false,
                    )
                    .unwrap();
                    assert_eq!(t.run.step, 3);
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
                                v(&p.master().unwrap()),
                                v(&t.adam.m[i].decode().unwrap()),
                                v(&t.adam.v[i].decode().unwrap()),
                            )
                        })
                        .collect();
                    vc_dist::Collective::finish(coll.as_ref()).unwrap();
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
    let single = vc_train::Trainer::new(opts(c.path()), false).unwrap();
    assert_eq!(single.run.step, 3);
    for (i, p) in single.params.params.iter().enumerate() {
        for (kind, t) in [
            ("master", p.master().unwrap()),
            ("exp_avg", single.adam.m[i].decode().unwrap()),
            ("exp_avg_sq", single.adam.v[i].decode().unwrap()),
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
    assert_same_run("4 → 2 ranks", c.path(), a.path(), 6, SHARDED_TOLERANCE);
    let d = as_of(a.path(), 3, 6);
    ok(&train(d.path(), &six));
    assert_same_run(
        "4 ranks → 1 device",
        d.path(),
        a.path(),
        6,
        SHARDED_TOLERANCE,
    );

    // A single-device checkpoint continues on 3 ranks.
    let s = workspace(model);
    ok(&train(s.path(), &six));
    let e = as_of(s.path(), 3, 6);
    let mut three = six.to_vec();
    three.extend(["--cpu-ranks", "3"]);
    let o = train(e.path(), &three);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stdout).contains("resuming from checkpoints/step-0000003"));
    assert_same_run(
        "1 device → 3 ranks",
        e.path(),
        s.path(),
        6,
        SHARDED_TOLERANCE,
    );
}

/// The GPU code path (autograd, bf16 storage) resumes as the kernels do: at the same world size
/// bit for bit, at another one (and on one device) within the sharded tolerance.
#[test]
fn autograd_checkpoints_resume_at_any_world_size() {
    let model = "tiny-1b7";
    let six = [
        "--max-steps",
        "6",
        "--save-every",
        "3",
        "--backend",
        "autograd",
    ];
    let a = workspace(model);
    let mut four = six.to_vec();
    four.extend(["--cpu-ranks", "4", "--shard", "full"]);
    ok(&train(a.path(), &four));
    let b = as_of(a.path(), 3, 6);
    ok(&train(b.path(), &four));
    assert!(
        state(b.path(), 6) == state(a.path(), 6),
        "autograd: 4 ranks resumed at 4 ranks differ"
    );
    for (tag, extra) in [
        (
            "4 → 2 ranks, grad-op",
            vec!["--cpu-ranks", "2", "--shard", "grad-op"],
        ),
        ("4 ranks → 1 device", vec![]),
    ] {
        let c = as_of(a.path(), 3, 6);
        let mut args = six.to_vec();
        args.extend(extra);
        let o = train(c.path(), &args);
        ok(&o);
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("resuming from checkpoints/step-0000003")
        );
        assert_same_run(
            &format!("autograd {tag}"),
            c.path(),
            a.path(),
            6,
            SHARDED_TOLERANCE,
        );
    }
}
