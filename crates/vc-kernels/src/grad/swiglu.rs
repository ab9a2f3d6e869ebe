//! SwiGLU gating `silu(gate) · up` (the MLP's gating, docs/model.md §4.1), forward and
//! backward, element-wise in fixed chunks.

use rayon::prelude::*;

use super::super::math::exp;
use super::super::simd::with_avx2;

/// Values per parallel task.
const CHUNK: usize = 1 << 14;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `silu(g) · u`.
pub fn forward(g: &[f32], u: &[f32]) -> Vec<f32> {
    assert_eq!(g.len(), u.len(), "swiglu: gate and up differ in size");
    let mut y = vec![0f32; g.len()];
    y.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
        .for_each(|(y, (g, u))| {
            with_avx2(|| {
                for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                    *y = g / (1.0 + exp(-g)) * u;
                }
            })
        });
    y
}

/// `(d gate, d up)` for the output gradient `d`: `d gate = d·up·σ(g)(1 + g(1 − σ(g)))`,
/// `d up = d·silu(g)`.
pub fn backward(g: &[f32], u: &[f32], d: &[f32]) -> (Vec<f32>, Vec<f32>) {
    assert!(
        g.len() == u.len() && g.len() == d.len(),
        "swiglu: gate, up and gradient differ in size"
    );
    let mut dg = vec![0f32; g.len()];
    let mut du = vec![0f32; g.len()];
    dg.par_chunks_mut(CHUNK)
        .zip(du.par_chunks_mut(CHUNK))
        .zip(
            g.par_chunks(CHUNK)
                .zip(u.par_chunks(CHUNK))
                .zip(d.par_chunks(CHUNK)),
        )
        .for_each(|((dg, du), ((g, u), d))| {
            with_avx2(|| {
                let outs = dg.iter_mut().zip(du.iter_mut());
                for ((dg, du), ((&g, &u), &d)) in outs.zip(g.iter().zip(u).zip(d)) {
                    let sg = sigmoid(g);
                    *dg = d * u * sg * (1.0 + g * (1.0 - sg));
                    *du = d * g * sg;
                }
            })
        });
    (dg, du)
}

#[cfg(test)]
mod tests {
    use super::super::tests::vals;
    use super::*;

    #[test]
    fn matches_the_formulas() {
        let n = if cfg!(miri) { 300 } else { 3 * CHUNK + 7 };
        let g: Vec<f32> = vals(n, 1).iter().map(|v| v * 12.0).collect();
        let u = vals(n, 2);
        let d = vals(n, 3);
        let y = forward(&g, &u);
        let (dg, du) = backward(&g, &u, &d);
        for i in 0..n {
            let (g, u, d) = (g[i] as f64, u[i] as f64, d[i] as f64);
            let s = 1.0 / (1.0 + (-g).exp());
            let tol = |w: f64| 1e-6 * w.abs().max(1e-2);
            assert!((y[i] as f64 - g * s * u).abs() < tol(g * s * u));
            let want = d * u * s * (1.0 + g * (1.0 - s));
            assert!(
                (dg[i] as f64 - want).abs() < tol(want) * 4.0,
                "{i}: {} vs {want}",
                dg[i]
            );
            assert!((du[i] as f64 - d * g * s).abs() < tol(d * g * s));
        }
    }
}
