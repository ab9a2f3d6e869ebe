//! CPU training kernels with hand-written backward passes (f32): linear layers, RMSNorm, the
//! per-head q/k norm fused with RoPE, attention, SwiGLU and the code predictor's heads
//! (docs/model.md §4.1, §5.1, §12).
//!
//! The plain-op formulations in [`super::ops`] are correct but record many small autograd nodes
//! per call; candle's backward pass gives every node a zero-filled gradient buffer plus an
//! accumulation, so on the CPU that bookkeeping cost as much as the arithmetic. Each function
//! here is one [`candle_core`] custom op whose backward computes the input gradients directly.
//! The training path picks them on the CPU (see [`super::ops::linear`], [`super::layers`]);
//! elsewhere (CUDA, inference) the plain ops run.
//!
//! Layouts are token-major, `(B, S, heads·head_dim)` as the projections produce them, so
//! attention needs no transposes. The loops themselves are in [`vc_kernels::grad`] (and
//! the products in [`vc_kernels::gemm`]): work is split over independent rows or
//! (batch, kv-head) pairs and every sum runs in a fixed order, so results do not depend on the
//! thread count (exact resume relies on that).

mod attention;
mod heads;
mod linear;
mod norm;
mod swiglu;
#[cfg(test)]
mod tests;

pub use attention::attention;
pub use heads::shifted_heads;
pub use linear::linear;
pub use norm::{rms_norm, RopeHalfTables};
pub use swiglu::swiglu;

use candle_core::{bail, CpuStorage, DType, Layout, Result, Storage, Tensor};

/// Whether these kernels apply: an f32 tensor on the CPU.
pub fn supported(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

pub fn cpu_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        bail!("{what}: expected an f32 tensor")
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("{what}: expected a contiguous tensor")
    };
    Ok(&v[a..b])
}

/// Runs `f` on the values of `t` (made contiguous first), without copying them out.
pub fn with_values<R>(t: &Tensor, what: &str, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(cpu_f32(s, layout, what)?),
        _ => bail!("{what}: expected a CPU tensor"),
    }
}

/// Whether an operand's gradient can be read: a variable or computed from one. candle's
/// backward pass keeps the gradient it is handed for any operand until the gradient store is
/// dropped, so one of a tensor outside the graph (a frozen weight, the input of the first
/// adapted layer of a LoRA run, docs/training.md §13) would only take memory and time.
pub(crate) fn needs_grad(t: &Tensor) -> bool {
    t.track_op()
}

pub(crate) fn new_tensor(values: Vec<f32>, like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(values, like.shape(), like.device())
}
