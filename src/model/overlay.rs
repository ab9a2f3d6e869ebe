//! A base model with an adapter directory put on it at load time (docs/training.md §13): the
//! tensors `voiceclone export` would have written — each adapted matrix merged as
//! `W + α/r·B·A` in f32, the modules saved whole replaced, each speaker's x-vector in its
//! codec-embedding row — and the CustomVoice `config.json` entries of the speakers. The
//! inference loaders read a tensor through [`WeightOverlay::apply`] and then keep it in the
//! dtype the checkpoint stores it in: on a bf16-stored base (what the export stores, and what
//! the released models store) speaking with the adapter beside its base model is speaking with
//! the merged export, bit for bit and at the same speed.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};

use super::files::ModelFiles;
use crate::artifacts::adapter::AdapterDir;

/// The codec-embedding row of the first fine-tuned speaker; named speakers take the rows after
/// it (docs/model.md §10.5).
pub const SPEAKER_ROW: usize = 3000;
/// The table the speakers' rows are written into.
pub const CODEC_EMBEDDING: &str = "talker.model.codec_embedding.weight";

/// One change to a tensor.
#[derive(Debug, Clone)]
enum Edit {
    /// The values of a module saved whole.
    Replace(Vec<f32>),
    /// `W + scale · B·A`, `a` `(r, in)`, `b` `(out, r)`.
    LowRank { a: Tensor, b: Tensor, scale: f64 },
    /// Rows set to these values (already rounded to bf16, as the export stores them).
    Rows(Vec<(usize, Vec<f32>)>),
}

/// What changes in which tensor, in the order the edits apply.
#[derive(Debug, Clone, Default)]
pub struct WeightOverlay {
    edits: BTreeMap<String, Vec<Edit>>,
}

impl WeightOverlay {
    /// Whether `name` changes.
    pub fn contains(&self, name: &str) -> bool {
        self.edits.contains_key(name)
    }

    /// The names of the tensors that change.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.edits.keys().map(String::as_str)
    }

    /// Tensor `name` replaced by `values` (row-major, the tensor's whole shape).
    pub fn replace(&mut self, name: &str, values: Vec<f32>) {
        self.edits
            .entry(name.to_string())
            .or_default()
            .push(Edit::Replace(values));
    }

    /// Tensor `name` of `shape` after its edits, from its stored values `base` (f32).
    pub fn apply(&self, name: &str, shape: &[usize], mut base: Vec<f32>) -> Result<Vec<f32>> {
        let Some(edits) = self.edits.get(name) else {
            return Ok(base);
        };
        for e in edits {
            match e {
                Edit::Replace(v) => {
                    if v.len() != base.len() {
                        bail!(
                            "the adapter's {name} has {} values, the model {:?}",
                            v.len(),
                            shape
                        );
                    }
                    base = v.clone();
                }
                Edit::LowRank { a, b, scale } => {
                    let w = Tensor::from_vec(base, shape, &Device::Cpu)?;
                    base = merge_low_rank(&w, a, b, *scale)
                        .with_context(|| format!("merging the adapter of {name}"))?
                        .flatten_all()?
                        .to_vec1()?;
                }
                Edit::Rows(rows) => {
                    let width: usize = shape.iter().skip(1).product();
                    for (row, v) in rows {
                        if v.len() != width || (row + 1) * width > base.len() {
                            bail!(
                                "row {row} of {name} {shape:?} cannot hold {} values",
                                v.len()
                            );
                        }
                        base[row * width..(row + 1) * width].copy_from_slice(v);
                    }
                }
            }
        }
        Ok(base)
    }
}

/// `W + scale · B·A` in f32: the one formula of the merged export and of an adapter merged at
/// load, computed by the same operations so that both give the same bits.
pub fn merge_low_rank(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let f32 = candle_core::DType::F32;
    let delta = (b.to_dtype(f32)?.matmul(&a.to_dtype(f32)?)? * scale)?;
    if delta.dims() != w.dims() {
        bail!(
            "the adapter makes a {:?} update for a {:?} matrix",
            delta.dims(),
            w.dims()
        );
    }
    Ok((w.to_dtype(f32)? + delta)?)
}

