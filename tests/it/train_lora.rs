//! Fine-tuning with low-rank adapters (docs/training.md §13) on the fixture models, stored in
//! bf16 and in f32, on the CPU kernels and on the autograd path CUDA runs: a fresh adapter is
//! the base model to the bit, only the adapters (and `train.lora_full`) train, checkpoints
//! resume bit for bit on one device and on two ranks and reshard from two ranks to one, refuse
//! another adapter configuration, and export merges `W + s·α/r·B·A` into the official layout.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use vc_train::{Backend, Storage, Trainer};

use crate::dist_support::{as_of, assert_same_run, ok, train, workspace, SHARDED_TOLERANCE};
use crate::train_support::*;

const BACKENDS: [Backend; 2] = [Backend::Kernels, Backend::Autograd(Storage::Bf16)];

/// [`constant_lr_trainer`] at lr 1e-3, with adapters of rank `lora` (0: a full fine-tune) and
/// the head trained fully beside them.
fn trainer(model: &str, dir: &std::path::Path, backend: Backend, lora: usize) -> Trainer {
    constant_lr_trainer(model, dir, backend, 1e-3, |c| {
        c.lora_rank = lora;
        if lora > 0 {
            c.lora_full = vec!["talker.codec_head.weight".into()];
        }
    })
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The masters of every trained tensor, by name.
fn masters(t: &Trainer) -> BTreeMap<String, Vec<f32>> {
    t.params
        .params
        .iter()
        .map(|p| (p.name.clone(), values(&p.master().unwrap())))
        .collect()
}

/// With B = 0 the loss is the base model's to the bit; over 30 steps at lr 1e-3 the loss falls,
/// every adapter factor and the fully trained head move, and every frozen tensor is the base
/// model's in the storage dtype. Both fixture models, stored in bf16 and in f32, both backends.
#[test]
fn a_fresh_adapter_is_the_base_model_and_only_adapters_train() {
    for model in ["tiny-0b6", "tiny-1b7"] {
        let f32_copy = f32_model_copy(model);
        let f32_path = f32_copy.path().to_str().unwrap().to_string();
        for (stored, dir) in [("bf16", model), ("f32", f32_path.as_str())] {
            for backend in BACKENDS {
                let tag = format!("{model} ({stored}) {}", backend.name());
                let ws = tempfile::tempdir().unwrap();
                let mut base = trainer(dir, ws.path(), backend, 0);
                let ws2 = tempfile::tempdir().unwrap();
                let mut lora = trainer(dir, ws2.path(), backend, 4);
                let batch = [0, 1, 2];
                let (lb, _) = base.batch_loss(&batch).unwrap();
                let (ll, _) = lora.batch_loss(&batch).unwrap();
                for (what, a, b) in [
                    ("total", &lb.total, &ll.total),
                    ("talker", &lb.talker, &ll.talker),
                    ("sub", &lb.sub, &ll.sub),
                ] {
                    let (a, b) = (a.to_scalar::<f32>().unwrap(), b.to_scalar::<f32>().unwrap());
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{tag}: step-0 {what} loss {a} vs {b}"
                    );
                }
                drop(base);

                let names: Vec<&str> = lora.params.params.iter().map(|p| p.name.as_str()).collect();
                assert!(
                    names.iter().all(|n| n.contains(".lora_A.")
                        || n.contains(".lora_B.")
                        || *n == "talker.codec_head.weight"),
                    "{tag}: trains {names:?}"
                );
                let frozen: Vec<String> = lora.params.frozen_names().map(String::from).collect();
                let file = candle_core::safetensors::load(
                    model_dir(dir).join("model.safetensors"),
                    &candle_core::Device::Cpu,
                )
                .unwrap();
                let storage = match backend {
                    Backend::Kernels => DType::F32,
                    _ => DType::BF16,
                };
                let frozen_before: Vec<Vec<f32>> = frozen
                    .iter()
                    .map(|n| values(&file[n].to_dtype(storage).unwrap()))
                    .collect();
                assert!(!frozen.is_empty(), "{tag}: nothing frozen");
                let start = masters(&lora);
                let mut losses = Vec::new();
                for _ in 0..30 {
                    losses.push(lora.step(&[vec![0, 1, 2], vec![3, 4, 5]]).unwrap().loss);
                }
                let (first, last) = (losses[0], losses[29]);
                assert!(last < 0.9 * first, "{tag}: loss {first} -> {last}");
                let end = masters(&lora);
                for (name, v0) in &start {
                    assert!(v0 != &end[name], "{tag}: {name} did not change");
                }
                for (n, v0) in frozen.iter().zip(&frozen_before) {
                    let v1 = values(lora.params.frozen_tensor(n).unwrap());
                    assert!(v0 == &v1, "{tag}: frozen {n} changed");
                }
                eprintln!("{tag}: loss {first:.4} -> {last:.4} in 30 steps");
            }
        }
    }
}

