//! SwiGLU gating.

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::{cpu_f32, new_tensor, with_values};
use vc_kernels::grad::swiglu as kernel;

/// `silu(gate) · up` (the MLP's gating, docs/model.md §4.1).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

struct SwiGlu;

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (cpu_f32(s1, l1, self.name())?, cpu_f32(s2, l2, self.name())?);
        if l1.dims() != l2.dims() {
            bail!("swiglu: gate {:?} vs up {:?}", l1.dims(), l2.dims());
        }
        Ok((CpuStorage::F32(kernel::forward(g, u)), l1.shape().clone()))
    }

    /// `d gate = dy·up·σ(g)(1 + g(1 − σ(g)))`, `d up = dy·silu(g)`.
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let what = "swiglu bwd";
        let (dg, du) = with_values(gate, what, |g| {
            with_values(up, what, |u| {
                with_values(dy, what, |d| Ok(kernel::backward(g, u, d)))
            })
        })?;
        Ok((Some(new_tensor(dg, gate)?), Some(new_tensor(du, up)?)))
    }
}
