//! 4-bit block-quantized matrices and their products with a few activation rows: the `q4`
//! precision of `speak` (docs/performance.md §2.6). Half the bytes of [`super::q8`] per weight,
//! for CPUs where a frame is bound by the weights it reads.
//!
//! **Format** ([`Q4Kind::Symmetric`], the layout of ggml's Q4_0, tiled like `q8`): every run of
//! [`BLOCK`] = 32 consecutive weights of a row shares one f16 scale `d`, and each weight is the
//! level `q = round(w / d) + 8`, clamped to `0..=15`, standing for `d · (q − 8)`: 4.5 bits per
//! weight. ggml takes `d = v / −8`, `v` the block's weight of largest magnitude (level 0, exact);
//! here that is the first of a few scales tried, each a little smaller (clamping `v`), then
//! least-squares refits, and the block keeps the one with the least squared error
//! ([`symmetric_scale`]). [`Q4Kind::Offset`] (ggml's Q4_1) is the other candidate measured: a
//! scale and a minimum per block, `w ≈ d·q + min`, 5 bits per weight; `examples/q4_formats`
//! compares the two, and the precision uses the symmetric one (docs/performance.md §2.6 has the
//! table).
//!
//! Rows are interleaved in tiles of [`TILE`] = 16 as in `q8`; a block of a tile is 256 bytes,
//! four loads of 64: byte `4·r + j` of load `l` holds row `r`'s column `4l + j` in its low
//! nibble and column `16 + 4l + j` in its high one. One 512-bit load and two masks (one after a
//! shift) give two of `q8`'s steps for 16 rows, each fed to `vpdpbusd` against 4 activation
//! bytes: unsigned levels times signed activations, the instruction's own operand types.
//!
//! **Activations** are `q8`'s rows ([`Q8Rows`]), quantized once per call and shared by every
//! product of the same input; their `128 · Σ q_x` gives the `8 · Σ q_x` that takes the levels'
//! offset back (and, for the offset kind, the `min · Σ x` term).
//!
//! **Paths**, picked at run time ([`Isa`]) as in `q8`: AVX-512 VNNI (alone and two tiles at
//! once), AVX-VNNI, AVX2 (`vpmaddubsw` of the levels and activation bytes, then `vpmaddwd`:
//! a 16-bit lane sums 16 products of at most 15 · 127, never past `i16::MAX`, so nothing
//! saturates), and a scalar loop, the reference the tests hold the others to (identical integer
//! sums; only the float accumulation over blocks may round differently).
//!
//! The x86-64 kernels are in `x86`; this module keeps the format, the quantization, the dispatch
//! and the scalar reference. The parallel loop over tiles is `q8`'s.

use rayon::prelude::*;

use super::isa::Isa;
use super::q8::{check_len, f16_to_f32, f32_to_f16, for_each_tile, Q8Error, Q8Rows, BLOCK, TILE};

#[cfg(target_arch = "x86_64")]
mod x86;

/// Bytes of one block of one tile: 32 weights × 16 rows, two weights per byte.
const TILE_BLOCK_BYTES: usize = BLOCK * TILE / 2;

/// How a block's 16 levels stand for weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q4Kind {
    /// `d · (q − 8)`, one f16 scale per block: 4.5 bits per weight (ggml's Q4_0).
    Symmetric,
    /// `d · q + min`, an f16 scale and an f16 minimum per block: 5 bits per weight (ggml's
    /// Q4_1).
    Offset,
}

/// A matrix `(n, k)` (PyTorch layout: one row per output) in the tiled 4-bit format above.
#[derive(Clone)]
pub struct Q4Matrix {
    n: usize,
    k: usize,
    /// `k` rounded up to whole blocks.
    kp: usize,
    kind: Q4Kind,
    /// Two levels per byte, `[tile][block][load][row in tile][4]` (see the module's docs).
    qs: Vec<u8>,
    /// f16 bits of the scales, `[tile][block][row in tile]`; 0 for the padding rows.
    scales: Vec<u16>,
    /// f16 bits of the minimums, laid out as the scales ([`Q4Kind::Offset`]; empty otherwise).
    mins: Vec<u16>,
}

impl std::fmt::Debug for Q4Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q4Matrix({:?}, {} x {})", self.kind, self.n, self.k)
    }
}

impl Q4Matrix {
    /// Quantizes a row-major f32 matrix `(n, k)`.
    pub fn from_f32(w: &[f32], n: usize, k: usize, kind: Q4Kind) -> Result<Self, Q8Error> {
        check_len(w.len(), n, k)?;
        Ok(Self::build(n, k, kind, Source::F32(w)))
    }

    /// Quantizes a row-major bf16 matrix `(n, k)` given as raw bf16 bits (the checkpoint's
    /// values; bf16 → f32 is exact, so this is [`Self::from_f32`] of the widened values).
    pub fn from_bf16(w: &[u16], n: usize, k: usize, kind: Q4Kind) -> Result<Self, Q8Error> {
        check_len(w.len(), n, k)?;
        Ok(Self::build(n, k, kind, Source::Bf16(w)))
    }

