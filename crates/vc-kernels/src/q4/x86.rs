//! The x86-64 kernels of `q4` (docs/performance.md §2.6): one tile (or, with AVX-512 VNNI, two)
//! against a few activation rows with AVX-512 VNNI, AVX-VNNI and AVX2. Each is an `unsafe fn`
//! compiled for its features, called only through the safe dispatch of [`super`] once the CPU
//! is known to have them (`Isa`) and the extents are checked. `OFFSET` selects the
//! [`super::Q4Kind::Offset`] epilogue (`+ min · d_x · Σ q_x`); otherwise the integer sums start
//! from `−8 · Σ q_x`, which takes the symmetric levels' `+8` back.

use super::{activation_sum, level_offset, Q8Rows, Tile, BLOCK, TILE, TILE_BLOCK_BYTES};
use std::arch::x86_64::*;

/// How far ahead of the block being multiplied its weights are requested, in blocks of a tile
/// (256 bytes each): 4 KB, as `q8` asks (docs/performance.md §10.1).
const PREFETCH_BLOCKS: usize = 16;

/// Requests the block `PREFETCH_BLOCKS` after the one at `block` (past a tile's end, the start
/// of the next tile; past the matrix's end nothing that matters: a prefetch never faults).
#[inline(always)]
fn prefetch_ahead(block: *const u8) {
    let ahead = block.wrapping_add(PREFETCH_BLOCKS * TILE_BLOCK_BYTES);
    for line in 0..TILE_BLOCK_BYTES / 64 {
        // SAFETY: a prefetch is a hint; it reads nothing Rust can observe and never faults,
        // whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line * 64) as *const i8) };
    }
}

/// `T` tiles (1 or 2) against rows `row0..row0 + M` of `x`: per block, 4 loads per tile give
/// the 8 steps' levels (low nibbles: steps 0–3, high nibbles: steps 4–7), each activation
/// broadcast feeds every tile's `vpdpbusd`, and each tile's outputs are summed as [`super::tile`]
/// sums them.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL + VNNI; extents as checked in [`super::tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tiles_avx512_vnni<const M: usize, const T: usize, const OFFSET: bool>(
    tiles: [Tile<'_>; T],
    x: &Q8Rows,
    row0: usize,
    outs: [&mut [f32]; T],
) {
    let kb = x.kp / BLOCK;
    let low = _mm512_set1_epi8(0x0F);
    // Per activation row, per tile.
    let mut facc = [[_mm512_setzero_ps(); T]; M];
    for b in 0..kb {
        let mut ws = [[_mm512_setzero_si512(); 8]; T];
        let mut scales = [_mm512_setzero_ps(); T];
        let mut mins = [_mm512_setzero_ps(); T];
        for (t, w) in tiles.iter().enumerate() {
            let wp = w.qs[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES].as_ptr();
            prefetch_ahead(wp);
            for l in 0..4 {
                // SAFETY: load l of this block is bytes l·64..l·64+64 of the 256-byte slice.
                let v = unsafe { _mm512_loadu_si512(wp.add(l * 64) as *const __m512i) };
                ws[t][l] = _mm512_and_si512(v, low);
                ws[t][l + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
            }
            let scp = w.scales[b * TILE..(b + 1) * TILE].as_ptr();
            // SAFETY: 16 f16 values = 32 bytes of the slice above.
            scales[t] = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(scp as *const __m256i) });
            if OFFSET {
                let mp = w.mins[b * TILE..(b + 1) * TILE].as_ptr();
                // SAFETY: as above, in the minimums (present when OFFSET, checked by `fits`).
                mins[t] = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(mp as *const __m256i) });
            }
        }
        for (mi, frow) in facc.iter_mut().enumerate() {
            let blk = (row0 + mi) * kb + b;
            let xw = &x.words[blk * 8..blk * 8 + 8];
            let start = if OFFSET {
                _mm512_setzero_si512()
            } else {
                _mm512_set1_epi32(-level_offset(x, blk))
            };
            let mut acc = [start; T];
            for (s, xs) in xw.iter().enumerate() {
                let xb = _mm512_set1_epi32(*xs);
                for t in 0..T {
                    acc[t] = _mm512_dpbusd_epi32(acc[t], ws[t][s], xb);
                }
            }
            let d = _mm512_set1_ps(x.d[blk]);
            let dsum = _mm512_set1_ps(x.d[blk] * activation_sum(x, blk) as f32);
            for (t, f) in frow.iter_mut().enumerate() {
                *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), _mm512_mul_ps(scales[t], d), *f);
                if OFFSET {
                    *f = _mm512_fmadd_ps(mins[t], dsum, *f);
                }
            }
        }
    }
    for (t, out) in outs.into_iter().enumerate() {
        for (mi, frow) in facc.iter().enumerate() {
            let o = &mut out[mi * TILE..(mi + 1) * TILE];
            // SAFETY: 16 f32 values fit the 16-value slice.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), frow[t]) };
        }
    }
}

