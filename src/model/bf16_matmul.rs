//! `x @ w^T` for f32 activations and bf16-stored weights on the CPU.
//!
//! Generation is memory-bandwidth bound (docs/performance.md §2): every frame reads all talker and
//! code predictor matrices for a handful of input rows. The official checkpoints are bf16, so
//! keeping the matrices in bf16 halves the bytes read per frame without changing a single
//! weight value; products are accumulated in f32, so results equal the f32 model up to the
//! summation order. candle's CPU GEMM has no fast bf16 path, hence this kernel: each weight row
//! is widened once (a 16-bit shift) into an L1-resident buffer and dotted with every input row,
//! output rows split across threads. Larger inputs (prefill) widen the whole matrix and use
//! the regular GEMM instead.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

/// Input rows up to which the row-streaming kernel beats widening the matrix for GEMM.
const MAX_STREAMED_ROWS: usize = 8;
/// Output rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// `x (M, K) f32 @ w (N, K) bf16 ^T -> (M, N) f32`, or `None` when the fast path does not apply
/// (not CPU, other dtypes, non-contiguous weights, many rows); the caller then falls back.
pub fn try_matmul_t(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if w.dtype() != DType::BF16 || x.dtype() != DType::F32 || !w.device().is_cpu() {
        return Ok(None);
    }
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if k != kw {
        candle_core::bail!("matmul: input width {k} does not match weight width {kw}");
    }
    if m > MAX_STREAMED_ROWS {
        let y = x.matmul(&w.to_dtype(DType::F32)?.t()?)?;
        return Ok(Some(y));
    }
    let (storage, layout) = w.storage_and_layout();
    let Storage::Cpu(CpuStorage::BF16(data)) = &*storage else {
        return Ok(None);
    };
    let Some((start, end)) = contiguous_range(layout) else {
        return Ok(None);
    };
    let weights = &data[start..end];
    let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let mut out = vec![0f32; m * n];
    // Output is (M, N) row-major; tasks own column ranges, written through a transposed buffer.
    let mut out_t = vec![0f32; n * m];
    out_t
        .par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(task, chunk)| {
            let first = task * ROWS_PER_TASK;
            let rows = chunk.len() / m;
            let w = &weights[first * k..(first + rows) * k];
            kernel(w, &xs, chunk, rows, m, k);
        });
    for (j, col) in out_t.chunks_exact(m).enumerate() {
        for (i, v) in col.iter().enumerate() {
            out[i * n + j] = *v;
        }
    }
    Ok(Some(Tensor::from_vec(
        out,
        Shape::from((m, n)),
        x.device(),
    )?))
}

fn contiguous_range(layout: &Layout) -> Option<(usize, usize)> {
    layout
        .contiguous_offsets()
        .filter(|_| layout.is_contiguous())
}

/// `out[r * m + i] = dot(w[r], x[i])` for `rows` weight rows of width `k`.
fn kernel(w: &[half::bf16], x: &[f32], out: &mut [f32], rows: usize, m: usize, k: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::fast_math::has_avx2_fma() {
            // SAFETY: the CPU supports the features the function is compiled for.
            unsafe { kernel_avx2(w, x, out, rows, m, k) };
            return;
        }
    }
    kernel_generic(w, x, out, rows, m, k);
}

/// AVX2 + FMA: eight weights per step are widened in registers (zero-extend, shift) and fed
/// straight into the FMAs; a single input row uses four accumulators to hide FMA latency.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2(
    w: &[half::bf16],
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    m: usize,
    k: usize,
) {
    use std::arch::x86_64::*;
    debug_assert!(m <= MAX_STREAMED_ROWS && w.len() >= rows * k && x.len() >= m * k);
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        let v = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
    }
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
    let k8 = k / 8 * 8;
    let k32 = k / 32 * 32;
    let xp = x.as_ptr();
    for r in 0..rows {
        let wr = w.as_ptr().add(r * k) as *const u16;
        if m == 1 {
            let (mut a0, mut a1, mut a2, mut a3) = (
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
            );
            let mut c = 0;
            while c < k32 {
                a0 = _mm256_fmadd_ps(load8(wr.add(c)), _mm256_loadu_ps(xp.add(c)), a0);
                a1 = _mm256_fmadd_ps(load8(wr.add(c + 8)), _mm256_loadu_ps(xp.add(c + 8)), a1);
                a2 = _mm256_fmadd_ps(load8(wr.add(c + 16)), _mm256_loadu_ps(xp.add(c + 16)), a2);
                a3 = _mm256_fmadd_ps(load8(wr.add(c + 24)), _mm256_loadu_ps(xp.add(c + 24)), a3);
                c += 32;
            }
            while c < k8 {
                a0 = _mm256_fmadd_ps(load8(wr.add(c)), _mm256_loadu_ps(xp.add(c)), a0);
                c += 8;
            }
            let mut sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            for c in k8..k {
                sum += f32::from_bits((*wr.add(c) as u32) << 16) * *xp.add(c);
            }
            out[r] = sum;
        } else {
            let mut acc = [_mm256_setzero_ps(); MAX_STREAMED_ROWS];
            let mut c = 0;
            while c < k8 {
                let wv = load8(wr.add(c));
                for (i, a) in acc.iter_mut().enumerate().take(m) {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(i * k + c)), *a);
                }
                c += 8;
            }
            for (i, a) in acc.iter().enumerate().take(m) {
                let mut sum = hsum(*a);
                for c in k8..k {
                    sum += f32::from_bits((*wr.add(c) as u32) << 16) * *xp.add(i * k + c);
                }
                out[r * m + i] = sum;
            }
        }
    }
}

#[inline(always)]
fn kernel_generic(w: &[half::bf16], x: &[f32], out: &mut [f32], rows: usize, m: usize, k: usize) {
    let mut row = vec![0f32; k];
    for r in 0..rows {
        widen(&w[r * k..(r + 1) * k], &mut row);
        for i in 0..m {
            out[r * m + i] = dot(&row, &x[i * k..(i + 1) * k]);
        }
    }
}

/// bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
#[inline(always)]
fn widen(src: &[half::bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// Dot product with 8 independent accumulators (lets the compiler keep SIMD lanes busy).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 8;
    let mut acc = [0f32; L];
    let chunks = a.len() / L;
    for c in 0..chunks {
        let (pa, pb) = (&a[c * L..c * L + L], &b[c * L..c * L + L]);
        for l in 0..L {
            acc[l] = pa[l].mul_add(pb[l], acc[l]);
        }
    }
    let mut sum = 0f32;
    for i in chunks * L..a.len() {
        sum = a[i].mul_add(b[i], sum);
    }
    acc.iter().sum::<f32>() + sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_f32_matmul_for_every_row_count() {
        let dev = Device::Cpu;
        for (m, k, n) in [
            (1, 37, 5),
            (2, 64, 33),
            (8, 100, 17),
            (9, 16, 3),
            (3, 1024, 70),
        ] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let want = x
                .matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap())
                .unwrap();
            let got = try_matmul_t(&x, &w).unwrap().expect("fast path");
            assert_eq!(got.dims(), want.dims());
            let err = (got - &want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let scale = (k as f32).sqrt();
            assert!(err < 1e-5 * scale * 4.0, "m {m} k {k} n {n}: {err}");
        }
    }

    #[test]
    fn other_dtypes_fall_back() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 4), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
        assert!(try_matmul_t(&x, &w).unwrap().is_none());
    }
}
