//! RMSNorm, and the attention's per-head RMSNorm fused with the rotary embedding.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{cpu_f32, new_tensor, with_values, ROW_BLOCK};

/// `x · rsqrt(mean(x²) + eps) · weight` over the last dimension (spec §4.1), with gradients for
/// `x` and `weight`.
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
                    let r = inv_rms(x, self.eps);
                    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                        *y = x * r * w;
                    }
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
                    Ok(rms_norm_grad(xv, wv, dyv, h, self.eps))
                })
            })
        })?;
        Ok((Some(new_tensor(dx, x)?), Some(new_tensor(dw, w)?)))
    }
}

/// With `g = dy·w` and `r = rsqrt(mean(x²)+eps)`: `dx = r·g − x·r³·mean(g·x)`,
/// `dw = Σ_rows dy·x·r` (summed block by block in order).
fn rms_norm_grad(x: &[f32], w: &[f32], dy: &[f32], h: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    let mut dx = vec![0f32; x.len()];
    let partial_dw: Vec<Vec<f32>> = dx
        .par_chunks_mut(h * ROW_BLOCK)
        .zip(
            x.par_chunks(h * ROW_BLOCK)
                .zip(dy.par_chunks(h * ROW_BLOCK)),
        )
        .map(|(dx, (x, dy))| {
            let mut dw = vec![0f32; h];
            for ((dx, x), dy) in dx
                .chunks_exact_mut(h)
                .zip(x.chunks_exact(h))
                .zip(dy.chunks_exact(h))
            {
                let r = inv_rms(x, eps);
                let gx: f32 = dy.iter().zip(w).zip(x).map(|((d, w), x)| d * w * x).sum();
                let c = r * r * r * gx / h as f32;
                for (i, dx) in dx.iter_mut().enumerate() {
                    *dx = r * dy[i] * w[i] - c * x[i];
                    dw[i] += dy[i] * x[i] * r;
                }
            }
            dw
        })
        .collect();
    let mut dw = vec![0f32; h];
    for p in &partial_dw {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
    }
    (dx, dw)
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

    /// Per-head RMSNorm then rotation (`q_norm`/`k_norm` + RoPE, spec §4.1) of `x`
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

    fn check(&self, dims: &[usize], d: usize) -> Result<(usize, usize)> {
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
        Ok((b, s))
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
        let (_, s) = self.tables.check(l1.dims(), d)?;
        let half = d / 2;
        let width = l1.dims()[2];
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(width)
            .zip(x.par_chunks(width))
            .enumerate()
            .for_each(|(t, (y, x))| {
                let (c, sn) = self.tables.at(t / s, t % s);
                let mut n = vec![0f32; d];
                for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                    let r = inv_rms(x, self.eps);
                    for ((n, x), w) in n.iter_mut().zip(x).zip(w) {
                        *n = x * r * w;
                    }
                    let (n1, n2) = n.split_at(half);
                    let (y1, y2) = y.split_at_mut(half);
                    for i in 0..half {
                        y1[i] = n1[i] * c[i] + -n2[i] * sn[i];
                        y2[i] = n2[i] * c[i] + n1[i] * sn[i];
                    }
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    /// Rotation backward (the transpose rotation) gives `dn`; then the RMSNorm gradient as in
    /// [`rms_norm_grad`] with `dy = dn`.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let what = "norm-rope bwd";
        let d = w.elem_count();
        let (_, s) = self.tables.check(x.dims(), d)?;
        let (half, width) = (d / 2, x.dims()[2]);
        let (dx, dw) = with_values(x, what, |xv| {
            with_values(w, what, |wv| {
                with_values(dy, what, |g| {
                    let mut dx = vec![0f32; xv.len()];
                    let block = width * ROW_BLOCK;
                    let partial: Vec<Vec<f32>> = dx
                        .par_chunks_mut(block)
                        .zip(xv.par_chunks(block).zip(g.par_chunks(block)))
                        .enumerate()
                        .map(|(blk, (dx, (x, g)))| {
                            let mut dw = vec![0f32; d];
                            let mut dn = vec![0f32; d];
                            let rows = dx
                                .chunks_exact_mut(width)
                                .zip(x.chunks_exact(width))
                                .zip(g.chunks_exact(width));
                            for (ri, ((dx, x), g)) in rows.enumerate() {
                                let t = blk * ROW_BLOCK + ri;
                                let (c, sn) = self.tables.at(t / s, t % s);
                                for ((dx, x), g) in dx
                                    .chunks_exact_mut(d)
                                    .zip(x.chunks_exact(d))
                                    .zip(g.chunks_exact(d))
                                {
                                    let (g1, g2) = g.split_at(half);
                                    for i in 0..half {
                                        dn[i] = g1[i] * c[i] + g2[i] * sn[i];
                                        dn[i + half] = g2[i] * c[i] + -g1[i] * sn[i];
                                    }
                                    let r = inv_rms(x, self.eps);
                                    let gx: f32 =
                                        dn.iter().zip(wv).zip(x).map(|((d, w), x)| d * w * x).sum();
                                    let k = r * r * r * gx / d as f32;
                                    for i in 0..d {
                                        dx[i] = r * dn[i] * wv[i] - k * x[i];
                                        dw[i] += dn[i] * x[i] * r;
                                    }
                                }
                            }
                            dw
                        })
                        .collect();
                    let mut dw = vec![0f32; d];
                    for p in &partial {
                        dw.iter_mut().zip(p).for_each(|(a, b)| *a += b);
                    }
                    Ok((dx, dw))
                })
            })
        })?;
        Ok((Some(new_tensor(dx, x)?), Some(new_tensor(dw, w)?)))
    }
}
