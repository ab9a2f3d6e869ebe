//! `dst (=|+=) β · lhs · rhs` for a few rows of `lhs` against a matrix whose rows are
//! contiguous: the products of the streaming codec decoder (docs/model.md §9.5), where a push of
//! one frame gives a layer one to a few rows and the weights are read from memory for them.
//!
//! The `gemm` crate's general kernel is built for many rows: below a few it spends its time
//! packing, and the callers' row tiles each read the whole matrix. Here the matrix is read once
//! per call, row by row as it lies in memory, and the columns are what the threads share: each
//! pass takes [`PASS_COLS`] columns of four weight rows at a time into the rows' partial sums,
//! which stay in the L1 cache.
//!
//! **Same bits as the crate.** Every element is summed as [`super::gemm`] sums it: the inner
//! dimension cut into blocks of [`K_BLOCK`] at fixed places, each block one chain of fused
//! multiply-adds from zero in `k` order, its sum `s` stored as `β·s` (first block of a
//! [`Acc::Set`]) or added as `fma(β, s, dst)`. So a row's values do not depend on whether it
//! went through this kernel or the crate's, which is what keeps the GEMM row-invariant. Used
//! only where the crate's kernels fuse their multiply-adds too (AVX2 + FMA or better, checked at
//! run time); `tests` compare the two bit for bit.

use rayon::prelude::*;

use super::gemm_call::{Acc, Par, K_BLOCK};
use super::mat::{MatMut, MatRef};
use super::simd;

/// Rows up to which [`super::gemm::gemm`] takes this kernel.
pub const FEW_ROWS: usize = 8;

/// Columns of one pass: `FEW_ROWS × PASS_COLS` partial sums (8 KB) and four weight-row pieces
/// (4 KB) stay in the L1 cache.
const PASS_COLS: usize = 256;

/// Whether a product of these shapes takes this kernel (`rhs`'s rows contiguous, β = 1, the
/// CPU with fused multiply-adds). With β ≠ 1 the crate itself scales a sum with or without a
/// fused multiply-add depending on where the element falls in its tiles, so there is no one
/// rounding to reproduce; with β = 1 both are the same.
pub(super) fn applies(m: usize, n: usize, k: usize, beta: f32, rhs: &MatRef<'_>) -> bool {
    (1..=FEW_ROWS).contains(&m)
        && n > 0
        && k > 0
        && beta == 1.0
        && rhs.col_stride() == 1
        && fused_fma()
}

fn fused_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        simd::has_avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The product (shapes checked by the caller, [`applies`] true). With [`Par::Rayon`] the column
/// passes are spread over the pool; each writes its own columns of `dst`.
pub(super) fn product(
    mut dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    acc: Acc,
    beta: f32,
    par: Par,
) {
    let (m, n) = (dst.rows(), dst.cols());
    // The rows' values along `k`, contiguous (one copy of a few rows).
    let k = lhs.cols();
    let mut x = vec![0f32; m * k];
    for (r, row) in x.chunks_exact_mut(k).enumerate() {
        for (l, v) in row.iter_mut().enumerate() {
            *v = lhs.get(r, l);
        }
    }
    let passes: Vec<(usize, usize)> = (0..n)
        .step_by(PASS_COLS)
        .map(|c0| (c0, (c0 + PASS_COLS).min(n)))
        .collect();
    let run = |&(c0, c1): &(usize, usize), prior: Option<Vec<f32>>| -> Vec<f32> {
        let mut out = prior.unwrap_or_else(|| vec![0f32; m * (c1 - c0)]);
        pass_fma(&mut out, &x, m, k, rhs, (c0, c1), acc, beta);
        out
    };
    let prior = |(c0, c1): (usize, usize), dst: &MatMut<'_>| -> Option<Vec<f32>> {
        (acc == Acc::Add).then(|| {
            let d = dst.as_ref();
            let mut v = Vec::with_capacity(m * (c1 - c0));
            for r in 0..m {
                v.extend((c0..c1).map(|c| d.get(r, c)));
            }
            v
        })
    };
    let parts: Vec<Vec<f32>> = match par {
        Par::Rayon if passes.len() > 1 && rayon::current_num_threads() > 1 => {
            let priors: Vec<Option<Vec<f32>>> = passes.iter().map(|&p| prior(p, &dst)).collect();
            passes
                .par_iter()
                .zip(priors)
                .map(|(p, pr)| run(p, pr))
                .collect()
        }
        _ => passes.iter().map(|p| run(p, prior(*p, &dst))).collect(),
    };
    for (&(c0, c1), part) in passes.iter().zip(&parts) {
        let w = c1 - c0;
        for r in 0..m {
            dst.row_mut(r)[c0..c1].copy_from_slice(&part[r * w..(r + 1) * w]);
        }
    }
}