impl ModelFiles {
    /// These files with `adapter` put on them: a Base model becomes the CustomVoice model the
    /// merged export of the same checkpoint is (its speakers in `spk_id`, rows 3000, 3001, …).
    pub fn with_adapter(self, adapter: &AdapterDir) -> Result<Self> {
        let what = format!("the adapter {}", adapter.dir.display());
        let shape_of = |name: &str| -> Result<Vec<usize>> {
            self.checkpoint
                .tensor(name)
                .map(|t| t.shape.clone())
                .with_context(|| {
                    format!(
                        "{what} changes {name}, which {} does not have",
                        self.source.describe()
                    )
                })
        };
        let mut overlay = WeightOverlay::default();
        for (name, v) in &adapter.saved {
            if shape_of(name)? != v.shape {
                bail!(
                    "{what}: {name} is {:?}, the model's {:?}",
                    v.shape,
                    shape_of(name)?
                );
            }
            overlay.replace(name, v.data.clone());
        }
        for (name, f) in &adapter.factors {
            let shape = shape_of(name)?;
            if shape != [f.b.shape[0], f.a.shape[1]] {
                bail!(
                    "{what}: the factors of {name} make {:?}, the matrix is {shape:?}",
                    [f.b.shape[0], f.a.shape[1]]
                );
            }
            let t = |v: &crate::artifacts::adapter::Values| {
                Tensor::from_vec(v.data.clone(), v.shape.as_slice(), &Device::Cpu)
            };
            overlay
                .edits
                .entry(name.clone())
                .or_default()
                .push(Edit::LowRank {
                    a: t(&f.a)?,
                    b: t(&f.b)?,
                    scale: adapter.scale(),
                });
        }
        self.as_custom_voice(overlay, &adapter.speakers, &what)
    }

    /// These files as the CustomVoice model an export makes of them (docs/training.md §10):
    /// the tensors `overlay` changes, each of `speakers` (name, x-vector) in its codec-embedding
    /// row (3000, 3001, … in order, rounded to bf16 as the export stores it) and in
    /// `spk_id`. `what` names the source of the changes in errors.
    pub fn as_custom_voice(
        mut self,
        mut overlay: WeightOverlay,
        speakers: &[(String, Vec<f32>)],
        what: &str,
    ) -> Result<Self> {
        if self.config.tts_model_type != "base" {
            bail!(
                "{what} goes on a Base model, but {} is a {} model",
                self.source.describe(),
                self.config.tts_model_type
            );
        }
        let hidden = self.config.talker_config.hidden_size;
        let vocab = self.config.talker_config.vocab_size;
        if speakers.is_empty() || SPEAKER_ROW + speakers.len() > vocab {
            bail!(
                "{what} holds {} speakers; rows {SPEAKER_ROW}..{vocab} hold at most {}",
                speakers.len(),
                vocab.saturating_sub(SPEAKER_ROW)
            );
        }
        let mut rows = Vec::new();
        let tc = &mut self.config.talker_config;
        for (i, (name, x)) in speakers.iter().enumerate() {
            if x.len() != hidden {
                bail!(
                    "{what}: the x-vector of {name:?} has {} values, the model needs {hidden}",
                    x.len()
                );
            }
            let row = SPEAKER_ROW + i;
            rows.push((
                row,
                x.iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect(),
            ));
            tc.spk_id.insert(name.clone(), row as u32);
            tc.spk_is_dialect
                .insert(name.clone(), serde_json::Value::Bool(false));
        }
        overlay
            .edits
            .entry(CODEC_EMBEDDING.to_string())
            .or_default()
            .push(Edit::Rows(rows));
        self.config.tts_model_type = "custom_voice".into();
        self.overlay = Some(Arc::new(overlay));
        Ok(self)
    }
}
