//! The polynomial `exp` family shared by every kernel (training's SwiGLU and cross-entropy,
//! the codec's activations, softmax and GELU).
//!
//! libm's `expf` is a fast scalar call, but a call: element-wise loops around it cannot
//! vectorise. [`exp`] is branch-free (clamped range, Cody–Waite reduction, degree-7 Taylor
//! polynomial, exponent by bit assembly), so such loops do; its relative error is below 2.5e-7
//! (2 ulp) on its range. In scalar code libm is faster: use these in loops that vectorise.
//!
//! One evaluation ([`exp_parts`]) serves [`exp`] and [`expm1_neg`]; there used to be three
//! copies (the codec's `exp1` clamped at −87 instead of −87.3, otherwise the same arithmetic).

const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// 1.5·2^23: adding and subtracting it rounds to the nearest integer.
const ROUND: f32 = 12_582_912.0;
/// Below this `e^x` is under f32's normal range: [`exp`] returns 0.
pub const EXP_MIN: f32 = -87.3;
/// Above this [`exp`] returns `e^88` (f32's largest power of e).
pub const EXP_MAX: f32 = 88.0;

/// `(p, 2^n)` with `e^x ≈ p · 2^n` for `x` clamped to `[EXP_MIN, EXP_MAX]`, `p ∈ [√½, √2]`.
#[inline(always)]
fn exp_parts(x: f32) -> (f32, f32) {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    // Integer ops on the bits instead of a float-to-int cast (Rust's saturating `as` would
    // block vectorisation): the low bits of `t` hold n + 2^22.
    let t = x * LOG2_E + ROUND;
    let n = t - ROUND;
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    // ln 2 split into a part exact in f32 products and a correction.
    let r = (x - n * 0.693_145_75) - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    (p, f32::from_bits((n_bits.wrapping_add(127) as u32) << 23))
}

/// `e^x`: exactly 0 below [`EXP_MIN`] (where the true value is subnormal), `e^88` above
/// [`EXP_MAX`], NaN for NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let (p, scale) = exp_parts(x);
    let v = p * scale;
    if x < EXP_MIN {
        0.0
    } else {
        v
    }
}

/// `e^x − 1` for `x ≤ 0` (within a few ulp; −1 below −87.3). Small |x| use the Taylor series
/// of `expm1` itself (no cancellation).
#[inline(always)]
pub fn expm1_neg(x: f32) -> f32 {
    // |x| < 0.35: error < 1 ulp with terms up to x^9/9!.
    let s = x;
    let small = s
        * (1.0
            + s * (0.5
                + s * (1.0 / 6.0
                    + s * (1.0 / 24.0
                        + s * (1.0 / 120.0
                            + s * (1.0 / 720.0
                                + s * (1.0 / 5040.0
                                    + s * (1.0 / 40320.0 + s * (1.0 / 362880.0)))))))));
    let big = exp(x) - 1.0;
    if x > -0.35 {
        small
    } else {
        big
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `step`-th f32 in [lo, hi) (fewer under Miri).
    fn grid(lo: f32, hi: f32, step: f32) -> impl Iterator<Item = f32> {
        let step = if cfg!(miri) { step * 97.0 } else { step };
        (0..)
            .map(move |i| lo + i as f32 * step)
            .take_while(move |&x| x < hi)
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        for x in grid(-87.3, 88.0, 0.0137) {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "max relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(-87.4), 0.0);
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(1000.0), exp(88.0));
        assert!(exp(88.0).is_finite());
    }

    #[test]
    fn expm1_is_accurate() {
        for x in grid(-100.0, 0.0, 0.005) {
            let want = (x as f64).exp_m1();
            let got = expm1_neg(x) as f64;
            let ulps = (got - want).abs() / (want.abs() * f32::EPSILON as f64);
            assert!(
                ulps <= 4.0 || (got - want).abs() < 1e-37,
                "expm1({x}) = {got}, want {want}"
            );
        }
        assert_eq!(expm1_neg(-200.0), -1.0);
        assert_eq!(expm1_neg(-1e-30), -1e-30);
        assert_eq!(expm1_neg(0.0), 0.0);
    }
}
