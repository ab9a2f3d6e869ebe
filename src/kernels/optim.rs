//! In-place, multi-threaded element-wise loops of the optimizer step: gradient accumulation,
//! AdamW's moments and parameter update, and the squared norm for gradient clipping. The
//! tensor-op formulation allocates a dozen parameter-sized temporaries per tensor (the
//! 151936-row text embedding alone is 1.2 GB in f32 at full size); these update the values
//! where they lie, in one pass each.
//!
//! Work is split into fixed-size chunks and reductions are summed chunk by chunk in order, so
//! results do not depend on the number of threads (exact resume needs that).

use rayon::prelude::*;

/// Values per parallel task (also the block of the ordered reduction in [`sum_squares`]).
pub const CHUNK: usize = 1 << 16;

/// `f(d, s)` for every pair of `dst` and `src`, in parallel chunks.
fn update_with(dst: &mut [f32], src: &[f32], f: impl Fn(&mut f32, f32) + Sync) {
    assert_eq!(dst.len(), src.len(), "element-wise update: sizes differ");
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| f(d, s)));
}

/// `dst += src`.
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    update_with(dst, src, |d, s| *d += s)
}

/// First moment: `m = lerp(m, c·g, weight)` (torch's `exp_avg.lerp_(grad, 1 - beta1)` with
/// `weight = 1 − β1`), the clipping factor `c` folded in.
pub fn first_moment(m: &mut [f32], g: &[f32], weight: f32, clip: f32) {
    update_with(m, g, |m, g| {
        let g = if clip == 1.0 { g } else { g * clip };
        *m += weight * (g - *m);
    })
}

/// Second moment: `v = β2·v + (1 − β2)·(c·g)²`.
pub fn second_moment(v: &mut [f32], g: &[f32], beta2: f32, clip: f32) {
    let w = 1.0 - beta2;
    update_with(v, g, |v, g| {
        let g = if clip == 1.0 { g } else { g * clip };
        *v = *v * beta2 + w * g * g;
    })
}

/// The parameter update `p = p·decay − step · m / (√v / bc2_sqrt + eps)`.
pub fn param_update(
    p: &mut [f32],
    m: &[f32],
    v: &[f32],
    decay: f32,
    step: f32,
    bc2_sqrt: f32,
    eps: f32,
) {
    assert!(
        p.len() == m.len() && p.len() == v.len(),
        "AdamW update: parameter, moments differ in size"
    );
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks(CHUNK))
        .zip(v.par_chunks(CHUNK))
        .for_each(|((p, m), v)| {
            for ((p, m), v) in p.iter_mut().zip(m).zip(v) {
                let denom = v.sqrt() / bc2_sqrt + eps;
                *p = *p * decay - step * (*m / denom);
            }
        });
}

/// Σ x² in f64 (per chunk, the chunks summed in order).
pub fn sum_squares(x: &[f32]) -> f64 {
    let parts: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
        .collect();
    parts.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn updates_match_their_formulas() {
        let n = if cfg!(miri) {
            2 * CHUNK / 512 + 3
        } else {
            3 * CHUNK + 17
        };
        let mk =
            |seed: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect() };
        let (g, m0) = (mk(1.0), mk(2.0));
        let v0: Vec<f32> = mk(3.0).iter().map(|x| x.abs()).collect();
        let acc0 = mk(4.0);
        let mut acc = acc0.clone();
        add_assign(&mut acc, &g);
        let mut m = m0.clone();
        first_moment(&mut m, &g, 0.1, 0.5);
        let mut v = v0.clone();
        second_moment(&mut v, &g, 0.999, 0.5);
        let mut p = mk(5.0);
        let p0 = p.clone();
        param_update(&mut p, &m, &v, 0.99, 1e-3, 0.5, 1e-8);
        for i in 0..n {
            assert_eq!(acc[i], acc0[i] + g[i]);
            let gc = g[i] * 0.5;
            assert!((m[i] - (m0[i] + 0.1 * (gc - m0[i]))).abs() < 1e-6);
            assert!((v[i] - (0.999 * v0[i] + 0.001 * gc * gc)).abs() < 1e-6);
            let want = p0[i] * 0.99 - 1e-3 * (m[i] / (v[i].sqrt() / 0.5 + 1e-8));
            assert!((p[i] - want).abs() < 1e-6);
        }
        let want: f64 = g.iter().map(|&x| (x as f64).powi(2)).sum();
        assert!((sum_squares(&g) - want).abs() < 1e-9 * want);
    }
}
