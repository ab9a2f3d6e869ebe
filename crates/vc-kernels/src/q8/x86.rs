//! The x86-64 kernels of `q8` (docs/performance.md §2): one tile against a few activation rows
//! with AVX-512 VNNI (alone and two tiles at once), AVX-VNNI and AVX2, and the vectorised
//! quantization of bf16 weight rows. Each is an `unsafe fn` compiled for its features, called
//! only through the safe dispatch of [`super`] once the CPU is known to have them (`Isa`) and
//! the extents are checked. Every intrinsic of `q8` and the `unsafe` it needs is here, built
//! only on x86-64; the format and the scalar reference are in [`super`].

use super::{Q8Rows, BLOCK, TILE, TILE_BLOCK_BYTES};
use std::arch::x86_64::*;

/// How far ahead of the block being multiplied its weights are requested, in blocks of a
/// tile (512 bytes each). The weights stream from memory once per product; with several
/// activation rows each block takes longer to multiply, the out-of-order window then spans
/// fewer blocks, and fewer of the stream's loads are in flight. Asking for the weights
/// 4 KB ahead keeps the stream going whatever the rows (docs/performance.md §10.1 has the
/// frames before and after).
const PREFETCH_BLOCKS: usize = 8;

/// Requests the block `PREFETCH_BLOCKS` after the one at `block` into the cache. Tiles lie
/// one after the other, so past a tile's end this asks for the start of the next tile: for
/// a single tile or the second of a pair, the tile the task multiplies next; for the first
/// of a pair, its partner, which is already streaming (those requests are wasted). Past the
/// matrix's end it asks for nothing that matters (a prefetch never faults).
#[inline(always)]
fn prefetch_ahead(block: *const u8) {
    let ahead = block.wrapping_add(PREFETCH_BLOCKS * TILE_BLOCK_BYTES);
    for line in 0..TILE_BLOCK_BYTES / 64 {
        // SAFETY: a prefetch is a hint; it reads nothing Rust can observe and never faults,
        // whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line * 64) as *const i8) };
    }
}

/// [`super::quantize_weight_row`] of a bf16 row, vectorised: the same values (clamp to ±127,
/// round to nearest even, `+ 128`), 32 weights per step.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL. `w.len() == q.len() == 32 · d.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn quantize_bf16_row_avx512(w: &[u16], q: &mut [u8], d: &mut [u16]) {
    assert!(w.len() == q.len() && w.len() == BLOCK * d.len());
    let widen = |v: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    let offset = _mm_set1_epi8(-128);
    for (b, db) in d.iter_mut().enumerate() {
        let src = w[b * BLOCK..(b + 1) * BLOCK].as_ptr();
        // SAFETY: 32 u16 = 64 bytes of the block's slice.
        let v = unsafe { _mm512_loadu_si512(src as *const __m512i) };
        let f0 = widen(_mm512_castsi512_si256(v));
        let f1 = widen(_mm512_extracti64x4_epi64::<1>(v));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1)));
        let bits = super::f32_to_f16(amax / 127.0);
        let scale = super::f16_to_f32(bits);
        let inv = _mm512_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
        // Round to nearest even (the default rounding mode), as `round_q`.
        let q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(f0, inv), lo), hi));
        let q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(f1, inv), lo), hi));
        let b0 = _mm_xor_si128(_mm512_cvtepi32_epi8(q0), offset);
        let b1 = _mm_xor_si128(_mm512_cvtepi32_epi8(q1), offset);
        let dst = q[b * BLOCK..(b + 1) * BLOCK].as_mut_ptr();
        // SAFETY: 2 × 16 bytes = the block's 32-byte slice.
        unsafe {
            _mm_storeu_si128(dst as *mut __m128i, b0);
            _mm_storeu_si128(dst.add(16) as *mut __m128i, b1);
        }
        *db = bits;
    }
}