    /// Rows, columns.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    pub fn kind(&self) -> Q4Kind {
        self.kind
    }

    /// Bytes held (levels, scales and minimums, padding included).
    pub fn bytes(&self) -> usize {
        self.qs.len() + 2 * (self.scales.len() + self.mins.len())
    }

    fn build(n: usize, k: usize, kind: Q4Kind, src: Source<'_>) -> Self {
        let kb = k.div_ceil(BLOCK);
        let kp = kb * BLOCK;
        let tiles = n.div_ceil(TILE);
        let offset = kind == Q4Kind::Offset;
        let mut qs = vec![0u8; tiles * kb * TILE_BLOCK_BYTES];
        let mut scales = vec![0u16; tiles * kb * TILE];
        let mut mins = vec![0u16; if offset { tiles * kb * TILE } else { 0 }];
        if kb > 0 {
            // Without minimums each tile gets an empty slice of them.
            let mut min_chunks: Vec<&mut [u16]> = if offset {
                mins.chunks_mut(kb * TILE).collect()
            } else {
                (0..tiles).map(|_| <&mut [u16]>::default()).collect()
            };
            qs.par_chunks_mut(kb * TILE_BLOCK_BYTES)
                .zip(scales.par_chunks_mut(kb * TILE))
                .zip(min_chunks.par_iter_mut())
                .enumerate()
                .for_each_init(
                    || {
                        (
                            vec![0f32; kp],
                            vec![0u8; kp],
                            vec![0u16; kb],
                            vec![0u16; kb],
                        )
                    },
                    |(row, q, d, mn), (t, ((qs_t, sc_t), mn_t))| {
                        let tile = TileOut {
                            qs: qs_t,
                            scales: sc_t,
                            mins: mn_t,
                        };
                        let scratch = Scratch { row, q, d, mn };
                        quantize_tile_simd(kind, src, n, k, t, scratch, tile);
                    },
                );
        }
        Self {
            n,
            k,
            kp,
            kind,
            qs,
            scales,
            mins,
        }
    }

    /// Row `r` as the f32 values the kernels compute with.
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        assert!(r < self.n, "row {r} of {}", self.n);
        let kb = self.kp / BLOCK;
        let (t, i) = (r / TILE, r % TILE);
        let mut out = vec![0f32; self.kp];
        for b in 0..kb {
            let at = (t * kb + b) * TILE + i;
            let d = f16_to_f32(self.scales[at]);
            for c in 0..BLOCK {
                let (l, j, high) = ((c % 16) / 4, c % 4, c >= 16);
                let byte = self.qs[(t * kb + b) * TILE_BLOCK_BYTES + l * TILE * 4 + i * 4 + j];
                let q = if high { byte >> 4 } else { byte & 15 } as f32;
                out[b * BLOCK + c] = match self.kind {
                    Q4Kind::Symmetric => (q - 8.0) * d,
                    Q4Kind::Offset => q * d + f16_to_f32(self.mins[at]),
                };
            }
        }
        out.truncate(self.k);
        out
    }

    /// `out (m, n) = x (m, k) · selfᵀ` on the best path this CPU has.
    pub fn matmul_t(&self, x: &Q8Rows, out: &mut [f32]) {
        self.matmul_t_with(Isa::detected(), x, out)
    }

    /// [`Self::matmul_t`] on the path `isa` selects (for tests and comparisons; what `isa`
    /// claims beyond [`Isa::detected`] is ignored).
    pub fn matmul_t_with(&self, isa: Isa, x: &Q8Rows, out: &mut [f32]) {
        let d = Isa::detected();
        let isa = Isa {
            avx2: isa.avx2 && d.avx2,
            avx_vnni: isa.avx_vnni && d.avx_vnni,
            avx512: isa.avx512 && d.avx512,
            avx512_vnni: isa.avx512_vnni && d.avx512_vnni,
        };
        assert_eq!(
            x.k, self.k,
            "activation width {} vs weight width {}",
            x.k, self.k
        );
        let (m, n) = (x.m, self.n);
        assert_eq!(
            out.len(),
            m * n,
            "output of {} values for ({m}, {n})",
            out.len()
        );
        let kb = self.kp / BLOCK;
        if m == 0 || n == 0 {
            return;
        }
        if kb == 0 {
            out.fill(0.0);
            return;
        }
        let per_tile = if self.kind == Q4Kind::Offset {
            kb * TILE
        } else {
            0
        };
        let tile = |t: usize| Tile {
            qs: &self.qs[t * kb * TILE_BLOCK_BYTES..(t + 1) * kb * TILE_BLOCK_BYTES],
            scales: &self.scales[t * kb * TILE..(t + 1) * kb * TILE],
            mins: &self.mins[t * per_tile..(t + 1) * per_tile],
        };
        let offset = self.kind == Q4Kind::Offset;
        for_each_tile(m, n, out, |t, paired, row0, g, o0, o1| {
            let second = paired.then(|| tile(t + 1)).zip(o1);
            match (g, offset) {
                (1, false) => tile_or_pair::<1, false>(isa, tile(t), second, x, row0, o0),
                (2, false) => tile_or_pair::<2, false>(isa, tile(t), second, x, row0, o0),
                (3, false) => tile_or_pair::<3, false>(isa, tile(t), second, x, row0, o0),
                (_, false) => tile_or_pair::<4, false>(isa, tile(t), second, x, row0, o0),
                (1, true) => tile_or_pair::<1, true>(isa, tile(t), second, x, row0, o0),
                (2, true) => tile_or_pair::<2, true>(isa, tile(t), second, x, row0, o0),
                (3, true) => tile_or_pair::<3, true>(isa, tile(t), second, x, row0, o0),
                (_, true) => tile_or_pair::<4, true>(isa, tile(t), second, x, row0, o0),
            }
        });
    }
}

