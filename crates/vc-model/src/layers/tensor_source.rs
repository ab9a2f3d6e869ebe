//! Where a model's weights come from: the [`TensorSource`] trait every model is built through (a
//! loaded checkpoint, or the trainer's parameter store of trained and frozen tensors), the
//! low-rank adapters a source may hold beside its matrices (docs/training.md §13), and a source
//! that records the names read. The candle models and the trainer share it; none of it is part
//! of the decoder block's arithmetic.

use std::collections::BTreeSet;
use std::sync::Mutex;

use anyhow::bail;
use candle_core::Tensor;

use crate::weights::Weights;

/// A named, shape-checked tensor provider: a loaded checkpoint ([`Weights`]) or the trainer's
/// parameter store (trainable [`Var`]s and frozen tensors). Models are built through this trait
/// only, so inference and training share one construction path.
pub trait TensorSource {
    /// The tensor `name`, which must have `shape`.
    fn tensor(&self, name: &str, shape: &[usize]) -> anyhow::Result<Tensor>;
    fn contains(&self, name: &str) -> bool;
    /// The rank and scale of the low-rank adapters this source holds beside its matrices
    /// (`{m}.lora_A.weight` `(r, in)` and `{m}.lora_B.weight` `(out, r)` for the matrix
    /// `{m}.weight`, docs/training.md §13); `None` = no adapters.
    fn adapters(&self) -> Option<AdapterSpec> {
        None
    }
}

/// What the adapters of a source share (docs/training.md §13): their rank and the scale
/// `α / r` their product is added with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterSpec {
    pub rank: usize,
    pub scale: f64,
}

/// The names of the two factors of the adapter on the matrix `weight` (`….weight`).
pub fn adapter_names(weight: &str) -> (String, String) {
    let module = weight.strip_suffix(".weight").unwrap_or(weight);
    (
        format!("{module}.lora_A.weight"),
        format!("{module}.lora_B.weight"),
    )
}

impl TensorSource for Weights {
    fn tensor(&self, name: &str, shape: &[usize]) -> anyhow::Result<Tensor> {
        self.get(name, shape)
    }
    fn contains(&self, name: &str) -> bool {
        Weights::contains(self, name)
    }
}

/// [`TensorSource::tensor`] for a set split into trained tensors (`Var`s, or gathered shards)
/// and frozen ones: the trained tensor `name` if there is one, else the frozen one, which must
/// have `shape`.
pub fn trainable_or_frozen(
    name: &str,
    shape: &[usize],
    trained: Option<&Tensor>,
    frozen: Option<&Tensor>,
) -> anyhow::Result<Tensor> {
    let t = match (trained, frozen) {
        (Some(v), _) => v.clone(),
        (None, Some(t)) => t.clone(),
        (None, None) => bail!("the model has no tensor {name}"),
    };
    if t.dims() != shape {
        bail!(
            "tensor {name} has shape {:?} but the model config implies {shape:?}",
            t.dims()
        );
    }
    Ok(t)
}

/// Wraps a source and records which names were read (to check that a model uses every tensor).
pub struct RecordingSource<'a> {
    inner: &'a dyn TensorSource,
    used: Mutex<BTreeSet<String>>,
}

impl<'a> RecordingSource<'a> {
    pub fn new(inner: &'a dyn TensorSource) -> Self {
        Self {
            inner,
            used: Mutex::new(BTreeSet::new()),
        }
    }
    pub fn used(&self) -> BTreeSet<String> {
        self.used.lock().expect("poisoned").clone()
    }
}

impl TensorSource for RecordingSource<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> anyhow::Result<Tensor> {
        self.used.lock().expect("poisoned").insert(name.to_string());
        self.inner.tensor(name, shape)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn adapters(&self) -> Option<AdapterSpec> {
        self.inner.adapters()
    }
}
