//! RMSNorm, and the attention's per-head RMSNorm fused with the rotary embedding.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{cpu_f32, new_tensor, sum_in_order, with_values, ROW_BLOCK};

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

fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ss: f32 = row.iter().map(|v| v * v).sum();
    1.0 / (ss / row.len() as f32 + eps).sqrt()
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
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(h * ROW_BLOCK)
            .zip(x.par_chunks(h * ROW_BLOCK))
            .for_each(|(y, x)| {
                for (y, x) in y.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
                    norm_vec(y, x, w, self.eps);
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let h = w.elem_count();
        let (dx, dw) = with_values(x, "rms-norm bwd", |xv| {
            with_values(w, "rms-norm bwd", |wv| {
                with_values(dy, "rms-norm bwd", |dyv| {
                    Ok(rowwise_grad(xv, dyv, h, h, |_, dx, x, g, dw| {
                        norm_vec_grad(dx, dw, x, wv, g, self.eps)
                    }))
                })
            })
        })?;
        Ok((Some(new_tensor(dx, x)?), Some(new_tensor(dw, w)?)))
    }
}

/// `y = x·r·w` with `r = rsqrt(mean(x²) + eps)`, for one vector.
fn norm_vec(y: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let r = inv_rms(x, eps);
    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
        *y = x * r * w;
    }
}

/// Gradient of [`norm_vec`] for the output gradient `dn`: `dx = r·dn·w − x·r³·mean(dn·w·x)`,
/// and `dw += dn·x·r`.
fn norm_vec_grad(dx: &mut [f32], dw: &mut [f32], x: &[f32], w: &[f32], dn: &[f32], eps: f32) {
    let r = inv_rms(x, eps);
    let gx: f32 = dn.iter().zip(w).zip(x).map(|((d, w), x)| d * w * x).sum();
    let k = r * r * r * gx / x.len() as f32;
    for i in 0..x.len() {
        dx[i] = r * dn[i] * w[i] - k * x[i];
        dw[i] += dn[i] * x[i] * r;
    }
}

/// Runs `f(row, dx_row, x_row, dy_row, dw)` over the rows (`width` values each) of `x` and
/// `dy`, blocks of rows in parallel, each block with its own weight gradient (`d` values); the
/// blocks' weight gradients are summed in order. Returns `(dx, dw)`.
fn rowwise_grad(
    x: &[f32],
    dy: &[f32],
    width: usize,
    d: usize,
    f: impl Fn(usize, &mut [f32], &[f32], &[f32], &mut [f32]) + Sync,
) -> (Vec<f32>, Vec<f32>) {
    let mut dx = vec![0f32; x.len()];
    let block = width * ROW_BLOCK;
    let partial: Vec<Vec<f32>> = dx
        .par_chunks_mut(block)
        .zip(x.par_chunks(block).zip(dy.par_chunks(block)))
        .enumerate()
        .map(|(b, (dx, (x, dy)))| {
            let mut dw = vec![0f32; d];
            let rows = dx
                .chunks_exact_mut(width)
                .zip(x.chunks_exact(width))
                .zip(dy.chunks_exact(width));
            for (r, ((dx, x), dy)) in rows.enumerate() {
                f(b * ROW_BLOCK + r, dx, x, dy, &mut dw);
            }
            dw
        })
        .collect();
    (dx, sum_in_order(&partial, d))
}

/// Rotates the two halves of `x` by the angles whose cosines and sines are `c`, `s`
/// (`sign = -1`: by the opposite angles, the transpose used in the backward pass).
fn rotate(y: &mut [f32], x: &[f32], c: &[f32], s: &[f32], sign: f32) {
    let half = c.len();
    let (x1, x2) = x.split_at(half);
    let (y1, y2) = y.split_at_mut(half);
    for i in 0..half {
        let sv = sign * s[i];
        y1[i] = x1[i] * c[i] + -x2[i] * sv;
        y2[i] = x2[i] * c[i] + x1[i] * sv;
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

    /// `(cos, sin)` rows of batch row `b`, position `s`.
    fn at(&self, b: usize, s: usize) -> (&[f32], &[f32]) {
        let p = if self.rows == 1 { 0 } else { b };
        let at = (p * self.seq + s) * self.half;
        (&self.cos[at..at + self.half], &self.sin[at..at + self.half])
    }

    /// Checks `(B, S, heads·d)` against the tables; returns S.
    fn check(&self, dims: &[usize], d: usize) -> Result<usize> {
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
        Ok(s)
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
        let d = w.len();
        let s = self.tables.check(l1.dims(), d)?;
        let width = l1.dims()[2];
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(width)
            .zip(x.par_chunks(width))
            .enumerate()
            .for_each(|(t, (y, x))| {
                let (c, sn) = self.tables.at(t / s, t % s);
                let mut n = vec![0f32; d];
                for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                    norm_vec(&mut n, x, w, self.eps);
                    rotate(y, &n, c, sn, 1.0);
                }
            });
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
        let d = w.elem_count();
        let s = self.tables.check(x.dims(), d)?;
        let width = x.dims()[2];
        let (dx, dw) = with_values(x, what, |xv| {
            with_values(w, what, |wv| {
                with_values(dy, what, |g| {
                    Ok(rowwise_grad(xv, g, width, d, |t, dx, x, g, dw| {
                        let (c, sn) = self.tables.at(t / s, t % s);
                        let mut dn = vec![0f32; d];
                        let heads = dx.chunks_exact_mut(d).zip(x.chunks_exact(d));
                        for ((dx, x), g) in heads.zip(g.chunks_exact(d)) {
                            rotate(&mut dn, g, c, sn, -1.0);
                            norm_vec_grad(dx, dw, x, wv, &dn, self.eps);
                        }
                    }))
                })
            })
        })?;
        Ok((Some(new_tensor(dx, x)?), Some(new_tensor(dw, w)?)))
    }
}