const LORA: &[&str] = &[
    "--lora-rank",
    "4",
    "--lora-full",
    "talker.codec_head.weight",
    "--max-steps",
    "4",
    "--save-every",
    "2",
    "--keep",
    "10",
];

fn rank_file(ws: &std::path::Path, step: usize, rank: usize) -> Vec<u8> {
    std::fs::read(ws.join(format!(
        "checkpoints/step-{step:07}/rank-{rank:05}.safetensors"
    )))
    .unwrap()
}

/// A resumed run ends bit for bit where an uninterrupted one does, on one device and on two
/// ranks; a two-rank checkpoint continues on one device as the two-rank run does; two ranks train
/// as one device does, also with no tensor trained fully (the embedding and head units then
/// train nothing); a checkpoint holds the adapters and the fully trained tensors only.
#[test]
fn adapters_resume_exactly_at_any_world_size() {
    for backend in ["kernels", "autograd"] {
        let mut args = LORA.to_vec();
        args.extend(["--backend", backend]);
        let one = workspace("tiny-0b6");
        ok(&train(one.path(), &args));
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(one.path().join("checkpoints/step-0000004/index.json"))
                .unwrap(),
        )
        .unwrap();
        let params: Vec<&String> = index["params"].as_object().unwrap().keys().collect();
        assert!(
            params
                .iter()
                .all(|n| n.contains(".lora_") || *n == "talker.codec_head.weight"),
            "{backend}: the checkpoint holds {params:?}"
        );
        assert_eq!(index["identity"]["lora"]["rank"], 4, "{backend}");
        let resumed = as_of(one.path(), 2, 4);
        ok(&train(resumed.path(), &args));
        assert!(
            rank_file(resumed.path(), 4, 0) == rank_file(one.path(), 4, 0),
            "{backend}: the resumed run differs"
        );

        let mut sharded = args.clone();
        sharded.extend(["--cpu-ranks", "2"]);
        let two = workspace("tiny-0b6");
        ok(&train(two.path(), &sharded));
        assert_same_run(
            &format!("{backend} LoRA at N = 2"),
            two.path(),
            one.path(),
            4,
            SHARDED_TOLERANCE,
        );
        let resumed = as_of(two.path(), 2, 4);
        ok(&train(resumed.path(), &sharded));
        for rank in 0..2 {
            assert!(
                rank_file(resumed.path(), 4, rank) == rank_file(two.path(), 4, rank),
                "{backend}: rank {rank} of the resumed two-rank run differs"
            );
        }
        let on_one = as_of(two.path(), 2, 4);
        ok(&train(on_one.path(), &args));
        assert_same_run(
            &format!("{backend} LoRA from N = 2 to 1"),
            on_one.path(),
            two.path(),
            4,
            SHARDED_TOLERANCE,
        );
        let only = ["--lora-rank", "4", "--max-steps", "2", "--backend", backend];
        let (a, b) = (workspace("tiny-0b6"), workspace("tiny-0b6"));
        ok(&train(a.path(), &only));
        let mut sharded = only.to_vec();
        sharded.extend(["--cpu-ranks", "2"]);
        ok(&train(b.path(), &sharded));
        assert_same_run(
            &format!("{backend} adapters only at N = 2"),
            b.path(),
            a.path(),
            2,
            SHARDED_TOLERANCE,
        );
    }
}

