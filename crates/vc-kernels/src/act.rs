//! Element-wise CPU kernels of the codec: ELU (SEANet encoder), SnakeBeta (decoder), exact
//! GELU, SwiGLU gating and the masked softmax of the codec transformers, written so that the
//! compiler vectorises them (polynomial `exp`/`sin` instead of libm calls, which cost ~10 ns
//! each: the decoder evaluates ~30 M SnakeBeta activations per second of audio). On x86-64 the
//! loops run in an AVX2+FMA build when the CPU has it ([`super::simd::with_avx2`]).
//!
//! Accuracy: `expm1` within a few ulp on (−∞, 0], `sin²` within a few ulp for |x| < 2^15·π
//! (larger arguments fall back to libm per row), which is far below the parity tolerances
//! (docs/model.md §14) and what the official vectorised kernels (SLEEF) differ by from libm
//! anyway.

use super::libm;
use super::math::{exp, expm1_neg};
use super::simd::with_avx2;

/// A per-row activation applied to channels-last rows `(T, C)`.
#[derive(Debug, Clone)]
pub enum Act {
    /// ELU with α = 1 (`nn.ELU()`).
    Elu,
    /// `SnakeBeta`: `x + inv_beta[c] · sin²(x · alpha[c])`, with `alpha = exp(log α)` and
    /// `inv_beta = 1 / (exp(log β) + 1e-9)` precomputed per channel.
    Snake(SnakeParams),
}

#[derive(Debug, Clone)]
pub struct SnakeParams {
    pub alpha: Vec<f32>,
    pub inv_beta: Vec<f32>,
}

impl SnakeParams {
    /// From the stored log-scale parameters (`SnakeBeta.alpha`, `SnakeBeta.beta`).
    pub fn from_log(log_alpha: &[f32], log_beta: &[f32]) -> Self {
        // torch: alpha = exp(alpha); beta = exp(beta); 1.0 / (beta + 1e-9), all in f32.
        let alpha = log_alpha.iter().map(|&a| libm::exp(a)).collect();
        let inv_beta = log_beta
            .iter()
            .map(|&b| 1.0f32 / (libm::exp(b) + 0.000000001f32))
            .collect();
        SnakeParams { alpha, inv_beta }
    }

    pub fn channels(&self) -> usize {
        self.alpha.len()
    }
}

impl Act {
    /// Applies the activation to whole rows: `src` and `dst` hold the same number of rows of
    /// `channels` values.
    pub fn apply(&self, src: &[f32], dst: &mut [f32], channels: usize) {
        debug_assert_eq!(src.len(), dst.len());
        debug_assert_eq!(src.len() % channels.max(1), 0);
        match self {
            Act::Elu => elu(src, dst),
            Act::Snake(p) => {
                debug_assert_eq!(p.channels(), channels);
                snake(src, dst, &p.alpha, &p.inv_beta)
            }
        }
    }

    /// In place.
    pub fn apply_inplace(&self, x: &mut [f32], channels: usize) {
        match self {
            Act::Elu => elu_inplace(x),
            Act::Snake(p) => {
                debug_assert_eq!(p.channels(), channels);
                snake_inplace(x, &p.alpha, &p.inv_beta)
            }
        }
    }
}

/// `x > 0 ? x : expm1(x)`.
pub fn elu(src: &[f32], dst: &mut [f32]) {
    with_avx2(|| imp::elu_impl(src, dst))
}

pub fn elu_inplace(x: &mut [f32]) {
    with_avx2(|| imp::elu_inplace_impl(x))
}

/// SnakeBeta over rows of `alpha.len()` channels.
pub fn snake(src: &[f32], dst: &mut [f32], alpha: &[f32], inv_beta: &[f32]) {
    with_avx2(|| imp::snake_impl(src, dst, alpha, inv_beta))
}

pub fn snake_inplace(x: &mut [f32], alpha: &[f32], inv_beta: &[f32]) {
    with_avx2(|| imp::snake_inplace_impl(x, alpha, inv_beta))
}

/// GELU with the exact (erf) form, `0.5·x·(1 + erf(x/√2))` (`nn.GELU()`), in place.
pub fn gelu_erf_inplace(x: &mut [f32]) {
    with_avx2(|| imp::gelu_impl(x))
}

