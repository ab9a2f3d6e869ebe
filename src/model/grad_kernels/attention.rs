//! Attention with grouped-query sharing and an additive mask, token-major.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{cpu_f32, new_tensor, with_values};
use crate::model::fast_math::with_avx2;

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a·x`.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

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
            Some(Arc::new(Bias { values, rows, s, t }))
        }
        None => None,
    };
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        Attention {
            head_dim,
            scale: scale as f32,
            bias,
        },
    )
}

struct Bias {
    values: Vec<f32>,
    rows: usize,
    s: usize,
    t: usize,
}

struct Attention {
    head_dim: usize,
    scale: f32,
    bias: Option<Arc<Bias>>,
}

/// Shapes of one attention call.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    s: usize,
    t: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
}

impl Dims {
    fn new(q: &[usize], k: &[usize], v: &[usize], d: usize) -> Result<Self> {
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
        Ok(Self {
            b,
            s,
            t,
            heads,
            kv_heads,
            d,
        })
    }

    fn rep(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Row `(b, pos)` of head `h` in a `(B, len, n_heads·D)` tensor.
    fn at(&self, b: usize, pos: usize, len: usize, n_heads: usize, h: usize) -> usize {
        ((b * len + pos) * n_heads + h) * self.d
    }
}

impl Attention {
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

    fn bias_row(&self, b: usize, i: usize) -> Option<&[f32]> {
        self.bias.as_ref().map(|bias| {
            let r = if bias.rows == 1 { 0 } else { b };
            &bias.values[(r * bias.s + i) * bias.t..(r * bias.s + i + 1) * bias.t]
        })
    }

    /// Softmax probabilities of query row `q` against `keys` `(T, D)` into `p`; entries with a
    /// `-inf` bias are exactly 0.
    #[inline(always)]
    fn probs(&self, q: &[f32], keys: &[f32], bias: Option<&[f32]>, p: &mut [f32]) {
        let d = q.len();
        let mut max = f32::NEG_INFINITY;
        for (j, pj) in p.iter_mut().enumerate() {
            let add = bias.map_or(0.0, |b| b[j]);
            *pj = if add == f32::NEG_INFINITY {
                f32::NEG_INFINITY
            } else {
                dot(q, &keys[j * d..(j + 1) * d]) * self.scale + add
            };
            max = max.max(*pj);
        }
        let mut sum = 0f32;
        for pj in p.iter_mut() {
            *pj = if *pj == f32::NEG_INFINITY {
                0.0
            } else {
                (*pj - max).exp()
            };
            sum += *pj;
        }
        let inv = 1.0 / sum;
        p.iter_mut().for_each(|pj| *pj *= inv);
    }

    /// Keys and values of kv head `g` of batch row `b` as contiguous `(T, D)` blocks.
    fn gather_kv(dims: &Dims, src: &[f32], b: usize, g: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(dims.t * dims.d);
        for j in 0..dims.t {
            let at = dims.at(b, j, dims.t, dims.kv_heads, g);
            out.extend_from_slice(&src[at..at + dims.d]);
        }
        out
    }

    /// Output rows of the q heads of group `(b, g)`, `(rep, S, D)`.
    #[inline(always)]
    fn forward_group(
        &self,
        dims: &Dims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        b: usize,
        g: usize,
    ) -> Vec<f32> {
        let (s, d, rep) = (dims.s, dims.d, dims.rep());
        let keys = Self::gather_kv(dims, k, b, g);
        let values = Self::gather_kv(dims, v, b, g);
        let mut out = vec![0f32; rep * s * d];
        let mut p = vec![0f32; dims.t];
        for r in 0..rep {
            let h = g * rep + r;
            for i in 0..s {
                let at = dims.at(b, i, s, dims.heads, h);
                self.probs(&q[at..at + d], &keys, self.bias_row(b, i), &mut p);
                let o = &mut out[(r * s + i) * d..(r * s + i + 1) * d];
                for (j, &pj) in p.iter().enumerate() {
                    if pj != 0.0 {
                        axpy(o, pj, &values[j * d..(j + 1) * d]);
                    }
                }
            }
        }
        out
    }

    /// Gradients of group `(b, g)`: `dq` `(rep, S, D)`, `dk`, `dv` `(T, D)`.
    /// With `dp_j = dO·v_j` and `δ = Σ_j p_j·dp_j`: `ds_j = p_j(dp_j − δ)`,
    /// `dq = scale·Σ ds_j k_j`, `dk_j += scale·ds_j q`, `dv_j += p_j dO`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn backward_group(
        &self,
        dims: &Dims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
        b: usize,
        g: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (s, t, d, rep) = (dims.s, dims.t, dims.d, dims.rep());
        let keys = Self::gather_kv(dims, k, b, g);
        let values = Self::gather_kv(dims, v, b, g);
        let mut dq = vec![0f32; rep * s * d];
        let mut dk = vec![0f32; t * d];
        let mut dv = vec![0f32; t * d];
        let mut p = vec![0f32; t];
        let mut dp = vec![0f32; t];
        for r in 0..rep {
            let h = g * rep + r;
            for i in 0..s {
                let at = dims.at(b, i, s, dims.heads, h);
                let (qi, doi) = (&q[at..at + d], &dout[at..at + d]);
                self.probs(qi, &keys, self.bias_row(b, i), &mut p);
                let mut delta = 0f32;
                for j in 0..t {
                    if p[j] != 0.0 {
                        dp[j] = dot(doi, &values[j * d..(j + 1) * d]);
                        delta += p[j] * dp[j];
                    }
                }
                let dqi = &mut dq[(r * s + i) * d..(r * s + i + 1) * d];
                for j in 0..t {
                    if p[j] != 0.0 {
                        let ds = p[j] * (dp[j] - delta) * self.scale;
                        axpy(dqi, ds, &keys[j * d..(j + 1) * d]);
                        axpy(&mut dk[j * d..(j + 1) * d], ds, qi);
                        axpy(&mut dv[j * d..(j + 1) * d], p[j], doi);
                    }
                }
            }
        }
        (dq, dk, dv)
    }
}

/// Copies the `(rep, len, D)` rows of group `g` of batch row `b` into a `(B, len, heads·D)`
/// tensor's values.
fn scatter_group(
    dims: &Dims,
    dst: &mut [f32],
    src: &[f32],
    b: usize,
    first_head: usize,
    n_heads: usize,
    len: usize,
) {
    let d = dims.d;
    let count = src.len() / (len * d);
    for r in 0..count {
        for i in 0..len {
            let at = dims.at(b, i, len, n_heads, first_head + r);
            dst[at..at + d].copy_from_slice(&src[(r * len + i) * d..(r * len + i + 1) * d]);
        }
    }
}

impl CustomOp3 for Attention {
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
        let dims = Dims::new(l1.dims(), l2.dims(), l3.dims(), self.head_dim)?;
        self.check_bias(&dims)?;
        let (q, k, v) = (
            cpu_f32(s1, l1, self.name())?,
            cpu_f32(s2, l2, self.name())?,
            cpu_f32(s3, l3, self.name())?,
        );
        let groups: Vec<Vec<f32>> = (0..dims.b * dims.kv_heads)
            .into_par_iter()
            .map(|t| {
                with_avx2(|| {
                    self.forward_group(&dims, q, k, v, t / dims.kv_heads, t % dims.kv_heads)
                })
            })
            .collect();
        let mut out = vec![0f32; q.len()];
        for (t, o) in groups.iter().enumerate() {
            let (b, g) = (t / dims.kv_heads, t % dims.kv_heads);
            scatter_group(&dims, &mut out, o, b, g * dims.rep(), dims.heads, dims.s);
        }
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
        let dims = Dims::new(q.dims(), k.dims(), v.dims(), self.head_dim)?;
        let what = "attention bwd";
        let (dq, dk, dv) = with_values(q, what, |qv| {
            with_values(k, what, |kv| {
                with_values(v, what, |vv| {
                    with_values(dout, what, |gv| {
                        let groups: Vec<_> = (0..dims.b * dims.kv_heads)
                            .into_par_iter()
                            .map(|t| {
                                let (b, g) = (t / dims.kv_heads, t % dims.kv_heads);
                                with_avx2(|| self.backward_group(&dims, qv, kv, vv, gv, b, g))
                            })
                            .collect();
                        let mut dq = vec![0f32; qv.len()];
                        let mut dk = vec![0f32; kv.len()];
                        let mut dv = vec![0f32; vv.len()];
                        for (t, (gq, gk, gv)) in groups.iter().enumerate() {
                            let (b, g) = (t / dims.kv_heads, t % dims.kv_heads);
                            scatter_group(
                                &dims,
                                &mut dq,
                                gq,
                                b,
                                g * dims.rep(),
                                dims.heads,
                                dims.s,
                            );
                            scatter_group(&dims, &mut dk, gk, b, g, dims.kv_heads, dims.t);
                            scatter_group(&dims, &mut dv, gv, b, g, dims.kv_heads, dims.t);
                        }
                        Ok((dq, dk, dv))
                    })
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
