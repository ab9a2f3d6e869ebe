//! `x · wᵀ` for a few f32 activation rows against dense weights stored in bf16 (the checkpoints'
//! own values) or f32: the `bf16-weights` and `f32` precisions of `speak`
//! (docs/performance.md §2).
//!
//! A decode step is a matrix-vector product: every weight is read once per step and used for
//! one to a few rows, so the kernels are bound by memory traffic and only have to keep up with
//! it. Paths, picked at run time ([`Isa`]):
//!
//! - **AVX-512 F** / **AVX2 + FMA**: weights widened in registers (bf16 → f32 is a 16-bit shift),
//!   fused multiply-adds with several accumulators, so the products and sums are f32 ones.
//! - **scalar**: the reference the tests hold the others to.
//!
//! AVX-512 BF16's `vdpbf16ps` is not used. It multiplies bf16 pairs, so exact f32 products need
//! the activation split into three bf16 parts: three dot instructions and three activation reads
//! per weight vector, against one shift and one FMA per activation row here; measured, that path
//! was slower per frame and fell further behind with batched rows (docs/performance.md §2.3).
//!
//! Output rows are split across the rayon pool in chunks of [`ROWS_PER_TASK`]; each task owns
//! its rows' outputs.

use rayon::prelude::*;

use super::isa::Isa;

/// Output rows per parallel task.
pub const ROWS_PER_TASK: usize = 16;
/// Activation rows handled per pass over a weight row.
const ROW_GROUP: usize = 4;

/// Dense weights of one matrix, row-major `(n, k)`.
#[derive(Debug, Clone, Copy)]
pub enum Dense<'a> {
    /// Raw bf16 bits.
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

impl Dense<'_> {
    fn len(&self) -> usize {
        match self {
            Dense::Bf16(w) => w.len(),
            Dense::F32(w) => w.len(),
        }
    }
}

/// Activation rows for a product: `x (m, k)`, f32.
#[derive(Debug, Clone)]
pub struct Rows<'a> {
    x: &'a [f32],
    m: usize,
    k: usize,
}

impl<'a> Rows<'a> {
    /// `x (m, k)`.
    pub fn new(x: &'a [f32], m: usize, k: usize) -> Self {
        assert_eq!(x.len(), m * k, "{} activations for ({m}, {k})", x.len());
        Self { x, m, k }
    }
}

/// `out (m, n) = x (m, k) · wᵀ` for `w (n, k)` on the best path of this CPU.
pub fn matmul_t(w: Dense<'_>, n: usize, x: &Rows<'_>, out: &mut [f32]) {
    matmul_t_with(Isa::detected(), w, n, x, out)
}

/// [`matmul_t`] on the path `isa` selects (capped at what the CPU has).
pub fn matmul_t_with(isa: Isa, w: Dense<'_>, n: usize, x: &Rows<'_>, out: &mut [f32]) {
    let d = Isa::detected();
    let isa = Isa {
        avx2: isa.avx2 && d.avx2,
        avx_vnni: false,
        avx512: isa.avx512 && d.avx512,
        avx512_vnni: false,
    };
    let (m, k) = (x.m, x.k);
    assert_eq!(w.len(), n * k, "{} weights for ({n}, {k})", w.len());
    assert_eq!(
        out.len(),
        m * n,
        "output of {} values for ({m}, {n})",
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    // `[row of w][row of x]`, split by weight rows.
    let mut tmp = vec![0f32; n * m];
    tmp.par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(task, chunk)| {
            let r0 = task * ROWS_PER_TASK;
            let rows_here = chunk.len() / m;
            let mut j = 0;
            while j < rows_here {
                // Two weight rows at a time where the task has two left: each activation
                // vector loaded serves both.
                let paired = j + 1 < rows_here;
                let (o0, rest) = chunk[j * m..].split_at_mut(m);
                let mut o1 = paired.then(|| &mut rest[..m]);
                let mut i0 = 0;
                while i0 < m {
                    let g = (m - i0).min(ROW_GROUP);
                    let o0 = &mut o0[i0..i0 + g];
                    let o1 = o1.as_deref_mut().map(|o| &mut o[i0..i0 + g]);
                    match g {
                        1 => row_or_pair::<1>(isa, w, r0 + j, x, i0, o0, o1),
                        2 => row_or_pair::<2>(isa, w, r0 + j, x, i0, o0, o1),
                        3 => row_or_pair::<3>(isa, w, r0 + j, x, i0, o0, o1),
                        _ => row_or_pair::<4>(isa, w, r0 + j, x, i0, o0, o1),
                    }
                    i0 += g;
                }
                j += if paired { 2 } else { 1 };
            }
        });
    if m == 1 {
        out.copy_from_slice(&tmp);
    } else {
        for (r, col) in tmp.chunks_exact(m).enumerate() {
            for (i, v) in col.iter().enumerate() {
                out[i * n + r] = *v;
            }
        }
    }
}

