//! `x · wᵀ` for a few f32 activation rows against dense weights stored in bf16 (the checkpoints'
//! own values) or f32: the `bf16-weights` and `f32` precisions of `speak`
//! (docs/performance.md §2).
//!
//! A decode step is a matrix-vector product: every weight is read once per step and used for
//! one to a few rows, so the kernels are bound by memory traffic and only have to keep up with
//! it. Paths, picked at run time ([`Isa`]):
//!
//! - **AVX-512 BF16** (`vdpbf16ps`, bf16 weights): the instruction multiplies bf16 pairs exactly
//!   and accumulates in f32. The f32 activations are split into three bf16 parts
//!   `x = hi + mid + lo` (each the bf16 rounding of what the previous parts leave; together the
//!   24 bits of an f32 significand), so the products are the f32 products and the arithmetic
//!   stays f32 — only the order of the sums changes, as with any other kernel (denormal parts
//!   are flushed to zero, far below f32 resolution of the sums).
//! - **AVX-512 F** / **AVX2 + FMA**: weights widened in registers (bf16 → f32 is a 16-bit shift),
//!   fused multiply-adds with several accumulators.
//! - **scalar**: the reference the tests hold the others to.
//!
//! Output rows are split across the rayon pool in chunks of [`ROWS_PER_TASK`]; each task owns
//! its rows' outputs.

use std::sync::OnceLock;

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

/// Activation rows prepared for a product: the f32 values, and for the `vdpbf16ps` path their
/// three bf16 parts. Prepare once, use for every matrix that reads the same input.
#[derive(Debug, Clone)]
pub struct Rows<'a> {
    x: &'a [f32],
    m: usize,
    k: usize,
    /// `[part][row][k]` bf16 bits, made when a bf16 product on the AVX-512 BF16 path first
    /// needs them.
    parts: OnceLock<Vec<u16>>,
}

impl<'a> Rows<'a> {
    /// `x (m, k)`.
    pub fn new(x: &'a [f32], m: usize, k: usize) -> Self {
        assert_eq!(x.len(), m * k, "{} activations for ({m}, {k})", x.len());
        Self {
            x,
            m,
            k,
            parts: OnceLock::new(),
        }
    }

    fn parts(&self) -> &[u16] {
        self.parts.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if Isa::detected().avx512_bf16 {
                    // SAFETY: the CPU has AVX-512 F/BW/VL + BF16 (checked above).
                    return unsafe { x86::split3_avx512(self.x) };
                }
            }
            split3(self.x)
        })
    }
}