/// # Safety
/// The CPU must have AVX-512 F/BW/VL + VNNI; extents as checked in [`super::tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tile_avx512_vnni<const M: usize>(
    qs: &[u8],
    sc: &[u16],
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    let kb = x.kp / BLOCK;
    let mut facc = [_mm512_setzero_ps(); M];
    for b in 0..kb {
        let wp = qs[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES].as_ptr();
        prefetch_ahead(wp);
        let mut ws = [_mm512_setzero_si512(); 8];
        for (s, w) in ws.iter_mut().enumerate() {
            // SAFETY: step s of this block is bytes s·64..s·64+64 of the 512-byte slice.
            *w = unsafe { _mm512_loadu_si512(wp.add(s * 64) as *const __m512i) };
        }
        let scp = sc[b * TILE..(b + 1) * TILE].as_ptr();
        // SAFETY: 16 f16 values = 32 bytes of the slice above.
        let scales = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(scp as *const __m256i) });
        for (mi, f) in facc.iter_mut().enumerate() {
            let blk = (row0 + mi) * kb + b;
            let xw = &x.words[blk * 8..blk * 8 + 8];
            let mut acc = _mm512_set1_epi32(-x.corr[blk]);
            for s in 0..8 {
                acc = _mm512_dpbusd_epi32(acc, ws[s], _mm512_set1_epi32(xw[s]));
            }
            let scale = _mm512_mul_ps(scales, _mm512_set1_ps(x.d[blk]));
            *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, *f);
        }
    }
    for (mi, f) in facc.iter().enumerate() {
        let o = &mut out[mi * TILE..(mi + 1) * TILE];
        // SAFETY: 16 f32 values fit the 16-value slice.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *f) };
    }
}

/// [`tile_avx512_vnni`] for two tiles at once: each activation broadcast feeds both tiles'
/// `vpdpbusd`, and each tile's outputs are summed exactly as there.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL + VNNI; extents as checked in [`super::tile_or_pair`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tile_pair_avx512_vnni<const M: usize>(
    (qs0, sc0): (&[u8], &[u16]),
    (qs1, sc1): (&[u8], &[u16]),
    x: &Q8Rows,
    row0: usize,
    out0: &mut [f32],
    out1: &mut [f32],
) {
    let kb = x.kp / BLOCK;
    let mut facc0 = [_mm512_setzero_ps(); M];
    let mut facc1 = [_mm512_setzero_ps(); M];
    for b in 0..kb {
        let wp0 = qs0[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES].as_ptr();
        let wp1 = qs1[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES].as_ptr();
        prefetch_ahead(wp0);
        prefetch_ahead(wp1);
        let mut ws0 = [_mm512_setzero_si512(); 8];
        let mut ws1 = [_mm512_setzero_si512(); 8];
        for s in 0..8 {
            // SAFETY: step s of this block is bytes s·64..s·64+64 of each 512-byte slice.
            ws0[s] = unsafe { _mm512_loadu_si512(wp0.add(s * 64) as *const __m512i) };
            // SAFETY: as above.
            ws1[s] = unsafe { _mm512_loadu_si512(wp1.add(s * 64) as *const __m512i) };
        }
        let scp0 = sc0[b * TILE..(b + 1) * TILE].as_ptr();
        let scp1 = sc1[b * TILE..(b + 1) * TILE].as_ptr();
        // SAFETY: 16 f16 values = 32 bytes of each slice above.
        let scales0 = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(scp0 as *const __m256i) });
        // SAFETY: as above.
        let scales1 = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(scp1 as *const __m256i) });
        for mi in 0..M {
            let blk = (row0 + mi) * kb + b;
            let xw = &x.words[blk * 8..blk * 8 + 8];
            let start = _mm512_set1_epi32(-x.corr[blk]);
            let (mut acc0, mut acc1) = (start, start);
            for s in 0..8 {
                let xb = _mm512_set1_epi32(xw[s]);
                acc0 = _mm512_dpbusd_epi32(acc0, ws0[s], xb);
                acc1 = _mm512_dpbusd_epi32(acc1, ws1[s], xb);
            }
            let d = _mm512_set1_ps(x.d[blk]);
            facc0[mi] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(acc0),
                _mm512_mul_ps(scales0, d),
                facc0[mi],
            );
            facc1[mi] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(acc1),
                _mm512_mul_ps(scales1, d),
                facc1[mi],
            );
        }
    }
    for (facc, out) in [(&facc0, out0), (&facc1, out1)] {
        for (mi, f) in facc.iter().enumerate() {
            let o = &mut out[mi * TILE..(mi + 1) * TILE];
            // SAFETY: 16 f32 values fit the 16-value slice.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *f) };
        }
    }
}

