//! Changes to a checkpoint's tensors applied as they are read (docs/training.md §13): each
//! adapted matrix merged as `W + α/r·B·A` in f32, modules saved whole replaced, rows set (a
//! speaker's x-vector in its codec-embedding row). The inference loaders read a tensor through
//! [`WeightOverlay::apply`] and then keep it in the dtype the checkpoint stores it in: on a
//! bf16-stored base (what the export stores, and what the released models store) speaking with
//! an adapter beside its base model is speaking with the merged export, bit for bit and at the
//! same speed. Which files carry an overlay is [`super::adapted_files`]' business.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};

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

    /// Tensor `name` plus `scale · b·a` (`a` `(r, in)`, `b` `(out, r)`, [`merge_low_rank`]).
    pub fn add_low_rank(&mut self, name: &str, a: Tensor, b: Tensor, scale: f64) {
        self.edits
            .entry(name.to_string())
            .or_default()
            .push(Edit::LowRank { a, b, scale });
    }

    /// Rows of tensor `name` set to these values (row index, the row's values).
    pub fn set_rows(&mut self, name: &str, rows: Vec<(usize, Vec<f32>)>) {
        self.edits
            .entry(name.to_string())
            .or_default()
            .push(Edit::Rows(rows));
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
