//! The memory plan (docs/training.md §6.9): `--plan` for the released models' shapes, the
//! choice `train.memory = "auto"` makes and its refusal before any weight is read, and the
//! plan held to what runs allocate — the counting allocator of `test-hooks` builds — within
//! 10 % for every mode on both backends, on a model large enough that the model, not the
//! process, is what is measured.

use std::path::{Path, PathBuf};

use serde_json::Value;
use vc_model::config::Qwen3TtsConfig;
use vc_train::plan::shapes::talker_tensors;

use crate::train_support::*;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn released(size: &str) -> PathBuf {
    repo().join(format!("configs/models/qwen3-tts-12hz-{size}-base"))
}

fn plan_json(workdir: &Path, args: &[&str]) -> Value {
    let mut all = vec!["train", "--plan", "--json"];
    all.extend_from_slice(args);
    let out = voiceclone(workdir, &all);
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)))
}

fn key(m: &Value) -> (String, String, String) {
    let s = |k: &str| m[k].as_str().unwrap().to_string();
    (s("optimizer_state"), s("offload"), s("recompute"))
}

#[test]
fn plan_of_the_released_models_and_the_choice_of_auto() {
    let ws = tempfile::tempdir().unwrap();
    let gib = |b: &Value| b.as_f64().unwrap() / (1u64 << 30) as f64;
    for (size, memory, trained_m) in [("1.7b", "24", 1916.7), ("0.6b", "12", 905.9)] {
        let model = released(size);
        let plan = plan_json(
            ws.path(),
            &[
                "--model",
                model.to_str().unwrap(),
                "--gpus",
                "1",
                "--gpu-memory",
                memory,
            ],
        );
        let modes = plan["modes"].as_array().unwrap();
        // Three optimizer states × offload or not × recompute or not.
        assert_eq!(modes.len(), 12, "{plan}");
        let fp32 = &modes[0];
        assert_eq!(key(fp32), ("fp32".into(), "none".into(), "none".into()));
        // fp32 masters and two fp32 moments of every trained value (docs/model.md §11).
        let masters = fp32["gpu"]["masters"].as_f64().unwrap();
        assert!((masters / 4e6 / trained_m - 1.0).abs() < 1e-3, "{masters}");
        let moments = fp32["gpu"]["moments"].as_f64().unwrap();
        assert!((moments / 8e6 / trained_m - 1.0).abs() < 1e-3, "{moments}");
        // int8 moments are about a quarter.
        let int8 = modes
            .iter()
            .find(|m| key(m) == ("int8".into(), "none".into(), "none".into()))
            .unwrap();
        let ratio = int8["gpu"]["moments"].as_f64().unwrap() / moments;
        assert!((0.25..0.27).contains(&ratio), "{ratio}");
        // Offloading moves masters and moments to the host.
        let off = &modes[2];
        assert_eq!(key(off), ("fp32".into(), "optimizer".into(), "none".into()));
        assert_eq!(off["gpu"]["masters"], 0);
        assert_eq!(off["host"]["masters"].as_f64().unwrap(), masters);
        // `chosen` is the first that fits, in the documented order, and it fits the card.
        let first = modes.iter().position(|m| m["fits"] == true).unwrap();
        assert!(modes[..first].iter().all(|m| m["fits"] == false));
        assert_eq!(key(&plan["chosen"]), key(&modes[first]), "{size}: {plan}");
        let limit: f64 = memory.parse().unwrap();
        assert!(gib(&modes[first]["gpu_bytes"]) <= limit);
        // A full fine-tune of the 1.7B fits 24 GB, of the 0.6B 12 GB (the point of the modes),
        // but not in the plain fp32 mode.
        assert_eq!(fp32["fits"], false, "{size}: {plan}");
        // The table says the same.
        let out = voiceclone(
            ws.path(),
            &[
                "train",
                "--plan",
                "--model",
                model.to_str().unwrap(),
                "--gpus",
                "1",
                "--gpu-memory",
                memory,
            ],
        );
        let table = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{}", text(&out));
        assert_eq!(table.matches("<- auto").count(), 1, "{table}");
        assert!(table.contains("bf16-compensated"), "{table}");
    }
    // A pinned setting is kept: with int8 fixed, only int8 rows are listed and chosen.
    let plan = plan_json(
        ws.path(),
        &[
            "--model",
            released("1.7b").to_str().unwrap(),
            "--gpus",
            "2",
            "--gpu-memory",
            "24",
            "--optimizer-state",
            "int8",
        ],
    );
    let modes = plan["modes"].as_array().unwrap();
    assert_eq!(modes.len(), 4);
    assert!(modes.iter().all(|m| m["optimizer_state"] == "int8"));
    assert_eq!(plan["chosen"]["optimizer_state"], "int8");
    // Sharding divides the state: each of two ranks holds half the moments (within a row).
    let one = plan_json(
        ws.path(),
        &[
            "--model",
            released("1.7b").to_str().unwrap(),
            "--gpus",
            "1",
            "--optimizer-state",
            "int8",
        ],
    );
    let (m1, m2) = (
        one["modes"][0]["gpu"]["moments"].as_f64().unwrap(),
        modes[0]["gpu"]["moments"].as_f64().unwrap(),
    );
    assert!((m2 / m1 - 0.5).abs() < 1e-3, "{m1} {m2}");
    // Without --gpu-memory a CPU build cannot ask a GPU: the plan prints, nothing is chosen.
    if !cfg!(feature = "cuda") {
        assert!(one["chosen"].is_null());
        assert!(one["modes"][0]["fits"].is_null());
    }
}