/// The values a matrix is quantized from, row-major.
#[derive(Clone, Copy)]
enum Source<'a> {
    F32(&'a [f32]),
    /// Raw bf16 bits.
    Bf16(&'a [u16]),
}

/// One tile's share of a quantized matrix: its level bytes, scales and minimums.
struct TileOut<'a> {
    qs: &'a mut [u8],
    scales: &'a mut [u16],
    mins: &'a mut [u16],
}

/// A thread's buffers for one row: its f32 values, levels, scales and minimums.
struct Scratch<'a> {
    row: &'a mut [f32],
    q: &'a mut [u8],
    d: &'a mut [u16],
    mn: &'a mut [u16],
}

/// [`quantize_tile`] compiled with AVX2 where the CPU has it. A named function rather than
/// `with_simd`'s closure: a closure this large is not inlined into the feature-enabled caller,
/// and then the scale search runs in SSE2 (profiled: 5× slower loads).
fn quantize_tile_simd(
    kind: Q4Kind,
    src: Source<'_>,
    n: usize,
    k: usize,
    t: usize,
    scratch: Scratch<'_>,
    out: TileOut<'_>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::detected().avx2 {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn avx2(
                kind: Q4Kind,
                src: Source<'_>,
                n: usize,
                k: usize,
                t: usize,
                scratch: Scratch<'_>,
                out: TileOut<'_>,
            ) {
                quantize_tile(kind, src, n, k, t, scratch, out)
            }
            // SAFETY: the CPU has the enabled features (checked above).
            return unsafe { avx2(kind, src, n, k, t, scratch, out) };
        }
    }
    quantize_tile(kind, src, n, k, t, scratch, out)
}

/// Quantizes the rows of tile `t` and interleaves their levels into the tile's bytes.
#[inline(always)]
fn quantize_tile(
    kind: Q4Kind,
    src: Source<'_>,
    n: usize,
    k: usize,
    t: usize,
    scratch: Scratch<'_>,
    out: TileOut<'_>,
) {
    let Scratch { row, q, d, mn } = scratch;
    let TileOut {
        qs: qs_t,
        scales: sc_t,
        mins: mn_t,
    } = out;
    let kb = d.len();
    let offset = kind == Q4Kind::Offset;
    for i in 0..TILE.min(n - t * TILE) {
        let r = t * TILE + i;
        match src {
            Source::Bf16(w) => {
                for (o, b) in row.iter_mut().zip(&w[r * k..(r + 1) * k]) {
                    *o = f32::from_bits((*b as u32) << 16);
                }
            }
            Source::F32(w) => row[..k].copy_from_slice(&w[r * k..(r + 1) * k]),
        }
        quantize_row(kind, row, q, d, mn);
        for b in 0..kb {
            sc_t[b * TILE + i] = d[b];
            if offset {
                mn_t[b * TILE + i] = mn[b];
            }
            let lv = &q[b * BLOCK..(b + 1) * BLOCK];
            let blk = &mut qs_t[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES];
            for l in 0..4 {
                for j in 0..4 {
                    blk[l * TILE * 4 + i * 4 + j] = lv[4 * l + j] | (lv[16 + 4 * l + j] << 4);
                }
            }
        }
    }
}

/// `v` rounded to the nearest integer (ties to even) and clamped to `lo..=hi`, without a libm
/// call (as `q8`'s `round_q`), so the quantization loops vectorise.
#[inline(always)]
fn round_level(v: f32, lo: f32, hi: f32) -> i32 {
    rounded(v, lo, hi) as i32
}

/// [`round_level`] as a float.
#[inline(always)]
fn rounded(v: f32, lo: f32, hi: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    // max/min rather than clamp: they vectorise without branches.
    (v.max(lo).min(hi) + MAGIC) - MAGIC
}

