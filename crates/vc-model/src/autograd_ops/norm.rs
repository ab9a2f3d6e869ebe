//! RMSNorm, and the attention's per-head RMSNorm fused with the rotary embedding.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::{cpu_f32, new_tensor, with_values};
use vc_kernels::grad::norm::{self as kernel, RopeSlices};

/// `x · rsqrt(mean(x²) + eps) · weight` over the last dimension (docs/model.md §4.1), with
/// gradients for `x` and `weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2(weight, RmsNorm { eps: eps as f32 })
}

#[derive(Clone, Copy)]
struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = cpu_f32(s1, l1, self.name())?;
        let w = cpu_f32(s2, l2, self.name())?;
        let h = w.len();
        if h == 0 || l1.dims().last() != Some(&h) {
            bail!("rms-norm: input {:?} vs weight {:?}", l1.dims(), l2.dims());
        }
        let y = kernel::rms_norm(x, w, self.eps);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = with_values(x, "rms-norm bwd", |xv| {
            with_values(w, "rms-norm bwd", |wv| {
                with_values(dy, "rms-norm bwd", |dyv| {
                    Ok(kernel::rms_norm_grad(xv, wv, dyv, self.eps))
                })
            })
        })?;
        Ok((Some(new_tensor(dx, x)?), Some(new_tensor(dw, w)?)))
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding
// ---------------------------------------------------------------------------------------------

/// Half-width RoPE tables `(P, S, head_dim/2)` f32 (P = 1 when every batch row shares its
/// positions, else B), built once per forward pass and shared by all layers.
#[derive(Debug, Clone)]
pub struct RopeHalfTables {
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
    rows: usize,
    seq: usize,
    half: usize,
}

impl RopeHalfTables {
    /// From `(P, S, half)` f32 cos/sin tensors.
    pub fn new(cos: &Tensor, sin: &Tensor) -> Result<Self> {
        let (rows, seq, half) = cos.dims3()?;
        let cos = cos.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let sin = sin.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(Self {
            cos: Arc::new(cos),
            sin: Arc::new(sin),
            rows,
            seq,
            half,
        })
    }

    /// Per-head RMSNorm then rotation (`q_norm`/`k_norm` + RoPE, docs/model.md §4.1) of `x`
    /// `(B, S, heads·head_dim)`, token-major; returns the same shape.
    pub fn norm_rope(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        x.contiguous()?.apply_op2(
            &weight.contiguous()?,
            NormRope {
                tables: self.clone(),
                eps: eps as f32,
            },
        )
    }

    /// The tables as slices.
    fn view(&self) -> RopeSlices<'_> {
        RopeSlices {
            cos: &self.cos,
            sin: &self.sin,
            rows: self.rows,
            seq: self.seq,
            half: self.half,
        }
    }

    /// Checks `(B, S, heads·d)` against the tables.
    fn check(&self, dims: &[usize], d: usize) -> Result<()> {
        let &[b, s, width] = dims else {
            bail!("rope: expected (B, S, heads·head_dim), got {dims:?}")
        };
        if d != 2 * self.half
            || width % d != 0
            || s != self.seq
            || (self.rows != 1 && self.rows != b)
        {
            bail!(
                "rope: input {dims:?} does not match tables ({}, {}, {})",
                self.rows,
                self.seq,
                self.half
            );
        }
        Ok(())
    }
}

struct NormRope {
    tables: RopeHalfTables,
    eps: f32,
}

impl CustomOp2 for NormRope {
    fn name(&self) -> &'static str {
        "norm-rope-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (cpu_f32(s1, l1, self.name())?, cpu_f32(s2, l2, self.name())?);
        self.tables.check(l1.dims(), w.len())?;
        let width = l1.dims()[2];
        let y = kernel::norm_rope(x, width, w, self.tables.view(), self.eps);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    /// The transposed rotation gives the normalised vectors' gradient `dn`; then the RMSNorm
    /// gradient.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let what = "norm-rope bwd";
        self.tables.check(x.dims(), w.elem_count())?;
        let width = x.dims()[2];
        let rope = self.tables.view();
        let (dx, dw) = with_values(x, what, |xv| {
            with_values(w, what, |wv| {
                with_values(dy, what, |g| {
                    Ok(kernel::norm_rope_grad(xv, width, wv, rope, self.eps, g))
                })
            })
        })?;
        Ok((Some(new_tensor(dx, x)?), Some(new_tensor(dw, w)?)))
    }
}
