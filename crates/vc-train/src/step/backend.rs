//! How a trainer computes (docs/training.md §5.5): the [`Backend`] — the CPU kernels with their
//! hand-written backward passes, or candle's autograd — and the [`Storage`] dtype of the autograd
//! backend's weights, with what follows from the choice (where the weights and optimizer state
//! live, how masters are kept, which dtypes store and compute). Both trainers, the memory plan
//! and the command layer decide by it.

use anyhow::{bail, Result};
use candle_core::{DType, Device};

use crate::optim::saved_state;
use crate::step::params::{self, Masters};
use crate::TrainOptions;
use vc_core::config::{OptimizerState, TrainBackend, TrainConfig};
use vc_model::ops::Numerics;

/// How a trainer computes; chosen once when it is built (docs/training.md §5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// CPU, f32: the kernels with hand-written backward passes, the trained `Var`s are their
    /// own masters and are updated in place, the text embedding's gradient is row-sparse.
    Kernels,
    /// Any device: candle's autograd over plain tensor ops, `Var`s stored in `Storage` copied
    /// from separate fp32 masters, dense gradients, AdamW in tensor ops. What CUDA runs (with
    /// bf16 storage); on the CPU the arithmetic is f32 on the stored values.
    Autograd(Storage),
}

/// The dtype the autograd backend stores its weights in: the compute copies of the masters,
/// the frozen tensors, and therefore everything gathered from them (docs/training.md §5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// bf16, as on CUDA.
    Bf16,
    /// f32 (exact against the CPU kernels and the official f32 references).
    F32,
}

impl Backend {
    /// The backend for `device`: the kernels on the CPU, autograd with bf16 storage elsewhere.
    pub fn auto(device: &Device) -> Self {
        if device.is_cpu() {
            Backend::Kernels
        } else {
            Backend::Autograd(Storage::Bf16)
        }
    }

    /// The backend `train.backend` asks for on `device`.
    pub fn resolve(choice: TrainBackend, device: &Device) -> Result<Self> {
        Ok(match choice {
            TrainBackend::Auto => Self::auto(device),
            TrainBackend::Kernels if device.is_cpu() => Backend::Kernels,
            TrainBackend::Kernels => bail!(
                "train.backend = \"kernels\" runs on the CPU only (this run trains on \
                 {device:?}); use \"auto\" or \"autograd\""
            ),
            TrainBackend::Autograd => Backend::Autograd(Storage::Bf16),
            TrainBackend::AutogradF32 => Backend::Autograd(Storage::F32),
        })
    }

    /// How `voiceclone train` names it (`train.backend`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Kernels => "kernels",
            Backend::Autograd(Storage::Bf16) => "autograd",
            Backend::Autograd(Storage::F32) => "autograd-f32",
        }
    }

    pub fn numerics(self) -> Numerics {
        match self {
            Backend::Kernels => Numerics::Kernels,
            Backend::Autograd(_) => Numerics::Autograd,
        }
    }

    /// Whether the gradient sums run as in-place CPU kernels.
    pub fn in_place(self) -> bool {
        self == Backend::Kernels
    }

    /// Whether the optimizer step runs as the CPU kernels on host copies: always with the CPU
    /// kernels backend, and with `train.offload = "optimizer"` (docs/training.md §6.6).
    pub fn optimizer_on_host(self, config: &TrainConfig) -> bool {
        self.in_place() || config.offload == vc_core::config::Offload::Optimizer
    }

    /// Where a run on `opts.device` keeps its weights and optimizer state.
    pub fn placement(self, opts: &TrainOptions) -> params::Placement {
        params::Placement {
            device: opts.device.clone(),
            // The CPU kernels keep everything on the host already.
            offload: opts.config.offload == vc_core::config::Offload::Optimizer
                && self != Backend::Kernels,
        }
    }

    /// How a trained tensor of (full) `shape` keeps its master with optimizer-state mode
    /// `state`: small tensors (norms, biases, whose values are near 1, where a bf16
    /// compensation is too coarse for small updates) keep fp32 masters in every mode
    /// (docs/training.md §6.5).
    pub fn masters(self, state: OptimizerState, shape: &[usize]) -> Masters {
        match self {
            _ if saved_state::compensated(state, shape) => Masters::Compensated,
            Backend::Kernels => Masters::Shared,
            Backend::Autograd(_) => Masters::Separate,
        }
    }

    /// The dtype weights are stored in (the trained tensors' compute copies, the frozen ones).
    pub fn storage_dtype(self) -> DType {
        match self {
            Backend::Kernels | Backend::Autograd(Storage::F32) => DType::F32,
            Backend::Autograd(Storage::Bf16) => DType::BF16,
        }
    }

    /// The dtype the model computes in on `device`: the storage dtype, except that the CPU
    /// computes bf16-stored weights in f32 (candle has no bf16 matmul there), casting each
    /// weight as it is used.
    pub fn arith_dtype(self, device: &Device) -> DType {
        if device.is_cpu() {
            DType::F32
        } else {
            self.storage_dtype()
        }
    }
}