/// One weight row (`k` rounded up to whole blocks, zero-padded): its levels `0..=15`, one per
/// byte, and per block the f16 scale and, for [`Q4Kind::Offset`], the f16 minimum.
#[inline(always)]
fn quantize_row(kind: Q4Kind, row: &[f32], q: &mut [u8], d: &mut [u16], mins: &mut [u16]) {
    for (b, (blk, qb)) in row
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        match kind {
            Q4Kind::Symmetric => {
                let blk: &[f32; BLOCK] = blk.try_into().expect("a whole block");
                let bits = symmetric_scale(blk);
                let scale = f16_to_f32(bits);
                let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                for (o, v) in qb.iter_mut().zip(blk) {
                    *o = (round_level(v * inv, -8.0, 7.0) + 8) as u8;
                }
                d[b] = bits;
            }
            Q4Kind::Offset => {
                let (lo, hi) = blk
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
                let (bits, min_bits) = (f32_to_f16((hi - lo) / 15.0), f32_to_f16(lo));
                let (scale, min) = (f16_to_f32(bits), f16_to_f32(min_bits));
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                for (o, v) in qb.iter_mut().zip(blk) {
                    *o = round_level((v - min) * inv, 0.0, 15.0) as u8;
                }
                d[b] = bits;
                mins[b] = min_bits;
            }
        }
    }
}

/// The symmetric search: scales `peak / −(8 + t·GRID_STEP)` for `t < GRID`, then up to `REFITS`
/// least-squares refits of the best (docs/performance.md §2.6 has what it gains and costs:
/// finer steps gained more than a wider range or scales with the peak at level 15).
const GRID: usize = 9;
const GRID_STEP: f32 = 0.25;
const REFITS: usize = 2;
/// Scales of the grid tried side by side, one per lane of a 256-bit vector.
const LANES: usize = 8;

/// The f16 scale of a symmetric block: of the scales that put the signed weight of largest
/// magnitude at level 0 (`peak / −8`, ggml's) or beyond it, clamped, and of least-squares
/// refits of the best (the scale that fits its levels best), the one that leaves the least
/// squared error, so that an outlier costs the block's other weights less resolution. The
/// search runs in f32; the format keeps the winner's f16 rounding.
#[inline(always)]
fn symmetric_scale(blk: &[f32; BLOCK]) -> u16 {
    let peak = signed_peak(blk);
    let sq = dot8(blk, blk);
    // The grid's first LANES scales in one pass over the block, one scale per vector lane: no
    // sums across lanes and no dependence of one scale on the last (the pass per scale, with
    // its two horizontal sums in a chain, made q4 loads 5× slower than q8's).
    let mut scale = [0f32; LANES];
    let mut inv = [0f32; LANES];
    for t in 0..LANES {
        scale[t] = peak / -(8.0 + t as f32 * GRID_STEP);
        inv[t] = if scale[t] != 0.0 { 1.0 / scale[t] } else { 0.0 };
    }
    let (wq, qq) = grid_sums(blk, &inv);
    let mut best = (f32::INFINITY, 0f32, 0f32, 0f32);
    for t in 0..LANES {
        let (d, w, q) = (scale[t], wq[0][t] + wq[1][t], qq[0][t] + qq[1][t]);
        let e = sq - 2.0 * d * w + d * d * q;
        if e < best.0 {
            best = (e, d, w, q);
        }
    }
    for t in LANES..GRID {
        let d = peak / -(8.0 + t as f32 * GRID_STEP);
        let (e, wq, qq) = error_at(blk, sq, d);
        if e < best.0 {
            best = (e, d, wq, qq);
        }
    }
    for _ in 0..REFITS {
        if best.3 == 0.0 {
            break;
        }
        let d = best.2 / best.3;
        let (e, wq, qq) = error_at(blk, sq, d);
        if e >= best.0 {
            break;
        }
        best = (e, d, wq, qq);
    }
    f32_to_f16(best.1)
}

/// `(Σ w·q, Σ q²)` of a block at each of [`LANES`] scales (given as their inverses), in two sets
/// of sums (even and odd weights: half the chain of dependent adds); AVX2 where the CPU has it
/// (`x86::grid_sums_avx2`, the same bits: the compiler left this loop in scalar code with
/// spills), else this loop.
#[inline(always)]
fn grid_sums(blk: &[f32; BLOCK], inv: &[f32; LANES]) -> ([[f32; LANES]; 2], [[f32; LANES]; 2]) {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::detected().avx2 {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { x86::grid_sums_avx2(blk, inv) };
        }
    }
    grid_sums_scalar(blk, inv)
}

/// [`grid_sums`] without vectors: the reference the AVX2 pass gives the bits of.
#[inline(always)]
fn grid_sums_scalar(
    blk: &[f32; BLOCK],
    inv: &[f32; LANES],
) -> ([[f32; LANES]; 2], [[f32; LANES]; 2]) {
    let (mut wq, mut qq) = ([[0f32; LANES]; 2], [[0f32; LANES]; 2]);
    for (i, v) in blk.iter().enumerate() {
        for t in 0..LANES {
            let q = rounded(v * inv[t], -8.0, 7.0);
            wq[i % 2][t] += v * q;
            qq[i % 2][t] += q * q;
        }
    }
    (wq, qq)
}

