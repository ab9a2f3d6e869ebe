//! The number formats of inference (`speak.precision`, docs/performance.md §2): [`Precision`],
//! what `auto` picks for a checkpoint and a device, and what each format means for the candle
//! path (activation and storage dtypes) and for the row inference path (its matrix format). The
//! command layer and the server resolve a precision before any model is loaded.

use candle_core::{DType, Device};

use vc_model::files::ModelFiles;
use vc_model::linear::WeightFormat;

/// Number formats of inference (`speak.precision`, docs/performance.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Everything in f32: the reference mode, the official f32 pipeline's arithmetic.
    F32,
    /// The large matrices (projections, heads, text embedding) kept in bf16 — the official
    /// checkpoints' own values, read in place from the mapped file, so nothing is rounded for
    /// bf16 checkpoints — with f32 activations and f32 arithmetic: half the bytes per frame.
    Bf16Weights,
    /// Everything in bf16 (GPUs).
    Bf16,
    /// Talker and code-predictor matrices quantized at load time to 8-bit blocks with one scale
    /// per 32 weights; activations quantized per row on the fly; integer dot products (CPU).
    Q8,
    /// As [`Self::Q8`] with 4-bit blocks (one f16 scale per 32 weights): about half the bytes
    /// per frame of `q8`, for CPUs that `q8` leaves short of real time
    /// (docs/performance.md §2.6).
    Q4,
}

impl Precision {
    /// The name `speak.precision` uses.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16Weights => "bf16-weights",
            Precision::Bf16 => "bf16",
            Precision::Q8 => "q8",
            Precision::Q4 => "q4",
        }
    }

    /// What `auto` picks: never less than the checkpoint stores. On a GPU bf16; on a CPU
    /// bf16-weights for a bf16-stored checkpoint (its exact values, f32 arithmetic) and f32 for
    /// anything else (f32 or f16 matrices would be rounded by bf16).
    pub fn auto(stored: Option<safetensors::Dtype>, cuda: bool) -> Precision {
        match (cuda, stored) {
            (true, _) => Precision::Bf16,
            (false, Some(safetensors::Dtype::BF16)) => Precision::Bf16Weights,
            (false, _) => Precision::F32,
        }
    }

    /// The stored dtype of a checkpoint's matrices, as [`Self::auto`] reads it (the first
    /// talker projection).
    pub fn stored(files: &ModelFiles) -> Option<safetensors::Dtype> {
        files
            .checkpoint
            .tensor(&format!(
                "{}.model.layers.0.self_attn.q_proj.weight",
                vc_model::talker::PREFIX
            ))
            .map(|t| t.dtype)
    }

    /// Activation dtype of the candle path.
    pub fn activations(self) -> DType {
        match self {
            Precision::F32 | Precision::Bf16Weights | Precision::Q8 | Precision::Q4 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// Storage dtype of checkpoint tensor `name` on the candle path.
    pub fn dtype_of(self, name: &str) -> DType {
        match self {
            Precision::Bf16Weights if is_matrix(name) => DType::BF16,
            other => other.activations(),
        }
    }

    /// The matrix format of the row inference path, or `None` where the candle path runs.
    pub(crate) fn row_format(self, device: &Device) -> Option<WeightFormat> {
        if !device.is_cpu() {
            return None;
        }
        match self {
            Precision::F32 => Some(WeightFormat::F32),
            Precision::Bf16Weights => Some(WeightFormat::Bf16),
            Precision::Q8 => Some(WeightFormat::Q8),
            Precision::Q4 => Some(WeightFormat::Q4),
            Precision::Bf16 => None,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The tensors that dominate the bytes read per frame (and the text embedding, by size).
fn is_matrix(name: &str) -> bool {
    name.ends_with("_proj.weight")
        || name == "talker.codec_head.weight"
        || name.starts_with("talker.code_predictor.lm_head.")
        || name == "talker.model.text_embedding.weight"
}
