//! The adapter-only export of a LoRA checkpoint (docs/training.md §13): a directory PEFT loads
//! onto the official model (`PeftModel.from_pretrained(model.model, DIR)`), and that
//! `voiceclone` reads beside its base model:
//!
//! ```text
//! adapter_config.json        PEFT's LoraConfig: r, lora_alpha, target_modules (full module
//!                            names), modules_to_save (the modules of train.lora_full)
//! adapter_model.safetensors  f32: base_model.model.{module}.lora_A.weight / .lora_B.weight, and
//!                            every parameter of the modules to save (trained values, or the
//!                            base model's for a parameter of such a module that was not trained)
//! speakers.safetensors       the speakers' x-vectors (S, H) f32, their names in the metadata
//! voiceclone-export.json     the marker of every export, with "kind": "adapter"
//! ```
//! `--lora-scale S` is written into α (`lora_alpha = S·α`): PEFT then applies the adapters at
//! `S·α/r`, the merged export's scale computed the same way, so both give the same bits.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::BufWriter;
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use serde_json::json;

use crate::checkpoint::safetensors_stream::{self, TensorHeader};
use crate::step::lora::LoraIdentity;
use vc_core::artifacts::adapter::{write_speakers, CONFIG, PEFT_PREFIX, SPEAKERS, WEIGHTS};
use vc_model::weights::Weights;

/// Whether tensor `name` is a parameter of `module` (`{module}.…`).
pub fn in_module(name: &str, module: &str) -> bool {
    name.strip_prefix(module)
        .is_some_and(|r| r.starts_with('.'))
}

/// Writes the adapter directory's files into `dir` from a LoRA checkpoint's `trained` masters
/// and `lora` identity, the base model's tensors of the modules to save (`base(modules)`, f32,
/// for their untrained parameters), and the exported `speakers` (name, x-vector). Returns
/// (tensors written, trained tensors).
pub fn write(
    lora: &LoraIdentity,
    trained: &BTreeMap<String, Tensor>,
    lora_scale: f64,
    base: &dyn Fn(&[String]) -> Result<Weights>,
    base_model: &str,
    speakers: &[(String, Vec<f32>)],
    dir: &Path,
) -> Result<(usize, usize)> {
    let mut targets = BTreeSet::new();
    let mut full_modules = BTreeSet::new();
    for name in trained.keys() {
        if let Some(m) = name
            .strip_suffix(".lora_A.weight")
            .or_else(|| name.strip_suffix(".lora_B.weight"))
        {
            targets.insert(m.to_string());
        } else {
            let (module, _) = name
                .rsplit_once('.')
                .with_context(|| format!("{name} names no module"))?;
            full_modules.insert(module.to_string());
        }
    }
    // Every parameter of a module to save: PEFT replaces whole modules.
    let base_weights = base(&full_modules.iter().cloned().collect::<Vec<_>>())?;
    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    for (name, t) in trained {
        tensors.insert(format!("{PEFT_PREFIX}{name}"), t.to_dtype(DType::F32)?);
    }
    for name in base_weights.names_with_prefix("") {
        let saved = full_modules.iter().any(|m| in_module(&name, m));
        if saved && !trained.contains_key(&name) {
            tensors.insert(
                format!("{PEFT_PREFIX}{name}"),
                base_weights.get_any(&name)?.to_dtype(DType::F32)?,
            );
        }
    }
    let entries: Vec<TensorHeader> = tensors
        .iter()
        .map(|(n, t)| TensorHeader {
            name: n.clone(),
            dtype: safetensors::Dtype::F32,
            shape: t.dims().to_vec(),
        })
        .collect();
    let values: Vec<&Tensor> = tensors.values().collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let path = dir.join(WEIGHTS);
    let file =
        fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = BufWriter::new(file);
    safetensors_stream::write(&mut w, &entries, &meta, |i| {
        safetensors_stream::f32_bytes(values[i])
    })?;
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;

    let config = json!({
        "peft_type": "LORA",
        "task_type": null,
        "base_model_name_or_path": base_model,
        "revision": null,
        "inference_mode": true,
        "r": lora.rank,
        "lora_alpha": lora_scale * lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "target_modules": targets.iter().collect::<Vec<_>>(),
        "modules_to_save": if full_modules.is_empty() {
            serde_json::Value::Null
        } else {
            json!(full_modules.iter().collect::<Vec<_>>())
        },
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    fs::write(
        dir.join(CONFIG),
        serde_json::to_string_pretty(&config)? + "\n",
    )?;
    write_speakers(speakers, &dir.join(SPEAKERS))?;
    Ok((tensors.len(), trained.len()))
}