/// The block's weight of largest magnitude, with its sign (the larger side where the most
/// positive and the most negative weights are equally large): its largest and smallest values
/// in 8 lanes, so that no comparison branches per weight.
#[inline(always)]
fn signed_peak(blk: &[f32; BLOCK]) -> f32 {
    let (mut hi, mut lo) = ([f32::MIN; 8], [f32::MAX; 8]);
    for i in 0..BLOCK / 8 {
        for l in 0..8 {
            hi[l] = hi[l].max(blk[i * 8 + l]);
            lo[l] = lo[l].min(blk[i * 8 + l]);
        }
    }
    let hi = hi.iter().fold(f32::MIN, |a, b| a.max(*b));
    let lo = lo.iter().fold(f32::MAX, |a, b| a.min(*b));
    if hi >= -lo {
        hi
    } else {
        lo
    }
}

/// `Σ a·b` over a block's 32 positions, in 8 lanes (a fixed trip count: vectorised).
#[inline(always)]
fn dot8(a: &[f32; BLOCK], b: &[f32; BLOCK]) -> f32 {
    let mut acc = [0f32; 8];
    for i in 0..BLOCK / 8 {
        for l in 0..8 {
            acc[l] += a[i * 8 + l] * b[i * 8 + l];
        }
    }
    acc.iter().sum()
}

/// The squared error of a block (whose `Σ w²` is `sq`) at scale `d`, and its [`level_sums`].
/// Functions, not closures or `array::map`, all the way down: those may be left out of line,
/// and then they are compiled without the caller's vector features.
#[inline(always)]
fn error_at(blk: &[f32; BLOCK], sq: f32, d: f32) -> (f32, f32, f32) {
    let (wq, qq) = level_sums(blk, d);
    (sq - 2.0 * d * wq + d * d * qq, wq, qq)
}

/// `(Σ w·q, Σ q²)` of a block with the signed levels `q ∈ −8..=7` that scale `d` gives its
/// weights: its squared error at `d` is `Σ w² − 2d·Σ w·q + d²·Σ q²`, and `Σ w·q / Σ q²` the
/// scale that fits those levels best.
#[inline(always)]
fn level_sums(blk: &[f32; BLOCK], d: f32) -> (f32, f32) {
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0f32; BLOCK];
    for (o, v) in q.iter_mut().zip(blk) {
        *o = rounded(v * inv, -8.0, 7.0);
    }
    (dot8(blk, &q), dot8(&q, &q))
}

/// The weights of one tile: its bytes, scales and minimums (empty for the symmetric kind).
#[derive(Clone, Copy)]
struct Tile<'a> {
    qs: &'a [u8],
    scales: &'a [u16],
    mins: &'a [u16],
}

