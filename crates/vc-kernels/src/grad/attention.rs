//! Attention with grouped-query sharing and an additive mask, token-major, forward and
//! backward (docs/model.md §12): `softmax(q·kᵀ·scale + bias)·v` per head, q head `g·rep + r`
//! reading kv head `g` (HF `repeat_kv`), softmax in f32.
//!
//! Work is split over (batch row, kv head) groups; each group's gradients are computed whole
//! and scattered in group order, so nothing depends on the thread count.

use rayon::prelude::*;

use super::super::simd::with_avx2;

/// `a·b` of the training attention (scores, and `dO·V` in the backward). Plain `*` and `+`, not
/// `mul_add`: it runs inside [`with_avx2`], and without fused multiply-adds both builds give the
/// same bits ([`super::super::simd`]), so a run does not depend on the machine's ISA. The eight
/// lanes fold in a fixed tree (lane `l` with `l + 4`, then pairs), three dependent adds where
/// summing them in order takes seven; any fixed order keeps runs reproducible and resumes exact
/// (docs/training.md §5.4, §7.3).
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

/// Shapes of one attention call: `q` `(b, s, heads·d)`, `k`, `v` `(b, t, kv_heads·d)`.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub b: usize,
    pub s: usize,
    pub t: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
}

impl Dims {
    fn rep(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Row `(b, pos)` of head `h` in a `(B, len, n_heads·D)` tensor.
    fn at(&self, b: usize, pos: usize, len: usize, n_heads: usize, h: usize) -> usize {
        ((b * len + pos) * n_heads + h) * self.d
    }

    fn check(&self, q: usize, k: usize, v: usize) {
        assert!(
            self.d > 0
                && self.kv_heads > 0
                && self.heads.is_multiple_of(self.kv_heads)
                && q == self.b * self.s * self.heads * self.d
                && k == self.b * self.t * self.kv_heads * self.d
                && v == k,
            "attention: {self:?} does not fit q {q}, k {k}, v {v} values"
        );
    }
}

/// An additive mask `(rows, 1, s, t)` (rows = 1 or B) with `-inf` for hidden keys.
#[derive(Clone, Copy, Debug)]
pub struct Bias<'a> {
    pub values: &'a [f32],
    pub rows: usize,
    pub s: usize,
    pub t: usize,
}

/// One attention call: shapes, scale and optional mask (every query must see at least one
/// key; `-inf` entries get probability exactly 0 and are skipped).
#[derive(Clone, Copy, Debug)]
pub struct Attention<'a> {
    pub dims: Dims,
    pub scale: f32,
    pub bias: Option<Bias<'a>>,
}

