//! The talker's tensors by name and shape, from `config.json` alone: the model is built through
//! [`Talker::from_source`] from a source that hands out shapes without values, so the plan
//! sees exactly the tensors a training run loads (docs/training.md §6.9).

use std::cell::RefCell;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use crate::step::units::{unit_of, Unit};
use vc_model::config::Qwen3TtsConfig;
use vc_model::layers::TensorSource;
use vc_model::ops::Numerics;
use vc_model::talker::Talker;

/// One talker tensor: its checkpoint name, shape and unit (docs/training.md §5.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorShape {
    pub name: String,
    pub shape: Vec<usize>,
    pub unit: Unit,
}

impl TensorShape {
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows (dimension 0; 1 for a scalar) and values per row.
    pub fn rows_cols(&self) -> (usize, usize) {
        let rows = self.shape.first().copied().unwrap_or(1);
        (rows, self.elem_count() / rows.max(1))
    }
}

/// Every tensor [`Talker::from_source`] reads, in the order it reads them.
pub fn talker_tensors(cfg: &Qwen3TtsConfig) -> Result<Vec<TensorShape>> {
    let source = ShapeSource::default();
    Talker::from_source(&source, cfg, Numerics::Autograd)?;
    source
        .seen
        .into_inner()
        .into_iter()
        .map(|(name, shape)| {
            Ok(TensorShape {
                unit: unit_of(&name)?,
                name,
                shape,
            })
        })
        .collect()
}

/// Answers every request with a zero-strided view of one scalar (nothing of the tensor's size
/// is allocated) and records what was asked for.
#[derive(Default)]
struct ShapeSource {
    seen: RefCell<Vec<(String, Vec<usize>)>>,
}

impl TensorSource for ShapeSource {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.seen
            .borrow_mut()
            .push((name.to_string(), shape.to_vec()));
        Ok(Tensor::zeros((), DType::F32, &Device::Cpu)?.broadcast_as(shape)?)
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}
