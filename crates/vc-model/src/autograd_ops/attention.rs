//! Attention with grouped-query sharing and an additive mask, token-major.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::{cpu_f32, new_tensor, with_values};
use vc_kernels::grad::attention::{self as kernel, Dims};

/// `softmax(q·kᵀ·scale + bias)·v` per head with grouped-query sharing (q head `g·rep + r` reads
/// kv head `g`, HF `repeat_kv`), softmax in f32 (docs/model.md §12).
///
/// `q` `(B, S, heads·D)`, `k`, `v` `(B, T, kv_heads·D)` (token-major, as the projections make
/// them); returns `(B, S, heads·D)`. `bias`
/// `(B or 1, 1, S, T)` is additive with `-inf` for hidden keys (every query must see at least one
/// key); `-inf` entries get probability exactly 0 and are skipped.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    head_dim: usize,
    scale: f64,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let bias = match bias {
        Some(b) => {
            let (rows, one, s, t) = b.dims4()?;
            if one != 1 {
                bail!("attention bias must be (B, 1, S, T), got {:?}", b.dims());
            }
            let values = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            Some(Arc::new(MaskValues { values, rows, s, t }))
        }
        None => None,
    };
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        AttentionOp {
            head_dim,
            scale: scale as f32,
            bias,
        },
    )
}

struct MaskValues {
    values: Vec<f32>,
    rows: usize,
    s: usize,
    t: usize,
}

struct AttentionOp {
    head_dim: usize,
    scale: f32,
    bias: Option<Arc<MaskValues>>,
}

/// The shapes of one call, checked.
fn dims(q: &[usize], k: &[usize], v: &[usize], d: usize) -> Result<Dims> {
    let (&[b, s, qw], &[kb, t, kw]) = (q, k) else {
        bail!("attention: q {q:?}, k {k:?} must be (B, S, heads·head_dim)")
    };
    let (heads, kv_heads) = (qw / d.max(1), kw / d.max(1));
    if d == 0 || qw % d != 0 || kw % d != 0 {
        bail!("attention: q {q:?}, k {k:?} are not multiples of head_dim {d}");
    }
    if kb != b || v != k || kv_heads == 0 || heads % kv_heads != 0 {
        bail!("attention: q {q:?}, k {k:?}, v {v:?} do not fit together");
    }
    Ok(Dims {
        b,
        s,
        t,
        heads,
        kv_heads,
        d,
    })
}

impl AttentionOp {
    fn check_bias(&self, dims: &Dims) -> Result<()> {
        if let Some(bias) = &self.bias {
            if bias.s != dims.s || bias.t != dims.t || (bias.rows != 1 && bias.rows != dims.b) {
                bail!(
                    "attention bias ({}, 1, {}, {}) does not fit S = {}, T = {}, B = {}",
                    bias.rows,
                    bias.s,
                    bias.t,
                    dims.s,
                    dims.t,
                    dims.b
                );
            }
        }
        Ok(())
    }

    /// The kernel for checked shapes.
    fn kernel(&self, dims: Dims) -> kernel::Attention<'_> {
        kernel::Attention {
            dims,
            scale: self.scale,
            bias: self.bias.as_ref().map(|b| kernel::Bias {
                values: &b.values,
                rows: b.rows,
                s: b.s,
                t: b.t,
            }),
        }
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "attention-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = dims(l1.dims(), l2.dims(), l3.dims(), self.head_dim)?;
        self.check_bias(&dims)?;
        let (q, k, v) = (
            cpu_f32(s1, l1, self.name())?,
            cpu_f32(s2, l2, self.name())?,
            cpu_f32(s3, l3, self.name())?,
        );
        let out = self.kernel(dims).forward(q, k, v);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = dims(q.dims(), k.dims(), v.dims(), self.head_dim)?;
        self.check_bias(&dims)?;
        let what = "attention bwd";
        let kernel = self.kernel(dims);
        let (dq, dk, dv) = with_values(q, what, |qv| {
            with_values(k, what, |kv| {
                with_values(v, what, |vv| {
                    with_values(dout, what, |gv| Ok(kernel.backward(qv, kv, vv, gv)))
                })
            })
        })?;
        Ok((
            Some(new_tensor(dq, q)?),
            Some(new_tensor(dk, k)?),
            Some(new_tensor(dv, v)?),
        ))
    }
}
