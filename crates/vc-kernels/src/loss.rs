//! Mean cross-entropy of f32 logits `(M, V)` against class indices, one pass per row forward
//! and a fused backward (`(softmax − onehot) · scale / M`): the composed version materialises
//! a handful of logits-sized temporaries (the sub-talker's logits are 15 × frames × 2048).
//! Per-row losses are summed in f64, in row order.

use rayon::prelude::*;

use super::buf::par_new_vec;
use super::math::exp;
use super::simd::with_avx2;

/// Lanes of the vectorised row loops.
const LANES: usize = 8;

/// `(max, Σ exp(x − max))` of one row. Eight-lane f32 partial sums over blocks of 64 values
/// (so the loop vectorises), the blocks summed in f64.
pub fn row_stats(row: &[f32]) -> (f32, f64) {
    with_avx2(|| {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let chunks = row.chunks_exact(LANES);
        let mut max = chunks
            .remainder()
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for c in chunks {
            for (m, &x) in lanes.iter_mut().zip(c) {
                *m = m.max(x);
            }
        }
        max = lanes.iter().fold(max, |a, &b| a.max(b));
        let mut sum = 0f64;
        for block in row.chunks(LANES * LANES) {
            let mut acc = [0f32; LANES];
            let chunks = block.chunks_exact(LANES);
            let tail: f32 = chunks.remainder().iter().map(|&x| exp(x - max)).sum();
            for c in chunks {
                for (a, &x) in acc.iter_mut().zip(c) {
                    *a += exp(x - max);
                }
            }
            sum += acc.iter().map(|&a| a as f64).sum::<f64>() + tail as f64;
        }
        (max, sum)
    })
}

fn check(x: &[f32], v: usize, targets: &[u32]) {
    assert!(
        v > 0 && x.len() == targets.len() * v,
        "cross-entropy: {} logits for {} rows of {v} classes",
        x.len(),
        targets.len()
    );
    if let Some(bad) = targets.iter().find(|&&c| c as usize >= v) {
        panic!("cross-entropy: target {bad} is outside the {v} classes");
    }
}

/// Each row's statistics ([`row_stats`]) and the mean loss over the rows.
pub fn forward(x: &[f32], v: usize, targets: &[u32]) -> (Vec<(f32, f64)>, f64) {
    check(x, v, targets);
    let stats: Vec<(f32, f64)> = x.par_chunks(v).map(row_stats).collect();
    let rows: Vec<f64> = x
        .chunks(v)
        .zip(targets)
        .zip(&stats)
        .map(|((row, &target), &(max, sum))| sum.ln() + max as f64 - row[target as usize] as f64)
        .collect();
    let mean = rows.iter().sum::<f64>() / targets.len().max(1) as f64;
    (stats, mean)
}

/// The gradient `(softmax(x) − onehot(t)) · scale / M` `(M, V)`, from the forward pass's row
/// statistics when given (recomputed otherwise).
pub fn grad(
    x: &[f32],
    v: usize,
    targets: &[u32],
    stats: Option<&[(f32, f64)]>,
    scale: f32,
) -> Vec<f32> {
    check(x, v, targets);
    let m = targets.len();
    let k = scale / m.max(1) as f32;
    let stats = stats.filter(|s| s.len() == m);
    par_new_vec(
        m * v,
        v,
        || (),
        |r, part, _| {
            let row = &x[r * v..(r + 1) * v];
            let (max, sum) = match stats {
                Some(s) => s[r],
                None => row_stats(row),
            };
            let inv = (1.0 / sum) as f32;
            let p = |x: f32| exp(x - max) * inv * k;
            let mut o = with_avx2(|| part.map_from(row, p));
            let t = targets[r] as usize;
            o[t] = p(row[t]) - k;
            o
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_and_gradient_match_the_definition() {
        let (m, v) = (5, 37);
        let x: Vec<f32> = (0..m * v).map(|i| (i as f32 * 0.731).sin() * 6.0).collect();
        let t: Vec<u32> = (0..m).map(|i| (i * 17 % v) as u32).collect();
        let (stats, loss) = forward(&x, v, &t);
        let mut want = 0f64;
        let mut want_grad = vec![0f64; m * v];
        for r in 0..m {
            let row = &x[r * v..(r + 1) * v];
            let z: f64 = row.iter().map(|&a| (a as f64).exp()).sum();
            want += z.ln() - row[t[r] as usize] as f64;
            for j in 0..v {
                let onehot = if j == t[r] as usize { 1.0 } else { 0.0 };
                want_grad[r * v + j] = ((row[j] as f64).exp() / z - onehot) * 3.0 / m as f64;
            }
        }
        want /= m as f64;
        assert!((loss - want).abs() < 1e-6 * want.abs());
        let g = grad(&x, v, &t, Some(&stats), 3.0);
        assert_eq!(g, grad(&x, v, &t, None, 3.0));
        for (a, b) in g.iter().zip(&want_grad) {
            assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
        }
    }
}