/// The levels of half `h` (rows `8h..8h + 8`) of block `b`'s 8 steps, and its scales and
/// minimums (bounds-checked: the loads read within the slices taken here).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn half_block<const OFFSET: bool>(
    w: Tile<'_>,
    b: usize,
    h: usize,
) -> ([__m256i; 8], __m256, __m256) {
    let low = _mm256_set1_epi8(0x0F);
    let wp = w.qs[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES].as_ptr();
    if h == 0 {
        prefetch_ahead(wp);
    }
    let mut ws = [_mm256_setzero_si256(); 8];
    for l in 0..4 {
        // SAFETY: half h of load l is bytes l·64+h·32.. +32 of the 256-byte slice.
        let v = unsafe { _mm256_loadu_si256(wp.add(l * 64 + h * 32) as *const __m256i) };
        ws[l] = _mm256_and_si256(v, low);
        ws[l + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
    }
    let at = b * TILE + h * 8;
    let sp = w.scales[at..at + 8].as_ptr();
    // SAFETY: 8 f16 values = the 16 bytes of the slice above.
    let scales = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(sp as *const __m128i) });
    let mins = if OFFSET {
        let mp = w.mins[at..at + 8].as_ptr();
        // SAFETY: as above, in the minimums.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(mp as *const __m128i) })
    } else {
        _mm256_setzero_ps()
    };
    (ws, scales, mins)
}

/// # Safety
/// The CPU must have AVX2 + F16C + AVX-VNNI; extents as checked in [`super::tile`].
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn tile_avx_vnni<const M: usize, const OFFSET: bool>(
    w: Tile<'_>,
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    let kb = x.kp / BLOCK;
    let mut facc = [[_mm256_setzero_ps(); 2]; M];
    for b in 0..kb {
        for h in 0..2 {
            let (ws, scales, mins) = half_block::<OFFSET>(w, b, h);
            for (mi, f) in facc.iter_mut().enumerate() {
                let blk = (row0 + mi) * kb + b;
                let xw = &x.words[blk * 8..blk * 8 + 8];
                let mut acc = if OFFSET {
                    _mm256_setzero_si256()
                } else {
                    _mm256_set1_epi32(-level_offset(x, blk))
                };
                for (s, xs) in xw.iter().enumerate() {
                    acc = _mm256_dpbusd_avx_epi32(acc, ws[s], _mm256_set1_epi32(*xs));
                }
                let d = _mm256_set1_ps(x.d[blk]);
                f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(scales, d), f[h]);
                if OFFSET {
                    let dsum = _mm256_set1_ps(x.d[blk] * activation_sum(x, blk) as f32);
                    f[h] = _mm256_fmadd_ps(mins, dsum, f[h]);
                }
            }
        }
    }
    store_halves(&facc, out);
}

