//! `x · wᵀ` for f32 activations and bf16-stored weights.
//!
//! bf16 halves the bytes read per generated frame without changing a weight value; products
//! are accumulated in f32, so results equal the f32 model up to the summation order. Each
//! weight row is widened once (a 16-bit shift) and dotted with every input row; AVX2 + FMA
//! widen eight weights in registers and feed them straight into the FMAs.

use half::bf16;
use rayon::prelude::*;

/// Input rows up to which streaming the weights beats widening the matrix for a GEMM.
pub const MAX_ROWS: usize = 8;
/// Output columns (weight rows) per parallel task.
const ROWS_PER_TASK: usize = 16;

/// `x (m, k) · w (n, k)ᵀ → (m, n)` row-major, for `m ≤` [`MAX_ROWS`].
pub fn matmul_t(x: &[f32], m: usize, w: &[bf16], n: usize, k: usize) -> Vec<f32> {
    assert!(m <= MAX_ROWS, "bf16 matvec: {m} rows (at most {MAX_ROWS})");
    assert_eq!(x.len(), m * k, "bf16 matvec: input size");
    assert_eq!(w.len(), n * k, "bf16 matvec: weight size");
    if m == 0 || n == 0 {
        return vec![0.0; m * n];
    }
    // Several input rows: their first k/8·8 values interleaved by blocks of eight,
    // `[c][i]` = x[i][8c..8c+8], so the AVX2 loop reads the blocks for one weight vector
    // contiguously.
    let mut blocks = Vec::new();
    if m > 1 {
        let rows: Vec<&[[f32; 8]]> = x.chunks_exact(k).map(|r| r.as_chunks::<8>().0).collect();
        blocks.reserve(k / 8 * m);
        for c in 0..k / 8 {
            blocks.extend(rows.iter().map(|r| r[c]));
        }
    }
    // Tasks own column ranges of the output, written through a transposed buffer `(N, M)`.
    let mut out_t = vec![0f32; n * m];
    out_t
        .par_chunks_mut(ROWS_PER_TASK * m)
        .zip(w.par_chunks(ROWS_PER_TASK * k.max(1)))
        .for_each(|(out, w)| kernel(w, x, &blocks, out, m, k));
    let mut out = vec![0f32; m * n];
    for (j, col) in out_t.chunks_exact(m).enumerate() {
        for (i, v) in col.iter().enumerate() {
            out[i * n + j] = *v;
        }
    }
    out
}