/// Weight row `r` against activation rows `i0..i0 + G` into `out0`, and with `out1` row `r + 1`
/// too, both in one pass where the CPU allows. Every output is summed exactly as [`row`] sums
/// it (the same accumulators in the same order), so whether a row is paired, which depends on
/// the matrix's row count and the task split, never changes a result.
#[inline]
#[allow(clippy::too_many_arguments)]
fn row_or_pair<const G: usize>(
    isa: Isa,
    w: Dense<'_>,
    r: usize,
    x: &Rows<'_>,
    i0: usize,
    out0: &mut [f32],
    out1: Option<&mut [f32]>,
) {
    let Some(out1) = out1 else {
        return row::<G>(isa, w, r, x, i0, out0);
    };
    #[cfg(target_arch = "x86_64")]
    if let (Dense::Bf16(wb), true) = (w, isa.avx512) {
        let k = x.k;
        // SAFETY: the CPU has the features (capped by detection in the caller); the kernel
        // reads only within the slices, whose lengths it asserts.
        unsafe {
            x86::bf16_rows2_avx512::<G>(
                &wb[r * k..(r + 1) * k],
                &wb[(r + 1) * k..(r + 2) * k],
                &x.x[i0 * k..(i0 + G) * k],
                out0,
                out1,
            )
        };
        return;
    }
    row::<G>(isa, w, r, x, i0, out0);
    row::<G>(isa, w, r + 1, x, i0, out1);
}