/// A checkpoint with adapters is not continued with another rank, α, target set or as a full
/// fine-tune, and says why; adapter settings without a rank are refused.
#[test]
fn a_checkpoint_refuses_another_adapter_configuration() {
    let ws = workspace("tiny-0b6");
    let two = ["--lora-rank", "4", "--max-steps", "2"];
    ok(&train(ws.path(), &two));
    for (flags, says) in [
        (
            vec!["--lora-rank", "8", "--max-steps", "3"],
            "adapters of rank 4 and alpha 8",
        ),
        (
            vec!["--lora-rank", "4", "--lora-alpha", "4", "--max-steps", "3"],
            "alpha 4",
        ),
        (
            vec!["--max-steps", "3"],
            "the configuration asks for a full fine-tune",
        ),
        (
            vec![
                "--lora-rank",
                "4",
                "--lora-target",
                "talker.model.layers.*_proj.weight",
                "--max-steps",
                "3",
            ],
            "train.lora_targets",
        ),
    ] {
        let o = train(ws.path(), &flags);
        assert!(!o.status.success(), "{flags:?} continued");
        let said = text(&o);
        assert!(said.contains("cannot be continued"), "{flags:?}: {said}");
        assert!(said.contains(says), "{flags:?}: {said}");
    }
    for flags in [
        ["--lora-full", "talker.codec_head.weight"],
        ["--lora-alpha", "16"],
        ["--lora-target", "talker.model.layers.*_proj.weight"],
    ] {
        let o = train(ws.path(), &flags);
        assert!(!o.status.success(), "{flags:?} ran");
        assert!(
            text(&o).contains("train.lora_rank is 0"),
            "{flags:?}: {}",
            text(&o)
        );
    }
}

/// Reads `name` of a safetensors file as f32 values.
fn tensor_values(path: &std::path::Path, name: &str) -> Vec<f32> {
    let raw = read_raw(path);
    let (dtype, _, bytes) = &raw[name];
    match dtype.as_str() {
        "F32" => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        "BF16" => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => panic!("{name} is {other}"),
    }
}