/// `out[r·m + i] = dot(w[r], x[i])` for the weight rows `w` (`k` wide); `blocks` is `x`
/// interleaved as in [`matmul_t`] (for `m > 1`).
fn kernel(w: &[bf16], x: &[f32], blocks: &[[f32; 8]], out: &mut [f32], m: usize, k: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::super::simd::has_avx2_fma() {
            // SAFETY: the CPU supports the features the function is compiled for.
            unsafe { avx2::kernel(w, x, blocks, out, m, k) };
            return;
        }
    }
    let _ = blocks;
    kernel_generic(w, x, out, m, k);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{bf16, MAX_ROWS};

    /// Eight bf16 values widened to f32.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn load8(v: &[bf16; 8]) -> __m256 {
        // SAFETY: `v` is 16 readable bytes and the load has no alignment requirement.
        let bits = unsafe { _mm_loadu_si128(v.as_ptr().cast::<__m128i>()) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))
    }

    /// Eight f32 values.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn loadf(v: &[f32; 8]) -> __m256 {
        // SAFETY: `v` is 32 readable bytes and the load has no alignment requirement.
        unsafe { _mm256_loadu_ps(v.as_ptr()) }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    fn widen(v: bf16) -> f32 {
        f32::from_bits((v.to_bits() as u32) << 16)
    }

    /// A single input row uses four accumulators to hide the FMA latency; several rows share
    /// each widened weight vector.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn kernel(
        w: &[bf16],
        x: &[f32],
        blocks: &[[f32; 8]],
        out: &mut [f32],
        m: usize,
        k: usize,
    ) {
        debug_assert!(m <= MAX_ROWS && x.len() == m * k && w.len() * m == out.len() * k);
        let k8 = k / 8 * 8;
        for (wr, o) in w.chunks_exact(k).zip(out.chunks_exact_mut(m)) {
            if m == 1 {
                let (w32, _) = wr.as_chunks::<32>();
                let (x32, _) = x.as_chunks::<32>();
                let mut a = [_mm256_setzero_ps(); 4];
                for (wb, xb) in w32.iter().zip(x32) {
                    let (wq, _) = wb.as_chunks::<8>();
                    let (xq, _) = xb.as_chunks::<8>();
                    for ((acc, wv), xv) in a.iter_mut().zip(wq).zip(xq) {
                        *acc = _mm256_fmadd_ps(load8(wv), loadf(xv), *acc);
                    }
                }
                let done = w32.len() * 32;
                let (w8, _) = wr[done..k8].as_chunks::<8>();
                let (x8, _) = x[done..k8].as_chunks::<8>();
                for (wv, xv) in w8.iter().zip(x8) {
                    a[0] = _mm256_fmadd_ps(load8(wv), loadf(xv), a[0]);
                }
                let mut sum = hsum(_mm256_add_ps(
                    _mm256_add_ps(a[0], a[1]),
                    _mm256_add_ps(a[2], a[3]),
                ));
                for (&wv, &xv) in wr[k8..].iter().zip(&x[k8..]) {
                    sum += widen(wv) * xv;
                }
                o[0] = sum;
            } else {
                let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
                let (w8, _) = wr.as_chunks::<8>();
                for (wv, xb) in w8.iter().zip(blocks.chunks_exact(m)) {
                    let wv = load8(wv);
                    for (a, xv) in acc.iter_mut().zip(xb) {
                        *a = _mm256_fmadd_ps(wv, loadf(xv), *a);
                    }
                }
                for (i, (a, o)) in acc.iter().zip(o.iter_mut()).enumerate() {
                    let xi = &x[i * k..(i + 1) * k];
                    let mut sum = hsum(*a);
                    for (&wv, &xv) in wr[k8..].iter().zip(&xi[k8..]) {
                        sum += widen(wv) * xv;
                    }
                    *o = sum;
                }
            }
        }
    }
}

fn kernel_generic(w: &[bf16], x: &[f32], out: &mut [f32], m: usize, k: usize) {
    let mut row = vec![0f32; k];
    for (wr, o) in w.chunks_exact(k.max(1)).zip(out.chunks_exact_mut(m)) {
        // bf16 → f32 is exact: the bf16 bits are the top half of the f32.
        for (d, s) in row.iter_mut().zip(wr) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
        for (o, xi) in o.iter_mut().zip(x.chunks_exact(k.max(1))) {
            *o = dot(&row, xi);
        }
    }
}

/// Dot product of [`kernel_generic`], the fallback where AVX2 + FMA are missing (or under Miri):
/// eight lanes of fused multiply-adds (`mul_add`, asked for explicitly, [`super::super::simd`]),
/// each product rounded once as in the AVX2 kernel it stands in for. The lanes are then summed
/// in order, not as `hsum` adds them, so the two paths agree up to the summation order, not bit
/// for bit: what the module promises and what its test checks against an f64 product
/// (docs/model.md §14 tolerances).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 8;
    let mut acc = [0f32; L];
    let (ac, at) = a.as_chunks::<L>();
    let (bc, bt) = b.as_chunks::<L>();
    for (pa, pb) in ac.iter().zip(bc) {
        for l in 0..L {
            acc[l] = pa[l].mul_add(pb[l], acc[l]);
        }
    }
    let mut sum = 0f32;
    for (x, y) in at.iter().zip(bt) {
        sum = x.mul_add(*y, sum);
    }
    acc.iter().sum::<f32>() + sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_naive_product_for_every_row_count() {
        let sizes: &[(usize, usize, usize)] = if cfg!(miri) {
            &[(1, 37, 3), (3, 40, 17)]
        } else {
            &[
                (1, 37, 5),
                (2, 64, 33),
                (8, 100, 17),
                (1, 1024, 70),
                (3, 1024, 70),
                (5, 7, 1),
            ]
        };
        for &(m, k, n) in sizes {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let w: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 48.0))
                .collect();
            let got = matmul_t(&x, m, &w, n, k);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| x[i * k + c] as f64 * w[j * k + c].to_f64())
                        .sum();
                    let err = (got[i * n + j] as f64 - want).abs();
                    assert!(
                        err < 1e-5 * (k as f64).sqrt() * 4.0,
                        "m {m} k {k} n {n}: {err}"
                    );
                }
            }
        }
    }
}
