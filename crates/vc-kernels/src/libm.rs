//! libm's f32 functions, the same on every C library.
//!
//! glibc and musl compute `expf`, `sinf`, `cosf` and `powf` with different algorithms, and
//! their last bits differ for some arguments: the static release (musl) and the dynamic build
//! (glibc) then wrote WAVs that differed by one step in a few samples
//! (docs/architecture.md §9.4). These evaluate in f64 and round once. Both libraries' f64
//! functions are within an ulp of the exact value, so the f32 result is the correctly rounded
//! one, and the same on both, unless the exact value lies within 2^-52 of a halfway point
//! between two f32s (about one argument in 2^28). Model code uses them where the official code computes these in f32: the
//! rotary tables, SnakeBeta's parameters, SiLU and softmax in the speaking path; the vectorised
//! loops use [`super::math`], which calls no libm at all.

/// `e^x`.
#[inline]
pub fn exp(x: f32) -> f32 {
    (x as f64).exp() as f32
}

/// `sin x`.
#[inline]
pub fn sin(x: f32) -> f32 {
    (x as f64).sin() as f32
}

/// `cos x`.
#[inline]
pub fn cos(x: f32) -> f32 {
    (x as f64).cos() as f32
}

/// `x^y`.
#[inline]
pub fn powf(x: f32, y: f32) -> f32 {
    (x as f64).powf(y as f64) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within one f32 ulp of this platform's f32 libm (which is within an ulp of the exact
    /// value): the f64 route changes no value by more than that rounding.
    #[test]
    fn agree_with_f32_libm_to_an_ulp() {
        for i in -2000..2000 {
            let x = i as f32 * 0.0437;
            for (ours, libm) in [
                (exp(x * 0.04), (x * 0.04).exp()),
                (sin(x), x.sin()),
                (cos(x), x.cos()),
                (powf(1e6, x * 1e-4), 1e6f32.powf(x * 1e-4)),
            ] {
                let ulp = f32::from_bits(libm.abs().to_bits() + 1) - libm.abs();
                assert!((ours - libm).abs() <= ulp, "{x}: {ours} vs libm {libm}");
            }
        }
    }
}