/// [`pass`] compiled with fused multiply-adds (a closure handed to [`simd::with_avx2`] is not
/// inlined into its `target_feature` function, and `mul_add` outside one is a library call).
#[allow(clippy::too_many_arguments)]
fn pass_fma(
    out: &mut [f32],
    x: &[f32],
    m: usize,
    k: usize,
    rhs: MatRef<'_>,
    cols: (usize, usize),
    acc: Acc,
    beta: f32,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        fn run(
            out: &mut [f32],
            x: &[f32],
            m: usize,
            k: usize,
            rhs: MatRef<'_>,
            cols: (usize, usize),
            acc: Acc,
            beta: f32,
        ) {
            pass(out, x, m, k, rhs, cols, acc, beta)
        }
        assert!(fused_fma(), "few_rows::product without fused multiply-adds");
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        unsafe { run(out, x, m, k, rhs, cols, acc, beta) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    pass(out, x, m, k, rhs, cols, acc, beta)
}

/// Columns `c0..c1` of every row: `out` (`m × (c1 − c0)`, holding the previous values for
/// [`Acc::Add`]) gets each block's chain added as the crate adds it.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pass(
    out: &mut [f32],
    x: &[f32],
    m: usize,
    k: usize,
    rhs: MatRef<'_>,
    (c0, c1): (usize, usize),
    acc: Acc,
    beta: f32,
) {
    let w = c1 - c0;
    let (data, rs) = (rhs.data(), rhs.row_stride());
    let wrow = |l: usize| &data[l * rs + c0..l * rs + c1];
    let mut sums = vec![0f32; m * w];
    for k0 in (0..k).step_by(K_BLOCK) {
        let k1 = (k0 + K_BLOCK).min(k);
        sums.fill(0.0);
        let mut l = k0;
        while l + 4 <= k1 {
            let (w0, w1, w2, w3) = (wrow(l), wrow(l + 1), wrow(l + 2), wrow(l + 3));
            for (r, s) in sums.chunks_exact_mut(w).enumerate() {
                let xr = &x[r * k + l..r * k + l + 4];
                let (a0, a1, a2, a3) = (xr[0], xr[1], xr[2], xr[3]);
                for ((((s, &b0), &b1), &b2), &b3) in s.iter_mut().zip(w0).zip(w1).zip(w2).zip(w3) {
                    let mut v = *s;
                    v = a0.mul_add(b0, v);
                    v = a1.mul_add(b1, v);
                    v = a2.mul_add(b2, v);
                    v = a3.mul_add(b3, v);
                    *s = v;
                }
            }
            l += 4;
        }
        while l < k1 {
            let w0 = wrow(l);
            for (r, s) in sums.chunks_exact_mut(w).enumerate() {
                let a0 = x[r * k + l];
                for (s, &b0) in s.iter_mut().zip(w0) {
                    *s = a0.mul_add(b0, *s);
                }
            }
            l += 1;
        }
        if k0 == 0 && acc == Acc::Set {
            for (o, &s) in out.iter_mut().zip(&sums) {
                *o = beta * s;
            }
        } else {
            for (o, &s) in out.iter_mut().zip(&sums) {
                *o = beta.mul_add(s, *o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gemm::gemm;
    use super::*;
    use crate::test_values::vals;

    /// Each row of a few-row product equals the same row inside a product of many rows (which
    /// takes the crate's kernel), bit for bit: inner sizes around the block size, row strides
    /// of padded and transposed views, both accumulation modes, serial and on the pool.
    #[test]
    fn few_rows_equal_the_crate_rows_bit_for_bit() {
        if !fused_fma() {
            eprintln!("skipped: no fused multiply-add on this CPU (the kernel is not used)");
            return;
        }
        let big = 3 * FEW_ROWS;
        let shapes: &[(usize, usize)] = if cfg!(miri) {
            &[(1, 1), (3, 40), (513, 3)]
        } else {
            &[
                (1, 1),
                (2, 1),
                (1, 16),
                (3, 40),
                (7, 300),
                (511, 64),
                (512, 260),
                (513, 33),
                (1100, 520),
            ]
        };
        for (case, &(k, n)) in shapes.iter().enumerate() {
            let w = vals(k * (n + 3), 10 + case as u64);
            // Weights with a row stride wider than the view (a sub-matrix of columns).
            let rhs = MatRef::strided(&w, k, n, n + 3, 1);
            let xs = vals(big * k, 100 + case as u64);
            for (transposed, acc) in [
                (false, Acc::Add),
                (true, Acc::Set),
                (true, Acc::Add),
                (false, Acc::Set),
            ] {
                let beta = 1.0;
                // lhs as row-major (rows contiguous) or column-major (a transposed view).
                let (lhs_data, rs, cs) = if transposed {
                    let mut t = vec![0f32; big * k];
                    for i in 0..big {
                        for l in 0..k {
                            t[l * big + i] = xs[i * k + l];
                        }
                    }
                    (t, 1, big)
                } else {
                    (xs.clone(), k, 1)
                };
                let prior = vals(big * n, 7);
                let mut many = prior.clone();
                let lhs = MatRef::strided(&lhs_data, big, k, rs, cs);
                gemm(
                    MatMut::new(&mut many, big, n),
                    lhs,
                    rhs,
                    acc,
                    beta,
                    Par::Seq,
                );
                for m in 1..=FEW_ROWS {
                    for (start, par) in [(0, Par::Seq), (big - m, Par::Rayon), (5, Par::Rayon)] {
                        let mut few = prior[start * n..(start + m) * n].to_vec();
                        let sub = lhs.rows_range(start, start + m);
                        assert!(applies(m, n, k, beta, &rhs));
                        product(MatMut::new(&mut few, m, n), sub, rhs, acc, beta, par);
                        for (i, (a, b)) in few.iter().zip(&many[start * n..]).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "k {k} n {n} m {m} rows {start}.. {acc:?}: element {i}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }
}