/// # Safety
/// The CPU must have AVX2 + FMA + F16C; extents as checked in [`super::tile`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_avx2<const M: usize, const OFFSET: bool>(
    w: Tile<'_>,
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    let kb = x.kp / BLOCK;
    let ones = _mm256_set1_epi16(1);
    let mut facc = [[_mm256_setzero_ps(); 2]; M];
    for b in 0..kb {
        for h in 0..2 {
            let (ws, scales, mins) = half_block::<OFFSET>(w, b, h);
            for (mi, f) in facc.iter_mut().enumerate() {
                let blk = (row0 + mi) * kb + b;
                let xw = &x.words[blk * 8..blk * 8 + 8];
                // Each 16-bit lane sums 2 products per step over 8 steps: at most
                // 16 · 15 · 127 = 30480 in magnitude, so neither `vpmaddubsw` nor the adds
                // saturate or wrap.
                let mut pairs = _mm256_setzero_si256();
                for (s, xs) in xw.iter().enumerate() {
                    let p = _mm256_maddubs_epi16(ws[s], _mm256_set1_epi32(*xs));
                    pairs = _mm256_add_epi16(pairs, p);
                }
                let mut acc = _mm256_madd_epi16(pairs, ones);
                if !OFFSET {
                    acc = _mm256_sub_epi32(acc, _mm256_set1_epi32(level_offset(x, blk)));
                }
                let d = _mm256_set1_ps(x.d[blk]);
                f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(scales, d), f[h]);
                if OFFSET {
                    let dsum = _mm256_set1_ps(x.d[blk] * activation_sum(x, blk) as f32);
                    f[h] = _mm256_fmadd_ps(mins, dsum, f[h]);
                }
            }
        }
    }
    store_halves(&facc, out);
}

/// Writes `M` rows of two 8-value halves into `out` (`[M][TILE]`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn store_halves<const M: usize>(facc: &[[__m256; 2]; M], out: &mut [f32]) {
    for (mi, f) in facc.iter().enumerate() {
        let o = &mut out[mi * TILE..(mi + 1) * TILE];
        // SAFETY: 2 × 8 f32 values fit the 16-value slice.
        unsafe {
            _mm256_storeu_ps(o.as_mut_ptr(), f[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), f[1]);
        }
    }
}

/// The symmetric scale search's grid pass ([`super::grid_sums`]) with one scale per lane of a
/// 256-bit vector: the same operations in the same order as the scalar loop (multiply, clamp,
/// round by the 1.5·2^23 trick, then separate multiplies and adds into two sets of sums), so
/// both give the same bits and a matrix quantizes alike on every CPU.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn grid_sums_avx2(
    blk: &[f32; BLOCK],
    inv: &[f32; super::LANES],
) -> ([[f32; super::LANES]; 2], [[f32; super::LANES]; 2]) {
    const MAGIC: f32 = 12_582_912.0;
    // SAFETY: `inv` holds LANES = 8 floats.
    let inv = unsafe { _mm256_loadu_ps(inv.as_ptr()) };
    let (lo, hi, magic) = (
        _mm256_set1_ps(-8.0),
        _mm256_set1_ps(7.0),
        _mm256_set1_ps(MAGIC),
    );
    // Named accumulators, not an array indexed by parity: that one lived on the stack.
    let (mut wq0, mut wq1, mut qq0, mut qq1) = (
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
    );
    let level = |v: __m256| {
        // `max` then `min` with the bound second: a NaN product gives the bound, as f32's do.
        let x = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, inv), lo), hi);
        _mm256_sub_ps(_mm256_add_ps(x, magic), magic)
    };
    for pair in blk.chunks_exact(2) {
        let (v0, v1) = (_mm256_set1_ps(pair[0]), _mm256_set1_ps(pair[1]));
        let (q0, q1) = (level(v0), level(v1));
        wq0 = _mm256_add_ps(wq0, _mm256_mul_ps(v0, q0));
        qq0 = _mm256_add_ps(qq0, _mm256_mul_ps(q0, q0));
        wq1 = _mm256_add_ps(wq1, _mm256_mul_ps(v1, q1));
        qq1 = _mm256_add_ps(qq1, _mm256_mul_ps(q1, q1));
    }
    let (wq, qq) = ([wq0, wq1], [qq0, qq1]);
    let mut out = ([[0f32; super::LANES]; 2], [[0f32; super::LANES]; 2]);
    for set in 0..2 {
        // SAFETY: each destination holds LANES = 8 floats.
        unsafe {
            _mm256_storeu_ps(out.0[set].as_mut_ptr(), wq[set]);
            _mm256_storeu_ps(out.1[set].as_mut_ptr(), qq[set]);
        }
    }
    out
}