/// `gate ← silu(gate) · up` (SwiGLU), in place.
pub fn silu_mul_inplace(gate: &mut [f32], up: &[f32]) {
    with_avx2(|| imp::silu_mul_impl(gate, up))
}

/// Softmax of `x[lo..hi]` in place; the other entries become 0 (masked).
pub fn softmax_range(x: &mut [f32], lo: usize, hi: usize) {
    with_avx2(|| imp::softmax_impl(x, lo, hi))
}

/// Largest |x·α| for which the polynomial `sin²` is used (n·PI_A stays exact below 2^15).
const SIN_MAX_ARG: f32 = 100_000.0;

/// Whether the polynomial `sin²` may be used for arguments up to `max_abs` (false for NaN).
#[inline(always)]
fn fast_sin_ok(max_abs: f32) -> bool {
    max_abs.partial_cmp(&SIN_MAX_ARG) != Some(std::cmp::Ordering::Greater) && !max_abs.is_nan()
}

/// The loops, inlined into the AVX2 or the baseline build by their callers.
mod imp {
    #![allow(clippy::excessive_precision)]
    use super::*;

    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        #[cfg(target_feature = "fma")]
        {
            a.mul_add(b, c)
        }
        #[cfg(not(target_feature = "fma"))]
        {
            a * b + c
        }
    }

    /// 0.5·x·(1 + erf(x/√2)) with erfc from Numerical Recipes' Chebyshev fit (relative
    /// error < 1.2e-7 everywhere); for x < 0 the `1 + erf` is taken as erfc directly.
    #[inline(always)]
    fn gelu1(x: f32) -> f32 {
        let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
        let t = 1.0 / fma(0.5, z, 1.0);
        let mut p = 0.170_872_77f32;
        p = fma(p, t, -0.822_152_23);
        p = fma(p, t, 1.488_515_87);
        p = fma(p, t, -1.135_203_98);
        p = fma(p, t, 0.278_868_07);
        p = fma(p, t, -0.186_288_06);
        p = fma(p, t, 0.096_784_18);
        p = fma(p, t, 0.374_091_96);
        p = fma(p, t, 1.000_023_68);
        p = fma(p, t, -1.265_512_23);
        let erfc = t * exp(p - z * z);
        let one_plus_erf = if x < 0.0 { erfc } else { 2.0 - erfc };
        0.5 * x * one_plus_erf
    }

    #[inline(always)]
    pub fn gelu_impl(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = gelu1(*v);
        }
    }

    #[inline(always)]
    pub fn silu_mul_impl(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = *g / (1.0 + exp(-*g)) * u;
        }
    }

    #[inline(always)]
    pub fn softmax_impl(x: &mut [f32], lo: usize, hi: usize) {
        let mut m = f32::NEG_INFINITY;
        for &v in &x[lo..hi] {
            m = m.max(v);
        }
        let mut sum = 0.0f32;
        for v in x[lo..hi].iter_mut() {
            *v = exp(*v - m);
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in x[lo..hi].iter_mut() {
            *v *= inv;
        }
        x[..lo].fill(0.0);
        x[hi..].fill(0.0);
    }

    #[inline(always)]
    fn elu1(x: f32) -> f32 {
        if x > 0.0 {
            x
        } else {
            expm1_neg(x)
        }
    }

    /// sin²(x) for |x| ≤ SIN_MAX_ARG: reduction by π (the sign does not matter) and the
    /// SLEEF `sinf_u35` polynomial on [−π/2, π/2].
    #[inline(always)]
    fn sin2(x: f32) -> f32 {
        const MAGIC: f32 = 12582912.0;
        let n = (x * std::f32::consts::FRAC_1_PI + MAGIC) - MAGIC;
        let mut r = fma(n, -3.140625, x);
        r = fma(n, -0.000_967_025_756_835_937_5, r);
        r = fma(n, -6.277_114_152_908_325e-7, r);
        r = fma(n, -1.215_420_125_655_342e-10, r);
        let s = r * r;
        let mut u = 2.608_315_980_978_659_4e-6_f32;
        u = fma(u, s, -0.000_198_106_907_191_686_33);
        u = fma(u, s, 0.008_333_078_585_565_09);
        u = fma(u, s, -0.166_666_597_127_914_43);
        let sin = fma(s, u * r, r);
        sin * sin
    }

    #[inline(always)]
    pub fn elu_impl(src: &[f32], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = elu1(s);
        }
    }

    #[inline(always)]
    pub fn elu_inplace_impl(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = elu1(*v);
        }
    }

    #[inline(always)]
    fn max_abs_prod(x: &[f32], alpha: &[f32]) -> f32 {
        let mut big = 0.0f32;
        for (&v, &a) in x.iter().zip(alpha) {
            big = big.max((v * a).abs());
        }
        big
    }

    #[inline(always)]
    pub fn snake_impl(src: &[f32], dst: &mut [f32], alpha: &[f32], inv_beta: &[f32]) {
        let c = alpha.len();
        for (srow, drow) in src.chunks_exact(c).zip(dst.chunks_exact_mut(c)) {
            // NaN compares false: such rows take the exact path too.
            if !fast_sin_ok(max_abs_prod(srow, alpha)) {
                slow_snake_row(srow, drow, alpha, inv_beta);
                continue;
            }
            for ((d, &x), (&a, &ib)) in drow.iter_mut().zip(srow).zip(alpha.iter().zip(inv_beta)) {
                *d = fma(ib, sin2(x * a), x);
            }
        }
    }

    #[inline(always)]
    pub fn snake_inplace_impl(x: &mut [f32], alpha: &[f32], inv_beta: &[f32]) {
        let c = alpha.len();
        for row in x.chunks_exact_mut(c) {
            if !fast_sin_ok(max_abs_prod(row, alpha)) {
                let orig = row.to_vec();
                slow_snake_row(&orig, row, alpha, inv_beta);
                continue;
            }
            for (v, (&a, &ib)) in row.iter_mut().zip(alpha.iter().zip(inv_beta)) {
                *v = fma(ib, sin2(*v * a), *v);
            }
        }
    }
}