/// # Safety
/// The CPU must have AVX2 + F16C + AVX-VNNI; extents as checked in [`super::tile`].
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn tile_avx_vnni<const M: usize>(
    qs: &[u8],
    sc: &[u16],
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    let kb = x.kp / BLOCK;
    let mut facc = [[_mm256_setzero_ps(); 2]; M];
    for b in 0..kb {
        let wp = qs[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES].as_ptr();
        let mut ws = [[_mm256_setzero_si256(); 2]; 8];
        for (s, w) in ws.iter_mut().enumerate() {
            for (h, wh) in w.iter_mut().enumerate() {
                // SAFETY: half h of step s is bytes s·64+h·32.. +32 of the 512-byte slice.
                *wh = unsafe { _mm256_loadu_si256(wp.add(s * 64 + h * 32) as *const __m256i) };
            }
        }
        let scp = sc[b * TILE..(b + 1) * TILE].as_ptr();
        // SAFETY: 2 × 8 f16 values = the 32 bytes of the slice above.
        let scales = unsafe {
            [
                _mm256_cvtph_ps(_mm_loadu_si128(scp as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(scp.add(8) as *const __m128i)),
            ]
        };
        for (mi, f) in facc.iter_mut().enumerate() {
            let blk = (row0 + mi) * kb + b;
            let xw = &x.words[blk * 8..blk * 8 + 8];
            let d = _mm256_set1_ps(x.d[blk]);
            for h in 0..2 {
                let mut acc = _mm256_set1_epi32(-x.corr[blk]);
                for s in 0..8 {
                    acc = _mm256_dpbusd_avx_epi32(acc, ws[s][h], _mm256_set1_epi32(xw[s]));
                }
                let scale = _mm256_mul_ps(scales[h], d);
                f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), scale, f[h]);
            }
        }
    }
    for (mi, f) in facc.iter().enumerate() {
        let o = &mut out[mi * TILE..(mi + 1) * TILE];
        // SAFETY: 2 × 8 f32 values fit the 16-value slice.
        unsafe {
            _mm256_storeu_ps(o.as_mut_ptr(), f[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), f[1]);
        }
    }
}

/// # Safety
/// The CPU must have AVX2 + FMA + F16C; extents as checked in [`super::tile`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_avx2<const M: usize>(
    qs: &[u8],
    sc: &[u16],
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    let kb = x.kp / BLOCK;
    let offset = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let mut facc = [[_mm256_setzero_ps(); 2]; M];
    for b in 0..kb {
        let wp = qs[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES].as_ptr();
        let mut ws = [[_mm256_setzero_si256(); 2]; 8];
        for (s, w) in ws.iter_mut().enumerate() {
            for (h, wh) in w.iter_mut().enumerate() {
                // SAFETY: half h of step s is bytes s·64+h·32.. +32 of the 512-byte slice.
                let v = unsafe { _mm256_loadu_si256(wp.add(s * 64 + h * 32) as *const __m256i) };
                // Back to signed weights: q = (q + 128) ^ 0x80.
                *wh = _mm256_xor_si256(v, offset);
            }
        }
        let scp = sc[b * TILE..(b + 1) * TILE].as_ptr();
        // SAFETY: 2 × 8 f16 values = the 32 bytes of the slice above.
        let scales = unsafe {
            [
                _mm256_cvtph_ps(_mm_loadu_si128(scp as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(scp.add(8) as *const __m128i)),
            ]
        };
        for (mi, f) in facc.iter_mut().enumerate() {
            let blk = (row0 + mi) * kb + b;
            let xw = &x.words[blk * 8..blk * 8 + 8];
            let d = _mm256_set1_ps(x.d[blk]);
            for h in 0..2 {
                let mut acc = _mm256_setzero_si256();
                for s in 0..8 {
                    let xs = _mm256_set1_epi32(xw[s]);
                    // |x| · (±w): both within ±127, so the pair sums cannot saturate.
                    let p =
                        _mm256_maddubs_epi16(_mm256_abs_epi8(xs), _mm256_sign_epi8(ws[s][h], xs));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
                }
                let scale = _mm256_mul_ps(scales[h], d);
                f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), scale, f[h]);
            }
        }
    }
    for (mi, f) in facc.iter().enumerate() {
        let o = &mut out[mi * TILE..(mi + 1) * TILE];
        // SAFETY: 2 × 8 f32 values fit the 16-value slice.
        unsafe {
            _mm256_storeu_ps(o.as_mut_ptr(), f[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), f[1]);
        }
    }
}