/// One tile against rows `row0..row0 + M` of `x` into `out` (`[M][TILE]`), and with `second`
/// another tile into its own output, in one pass where the CPU allows. Every output is summed
/// exactly as [`tile`] sums it, so whether a tile is paired never changes a result.
#[inline]
fn tile_or_pair<const M: usize, const OFFSET: bool>(
    isa: Isa,
    first: Tile<'_>,
    second: Option<(Tile<'_>, &mut [f32])>,
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    let Some((w1, out1)) = second else {
        return tile::<M, OFFSET>(isa, first, x, row0, out);
    };
    #[cfg(target_arch = "x86_64")]
    if isa.avx512_vnni {
        assert!(fits::<M, OFFSET>(first, x, row0, out) && fits::<M, OFFSET>(w1, x, row0, out1));
        // SAFETY: the CPU has the features (`isa` never claims more than detected), and the
        // extents were checked above.
        unsafe { x86::tiles_avx512_vnni::<M, 2, OFFSET>([first, w1], x, row0, [out, out1]) };
        return;
    }
    tile::<M, OFFSET>(isa, first, x, row0, out);
    tile::<M, OFFSET>(isa, w1, x, row0, out1);
}

/// Whether a tile, rows `row0..row0 + M` of `x` and `out` have the extents the kernels read and
/// write.
fn fits<const M: usize, const OFFSET: bool>(
    w: Tile<'_>,
    x: &Q8Rows,
    row0: usize,
    out: &[f32],
) -> bool {
    let kb = x.kp / BLOCK;
    w.qs.len() == kb * TILE_BLOCK_BYTES
        && w.scales.len() == kb * TILE
        && w.mins.len() == if OFFSET { kb * TILE } else { 0 }
        && out.len() == M * TILE
        && (row0 + M) * kb * 8 <= x.words.len()
        && (row0 + M) * kb <= x.d.len()
        && (row0 + M) * kb <= x.corr.len()
}

/// One tile against rows `row0..row0 + M` of `x`; `out` is `[M][TILE]`.
#[inline]
fn tile<const M: usize, const OFFSET: bool>(
    isa: Isa,
    w: Tile<'_>,
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    assert!(fits::<M, OFFSET>(w, x, row0, out));
    #[cfg(target_arch = "x86_64")]
    {
        if isa.avx512_vnni {
            // SAFETY: the CPU has the features (`isa` never claims more than detected), and the
            // extents were checked above.
            unsafe { x86::tiles_avx512_vnni::<M, 1, OFFSET>([w], x, row0, [out]) };
            return;
        }
        if isa.avx_vnni {
            // SAFETY: as above.
            unsafe { x86::tile_avx_vnni::<M, OFFSET>(w, x, row0, out) };
            return;
        }
        if isa.avx2 {
            // SAFETY: as above.
            unsafe { x86::tile_avx2::<M, OFFSET>(w, x, row0, out) };
            return;
        }
    }
    let _ = isa;
    tile_scalar::<M, OFFSET>(w, x, row0, out);
}

/// `8 · Σ q_x` of block `blk` of `x`, the symmetric levels' offset (`corr` is `128 · Σ q_x`),
/// and `Σ q_x` itself.
#[inline(always)]
fn level_offset(x: &Q8Rows, blk: usize) -> i32 {
    x.corr[blk] / 16
}

#[inline(always)]
fn activation_sum(x: &Q8Rows, blk: usize) -> i32 {
    x.corr[blk] / 128
}

/// The reference: integer block sums, then `Σ_blocks sum · d_w · d_x (+ min · d_x · Σ q_x)` in
/// block order.
fn tile_scalar<const M: usize, const OFFSET: bool>(
    w: Tile<'_>,
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    let kb = x.kp / BLOCK;
    for mi in 0..M {
        let m = row0 + mi;
        for i in 0..TILE {
            let mut acc = 0f32;
            for b in 0..kb {
                let blk = m * kb + b;
                let mut sum = if OFFSET { 0 } else { -level_offset(x, blk) };
                for l in 0..4 {
                    let lo = x.words[blk * 8 + l].to_le_bytes();
                    let hi = x.words[blk * 8 + 4 + l].to_le_bytes();
                    let off = b * TILE_BLOCK_BYTES + l * TILE * 4 + i * 4;
                    for j in 0..4 {
                        let byte = w.qs[off + j];
                        sum += (byte & 15) as i32 * lo[j] as i8 as i32
                            + (byte >> 4) as i32 * hi[j] as i8 as i32;
                    }
                }
                let dx = x.d[blk];
                acc += sum as f32 * (f16_to_f32(w.scales[b * TILE + i]) * dx);
                if OFFSET {
                    acc += f16_to_f32(w.mins[b * TILE + i]) * (dx * activation_sum(x, blk) as f32);
                }
            }
            out[mi * TILE + i] = acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::grad::tests::vals as values;
    use super::super::q8::ROW_GROUP;
    use super::*;

    const KINDS: [Q4Kind; 2] = [Q4Kind::Symmetric, Q4Kind::Offset];

    /// f64 products of the dequantized operands: what every path must reproduce up to the f32
    /// rounding of the block accumulation.
    fn reference(w: &Q4Matrix, x: &Q8Rows) -> Vec<f64> {
        let (n, _) = w.dims();
        let (m, _) = x.dims();
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            let xr = x.dequantize_row(i);
            for r in 0..n {
                let wr = w.dequantize_row(r);
                out[i * n + r] = wr.iter().zip(&xr).map(|(a, b)| *a as f64 * *b as f64).sum();
            }
        }
        out
    }

    /// Every path against the dequantized product, within the f32 rounding of `kb` block terms
    /// (each a product of three roundings) relative to the sum of their magnitudes.
    fn check_paths(w: &Q4Matrix, x: &Q8Rows, what: &str) {
        let (n, k) = w.dims();
        let m = x.dims().0;
        let want = reference(w, x);
        // The magnitude the float sums run over: Σ |w| |x| per output.
        let mut scale = vec![0f64; m * n];
        for i in 0..m {
            let xr = x.dequantize_row(i);
            for r in 0..n {
                let wr = w.dequantize_row(r);
                scale[i * n + r] = wr
                    .iter()
                    .zip(&xr)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
            }
        }
        let kb = k.div_ceil(BLOCK) as f64;
        for isa in Isa::testable() {
            let mut got = vec![f32::NAN; m * n];
            w.matmul_t_with(isa, x, &mut got);
            for ((g, r), s) in got.iter().zip(&want).zip(&scale) {
                let tol = (kb + 4.0) * f32::EPSILON as f64 * s + 1e-30;
                assert!(
                    (*g as f64 - r).abs() <= tol,
                    "{what} {isa:?} m {m} n {n} k {k}: {g} vs {r} (tolerance {tol})"
                );
            }
        }
    }

    #[test]
    fn every_path_matches_the_dequantized_product() {
        // Sizes: partial tiles, k not a multiple of the block, several blocks, and every row
        // count from 1 to a full group and one more.
        let mut shapes = vec![
            (2, 16, 64),
            (3, 21, 96),
            (1, 4, 40),
            (2, 3, 8),
            (1, 33, 200),
        ];
        shapes.extend((1..=ROW_GROUP + 1).map(|m| (m, 37, 72)));
        if cfg!(miri) {
            // A partial block and tile, a full row group and one more: the slow interpreter.
            shapes = vec![(ROW_GROUP + 1, 17, 40)];
        }
        for kind in KINDS {
            for &(m, n, k) in &shapes {
                let wf = values(n * k, (n * k) as u64);
                let w = Q4Matrix::from_f32(&wf, n, k, kind).unwrap();
                let xf = values(m * k, 7 + m as u64);
                let x = Q8Rows::quantize(&xf, m, k).unwrap();
                check_paths(&w, &x, &format!("{kind:?}"));
            }
        }
    }

    #[test]
    fn paths_give_the_scalar_integer_sums() {
        // With every activation scale and weight scale a power of two, each block term is
        // exact in f32, so the paths must agree to the bit: their integer sums are identical.
        let (m, n, k) = (ROW_GROUP + 1, 35, 96);
        let wf: Vec<f32> = values(n * k, 5).iter().map(|v| (v * 8.0).round()).collect();
        // Each block's peak is ±8 (scale ∓1): set the first weight of every block to it.
        let wf: Vec<f32> = wf
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if i % BLOCK == 0 {
                    8.0
                } else {
                    v.clamp(-7.0, 7.0)
                }
            })
            .collect();
        let w = Q4Matrix::from_f32(&wf, n, k, Q4Kind::Symmetric).unwrap();
        // Activations whose blocks peak at 127: scale 1, levels = the values.
        let xf: Vec<f32> = values(m * k, 9)
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if i % BLOCK == 0 {
                    127.0
                } else {
                    (v * 100.0).round()
                }
            })
            .collect();
        let x = Q8Rows::quantize(&xf, m, k).unwrap();
        let mut want = vec![0f32; m * n];
        w.matmul_t_with(Isa::SCALAR, &x, &mut want);
        // Independent of the format: the product of the exact integer matrices.
        for i in 0..m {
            for r in 0..n {
                let exact: f32 = (0..k).map(|c| wf[r * k + c] * xf[i * k + c]).sum();
                assert_eq!(want[i * n + r], exact, "row {i} output {r}");
            }
        }
        for isa in Isa::testable() {
            let mut got = vec![f32::NAN; m * n];
            w.matmul_t_with(isa, &x, &mut got);
            assert_eq!(got, want, "{isa:?}");
        }
    }

    #[test]
    fn paired_tiles_give_the_bits_of_single_ones() {
        // As in `q8`: one thread, tasks of 3 and 4 tiles, so pairs and single tiles both occur.
        let one_thread = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        one_thread.install(|| {
            for kind in KINDS {
                let shapes: &[(usize, usize, usize)] = if cfg!(miri) {
                    // 9 tiles in tasks of 3: a pair and a single tile each.
                    &[(1, 144, 32)]
                } else {
                    &[(1, 144, 64), (5, 203, 96)]
                };
                for &(m, n, k) in shapes {
                    let wf = values(n * k, 3 + (n * k) as u64);
                    let w = Q4Matrix::from_f32(&wf, n, k, kind).unwrap();
                    let xf = values(m * k, 11 + m as u64);
                    let x = Q8Rows::quantize(&xf, m, k).unwrap();
                    for isa in Isa::testable() {
                        let mut whole = vec![f32::NAN; m * n];
                        w.matmul_t_with(isa, &x, &mut whole);
                        for t in 0..n.div_ceil(TILE) {
                            let rows = TILE.min(n - t * TILE);
                            let alone_w = Q4Matrix::from_f32(
                                &wf[t * TILE * k..(t * TILE + rows) * k],
                                rows,
                                k,
                                kind,
                            )
                            .unwrap();
                            let mut alone = vec![f32::NAN; m * rows];
                            alone_w.matmul_t_with(isa, &x, &mut alone);
                            for i in 0..m {
                                for r in 0..rows {
                                    assert_eq!(
                                        whole[i * n + t * TILE + r].to_bits(),
                                        alone[i * rows + r].to_bits(),
                                        "{kind:?} {isa:?} m {m} n {n} k {k}: tile {t} row {r}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        });
    }

    #[test]
    fn quantization_round_trip() {
        let (n, k) = (5, 72);
        let mut wf = values(n * k, 3);
        // An outlier, for the scale search to weigh.
        wf[40] = 9.0;
        for kind in KINDS {
            let w = Q4Matrix::from_f32(&wf, n, k, kind).unwrap();
            for r in 0..n {
                let back = w.dequantize_row(r);
                assert_eq!(back.len(), k);
                for (b, blk) in wf[r * k..(r + 1) * k].chunks(BLOCK).enumerate() {
                    // Padding columns are zeros and count in the block's range.
                    let (lo, hi) = blk
                        .iter()
                        .fold((0f32, 0f32), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
                    let amax = lo.abs().max(hi.abs());
                    let got = &back[b * BLOCK..b * BLOCK + blk.len()];
                    let errs: Vec<f32> = got.iter().zip(blk).map(|(g, v)| (g - v).abs()).collect();
                    match kind {
                        Q4Kind::Symmetric => {
                            let d = f16_to_f32(
                                w.scales[(r / TILE * k.div_ceil(BLOCK) + b) * TILE + r % TILE],
                            )
                            .abs();
                            // Weights within the levels' reach are rounded to the nearest one.
                            for (e, v) in errs.iter().zip(blk) {
                                if v.abs() <= 7.0 * d {
                                    assert!(*e <= d * 0.5 * (1.0 + 1e-6), "{e} > {d}/2 at {r},{b}");
                                }
                            }
                            // No worse than ggml's scale, peak / −8, rounded here on its own (up
                            // to the f16 rounding of the searched scale, 2^-11 relative).
                            let peak =
                                blk.iter()
                                    .fold(0f32, |p, v| if v.abs() > p.abs() { *v } else { p });
                            let d0 = half::f16::from_f32(peak / -8.0).to_f32();
                            let ggml: f32 = blk
                                .iter()
                                .map(|v| {
                                    let q = if d0 != 0.0 {
                                        (v / d0).round().clamp(-8.0, 7.0)
                                    } else {
                                        0.0
                                    };
                                    (v - q * d0).powi(2)
                                })
                                .sum();
                            let sse: f32 = errs.iter().map(|e| e * e).sum();
                            assert!(sse <= ggml * (1.0 + 2e-3), "{sse} > {ggml} at {r},{b}");
                        }
                        Q4Kind::Offset => {
                            // Half a step of (hi − lo)/15, and the f16 rounding of the scale
                            // and minimum (2^-11 relative each, times 15 levels).
                            let bound = (hi - lo) / 30.0 + amax * 16.0 / 2048.0;
                            for e in &errs {
                                assert!(*e <= bound, "{e} > {bound} at {r},{b}");
                            }
                        }
                    }
                }
            }
            // bf16 input gives the same matrix as its exact f32 values.
            let bits: Vec<u16> = wf
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let widened: Vec<f32> = bits
                .iter()
                .map(|b| f32::from_bits((*b as u32) << 16))
                .collect();
            let a = Q4Matrix::from_bf16(&bits, n, k, kind).unwrap();
            let b = Q4Matrix::from_f32(&widened, n, k, kind).unwrap();
            assert_eq!((a.qs, a.scales, a.mins), (b.qs, b.scales, b.mins));
        }
    }

    #[test]
    fn half_the_bytes_of_q8() {
        let (n, k) = (32, 256);
        let wf = values(n * k, 1);
        let q8 = super::super::q8::Q8Matrix::from_f32(&wf, n, k).unwrap();
        let sym = Q4Matrix::from_f32(&wf, n, k, Q4Kind::Symmetric).unwrap();
        let off = Q4Matrix::from_f32(&wf, n, k, Q4Kind::Offset).unwrap();
        // 4.5 and 5 bits per weight against 8.5.
        assert_eq!(sym.bytes() * 85, q8.bytes() * 45);
        assert_eq!(off.bytes() * 85, q8.bytes() * 50);
    }

    /// The scale search quantizes alike on every CPU: the AVX2 grid pass gives the scalar
    /// loop's bits, on blocks of every magnitude and with weights past the grid's reach.
    #[test]
    fn the_grid_pass_gives_the_scalar_bits() {
        #[cfg(target_arch = "x86_64")]
        if Isa::detected().avx2 {
            for seed in 0..64u64 {
                let mut blk = [0f32; BLOCK];
                let v = values(BLOCK, seed);
                let magnitude = 10f32.powi(seed as i32 % 7 - 4);
                for (o, x) in blk.iter_mut().zip(&v) {
                    *o = x * magnitude;
                }
                blk[seed as usize % BLOCK] *= 9.0;
                let peak = signed_peak(&blk);
                let mut inv = [0f32; LANES];
                for (t, o) in inv.iter_mut().enumerate() {
                    let d = peak / -(8.0 + t as f32 * GRID_STEP);
                    *o = if d != 0.0 { 1.0 / d } else { 0.0 };
                }
                // SAFETY: the CPU has AVX2 (checked above).
                let fast = unsafe { x86::grid_sums_avx2(&blk, &inv) };
                let slow = grid_sums_scalar(&blk, &inv);
                let bits = |s: ([[f32; LANES]; 2], [[f32; LANES]; 2])| {
                    [s.0, s.1]
                        .concat()
                        .concat()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(bits(fast), bits(slow), "seed {seed}");
            }
        }
    }

    #[test]
    fn zero_rows_and_bad_shapes() {
        for kind in KINDS {
            let w = Q4Matrix::from_f32(&[0.0; 64], 2, 32, kind).unwrap();
            let x = Q8Rows::quantize(&[0.5; 32], 1, 32).unwrap();
            let mut out = [1.0f32; 2];
            w.matmul_t(&x, &mut out);
            assert_eq!(out, [0.0, 0.0]);
            assert_eq!(
                Q4Matrix::from_f32(&[0.0; 39], 2, 20, kind).unwrap_err(),
                Q8Error::Len {
                    expected: 40,
                    got: 39
                }
            );
        }
    }
}