/// A workspace training `model` (a directory) on `rows`.
fn workspace_for(dir: &Path, model: &Path, rows: &[Value], hidden: usize) {
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let manifest: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(dir.join("data/train.jsonl"), manifest).unwrap();
    let bytes = vc_core::artifacts::speaker::to_bytes(&xvector(hidden, 3), None).unwrap();
    std::fs::write(dir.join("data/speaker.safetensors"), bytes).unwrap();
    std::fs::write(
        dir.join("voiceclone.toml"),
        format!("[model]\nbase = {:?}\n", model.display().to_string()),
    )
    .unwrap();
}

#[test]
fn auto_refuses_what_cannot_fit_before_reading_any_weight() {
    // A model of the 0.6B's shapes with no weights at all: only the plan can look at it.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        released("0.6b").join("config.json"),
        model.join("config.json"),
    )
    .unwrap();
    let ws = tmp.path().join("ws");
    workspace_for(&ws, &model, &synthetic_rows(4, 1), 1024);
    let out = voiceclone(&ws, &["train", "--gpu-memory", "6"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{}", text(&out));
    assert!(err.contains("training does not fit"), "{err}");
    assert!(!err.contains("safetensors"), "{err}");
    // The rank count it suggests is the first whose plan fits.
    let ranks: usize = err
        .split("--cpu-ranks ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no rank count suggested: {err}"));
    let fits = |n: usize| {
        let n = n.to_string();
        let plan = plan_json(&ws, &["--gpu-memory", "6", "--cpu-ranks", &n]);
        !plan["chosen"].is_null()
    };
    assert!(
        ranks >= 2 && fits(ranks) && !fits(ranks - 1),
        "{ranks}: {err}"
    );
    // Pinning the mode does not change what fits, but the message names the open choice too.
    let out = voiceclone(
        &ws,
        &["train", "--gpu-memory", "6", "--optimizer-state", "fp32"],
    );
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(err.contains("training does not fit"), "{err}");
    // `manual` does not plan: the run goes on to the model files and fails on the weights.
    let out = voiceclone(&ws, &["train", "--gpu-memory", "6", "--memory", "manual"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success());
    assert!(!err.contains("training does not fit"), "{err}");
}

/// A random bf16 model of `cfg`'s talker (the fixture's tokenizer beside it), written through
/// the shapes the plan reads.
fn write_model(dir: &Path, config: &Value) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    for f in [
        "generation_config.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
    ] {
        std::fs::copy(model_dir("tiny-0b6").join(f), dir.join(f)).unwrap();
    }
    let cfg = Qwen3TtsConfig::from_file(&dir.join("config.json")).unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = talker_tensors(&cfg)
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.shape))
        .collect();
    // The fixture's small speaker encoder, its output layer widened to the talker's width
    // (training reads precomputed x-vectors; the checkpoint must still be complete).
    let fixture = std::fs::read(model_dir("tiny-0b6").join("model.safetensors")).unwrap();
    let fixture = safetensors::SafeTensors::deserialize(&fixture).unwrap();
    let hidden = cfg.talker_config.hidden_size;
    for (name, view) in fixture.tensors() {
        let Some(rest) = name.strip_prefix("speaker_encoder.") else {
            continue;
        };
        let mut shape = view.shape().to_vec();
        if rest.starts_with("fc.") {
            shape[0] = hidden;
        }
        shapes.push((name, shape));
    }
    let mut r = Lcg(11);
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(_, shape)| {
            (0..shape.iter().product::<usize>())
                .flat_map(|_| {
                    let v = (r.next() % 2001) as f32 / 1000.0 - 1.0;
                    half::bf16::from_f32(v * 0.05).to_le_bytes()
                })
                .collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = shapes
        .iter()
        .zip(&data)
        .map(|((name, shape), bytes)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::BF16,
                shape.clone(),
                bytes,
            )
            .unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// The fixture's config with a talker wide enough that its tensors, not the process, are what
/// a run allocates (about 50 M values besides the text table).
fn mid_config() -> Value {
    let text = std::fs::read_to_string(model_dir("tiny-0b6").join("config.json")).unwrap();
    let mut c: Value = serde_json::from_str(&text).unwrap();
    let t = &mut c["talker_config"];
    for (k, v) in [
        ("hidden_size", 512),
        ("num_hidden_layers", 4),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("head_dim", 64),
        ("intermediate_size", 1536),
        ("text_hidden_size", 256),
    ] {
        t[k] = v.into();
    }
    t["rope_scaling"]["mrope_section"] = serde_json::json!([16, 8, 8]);
    let cp = &mut t["code_predictor_config"];
    for (k, v) in [
        ("hidden_size", 512),
        ("num_hidden_layers", 2),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("head_dim", 64),
        ("intermediate_size", 1536),
    ] {
        cp[k] = v.into();
    }
    c["speaker_encoder_config"]["enc_dim"] = 512.into();
    c
}

/// Rows of `frames` frames each.
fn rows_of(n: usize, frames: usize) -> Vec<Value> {
    synthetic_rows(n, 2)
        .into_iter()
        .map(|mut r| {
            let codes = r["audio_codes"][0].clone();
            r["audio_codes"] = Value::Array(vec![codes; frames]);
            r
        })
        .collect()
}

/// The plan's bytes for `args` (`train …` on `ws`) beside what the run's processes allocate: the
/// plan of the largest rank without the process's own share (code, stacks: not allocated through
/// the allocator), and the peak of each process — `processes` of them — over two steps (memory a
/// step leaks would show). Each process reports its peak in a file of its own.
fn plan_and_peaks(ws: &Path, args: &[&str], processes: usize) -> (f64, Vec<f64>) {
    let plan = plan_json(ws, &args[1..]);
    let host = &plan["modes"][0]["host"];
    let predicted = host["total"].as_f64().unwrap() - host["fixed"].as_f64().unwrap();
    let mut run = args.to_vec();
    run.extend_from_slice(&["--max-steps", "2", "--save-every", "0", "--no-export"]);
    let peaks_dir = tempfile::tempdir().unwrap();
    let out = command(ws, &run)
        .env("VOICECLONE_TEST_REPORT_PEAK", peaks_dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let peaks: Vec<f64> = std::fs::read_dir(peaks_dir.path())
        .unwrap()
        .map(|f| {
            let f = f.unwrap().path();
            std::fs::read_to_string(&f).unwrap().trim().parse().unwrap()
        })
        .collect();
    assert_eq!(
        peaks.len(),
        processes,
        "not every process reported its peak"
    );
    (predicted, peaks)
}

/// [`plan_and_peaks`] of `train --backend BACKEND` and the `flags` in a fresh workspace
/// `dir/ws` training `model` on eight utterances of 40 frames.
fn fresh_run(
    dir: &Path,
    model: &Path,
    backend: &str,
    flags: &[&[&str]],
    processes: usize,
) -> (f64, Vec<f64>) {
    let ws = dir.join("ws");
    let _ = std::fs::remove_dir_all(&ws);
    workspace_for(&ws, model, &rows_of(8, 40), 512);
    let mut args = vec!["train", "--backend", backend];
    for f in flags {
        args.extend_from_slice(f);
    }
    plan_and_peaks(&ws, &args, processes)
}

/// `label: plan …, allocated …, ratio R` for the report of a plan test.
fn report_line(label: &str, predicted: f64, peak: f64) -> String {
    format!(
        "{label}: plan {:.1} MB, allocated {:.1} MB, ratio {:.3}",
        predicted / 1e6,
        peak / 1e6,
        predicted / peak
    )
}

/// Prints the report and holds every ratio in it within 10 %.
fn assert_within_a_tenth(report: &[String]) {
    let text = report.join("\n");
    println!("{text}");
    for line in report {
        let ratio: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((0.9..=1.1).contains(&ratio), "{text}");
    }
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn the_plan_predicts_what_runs_allocate() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("mid");
    write_model(&model, &mid_config());
    let base = ["--batch-size", "2", "--grad-accum", "2", "--no-shuffle"];
    let mut report = Vec::new();
    for backend in ["kernels", "autograd"] {
        for extra in [
            &[][..],
            &["--optimizer-state", "int8"],
            &["--optimizer-state", "bf16-compensated"],
            &["--recompute", "layers"],
            &["--reduce-dtype", "bf16"],
        ] {
            let (predicted, peaks) = fresh_run(tmp.path(), &model, backend, &[&base, extra], 1);
            report.push(report_line(
                &format!("{backend} {extra:?}"),
                predicted,
                peaks[0],
            ));
        }
    }
    assert_within_a_tenth(&report);
}

/// What a LoRA rank costs (docs/training.md §13): the factors, their gradients and optimizer
/// state, and the rank-wide activations of every adapted projection, held to what a run
/// allocates at a small and at the largest useful rank on both backends; a rank above the
/// adapted matrices' smaller side is refused before anything is loaded, naming the largest
/// useful one.
#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn the_plan_counts_what_a_lora_rank_costs() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("mid");
    write_model(&model, &mid_config());
    let ws = tmp.path().join("ws");
    workspace_for(&ws, &model, &rows_of(8, 40), 512);
    // The k and v projections are 256 × 512: no rank above 256 can be used.
    let out = voiceclone(
        &ws,
        &["train", "--lora-rank", "1000000", "--max-steps", "1"],
    );
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        err.contains("the largest useful rank for these targets is 256"),
        "{err}"
    );
    let mut report = Vec::new();
    for backend in ["kernels", "autograd"] {
        for rank in ["8", "256"] {
            let _ = std::fs::remove_dir_all(ws.join("checkpoints"));
            let args = [
                "train",
                "--backend",
                backend,
                "--lora-rank",
                rank,
                "--batch-size",
                "2",
                "--grad-accum",
                "2",
                "--no-shuffle",
            ];
            let (predicted, peaks) = plan_and_peaks(&ws, &args, 1);
            report.push(report_line(
                &format!("{backend} rank {rank}"),
                predicted,
                peaks[0],
            ));
        }
    }
    assert_within_a_tenth(&report);
}