impl Attention<'_> {
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
    fn forward_group(&self, q: &[f32], k: &[f32], v: &[f32], b: usize, g: usize) -> Vec<f32> {
        let dims = &self.dims;
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
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
        b: usize,
        g: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let dims = &self.dims;
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

    fn check(&self, q: usize, k: usize, v: usize) {
        self.dims.check(q, k, v);
        if let Some(bias) = &self.bias {
            let dims = &self.dims;
            assert!(
                bias.s == dims.s
                    && bias.t == dims.t
                    && (bias.rows == 1 || bias.rows == dims.b)
                    && bias.values.len() == bias.rows * bias.s * bias.t,
                "attention bias ({}, 1, {}, {}) does not fit {dims:?}",
                bias.rows,
                bias.s,
                bias.t
            );
        }
    }

    /// The output `(B, S, heads·D)`.
    pub fn forward(&self, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        self.check(q.len(), k.len(), v.len());
        let dims = &self.dims;
        let groups: Vec<Vec<f32>> = (0..dims.b * dims.kv_heads)
            .into_par_iter()
            .map(|t| {
                with_avx2(|| self.forward_group(q, k, v, t / dims.kv_heads, t % dims.kv_heads))
            })
            .collect();
        let mut out = vec![0f32; q.len()];
        for (t, o) in groups.iter().enumerate() {
            let (b, g) = (t / dims.kv_heads, t % dims.kv_heads);
            scatter_group(dims, &mut out, o, b, g * dims.rep(), dims.heads, dims.s);
        }
        out
    }

    /// `(dq, dk, dv)` for the output gradient `dout`.
    pub fn backward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        self.check(q.len(), k.len(), v.len());
        assert_eq!(dout.len(), q.len(), "attention: output gradient size");
        let dims = &self.dims;
        let groups: Vec<_> = (0..dims.b * dims.kv_heads)
            .into_par_iter()
            .map(|t| {
                let (b, g) = (t / dims.kv_heads, t % dims.kv_heads);
                with_avx2(|| self.backward_group(q, k, v, dout, b, g))
            })
            .collect();
        let mut dq = vec![0f32; q.len()];
        let mut dk = vec![0f32; k.len()];
        let mut dv = vec![0f32; v.len()];
        for (t, (gq, gk, gv)) in groups.iter().enumerate() {
            let (b, g) = (t / dims.kv_heads, t % dims.kv_heads);
            scatter_group(dims, &mut dq, gq, b, g * dims.rep(), dims.heads, dims.s);
            scatter_group(dims, &mut dk, gk, b, g, dims.kv_heads, dims.t);
            scatter_group(dims, &mut dv, gv, b, g, dims.kv_heads, dims.t);
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
    if len == 0 {
        return;
    }
    let count = src.len() / (len * d);
    for r in 0..count {
        for i in 0..len {
            let at = dims.at(b, i, len, n_heads, first_head + r);
            dst[at..at + d].copy_from_slice(&src[(r * len + i) * d..(r * len + i + 1) * d]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{on_threads, vals};
    use super::*;

    #[test]
    fn matches_a_naive_softmax_and_its_finite_differences() {
        let dims = Dims {
            b: 2,
            s: 3,
            t: 4,
            heads: 4,
            kv_heads: 2,
            d: 3,
        };
        let q = vals(dims.b * dims.s * dims.heads * dims.d, 1);
        let k = vals(dims.b * dims.t * dims.kv_heads * dims.d, 2);
        let v = vals(k.len(), 3);
        // Batch row 1 hides key 3 from every query.
        let mut mask = vec![0f32; 2 * dims.s * dims.t];
        for i in 0..dims.s {
            mask[(dims.s + i) * dims.t + 3] = f32::NEG_INFINITY;
        }
        let att = Attention {
            dims,
            scale: 0.7,
            bias: Some(Bias {
                values: &mask,
                rows: 2,
                s: dims.s,
                t: dims.t,
            }),
        };
        let y = att.forward(&q, &k, &v);
        let d = dims.d;
        for b in 0..dims.b {
            for h in 0..dims.heads {
                let g = h / 2;
                for i in 0..dims.s {
                    let qi = &q[dims.at(b, i, dims.s, dims.heads, h)..][..d];
                    let keys = if b == 1 { 3 } else { 4 };
                    let scores: Vec<f64> = (0..keys)
                        .map(|j| {
                            let kj = &k[dims.at(b, j, dims.t, dims.kv_heads, g)..][..d];
                            0.7 * qi.iter().zip(kj).map(|(a, c)| (a * c) as f64).sum::<f64>()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for c in 0..d {
                        let want: f64 = (0..keys)
                            .map(|j| {
                                (scores[j] - m).exp() / z
                                    * v[dims.at(b, j, dims.t, dims.kv_heads, g) + c] as f64
                            })
                            .sum();
                        let got = y[dims.at(b, i, dims.s, dims.heads, h) + c] as f64;
                        assert!((got - want).abs() < 1e-5, "({b}, {h}, {i}, {c})");
                    }
                }
            }
        }
        let r = vals(y.len(), 4);
        let grads = on_threads(1, || att.backward(&q, &k, &v, &r));
        let threaded = on_threads(3, || att.backward(&q, &k, &v, &r));
        if cfg!(miri) {
            // Miri gives `f32::exp` a random error of a few ulps at every call (its precision
            // is not guaranteed), so two runs differ there in the last bits whatever the
            // threads; the bit-for-bit check runs on real hardware.
            for (a, b) in [
                (&threaded.0, &grads.0),
                (&threaded.1, &grads.1),
                (&threaded.2, &grads.2),
            ] {
                for (x, y) in a.iter().zip(b.iter()) {
                    assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
                }
            }
        } else {
            assert_eq!(threaded, grads);
        }
        let loss = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
            let y = att.forward(q, k, v);
            y.iter().zip(&r).map(|(a, b)| (a * b) as f64).sum()
        };
        let step = 1e-2f32;
        let moved = |x: &[f32], u: &[f32], s: f32| -> Vec<f32> {
            x.iter().zip(u).map(|(a, b)| a + s * step * b).collect()
        };
        let dot =
            |a: &[f32], b: &[f32]| -> f64 { a.iter().zip(b).map(|(x, y)| (x * y) as f64).sum() };
        let (uq, uk, uv) = (vals(q.len(), 5), vals(k.len(), 6), vals(v.len(), 7));
        let fd = [
            (loss(&moved(&q, &uq, 1.0), &k, &v) - loss(&moved(&q, &uq, -1.0), &k, &v)),
            (loss(&q, &moved(&k, &uk, 1.0), &v) - loss(&q, &moved(&k, &uk, -1.0), &v)),
            (loss(&q, &k, &moved(&v, &uv, 1.0)) - loss(&q, &k, &moved(&v, &uv, -1.0))),
        ]
        .map(|d| d / (2.0 * step as f64));
        let an = [dot(&grads.0, &uq), dot(&grads.1, &uk), dot(&grads.2, &uv)];
        for (a, f) in an.iter().zip(&fd) {
            assert!((a - f).abs() < 1e-2 * f.abs().max(1.0), "{a} vs {f}");
        }
    }
}
