//! RMSNorm, and the attention's per-head RMSNorm fused with the rotary embedding
//! (docs/model.md §4.1), forward and backward over rows.

use rayon::prelude::*;

use super::{rowwise_grad, ROW_BLOCK};

fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ss: f32 = row.iter().map(|v| v * v).sum();
    1.0 / (ss / row.len() as f32 + eps).sqrt()
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

/// RMSNorm of every row (`w.len()` values) of `x`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    assert!(
        h > 0 && x.len().is_multiple_of(h),
        "rms-norm: {} values, width {h}",
        x.len()
    );
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(h * ROW_BLOCK)
        .zip(x.par_chunks(h * ROW_BLOCK))
        .for_each(|(y, x)| {
            for (y, x) in y.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
                norm_vec(y, x, w, eps);
            }
        });
    y
}

/// `(dx, dw)` of [`rms_norm`] for the output gradient `dy`.
pub fn rms_norm_grad(x: &[f32], w: &[f32], dy: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let h = w.len();
    rowwise_grad(x, dy, h, h, |_, dx, x, g, dw| {
        norm_vec_grad(dx, dw, x, w, g, eps)
    })
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

/// Half-width RoPE tables `(P, S, half)` (P = 1 when every batch row shares its positions,
/// else B), as slices.
#[derive(Clone, Copy, Debug)]
pub struct RopeSlices<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub rows: usize,
    pub seq: usize,
    pub half: usize,
}

impl RopeSlices<'_> {
    /// `(cos, sin)` rows of batch row `b`, position `s`.
    fn at(&self, b: usize, s: usize) -> (&[f32], &[f32]) {
        let p = if self.rows == 1 { 0 } else { b };
        let at = (p * self.seq + s) * self.half;
        (&self.cos[at..at + self.half], &self.sin[at..at + self.half])
    }

    fn check(&self, x_len: usize, width: usize, d: usize) {
        assert!(
            d == 2 * self.half
                && width.is_multiple_of(d.max(1))
                && width > 0
                && x_len.is_multiple_of(width * self.seq.max(1))
                && self.cos.len() == self.rows * self.seq * self.half
                && self.sin.len() == self.cos.len(),
            "rope: {x_len} values of width {width}, head {d}, tables ({}, {}, {})",
            self.rows,
            self.seq,
            self.half
        );
    }
}

/// Per-head RMSNorm (weight `w`, one head wide) then rotation of `x` `(B, S, width)`,
/// token-major.
pub fn norm_rope(x: &[f32], width: usize, w: &[f32], rope: RopeSlices<'_>, eps: f32) -> Vec<f32> {
    let d = w.len();
    rope.check(x.len(), width, d);
    let s = rope.seq;
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .enumerate()
        .for_each(|(t, (y, x))| {
            let (c, sn) = rope.at(t / s, t % s);
            let mut n = vec![0f32; d];
            for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                norm_vec(&mut n, x, w, eps);
                rotate(y, &n, c, sn, 1.0);
            }
        });
    y
}

/// `(dx, dw)` of [`norm_rope`]: the transposed rotation gives the normalised vectors'
/// gradient, then the RMSNorm gradient.
pub fn norm_rope_grad(
    x: &[f32],
    width: usize,
    w: &[f32],
    rope: RopeSlices<'_>,
    eps: f32,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let d = w.len();
    rope.check(x.len(), width, d);
    let s = rope.seq;
    rowwise_grad(x, dy, width, d, |t, dx, x, g, dw| {
        let (c, sn) = rope.at(t / s, t % s);
        let mut dn = vec![0f32; d];
        let heads = dx.chunks_exact_mut(d).zip(x.chunks_exact(d));
        for ((dx, x), g) in heads.zip(g.chunks_exact(d)) {
            rotate(&mut dn, g, c, sn, -1.0);
            norm_vec_grad(dx, dw, x, w, &dn, eps);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{on_threads, vals};
    use super::*;

    /// `Σ y·r` for the directional finite-difference checks.
    fn dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    #[test]
    fn rms_norm_values_and_gradients() {
        let (rows, h, eps) = (3, 8, 1e-6);
        let x = vals(rows * h, 1);
        let w = vals(h, 2);
        let y = rms_norm(&x, &w, eps);
        for (yr, xr) in y.chunks(h).zip(x.chunks(h)) {
            let ms: f64 = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / h as f64;
            for j in 0..h {
                let want = xr[j] as f64 / (ms + eps as f64).sqrt() * w[j] as f64;
                assert!((yr[j] as f64 - want).abs() < 1e-5);
            }
        }
        // The gradients against central differences of the loss Σ y·r along random
        // directions of x and w.
        let r = vals(x.len(), 3);
        let (dx, dw) = rms_norm_grad(&x, &w, &r, eps);
        let (ux, uw) = (vals(x.len(), 4), vals(h, 5));
        let loss = |xs: &[f32], ws: &[f32]| dot(&rms_norm(xs, ws, eps), &r);
        let step = 1e-2f32;
        let shift = |v: &[f32], u: &[f32], s: f32| -> Vec<f32> {
            v.iter().zip(u).map(|(a, b)| a + s * b).collect()
        };
        let fd_x = (loss(&shift(&x, &ux, step), &w) - loss(&shift(&x, &ux, -step), &w))
            / (2.0 * step as f64);
        let fd_w = (loss(&x, &shift(&w, &uw, step)) - loss(&x, &shift(&w, &uw, -step)))
            / (2.0 * step as f64);
        assert!((dot(&dx, &ux) - fd_x).abs() < 1e-2 * fd_x.abs().max(1.0));
        assert!((dot(&dw, &uw) - fd_w).abs() < 1e-2 * fd_w.abs().max(1.0));
    }

    #[test]
    fn norm_rope_rotates_and_its_gradient_is_the_transpose() {
        let (b, s, heads, d) = (2, 3, 2, 4);
        let half = d / 2;
        let width = heads * d;
        let angles: Vec<f32> = (0..b * s * half).map(|i| i as f32 * 0.3).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let rope = RopeSlices {
            cos: &cos,
            sin: &sin,
            rows: b,
            seq: s,
            half,
        };
        let x = vals(b * s * width, 6);
        let w = vec![1f32; d];
        let y = norm_rope(&x, width, &w, rope, 0.0);
        // A rotation keeps each half-pair's norm, and the RMSNorm makes each head's mean
        // square 1.
        for head in y.chunks(d) {
            let ms: f32 = head.iter().map(|v| v * v).sum::<f32>() / d as f32;
            assert!((ms - 1.0).abs() < 1e-5, "{ms}");
        }
        let r = vals(y.len(), 7);
        let grads = on_threads(1, || norm_rope_grad(&x, width, &w, rope, 0.0, &r));
        assert_eq!(
            on_threads(3, || norm_rope_grad(&x, width, &w, rope, 0.0, &r)),
            grads
        );
        let u = vals(x.len(), 8);
        let step = 1e-2f32;
        let at = |sgn: f32| {
            let xs: Vec<f32> = x.iter().zip(&u).map(|(a, b)| a + sgn * step * b).collect();
            dot(&norm_rope(&xs, width, &w, rope, 0.0), &r)
        };
        let fd = (at(1.0) - at(-1.0)) / (2.0 * step as f64);
        assert!((dot(&grads.0, &u) - fd).abs() < 1e-2 * fd.abs().max(1.0));
    }
}