/// The plan of a sharded run (docs/distributed.md §7) held to what its ranks allocate: the
/// state of one rank's rows within its group, the units gathered ahead (`train.prefetch` 0, the
/// default 1, and 2) and the reductions in flight behind the computation, flat and in shard
/// groups, both modes, on CPU ranks of both backends. Every rank process reports its own peak;
/// the plan is for the largest rank.
#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn the_plan_predicts_what_sharded_ranks_allocate() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("mid");
    write_model(&model, &mid_config());
    let base = ["--batch-size", "2", "--grad-accum", "4", "--no-shuffle"];
    let mut report = Vec::new();
    let cases: [(&str, &[&str]); 6] = [
        ("kernels", &["--cpu-ranks", "2", "--prefetch", "0"]),
        ("kernels", &["--cpu-ranks", "2", "--prefetch", "2"]),
        ("kernels", &["--cpu-ranks", "4", "--shard-group", "2"]),
        ("autograd", &["--cpu-ranks", "2"]),
        ("autograd", &["--cpu-ranks", "2", "--shard", "grad-op"]),
        ("autograd", &["--cpu-ranks", "4", "--shard-group", "2"]),
    ];
    for (backend, extra) in cases {
        // Every rank and the launcher (its peak far smaller) report.
        let ranks: usize = extra[1].parse().unwrap();
        let (predicted, peaks) = fresh_run(tmp.path(), &model, backend, &[&base, extra], ranks + 1);
        let peak = peaks.iter().copied().fold(0f64, f64::max);
        report.push(report_line(
            &format!("{backend} {extra:?}, largest rank"),
            predicted,
            peak,
        ));
    }
    assert_within_a_tenth(&report);
}
