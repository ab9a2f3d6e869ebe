//! The weight file of an exported model (docs/model.md §10.5): `model.safetensors` in bf16,
//! streamed from the base model's shards with the checkpoint's trained tensors in place of the
//! base ones, a LoRA checkpoint's adapters merged into their matrices, and each speaker's x-vector
//! in its codec-embedding row. This is the one part of an export that reads and converts
//! tensors; the rest of [`super::export`] copies files and writes JSON.

use std::collections::BTreeMap;
use std::fs;
use std::io::BufWriter;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};

use super::ExportOptions;
use crate::checkpoint;
use crate::checkpoint::safetensors_stream::{self, TensorHeader};
use crate::step::lora::LoraIdentity;
use vc_model::overlay::CODEC_EMBEDDING;

/// Writes `model.safetensors` (bf16) with each speaker's x-vector in its codec-embedding row,
/// and returns (tensor count, trained tensor count).
pub(super) fn write_weights(
    opts: &ExportOptions,
    index: &checkpoint::Index,
    speakers: &[(usize, &[f32])],
    dest: &Path,
) -> Result<(usize, usize)> {
    let mut trained: BTreeMap<String, Tensor> =
        checkpoint::RowReader::open(&opts.checkpoint)?.masters(&Device::Cpu)?;
    let mmaps = opts
        .files
        .checkpoint
        .shards
        .iter()
        .map(|p| {
            let f = fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
            // SAFETY: read-only mapping of a checkpoint that is not modified while exporting.
            Ok(unsafe { Mmap::map(&f)? })
        })
        .collect::<Result<Vec<_>>>()?;
    let files = mmaps
        .iter()
        .zip(&opts.files.checkpoint.shards)
        .map(|(m, p)| {
            SafeTensors::deserialize(m)
                .map_err(|e| anyhow::anyhow!("{} is not valid safetensors: {e}", p.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut entries = Vec::new();
    let mut origin = Vec::new();
    for (fi, st) in files.iter().enumerate() {
        for name in st.names() {
            if name.starts_with("speaker_encoder.") {
                continue;
            }
            let view = st.tensor(name)?;
            let dtype = if is_float(view.dtype()) {
                StDtype::BF16
            } else {
                view.dtype()
            };
            entries.push(TensorHeader {
                name: name.to_string(),
                dtype,
                shape: view.shape().to_vec(),
            });
            origin.push(fi);
        }
    }
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by(|&a, &b| entries[a].name.cmp(&entries[b].name));
    let entries: Vec<TensorHeader> = order.iter().map(|&i| entries[i].clone()).collect();
    let origin: Vec<usize> = order.iter().map(|&i| origin[i]).collect();
    if let Some(lora) = &index.identity.lora {
        // S·α/r as the adapter-only export's α' = S·α gives it (α'/r), so both merge alike.
        let scale = LoraIdentity {
            rank: lora.rank,
            alpha: opts.lora_scale * lora.alpha,
        }
        .scale();
        let base = |name: &str| -> Result<Tensor> {
            let i = entries
                .iter()
                .position(|e| e.name == name)
                .with_context(|| {
                    format!("the checkpoint adapts {name}, which the base model does not have")
                })?;
            view_f32(&files[origin[i]].tensor(name)?)
        };
        trained = merge_adapters(trained, scale, base)?;
    }
    for name in trained.keys() {
        let Some(e) = entries.iter().find(|e| &e.name == name) else {
            bail!("the checkpoint trains {name}, which the base model does not have");
        };
        if trained[name].dims() != e.shape.as_slice() {
            bail!(
                "the checkpoint's {name} has shape {:?}, the base model {:?}",
                trained[name].dims(),
                e.shape
            );
        }
    }
    let speaker_bf16: Vec<(usize, Vec<u8>)> = speakers
        .iter()
        .map(|(row, x)| {
            let bytes = x
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            (*row, bytes)
        })
        .collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let file =
        fs::File::create(dest).with_context(|| format!("cannot create {}", dest.display()))?;
    let mut w = BufWriter::new(file);
    safetensors_stream::write(&mut w, &entries, &meta, |i| {
        let e = &entries[i];
        let mut bytes = match trained.get(&e.name) {
            Some(t) => safetensors_stream::bf16_bytes(t)?,
            None => {
                let view = files[origin[i]].tensor(&e.name)?;
                to_bf16_bytes(view.dtype(), view.data())?
            }
        };
        if e.name == CODEC_EMBEDDING {
            for (row, x) in &speaker_bf16 {
                let n = x.len();
                bytes[row * n..(row + 1) * n].copy_from_slice(x);
            }
        }
        Ok(bytes)
    })?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok((entries.len(), trained.len()))
}

/// The trained tensors of a LoRA checkpoint with every adapter merged into its matrix:
/// `W + scale · B·A` in f32 (`base(name)` gives `W`); the fully trained tensors as they are.
pub fn merge_adapters(
    trained: BTreeMap<String, Tensor>,
    scale: f64,
    base: impl Fn(&str) -> Result<Tensor>,
) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    for (name, t) in &trained {
        if let Some(module) = name.strip_suffix(".lora_A.weight") {
            let b_name = format!("{module}.lora_B.weight");
            let b = trained
                .get(&b_name)
                .with_context(|| format!("the checkpoint has {name} but no {b_name}"))?;
            let weight = format!("{module}.weight");
            let w = base(&weight)?;
            let merged = vc_model::overlay::merge_low_rank(&w, t, b, scale)
                .with_context(|| format!("merging the adapter of {weight}"))?;
            out.insert(weight, merged);
        } else if name.ends_with(".lora_B.weight") {
            let a_name = name.replace(".lora_B.weight", ".lora_A.weight");
            if !trained.contains_key(&a_name) {
                bail!("the checkpoint has {name} but no {a_name}");
            }
        } else {
            out.insert(name.clone(), t.clone());
        }
    }
    Ok(out)
}

/// A safetensors tensor as an f32 CPU tensor.
fn view_f32(view: &safetensors::tensor::TensorView<'_>) -> Result<Tensor> {
    let dtype = match view.dtype() {
        StDtype::BF16 => candle_core::DType::BF16,
        StDtype::F16 => candle_core::DType::F16,
        StDtype::F32 => candle_core::DType::F32,
        StDtype::F64 => candle_core::DType::F64,
        d => bail!("a {d:?} tensor is not a matrix an adapter can sit on"),
    };
    Ok(
        Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)?
            .to_dtype(candle_core::DType::F32)?,
    )
}

fn is_float(d: StDtype) -> bool {
    matches!(
        d,
        StDtype::BF16 | StDtype::F16 | StDtype::F32 | StDtype::F64
    )
}

/// Raw little-endian tensor bytes converted to bf16 (floats) or kept (other dtypes).
fn to_bf16_bytes(dtype: StDtype, data: &[u8]) -> Result<Vec<u8>> {
    let conv = |v: f32| half::bf16::from_f32(v).to_le_bytes();
    Ok(match dtype {
        StDtype::BF16 => data.to_vec(),
        StDtype::F16 => data
            .chunks_exact(2)
            .flat_map(|b| conv(half::f16::from_le_bytes([b[0], b[1]]).to_f32()))
            .collect(),
        StDtype::F32 => data
            .chunks_exact(4)
            .flat_map(|b| conv(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        StDtype::F64 => data
            .chunks_exact(8)
            .flat_map(|b| conv(f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32))
            .collect(),
        _ => data.to_vec(),
    })
}