/// `x = hi + mid + lo` in bf16 parts, `[part][i]`.
fn split3(x: &[f32]) -> Vec<u16> {
    let n = x.len();
    let mut out = vec![0u16; 3 * n];
    for (i, v) in x.iter().enumerate() {
        let mut rest = *v;
        for p in 0..3 {
            let b = half::bf16::from_f32(rest);
            out[p * n + i] = b.to_bits();
            rest -= b.to_f32();
        }
    }
    out
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
        avx512_bf16: isa.avx512_bf16 && d.avx512_bf16 && x.k.is_multiple_of(32),
    };
    let (m, k) = (x.m, x.k);
    if isa.avx512_bf16 && matches!(w, Dense::Bf16(_)) {
        // Split once, before the parallel part reads it.
        x.parts();
    }
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
            for (j, o) in chunk.chunks_exact_mut(m).enumerate() {
                let r = r0 + j;
                let mut i0 = 0;
                while i0 < m {
                    let g = (m - i0).min(ROW_GROUP);
                    let o = &mut o[i0..i0 + g];
                    match g {
                        1 => row::<1>(isa, w, r, x, i0, o),
                        2 => row::<2>(isa, w, r, x, i0, o),
                        3 => row::<3>(isa, w, r, x, i0, o),
                        _ => row::<4>(isa, w, r, x, i0, o),
                    }
                    i0 += g;
                }
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
                if isa.avx512_bf16 {
                    let parts = x.parts();
                    let n = x.m * k;
                    let p = [
                        &parts[i0 * k..(i0 + G) * k],
                        &parts[n + i0 * k..n + (i0 + G) * k],
                        &parts[2 * n + i0 * k..2 * n + (i0 + G) * k],
                    ];
                    // SAFETY: the CPU has the features (capped by detection in the caller); the
                    // kernel reads only within the slices, whose lengths it asserts.
                    unsafe { x86::bf16_row_dpbf16::<G>(wr, p, out) };
                    return;
                }
                if isa.avx512 {
                    // SAFETY: as above.
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

    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL + BF16. `w.len()` = k, a multiple of 32; each part
    /// holds `G · k` values; `out.len() == G`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn bf16_row_dpbf16<const G: usize>(
        w: &[u16],
        parts: [&[u16]; 3],
        out: &mut [f32],
    ) {
        let k = w.len();
        assert!(k.is_multiple_of(32) && out.len() == G);
        assert!(parts.iter().all(|p| p.len() == G * k));
        // [part][row] accumulators: 3·G independent chains.
        let mut acc = [[_mm512_setzero_ps(); G]; 3];
        let mut c = 0;
        while c < k {
            // SAFETY: c + 32 <= k = w.len(); likewise for every row of every part below.
            let wv: __m512bh =
                unsafe { _mm512_loadu_si512(w.as_ptr().add(c) as *const _) }.into_bh();
            for (p, part) in parts.iter().enumerate() {
                for (g, a) in acc[p].iter_mut().enumerate() {
                    // SAFETY: row g of the part covers g·k..g·k + k.
                    let xv =
                        unsafe { _mm512_loadu_si512(part.as_ptr().add(g * k + c) as *const _) };
                    *a = _mm512_dpbf16_ps(*a, wv, xv.into_bh());
                }
            }
            c += 32;
        }
        for (g, o) in out.iter_mut().enumerate() {
            // hi + mid + lo, each summed over the row.
            *o = _mm512_reduce_add_ps(acc[0][g])
                + (_mm512_reduce_add_ps(acc[1][g]) + _mm512_reduce_add_ps(acc[2][g]));
        }
    }

    /// [`super::split3`] with `vcvtneps2bf16` (round to nearest even, as `half` does; inputs
    /// below the smallest normal f32 count as zero, far below the sums' resolution).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL + BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn split3_avx512(x: &[f32]) -> Vec<u16> {
        let n = x.len();
        let mut out = vec![0u16; 3 * n];
        let n16 = n / 16 * 16;
        let mut i = 0;
        while i < n16 {
            // SAFETY: i + 16 <= n.
            let mut rest = unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) };
            for p in 0..3 {
                let b = _mm512_cvtneps_pbh(rest);
                let bits: __m256i = b.into_i();
                let back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
                rest = _mm512_sub_ps(rest, back);
                // SAFETY: p·n + i + 16 <= 3·n.
                unsafe {
                    _mm256_storeu_si256(out.as_mut_ptr().add(p * n + i) as *mut __m256i, bits)
                };
            }
            i += 16;
        }
        for (j, v) in x.iter().enumerate().skip(n16) {
            let mut rest = *v;
            for p in 0..3 {
                let b = half::bf16::from_f32(rest);
                out[p * n + j] = b.to_bits();
                rest -= b.to_f32();
            }
        }
        out
    }

    /// `__m256bh` → `__m256i` (same bits).
    trait IntoI {
        fn into_i(self) -> __m256i;
    }
    impl IntoI for __m256bh {
        #[inline(always)]
        fn into_i(self) -> __m256i {
            // SAFETY: both are 32-byte plain vector types; every bit pattern is valid in each.
            unsafe { std::mem::transmute::<__m256bh, __m256i>(self) }
        }
    }

    /// `__m512i` → `__m512bh` (same bits).
    trait IntoBh {
        fn into_bh(self) -> __m512bh;
    }
    impl IntoBh for __m512i {
        #[inline(always)]
        fn into_bh(self) -> __m512bh {
            // SAFETY: both are 64-byte plain vector types; every bit pattern is valid in each.
            unsafe { std::mem::transmute::<__m512i, __m512bh>(self) }
        }
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
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(3);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
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

    #[test]
    fn vector_split_matches_the_scalar_one() {
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::detected().avx512_bf16 {
                let x = values(37, 9);
                // SAFETY: the CPU has the features (checked above).
                let v = unsafe { x86::split3_avx512(&x) };
                assert_eq!(v, split3(&x));
            }
        }
    }

    #[test]
    fn split_parts_sum_to_the_value() {
        let x = [1.0f32 / 3.0, -7.123_456_7e3, 1e-30, 0.0];
        let p = split3(&x);
        for (i, v) in x.iter().enumerate() {
            let s: f64 = (0..3)
                .map(|j| f32::from_bits((p[j * x.len() + i] as u32) << 16) as f64)
                .sum();
            assert!(
                (s - *v as f64).abs() <= (*v as f64).abs() * 1e-7,
                "{v}: {s}"
            );
        }
    }
}
