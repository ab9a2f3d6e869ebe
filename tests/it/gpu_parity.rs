//! The parity checks on a GPU (`scripts/gpu-check.sh` runs them; they need a build with `cuda`
//! and a CUDA device): the talker in bf16 on CUDA against the official f32 references, within
//! bf16 tolerances, and three training steps of the CUDA path (bf16 `Var`s from fp32 masters)
//! against the official f32 trajectory.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use vc_model::config::Qwen3TtsConfig;
use vc_model::ops::Numerics;
use vc_model::talker::Talker;
use vc_model::weights::Weights;

use crate::common::fixtures;

fn cuda() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA device")
}

/// max |a − b| relative to max |b|.
fn rel_max(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    let d = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let s = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    d / s.max(1e-6)
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs a build with --features cuda and a GPU"
)]
fn the_talker_in_bf16_on_cuda_matches_the_official_f32_references() {
    let dev = cuda();
    for name in ["tiny-0b6", "tiny-1b7"] {
        let dir = fixtures().join(name);
        let cfg = Qwen3TtsConfig::from_file(&dir.join("config.json")).unwrap();
        let weights = Weights::load(&[dir.join("model.safetensors")], DType::BF16, &dev, |n| {
            n.starts_with("talker.")
        })
        .unwrap();
        let talker = Talker::load(&weights, &cfg, Numerics::Fused).unwrap();
        let refs: HashMap<String, Tensor> = candle_core::safetensors::load(
            fixtures().join(format!("refs/{name}.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        for case in ["single", "batch"] {
            let p = format!("talker.{case}");
            let embeds = refs[&format!("{p}.inputs_embeds")]
                .to_dtype(DType::BF16)
                .unwrap()
                .to_device(&dev)
                .unwrap();
            let mask = refs[&format!("{p}.attention_mask")]
                .to_device(&dev)
                .unwrap();
            let hidden = talker.forward(&embeds, Some(&mask), None).unwrap();
            let logits = talker.codec_logits(&hidden).unwrap();
            let (eh, el) = (
                rel_max(&hidden, &refs[&format!("{p}.hidden")]),
                rel_max(&logits, &refs[&format!("{p}.logits")]),
            );
            eprintln!(
                "{name} {case} bf16 on CUDA: hidden {eh:.2e}, logits {el:.2e} of their scale"
            );
            // bf16 keeps 8 bits of mantissa: a few 1e-3 of the scale per layer, compounded.
            assert!(
                eh < 5e-2 && el < 5e-2,
                "{name} {case}: hidden {eh}, logits {el}"
            );
        }
    }
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs a build with --features cuda and a GPU"
)]
fn training_on_cuda_follows_the_official_trajectory_within_bf16() {
    use crate::train_support::*;
    let dev = cuda();
    for model in ["tiny-0b6", "tiny-1b7"] {
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join(format!("refs/{model}.train.json"))).unwrap(),
        )
        .unwrap();
        let t = candle_core::safetensors::load(
            fixtures().join(format!("refs/{model}.train.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        let rows: Vec<serde_json::Value> = json["rows"].as_array().unwrap().clone();
        let xvec: Vec<f32> = t["batch.xvector"].get(0).unwrap().to_vec1().unwrap();
        let ws = tempfile::tempdir().unwrap();
        make_workspace(ws.path(), model, &rows, &xvec, "");
        let mut config = vc_core::config::resolve_layers(vec![])
            .unwrap()
            .config
            .train;
        config.batch_size = rows.len();
        config.grad_accum = 1;
        config.shuffle = false;
        config.warmup_steps = 0;
        let tr = &json["train_steps"];
        config.lr = tr["lr"].as_f64().unwrap();
        config.weight_decay = tr["weight_decay"].as_f64().unwrap();
        config.clip_norm = tr["clip"].as_f64().unwrap();
        let files = vc_model::files::ModelFiles::resolve(&vc_core::hub::ModelSource::Local(
            model_dir(model),
        ))
        .unwrap();
        let opts = vc_train::TrainOptions {
            files,
            model_spec: model.into(),
            manifest: ws.path().join("data/train.jsonl"),
            base_dir: fixtures(),
            speaker: ws.path().join("data/speaker.safetensors"),
            checkpoints: ws.path().join("checkpoints"),
            config,
            device: dev.clone(),
            backend: vc_train::Backend::Autograd(vc_train::Storage::Bf16),
            hooks: std::sync::Arc::new(vc_train::hooks::NoHooks),
            evaluator: evaluator(),
        };
        let mut trainer = vc_train::Trainer::new(opts, false).unwrap();
        trainer.run.schedule = vc_train::optim::Schedule {
            peak: trainer.run.schedule.peak,
            warmup: 0,
            total: usize::MAX / 2,
        };
        let losses: Vec<f64> = serde_json::from_value(tr["losses"].clone()).unwrap();
        for (step, want) in losses.iter().enumerate() {
            let m = trainer.step(&[vec![0, 1]]).unwrap();
            let e = (m.loss - want).abs() / want.abs();
            eprintln!(
                "{model} CUDA bf16: step {}: loss {:.5} (official f32 {want:.5}, rel {e:.1e})",
                step + 1,
                m.loss
            );
            assert!(
                e < 2e-2,
                "{model}: step {} loss {} vs {want}",
                step + 1,
                m.loss
            );
        }
    }
}