/// libm path for rows with huge arguments (or NaN/inf): the exact official formula.
fn slow_snake_row(src: &[f32], dst: &mut [f32], alpha: &[f32], inv_beta: &[f32]) {
    for ((d, &x), (&a, &ib)) in dst.iter_mut().zip(src).zip(alpha.iter().zip(inv_beta)) {
        let s = libm::sin(x * a);
        *d = x + ib * (s * s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf in f64: the Taylor series below 3 (≈1e-13 absolute), Lentz's continued fraction
    /// for erfc above.
    fn erf(x: f64) -> f64 {
        let a = x.abs();
        let v = if a < 3.0 {
            let (mut term, mut sum, mut n) = (a, a, 0.0);
            while term.abs() > 1e-17 * sum.abs() {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc(a) = exp(−a²)/√π · 1/(a + (1/2)/(a + 1/(a + (3/2)/(a + …))))
            let tiny = 1e-300;
            let (mut f, mut c, mut d) = (a, a, 0.0);
            for k in 1..200 {
                let an = k as f64 / 2.0;
                d = a + an * d;
                d = if d.abs() < tiny { tiny } else { d };
                c = a + an / c;
                c = if c.abs() < tiny { tiny } else { c };
                d = 1.0 / d;
                f *= c * d;
            }
            1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / f
        };
        v.copysign(x)
    }

    fn ulp_diff(a: f32, b: f32) -> f32 {
        (a - b).abs() / f32::EPSILON / b.abs().max(f32::MIN_POSITIVE)
    }

    #[test]
    fn elu_matches_expm1() {
        let step = if cfg!(miri) { 97 } else { 1 };
        let xs: Vec<f32> = (-20000..=2000)
            .step_by(step)
            .map(|i| i as f32 * 0.005)
            .collect();
        let mut out = vec![0.0; xs.len()];
        elu(&xs, &mut out);
        for (&x, &y) in xs.iter().zip(&out) {
            let want = if x > 0.0 {
                x
            } else {
                (x as f64).exp_m1() as f32
            };
            assert!(
                ulp_diff(y, want) <= 4.0 || (y - want).abs() < 1e-37,
                "elu({x}) = {y}, want {want}"
            );
        }
        let mut v = vec![-200.0f32, -88.5, -1e-30, 0.0, 3.0];
        elu_inplace(&mut v);
        assert_eq!(v, vec![-1.0, -1.0, -1e-30, 0.0, 3.0]);
    }

    #[test]
    fn snake_matches_formula() {
        let c = 5;
        let p = SnakeParams::from_log(&[0.0, 0.5, -0.7, 2.0, 1.3], &[0.0, -0.3, 0.9, 1.5, -2.0]);
        let rows = if cfg!(miri) { 40 } else { 4000 };
        let xs: Vec<f32> = (0..c * rows)
            .map(|i| ((i as f32) * 0.37).sin() * 40.0 + (i % 7) as f32)
            .collect();
        let mut out = vec![0.0; xs.len()];
        snake(&xs, &mut out, &p.alpha, &p.inv_beta);
        let mut inplace = xs.clone();
        snake_inplace(&mut inplace, &p.alpha, &p.inv_beta);
        assert_eq!(out, inplace);
        let mut max_err = 0.0f64;
        for (i, (&x, &y)) in xs.iter().zip(&out).enumerate() {
            // The argument is the f32 product, as in the official code.
            let ib = p.inv_beta[i % c] as f64;
            let s = ((x * p.alpha[i % c]) as f64).sin();
            let want = x as f64 + ib * s * s;
            max_err = max_err.max((y as f64 - want).abs() / want.abs().max(1.0));
        }
        assert!(max_err < 1.5e-6, "relative error {max_err}");
    }

    #[test]
    fn gelu_silu_softmax_match_references() {
        let step = if cfg!(miri) { 97 } else { 1 };
        let xs: Vec<f32> = (-3000..=3000)
            .step_by(step)
            .map(|i| i as f32 * 0.004)
            .collect();
        let want: Vec<f32> = xs
            .iter()
            .map(|&x| {
                let x = x as f64;
                (0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))) as f32
            })
            .collect();
        let mut got = xs.clone();
        gelu_erf_inplace(&mut got);
        for ((&x, &g), &w) in xs.iter().zip(&got).zip(&want) {
            assert!(
                (g - w).abs() <= 3e-7 * x.abs().max(1.0),
                "gelu({x}) = {g}, want {w}"
            );
        }
        let mut big = vec![-30.0f32, 30.0, -0.0];
        gelu_erf_inplace(&mut big);
        assert_eq!(big, vec![-0.0, 30.0, -0.0]);

        let up: Vec<f32> = xs.iter().map(|x| 1.5 - x).collect();
        let mut g = xs.clone();
        silu_mul_inplace(&mut g, &up);
        for ((&x, &u), &v) in xs.iter().zip(&up).zip(&g) {
            let want = (x as f64 / (1.0 + (-x as f64).exp()) * u as f64) as f32;
            assert!(
                (v - want).abs() <= 2e-6 * want.abs().max(1e-3),
                "silu({x})·{u} = {v}, want {want}"
            );
        }

        let mut row = vec![5.0f32, 1.0, 2.0, 3.0, -1e30, 7.0];
        softmax_range(&mut row, 1, 5);
        let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|v| (v - 3.0).exp()).collect();
        let s: f64 = e.iter().sum();
        assert_eq!(row[0], 0.0);
        assert_eq!(row[5], 0.0);
        assert_eq!(row[4], 0.0);
        for i in 0..3 {
            assert!((row[i + 1] as f64 - e[i] / s).abs() < 1e-7);
        }
    }

    #[test]
    fn snake_huge_arguments_fall_back() {
        let p = SnakeParams::from_log(&[3.0, 0.0], &[0.0, 0.0]);
        let xs = [1.0e6f32, 2.0, f32::NAN, 1.0];
        let mut out = [0.0f32; 4];
        snake(&xs, &mut out, &p.alpha, &p.inv_beta);
        let s0 = (xs[0] * p.alpha[0]).sin();
        assert_eq!(out[0], xs[0] + p.inv_beta[0] * s0 * s0);
        assert!(out[2].is_nan());
        let s3 = (1.0f32).sin();
        assert!((out[3] - (1.0 + p.inv_beta[1] * s3 * s3)).abs() < 1e-6);
    }
}
