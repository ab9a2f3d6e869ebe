//! Fine-tuning (docs/training.md §1, docs/model.md §10): the corrected SFT objective on the
//! official batch layout, AdamW over fp32 masters, gradient accumulation and clipping, warm-up +
//! cosine schedule, exactly resumable checkpoints, metrics, and the export to the official model
//! layout.
//!
//! Modules, by concern:
//! - the data: [`data`] (manifest → samples, the speaker table), [`sampler`] (epoch order,
//!   cursor), [`batch`] (the official layout), [`heldout`] and [`validation`] (the held-out set
//!   and its loss);
//! - the step and its backends: [`step`] (the objective, the forward pass cut at the units, the
//!   trained set and adapters, the text table's row-sparse gradient, [`Backend`]), the
//!   single-device [`Trainer`] and one rank of a sharded run ([`sharded`]);
//! - the optimizer and its state's forms: [`optim`];
//! - checkpoints and their layout: [`checkpoint`];
//! - export: [`export`] (the official model layout, or the adapters alone);
//! - the run: [`run_setup`] (what a run is), [`run_state`] (where it stands, held once for
//!   every trainer), [`driver`] (the one loop), [`metrics`] and [`tensorboard`] (the same
//!   numbers as TensorBoard event files), [`selection`] (the chosen checkpoint), [`evaluation`]
//!   (what the loop asks of the `vc-eval` crate), [`plan`] (the memory plan), [`lock`] (one run
//!   per workspace), [`hooks`] (test seams).

pub mod batch;
pub mod checkpoint;
pub mod data;
pub mod driver;
pub mod evaluation;
pub mod export;
pub mod heldout;
pub mod hooks;
pub mod lock;
pub mod metrics;
pub mod optim;
pub mod plan;
pub mod run_setup;
pub mod run_state;
pub mod sampler;
pub mod selection;
pub mod sharded;
pub mod step;
pub mod tensorboard;
#[cfg(test)]
pub(crate) mod test_support;
mod trainer;
pub mod validation;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use self::hooks::TrainHooks;
use vc_core::config::{ReduceDtype, TrainConfig};
use vc_model::files::ModelFiles;

pub use self::step::backend::{Backend, Storage};
pub use self::trainer::Trainer;

/// The text embedding table, whose gradient the CPU trainer keeps row-sparse.
pub const TEXT_EMBEDDING: &str = "talker.model.text_embedding.weight";

/// Everything a training run needs, resolved by the command layer.
pub struct TrainOptions {
    pub files: ModelFiles,
    /// `model.base` as configured (recorded in checkpoints).
    pub model_spec: String,
    pub manifest: PathBuf,
    /// Directory relative manifest paths are relative to (the workspace).
    pub base_dir: PathBuf,
    /// The x-vector file (`data/speaker.safetensors`), or with named speakers the directory of
    /// their files (`data/speakers/`, docs/training.md §3.3).
    pub speaker: PathBuf,
    /// `checkpoints/`.
    pub checkpoints: PathBuf,
    pub config: TrainConfig,
    pub device: Device,
    pub backend: Backend,
    /// Test seams ([`hooks::NoHooks`] in production).
    pub hooks: Arc<dyn TrainHooks>,
    /// The samples and pages of the run's evaluations (docs/training.md §14.4–14.6); `None`:
    /// validation losses in `metrics.jsonl` only.
    pub evaluator: Option<Arc<dyn evaluation::Evaluator>>,
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub start_step: usize,
    pub step: usize,
    pub total_steps: usize,
    /// The newest checkpoint (None only if no step was ever taken).
    pub checkpoint: Option<PathBuf>,
    /// Stopped by a signal before `total_steps`.
    pub interrupted: bool,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    /// The last validation loss over the held-out set (docs/training.md §14).
    pub last_val_loss: Option<f64>,
    /// Stopped by `train.early_stop` (docs/training.md §14.3).
    pub early_stopped: bool,
    pub frames_per_second: Option<f64>,
}

/// The dtype gradients are reduced and accumulated in (`train.reduce_dtype`). The setting lives in
/// `vc-core`, which knows no tensors; the trainer maps it here.
pub fn reduce_dtype(setting: ReduceDtype) -> DType {
    match setting {
        ReduceDtype::Fp32 => DType::F32,
        ReduceDtype::Bf16 => DType::BF16,
    }
}

/// Reads the x-vector `(H,)` written by `voiceclone embed`, as an f32 tensor on `device`.
pub fn load_speaker(path: &Path, hidden: usize, device: &Device) -> Result<Tensor> {
    let x = vc_core::artifacts::speaker::read_for_model(path, hidden)?;
    Ok(Tensor::from_vec(x, hidden, device)?)
}

/// Runs one training step where `device` wants it: on the CPU on a worker of the rayon pool,
/// so that the step's parallel loops start inside the pool (docs/performance.md §2.4); a CUDA
/// step stays on the thread that owns the device's context.
pub(crate) fn run_step<R: Send>(device: &Device, step: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() {
        vc_kernels::pool::on_pool(step)
    } else {
        step()
    }
}