/// `export` merges every adapter as bf16(W + s·α/r·B·A), computed in
/// f32 from the base matrix and the checkpoint's factors; `--lora-scale 0` gives the base
/// matrices back; untouched tensors are the base model's; a full fine-tune refuses a scale.
#[test]
fn export_merges_the_adapters_at_the_scale_asked() {
    for model in ["tiny-0b6", "tiny-1b7"] {
        let ws = workspace(model);
        ok(&train(
            ws.path(),
            &["--lora-rank", "4", "--lora-alpha", "6", "--max-steps", "3"],
        ));
        let ckpt = ws.path().join("checkpoints/step-0000003");
        let state = crate::dist_support::state(ws.path(), 3);
        let base_file = model_dir(model).join("model.safetensors");
        let q = "talker.model.layers.0.self_attn.q_proj";
        let down = "talker.code_predictor.model.layers.0.mlp.down_proj";
        for scale in ["1", "0.35", "0"] {
            let out = ws.path().join(format!("model-{scale}"));
            let o = voiceclone(
                ws.path(),
                &[
                    "export",
                    "--checkpoint",
                    ckpt.to_str().unwrap(),
                    "--lora-scale",
                    scale,
                    "-o",
                    out.to_str().unwrap(),
                ],
            );
            ok(&o);
            let file = out.join("model.safetensors");
            let s: f64 = scale.parse::<f64>().unwrap() * 6.0 / 4.0;
            for m in [q, down] {
                let (a_shape, a) = &state[&format!("master.{m}.lora_A.weight")];
                let (_, b) = &state[&format!("master.{m}.lora_B.weight")];
                let w = tensor_values(&base_file, &format!("{m}.weight"));
                let (r, inp) = (a_shape[0], a_shape[1]);
                let out_dim = w.len() / inp;
                let got = tensor_values(&file, &format!("{m}.weight"));
                let mut moved = 0usize;
                for i in 0..out_dim {
                    for j in 0..inp {
                        let mut d = 0f64;
                        for k in 0..r {
                            d += b[i * r + k] as f64 * a[k * inp + j] as f64;
                        }
                        let want = w[i * inp + j] + (s * d) as f32;
                        let want = half::bf16::from_f32(want).to_f32();
                        let g = got[i * inp + j];
                        // f32 sums in another order may round to the neighbouring bf16 value.
                        let ulp = half::bf16::from_f32(want.abs()).to_f32() / 128.0;
                        assert!(
                            (g - want).abs() <= ulp,
                            "{model} scale {scale}: {m}[{i},{j}] {g} vs {want}"
                        );
                        moved += (g != w[i * inp + j]) as usize;
                    }
                }
                if scale == "0" {
                    assert_eq!(moved, 0, "{model}: scale 0 changed {m}");
                } else {
                    assert!(moved > 0, "{model} scale {scale}: {m} is the base matrix");
                }
            }
            for name in [
                "talker.model.layers.0.input_layernorm.weight",
                "talker.codec_head.weight",
            ] {
                assert_eq!(
                    tensor_values(&file, name),
                    tensor_values(&base_file, name),
                    "{model}: {name} changed"
                );
            }
            let raw = read_raw(&file);
            assert!(
                !raw.keys().any(|k| k.contains("lora_")),
                "{model}: the merged export holds adapter factors"
            );
        }
    }
    // A scale that would drown the base weights is refused, in training and in the export.
    let ws = workspace("tiny-0b6");
    let o = train(ws.path(), &["--lora-rank", "2", "--lora-alpha", "1e30"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("scales the adapters by 5e29"),
        "{}",
        text(&o)
    );
    ok(&train(ws.path(), &["--lora-rank", "2", "--max-steps", "1"]));
    let o = voiceclone(ws.path(), &["export", "--lora-scale", "1e30"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("at most --lora-scale 32"), "{}", text(&o));
    let ws = workspace("tiny-0b6");
    ok(&train(ws.path(), &["--max-steps", "1"]));
    let o = voiceclone(ws.path(), &["export", "--lora-scale", "0.5"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("full fine-tune"), "{}", text(&o));
}

/// `export --adapter-only` writes PEFT's `adapter_config.json` (rank, α times `--lora-scale`,
/// every adapted module by its full name, the modules of `lora_full` to save) and
/// `adapter_model.safetensors` with PEFT's names — the factors as trained and every parameter of
/// a module to save — beside the speakers' x-vectors, by default to `adapter/`; it never
/// replaces a merged model (nor the reverse); a full fine-tune has nothing to export alone.
#[test]
fn the_adapter_only_export_is_peft_format() {
    let ws = workspace("tiny-0b6");
    ok(&train(
        ws.path(),
        &[
            "--lora-rank",
            "4",
            "--lora-full",
            "talker.text_projection.linear_fc1.bias",
            "--max-steps",
            "2",
        ],
    ));
    let state = crate::dist_support::state(ws.path(), 2);
    for scale in ["1", "0.5"] {
        let out = ws.path().join(format!("adapter-{scale}"));
        ok(&voiceclone(
            ws.path(),
            &[
                "export",
                "--adapter-only",
                "--lora-scale",
                scale,
                "-o",
                out.to_str().unwrap(),
            ],
        ));
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["peft_type"], "LORA");
        assert_eq!(cfg["r"], 4);
        assert_eq!(cfg["lora_alpha"], 8.0 * scale.parse::<f64>().unwrap());
        let targets = cfg["target_modules"].as_array().unwrap();
        assert_eq!(targets.len(), (2 + 2) * 7, "{targets:?}");
        assert!(targets.contains(&"talker.model.layers.1.mlp.down_proj".into()));
        assert_eq!(
            cfg["modules_to_save"],
            serde_json::json!(["talker.text_projection.linear_fc1"])
        );
        let file = out.join("adapter_model.safetensors");
        let raw = read_raw(&file);
        for (key, (shape, want)) in &state {
            let Some(name) = key.strip_prefix("master.") else {
                continue;
            };
            let got = tensor_values(&file, &format!("base_model.model.{name}"));
            assert_eq!(got.len(), shape.iter().product::<usize>(), "{name}");
            assert!(&got == want, "{name}: the exported values differ");
        }
        // The module to save is whole: its untrained weight is the base model's.
        let w = "talker.text_projection.linear_fc1.weight";
        assert_eq!(
            tensor_values(&file, &format!("base_model.model.{w}")),
            tensor_values(&model_dir("tiny-0b6").join("model.safetensors"), w)
        );
        assert_eq!(raw.len(), 2 * (2 + 2) * 7 + 2, "{:?}", raw.keys());
        assert!(out.join("speakers.safetensors").is_file());
        assert!(!out.join("model.safetensors").exists());
        let marker: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("voiceclone-export.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(marker["kind"], "adapter");
        // The adapter directory carries its speaker's pace too (docs/model.md §7.2).
        let paces = marker["speaking_pace"]
            .as_object()
            .expect("a speaking_pace");
        assert_eq!(paces.keys().collect::<Vec<_>>(), ["speaker"], "{marker}");
        assert!(paces["speaker"]["frames_per_token"].as_f64().unwrap() > 0.0);
    }
    // The default place, and no kind replaces the other.
    ok(&voiceclone(ws.path(), &["export", "--adapter-only"]));
    assert!(ws.path().join("adapter/adapter_config.json").is_file());
    ok(&voiceclone(ws.path(), &["export"]));
    let (model, adapter) = (ws.path().join("model"), ws.path().join("adapter"));
    let o = voiceclone(
        ws.path(),
        &["export", "--adapter-only", "-o", model.to_str().unwrap()],
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("holds an exported model"), "{}", text(&o));
    assert!(ws.path().join("model/model.safetensors").is_file());
    let o = voiceclone(ws.path(), &["export", "-o", adapter.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("holds an exported adapter"),
        "{}",
        text(&o)
    );
    // Adapters exported into model/ are not a model: `speak` says how to use them.
    let lone = workspace("tiny-0b6");
    ok(&train(
        lone.path(),
        &["--lora-rank", "2", "--max-steps", "1"],
    ));
    let into = lone.path().join("model");
    ok(&voiceclone(
        lone.path(),
        &["export", "--adapter-only", "-o", into.to_str().unwrap()],
    ));
    let wav = lone.path().join("out.wav");
    let o = voiceclone(lone.path(), &["speak", "Hi.", "-o", wav.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--adapter"), "{}", text(&o));
    let full = workspace("tiny-0b6");
    ok(&train(full.path(), &["--max-steps", "1"]));
    let o = voiceclone(full.path(), &["export", "--adapter-only"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("no adapters"), "{}", text(&o));
}

/// `speak --adapter DIR` puts the adapter on its base model as the merged export would be, so it
/// speaks exactly as `speak` on the merged export of the same checkpoint (also both exported at
/// `--lora-scale 0.35`): the same greedy codes and the same WAV bytes, in f32, bf16-weights, q8 and q4 on a
/// bf16-stored base, and in bf16-weights on an f32-stored one (the one precision in which the
/// export's bf16 rounding is the loader's too: f32, q8 and q4 read the f32 base's merged matrices
/// unrounded, as they would read an f32 export).
#[test]
fn speaking_with_an_adapter_is_speaking_with_the_merged_export() {
    let f32_copy = f32_model_copy("tiny-0b6");
    let f32_base = f32_copy.path().to_str().unwrap().to_string();
    for (base, precisions) in [
        ("tiny-0b6", vec!["f32", "bf16-weights", "q8", "q4"]),
        (f32_base.as_str(), vec!["bf16-weights"]),
    ] {
        let ws = workspace(base);
        ok(&train(
            ws.path(),
            &[
                "--lora-rank",
                "4",
                "--lora-full",
                "talker.codec_head.weight",
                "--max-steps",
                "3",
            ],
        ));
        for (scale, p) in precisions
            .iter()
            .map(|p| ("1", *p))
            .chain([("0.35", "bf16-weights")])
        {
            let merged = ws.path().join(format!("merged-{scale}"));
            let adapter = ws.path().join(format!("adapter-{scale}"));
            for (out, extra) in [(&merged, None), (&adapter, Some("--adapter-only"))] {
                if !out.exists() {
                    let mut args =
                        vec!["export", "--lora-scale", scale, "-o", out.to_str().unwrap()];
                    args.extend(extra);
                    ok(&voiceclone(ws.path(), &args));
                }
            }
            let speak = |tag: &str, with: [&str; 2]| {
                let wav = ws.path().join(format!("{tag}-{p}-{scale}.wav"));
                let codes = ws.path().join(format!("{tag}-{p}-{scale}.json"));
                let mut args = vec!["speak", "Hello there, adapter."];
                args.extend(with);
                args.extend([
                    "--speaker",
                    "speaker",
                    "--greedy",
                    "--max-frames",
                    "24",
                    "--precision",
                    p,
                    "-o",
                    wav.to_str().unwrap(),
                    "--save-codes",
                    codes.to_str().unwrap(),
                ]);
                let o = voiceclone(ws.path(), &args);
                ok(&o);
                (
                    std::fs::read(&codes).unwrap(),
                    std::fs::read(&wav).unwrap(),
                    text(&o),
                )
            };
            let m = speak("merged", ["--model", merged.to_str().unwrap()]);
            let a = speak("adapter", ["--adapter", adapter.to_str().unwrap()]);
            assert!(a.2.contains("with the adapter"), "{}", a.2);
            assert!(m.0 == a.0, "{base} {p} scale {scale}: the codes differ");
            assert!(m.1 == a.1, "{base} {p} scale {scale}: the audio differs");
        }
    }
}