/// Weight row `r` against activation rows `i0..i0 + G`.
#[inline]
fn row<const G: usize>(isa: Isa, w: Dense<'_>, r: usize, x: &Rows<'_>, i0: usize, out: &mut [f32]) {
    let k = x.k;
    let xs = &x.x[i0 * k..(i0 + G) * k];
    match w {
        Dense::Bf16(w) => {
            let wr = &w[r * k..(r + 1) * k];
            #[cfg(target_arch = "x86_64")]
            {
                if isa.avx512 {
                    // SAFETY: the CPU has the features (capped by detection in the caller); the
                    // kernel reads only within the slices, whose lengths it asserts.
                    unsafe { x86::bf16_row_avx512::<G>(wr, xs, out) };
                    return;
                }
                if isa.avx2 {
                    // SAFETY: as above.
                    unsafe { x86::bf16_row_avx2::<G>(wr, xs, out) };
                    return;
                }
            }
            let _ = isa;
            for (g, o) in out.iter_mut().enumerate() {
                *o = wr
                    .iter()
                    .zip(&xs[g * k..(g + 1) * k])
                    .fold(0f32, |a, (w, x)| {
                        f32::from_bits((*w as u32) << 16).mul_add(*x, a)
                    });
            }
        }
        Dense::F32(w) => {
            let wr = &w[r * k..(r + 1) * k];
            #[cfg(target_arch = "x86_64")]
            {
                if isa.avx512 {
                    // SAFETY: as above.
                    unsafe { x86::f32_row_avx512::<G>(wr, xs, out) };
                    return;
                }
                if isa.avx2 {
                    // SAFETY: as above.
                    unsafe { x86::f32_row_avx2::<G>(wr, xs, out) };
                    return;
                }
            }
            for (g, o) in out.iter_mut().enumerate() {
                *o = wr
                    .iter()
                    .zip(&xs[g * k..(g + 1) * k])
                    .fold(0f32, |a, (w, x)| w.mul_add(*x, a));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// How far ahead of the weights being multiplied they are requested (bytes). A product
    /// reads its weights once, row after row (`ROWS_PER_TASK` rows of a task lie one after the
    /// other); with several activation rows each weight vector takes longer to use, the
    /// out-of-order window holds fewer of the stream's loads, and the stream slows unless it is
    /// asked for ahead (docs/performance.md §10).
    const PREFETCH_BYTES: usize = 4096;

    /// Requests the cache line `PREFETCH_BYTES` after `at`.
    #[inline(always)]
    fn prefetch_ahead(at: *const u8) {
        // SAFETY: a prefetch is a hint; it reads nothing Rust can observe and never faults,
        // whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES) as *const i8) };
    }

    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL; `xs.len() == G · w.len()`, `out.len() == G`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn bf16_row_avx512<const G: usize>(w: &[u16], xs: &[f32], out: &mut [f32]) {
        let k = w.len();
        assert!(xs.len() == G * k && out.len() == G);
        let k16 = k / 16 * 16;
        let mut acc = [[_mm512_setzero_ps(); G]; 2];
        let mut c = 0;
        let mut parity = 0;
        while c < k16 {
            if parity == 0 {
                prefetch_ahead(w.as_ptr().wrapping_add(c) as *const u8);
            }
            // SAFETY: c + 16 <= k; 16 bf16 = 32 bytes.
            let v = unsafe { _mm256_loadu_si256(w.as_ptr().add(c) as *const __m256i) };
            let wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
            for (g, a) in acc[parity].iter_mut().enumerate() {
                // SAFETY: row g of xs covers g·k..g·k + k and c + 16 <= k.
                let xv = unsafe { _mm512_loadu_ps(xs.as_ptr().add(g * k + c)) };
                *a = _mm512_fmadd_ps(wv, xv, *a);
            }
            c += 16;
            parity ^= 1;
        }
        for (g, o) in out.iter_mut().enumerate() {
            let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][g], acc[1][g]));
            for c in k16..k {
                s += f32::from_bits((w[c] as u32) << 16) * xs[g * k + c];
            }
            *o = s;
        }
    }

    /// [`bf16_row_avx512`] for two weight rows at once (each activation load feeds both), with
    /// each row's accumulators, order and final sum exactly as there.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL; `w1.len() == w0.len()`, `xs.len() == G · w0.len()`,
    /// `out0.len() == out1.len() == G`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn bf16_rows2_avx512<const G: usize>(
        w0: &[u16],
        w1: &[u16],
        xs: &[f32],
        out0: &mut [f32],
        out1: &mut [f32],
    ) {
        let k = w0.len();
        assert!(w1.len() == k && xs.len() == G * k && out0.len() == G && out1.len() == G);
        let k16 = k / 16 * 16;
        let widen =
            |v: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
        let mut acc0 = [[_mm512_setzero_ps(); G]; 2];
        let mut acc1 = [[_mm512_setzero_ps(); G]; 2];
        let mut c = 0;
        let mut parity = 0;
        while c < k16 {
            if parity == 0 {
                prefetch_ahead(w0.as_ptr().wrapping_add(c) as *const u8);
                prefetch_ahead(w1.as_ptr().wrapping_add(c) as *const u8);
            }
            // SAFETY: c + 16 <= k; 16 bf16 = 32 bytes of each row.
            let v0 = unsafe { _mm256_loadu_si256(w0.as_ptr().add(c) as *const __m256i) };
            // SAFETY: as above.
            let v1 = unsafe { _mm256_loadu_si256(w1.as_ptr().add(c) as *const __m256i) };
            let (wv0, wv1) = (widen(v0), widen(v1));
            for g in 0..G {
                // SAFETY: row g of xs covers g·k..g·k + k and c + 16 <= k.
                let xv = unsafe { _mm512_loadu_ps(xs.as_ptr().add(g * k + c)) };
                acc0[parity][g] = _mm512_fmadd_ps(wv0, xv, acc0[parity][g]);
                acc1[parity][g] = _mm512_fmadd_ps(wv1, xv, acc1[parity][g]);
            }
            c += 16;
            parity ^= 1;
        }
        for (w, acc, out) in [(w0, &acc0, out0), (w1, &acc1, out1)] {
            for (g, o) in out.iter_mut().enumerate() {
                let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][g], acc[1][g]));
                for c in k16..k {
                    s += f32::from_bits((w[c] as u32) << 16) * xs[g * k + c];
                }
                *o = s;
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2 + FMA; `xs.len() == G · w.len()`, `out.len() == G`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn bf16_row_avx2<const G: usize>(w: &[u16], xs: &[f32], out: &mut [f32]) {
        let k = w.len();
        assert!(xs.len() == G * k && out.len() == G);
        let k8 = k / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); G]; 2];
        let mut c = 0;
        let mut parity = 0;
        while c < k8 {
            // SAFETY: c + 8 <= k; 8 bf16 = 16 bytes.
            let v = unsafe { _mm_loadu_si128(w.as_ptr().add(c) as *const __m128i) };
            let wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
            for (g, a) in acc[parity].iter_mut().enumerate() {
                // SAFETY: row g of xs covers g·k..g·k + k and c + 8 <= k.
                let xv = unsafe { _mm256_loadu_ps(xs.as_ptr().add(g * k + c)) };
                *a = _mm256_fmadd_ps(wv, xv, *a);
            }
            c += 8;
            parity ^= 1;
        }
        for (g, o) in out.iter_mut().enumerate() {
            let mut s = hsum256(_mm256_add_ps(acc[0][g], acc[1][g]));
            for c in k8..k {
                s += f32::from_bits((w[c] as u32) << 16) * xs[g * k + c];
            }
            *o = s;
        }
    }

    /// # Safety
    /// The CPU must have AVX-512 F; `xs.len() == G · w.len()`, `out.len() == G`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn f32_row_avx512<const G: usize>(w: &[f32], xs: &[f32], out: &mut [f32]) {
        let k = w.len();
        assert!(xs.len() == G * k && out.len() == G);
        let k16 = k / 16 * 16;
        let mut acc = [[_mm512_setzero_ps(); G]; 2];
        let mut c = 0;
        let mut parity = 0;
        while c < k16 {
            // SAFETY: c + 16 <= k.
            let wv = unsafe { _mm512_loadu_ps(w.as_ptr().add(c)) };
            for (g, a) in acc[parity].iter_mut().enumerate() {
                // SAFETY: row g of xs covers g·k..g·k + k and c + 16 <= k.
                let xv = unsafe { _mm512_loadu_ps(xs.as_ptr().add(g * k + c)) };
                *a = _mm512_fmadd_ps(wv, xv, *a);
            }
            c += 16;
            parity ^= 1;
        }
        for (g, o) in out.iter_mut().enumerate() {
            let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][g], acc[1][g]));
            for c in k16..k {
                s += w[c] * xs[g * k + c];
            }
            *o = s;
        }
    }

    /// # Safety
    /// The CPU must have AVX2 + FMA; `xs.len() == G · w.len()`, `out.len() == G`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn f32_row_avx2<const G: usize>(w: &[f32], xs: &[f32], out: &mut [f32]) {
        let k = w.len();
        assert!(xs.len() == G * k && out.len() == G);
        let k8 = k / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); G]; 2];
        let mut c = 0;
        let mut parity = 0;
        while c < k8 {
            // SAFETY: c + 8 <= k.
            let wv = unsafe { _mm256_loadu_ps(w.as_ptr().add(c)) };
            for (g, a) in acc[parity].iter_mut().enumerate() {
                // SAFETY: row g of xs covers g·k..g·k + k and c + 8 <= k.
                let xv = unsafe { _mm256_loadu_ps(xs.as_ptr().add(g * k + c)) };
                *a = _mm256_fmadd_ps(wv, xv, *a);
            }
            c += 8;
            parity ^= 1;
        }
        for (g, o) in out.iter_mut().enumerate() {
            let mut s = hsum256(_mm256_add_ps(acc[0][g], acc[1][g]));
            for c in k8..k {
                s += w[c] * xs[g * k + c];
            }
            *o = s;
        }
    }

    #[target_feature(enable = "avx2")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::super::grad::tests::vals as values;
    use super::*;

    #[test]
    fn paired_weight_rows_give_the_bits_of_single_ones() {
        // Rows paired or left single (odd counts, task boundaries) must sum identically: a
        // served stream's samples equal `speak`'s whatever the batch (docs/serving.md §3).
        for (m, n, k) in [(1, 5, 48), (4, 33, 1040), (3, 18, 32), (6, 2, 23)] {
            let bits: Vec<u16> = values(n * k, 7 + k as u64)
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let x = values(m * k, 3 + m as u64);
            for isa in Isa::testable() {
                let rows = Rows::new(&x, m, k);
                let mut whole = vec![f32::NAN; m * n];
                matmul_t_with(isa, Dense::Bf16(&bits), n, &rows, &mut whole);
                for r in 0..n {
                    let mut alone = vec![f32::NAN; m];
                    let w = Dense::Bf16(&bits[r * k..(r + 1) * k]);
                    matmul_t_with(isa, w, 1, &rows, &mut alone);
                    for i in 0..m {
                        assert_eq!(
                            whole[i * n + r].to_bits(),
                            alone[i].to_bits(),
                            "{isa:?} m {m} n {n} k {k}: weight row {r}, activation row {i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_path_matches_f64_products() {
        for (m, n, k) in [(1, 3, 32), (2, 17, 64), (5, 4, 96), (3, 2, 40), (1, 1, 7)] {
            let wf = values(n * k, 11 + n as u64);
            let bits: Vec<u16> = wf
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let wb: Vec<f32> = bits
                .iter()
                .map(|b| f32::from_bits((*b as u32) << 16))
                .collect();
            let x = values(m * k, 5 + m as u64);
            let exact = |w: &[f32]| -> Vec<f64> {
                let mut o = vec![0f64; m * n];
                for i in 0..m {
                    for r in 0..n {
                        o[i * n + r] = (0..k)
                            .map(|c| w[r * k + c] as f64 * x[i * k + c] as f64)
                            .sum();
                    }
                }
                o
            };
            let (want_b, want_f) = (exact(&wb), exact(&wf));
            for isa in Isa::testable() {
                let rows = Rows::new(&x, m, k);
                for (w, want) in [(Dense::Bf16(&bits), &want_b), (Dense::F32(&wf), &want_f)] {
                    let mut got = vec![f32::NAN; m * n];
                    matmul_t_with(isa, w, n, &rows, &mut got);
                    for (g, r) in got.iter().zip(want) {
                        // f32 rounding of a k-term sum of values below 1.
                        assert!(
                            (*g as f64 - r).abs() <= 2e-6 * k as f64,
                            "{isa:?} {w:?} m {m} n {n} k {k}: {g} vs {r}"
                        );
                    }
                }
            }
        }
    }
}
