//! 8-bit block-quantized matrices and their products with a few activation rows: the `q8`
//! precision of `speak` (docs/performance.md §2).
//!
//! **Format** (the layout of ggml's Q8_0, re-tiled): every run of [`BLOCK`] = 32 consecutive
//! weights of a row shares one scale `d = max|w| / 127` (stored as f16) and the weights are
//! `round(w / d)` in `-127..=127`, stored as `q + 128` (unsigned). 8.5 bits per weight. Rows are
//! interleaved in tiles of [`TILE`] = 16: for each block, 8 steps of 4 columns, each step the 4
//! bytes of row 0, then of row 1, …, row 15 (64 bytes). One 512-bit load is then one step for 16
//! rows, and one `vpdpbusd` against the 4 activation bytes of that step (broadcast) adds 4
//! products into each of the 16 rows' lanes: a block of 16 rows costs 8 loads and 8 `vpdpbusd`,
//! one integer-to-float conversion and one multiply-add with the 16 rows' scales.
//!
//! Rows whose length is not a multiple of 32 are padded with zero weights (and the activations
//! with zeros), which changes no product.
//!
//! **Activations** are quantized per row when they arrive ([`Q8Rows`]): the same 32-blocks, f32
//! scales, `round(x / d)` in `-127..=127`. `vpdpbusd` multiplies unsigned by signed bytes, so the
//! weights' `+128` is taken back per block with the precomputed `128 · Σ q_x` (the accumulator
//! starts from its negative).
//!
//! **Paths**, picked at run time ([`Isa`]): AVX-512 VNNI (16 rows per instruction), AVX-VNNI
//! (the same on two 256-bit halves), AVX2 (`vpmaddubsw`/`vpmaddwd` with the sign trick: |x| times
//! ±w, exact because both factors stay within ±127), and a scalar loop, which is the reference
//! the tests hold the others to (they give identical integer sums; only the order of the float
//! accumulation over blocks differs).
//!
//! Output tiles are split across the threads of [`super::team`]; each task owns its tiles'
//! outputs.
//!
//! The activation rows' quantization is in `rows`, the x86-64 kernels (AVX-512 VNNI, AVX-VNNI,
//! AVX2, and the vectorised quantization of bf16 weights) in `x86`; this module keeps the
//! weights' format, the dispatch over the paths and the scalar reference.

use rayon::prelude::*;

use super::isa::Isa;

mod rows;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use rows::Q8Rows;

/// Weights per scale.
pub const BLOCK: usize = 32;
/// Rows interleaved per tile.
pub const TILE: usize = 16;
/// Bytes of one block of one tile: 8 steps × 16 rows × 4 bytes.
const TILE_BLOCK_BYTES: usize = BLOCK * TILE;
/// Activation rows handled per pass over a tile (registers hold their accumulators).
pub(crate) const ROW_GROUP: usize = 4;

/// A matrix `(n, k)` (PyTorch layout: one row per output) in the tiled 8-bit format above.
#[derive(Clone)]
pub struct Q8Matrix {
    n: usize,
    k: usize,
    /// `k` rounded up to whole blocks.
    kp: usize,
    /// `q + 128` per weight, `[tile][block][step][row in tile][4]`.
    qs: Vec<u8>,
    /// f16 bits of the scales, `[tile][block][row in tile]`; 0 for the padding rows.
    scales: Vec<u16>,
}

impl std::fmt::Debug for Q8Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q8Matrix({} x {})", self.n, self.k)
    }
}

/// Why a matrix or rows cannot be quantized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Q8Error {
    /// The data does not hold `n · k` values.
    Len { expected: usize, got: usize },
}

impl std::fmt::Display for Q8Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Q8Error::Len { expected, got } => {
                write!(f, "expected {expected} values, got {got}")
            }
        }
    }
}

impl std::error::Error for Q8Error {}

impl Q8Matrix {
    /// Quantizes a row-major f32 matrix `(n, k)`.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Result<Self, Q8Error> {
        check_len(w.len(), n, k)?;
        Self::build(n, k, QuantSource::F32(w))
    }

    /// Quantizes a row-major bf16 matrix `(n, k)` given as raw bf16 bits (the checkpoint's
    /// values; bf16 → f32 is exact).
    pub fn from_bf16(w: &[u16], n: usize, k: usize) -> Result<Self, Q8Error> {
        check_len(w.len(), n, k)?;
        Self::build(n, k, QuantSource::Bf16(w))
    }

    /// Rows, columns.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held (quantized weights and scales, padding included).
    pub fn bytes(&self) -> usize {
        self.qs.len() + 2 * self.scales.len()
    }

    fn build(n: usize, k: usize, src: QuantSource<'_>) -> Result<Self, Q8Error> {
        let fast_bf16 = cfg!(target_arch = "x86_64") && Isa::detected().avx512;
        let kb = k.div_ceil(BLOCK);
        let kp = kb * BLOCK;
        let tiles = n.div_ceil(TILE);
        let mut qs = vec![128u8; tiles * kb * TILE_BLOCK_BYTES];
        let mut scales = vec![0u16; tiles * kb * TILE];
        if kb > 0 {
            qs.par_chunks_mut(kb * TILE_BLOCK_BYTES)
                .zip(scales.par_chunks_mut(kb * TILE))
                .enumerate()
                .for_each_init(
                    || (vec![0f32; kp], vec![0u8; kp], vec![0u16; kb]),
                    |(row, q, d), (t, (qs_t, sc_t))| {
                        with_simd(|| {
                            for i in 0..TILE.min(n - t * TILE) {
                                let r = t * TILE + i;
                                match src {
                                    #[cfg(target_arch = "x86_64")]
                                    QuantSource::Bf16(w) if fast_bf16 && k == kp => {
                                        // SAFETY: the CPU has AVX-512 F/BW/VL (checked above);
                                        // row, bytes and scales have the lengths it asserts.
                                        unsafe {
                                            x86::quantize_bf16_row_avx512(
                                                &w[r * k..(r + 1) * k],
                                                q,
                                                d,
                                            )
                                        };
                                    }
                                    QuantSource::Bf16(w) => {
                                        for (o, b) in row.iter_mut().zip(&w[r * k..(r + 1) * k]) {
                                            *o = f32::from_bits((*b as u32) << 16);
                                        }
                                        quantize_weight_row(row, q, d);
                                    }
                                    QuantSource::F32(w) => {
                                        row[..k].copy_from_slice(&w[r * k..(r + 1) * k]);
                                        quantize_weight_row(row, q, d);
                                    }
                                }
                                let q: &[u8] = q;
                                for b in 0..kb {
                                    sc_t[b * TILE + i] = d[b];
                                    let blk =
                                        &mut qs_t[b * TILE_BLOCK_BYTES..(b + 1) * TILE_BLOCK_BYTES];
                                    for (s, c) in
                                        q[b * BLOCK..(b + 1) * BLOCK].chunks_exact(4).enumerate()
                                    {
                                        blk[s * TILE * 4 + i * 4..s * TILE * 4 + i * 4 + 4]
                                            .copy_from_slice(c);
                                    }
                                }
                            }
                        })
                    },
                );
        }
        Ok(Self {
            n,
            k,
            kp,
            qs,
            scales,
        })
    }

    /// Row `r` as the f32 values the kernels compute with (`(q) · d`).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        assert!(r < self.n, "row {r} of {}", self.n);
        let kb = self.kp / BLOCK;
        let (t, i) = (r / TILE, r % TILE);
        let mut out = vec![0f32; self.kp];
        for b in 0..kb {
            let d = f16_to_f32(self.scales[(t * kb + b) * TILE + i]);
            for c in 0..BLOCK {
                let (s, j) = (c / 4, c % 4);
                let byte = self.qs[(t * kb + b) * TILE_BLOCK_BYTES + s * TILE * 4 + i * 4 + j];
                out[b * BLOCK + c] = (byte as i32 - 128) as f32 * d;
            }
        }
        out.truncate(self.k);
        out
    }

    /// `out (m, n) = x (m, k) · selfᵀ` on the best path this CPU has.
    pub fn matmul_t(&self, x: &Q8Rows, out: &mut [f32]) {
        self.matmul_t_with(Isa::detected(), x, out)
    }

    /// [`Self::matmul_t`] on the path `isa` selects (for tests and comparisons; `isa` must not
    /// claim more than [`Isa::detected`]).
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
        let weights = |t: usize| -> TileRef<'_> {
            (
                &self.qs[t * kb * TILE_BLOCK_BYTES..(t + 1) * kb * TILE_BLOCK_BYTES],
                &self.scales[t * kb * TILE..(t + 1) * kb * TILE],
            )
        };
        for_each_tile(m, n, out, |t, paired, row0, g, o0, o1| {
            let second = paired.then(|| weights(t + 1)).zip(o1);
            match g {
                1 => tile_or_pair::<1>(isa, weights(t), second, x, row0, o0),
                2 => tile_or_pair::<2>(isa, weights(t), second, x, row0, o0),
                3 => tile_or_pair::<3>(isa, weights(t), second, x, row0, o0),
                _ => tile_or_pair::<4>(isa, weights(t), second, x, row0, o0),
            }
        });
    }
}

/// The parallel loop of a tiled product `out (m, n)` (`n` outputs in tiles of [`TILE`] rows),
/// shared by `q8` and `q4`: the tiles are split across [`super::team`], each task owns its
/// tiles' outputs, and within a task `kernel(t, paired, row0, g, out0, out1)` computes
/// activation rows `row0..row0 + g` (`g ≤` [`ROW_GROUP`]) of tile `t` into `out0`
/// (`[g][TILE]`) and, where `paired`, of tile `t + 1` into `out1`: two tiles at a time where the
/// task has two left, so that each activation broadcast feeds both.
pub(crate) fn for_each_tile(
    m: usize,
    n: usize,
    out: &mut [f32],
    kernel: impl Fn(usize, bool, usize, usize, &mut [f32], Option<&mut [f32]>) + Sync,
) {
    let tiles = n.div_ceil(TILE);
    // Per tile: `[row of x][16 outputs]`.
    let mut tmp = vec![0f32; tiles * m * TILE];
    let per_task = tiles.div_ceil(rayon::current_num_threads() * 4).max(1);
    super::team::for_each_chunk(&mut tmp, per_task * m * TILE, |task, chunk| {
        let tiles_here = chunk.len() / (m * TILE);
        let mut j = 0;
        while j < tiles_here {
            let t = task * per_task + j;
            let paired = j + 1 < tiles_here;
            let (o0, rest) = chunk[j * m * TILE..].split_at_mut(m * TILE);
            let mut o1 = paired.then(|| &mut rest[..m * TILE]);
            let mut row0 = 0;
            while row0 < m {
                let g = (m - row0).min(ROW_GROUP);
                let span = row0 * TILE..(row0 + g) * TILE;
                let second = o1.as_deref_mut().map(|o| &mut o[span.clone()]);
                kernel(t, paired, row0, g, &mut o0[span], second);
                row0 += g;
            }
            j += if paired { 2 } else { 1 };
        }
    });
    for t in 0..tiles {
        let rows = TILE.min(n - t * TILE);
        for i in 0..m {
            let src = &tmp[(t * m + i) * TILE..(t * m + i) * TILE + rows];
            out[i * n + t * TILE..i * n + t * TILE + rows].copy_from_slice(src);
        }
    }
}

/// The values a matrix is quantized from, row-major.
#[derive(Clone, Copy)]
enum QuantSource<'a> {
    F32(&'a [f32]),
    /// Raw bf16 bits.
    Bf16(&'a [u16]),
}

pub(crate) fn check_len(len: usize, n: usize, k: usize) -> Result<(), Q8Error> {
    if len != n * k {
        return Err(Q8Error::Len {
            expected: n * k,
            got: len,
        });
    }
    Ok(())
}

/// Runs `f` in a function compiled with AVX2, FMA and F16C when the CPU has them, so that the
/// quantization loops, where they are inlined into it, use wider vectors. The results are the
/// same either way: every operation is exactly rounded.
#[inline(always)]
pub(crate) fn with_simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::detected().avx2 {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn run<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU has the enabled features (checked above).
            return unsafe { run(f) };
        }
    }
    f()
}

/// `v` clamped to ±127 and rounded to the nearest integer, ties to even: adding and taking away
/// 1.5·2^23 leaves no fraction bits (exact for |v| < 2^22), without a libm call, so the loops
/// around it vectorise with plain SSE2.
#[inline(always)]
fn round_q(v: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    ((v.clamp(-127.0, 127.0) + MAGIC) - MAGIC) as i32
}

/// `max |v|` of a block, in 8 lanes (vectorisable).
#[inline(always)]
pub(crate) fn abs_max(blk: &[f32]) -> f32 {
    let mut m = [0f32; 8];
    for c in blk.chunks_exact(8) {
        for l in 0..8 {
            m[l] = m[l].max(c[l].abs());
        }
    }
    m.iter().fold(0f32, |a, b| a.max(*b))
}

/// One weight row: f16 scales `d` per block and `q + 128` bytes.
#[inline(always)]
fn quantize_weight_row(row: &[f32], q: &mut [u8], d: &mut [u16]) {
    for ((blk, qb), db) in row
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
    {
        let amax = abs_max(blk);
        let bits = f32_to_f16(amax / 127.0);
        let scale = f16_to_f32(bits);
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (o, v) in qb.iter_mut().zip(blk) {
            *o = (round_q(v * inv) + 128) as u8;
        }
        *db = bits;
    }
}

/// The weights of one tile: its bytes and scales.
type TileRef<'a> = (&'a [u8], &'a [u16]);

/// One tile against rows `row0..row0 + M` of `x` into `out` (`[M][TILE]`), and with `second`
/// another tile into its own output, both in one pass where the CPU allows. Every output is
/// summed exactly as [`tile`] sums it (integer block sums, then the scaled blocks in block
/// order), so whether a tile is paired never changes a result.
#[inline]
fn tile_or_pair<const M: usize>(
    isa: Isa,
    first: TileRef<'_>,
    second: Option<(TileRef<'_>, &mut [f32])>,
    x: &Q8Rows,
    row0: usize,
    out: &mut [f32],
) {
    let Some((w1, out1)) = second else {
        return tile::<M>(isa, first.0, first.1, x, row0, out);
    };
    #[cfg(target_arch = "x86_64")]
    if isa.avx512_vnni {
        assert!(fits::<M>(first, x, row0, out) && fits::<M>(w1, x, row0, out1));
        // SAFETY: the CPU has the features (`isa` never claims more than detected), and the
        // extents were checked above.
        unsafe { x86::tile_pair_avx512_vnni::<M>(first, w1, x, row0, out, out1) };
        return;
    }
    tile::<M>(isa, first.0, first.1, x, row0, out);
    tile::<M>(isa, w1.0, w1.1, x, row0, out1);
}

/// Whether a tile, rows `row0..row0 + M` of `x` and `out` have the extents the kernels read and
/// write.
fn fits<const M: usize>((qs, sc): TileRef<'_>, x: &Q8Rows, row0: usize, out: &[f32]) -> bool {
    let kb = x.kp / BLOCK;
    qs.len() == kb * TILE_BLOCK_BYTES
        && sc.len() == kb * TILE
        && out.len() == M * TILE
        && (row0 + M) * kb * 8 <= x.words.len()
        && (row0 + M) * kb <= x.d.len()
}

/// One tile against rows `row0..row0 + M` of `x`; `out` is `[M][TILE]`.
#[inline]
fn tile<const M: usize>(isa: Isa, qs: &[u8], sc: &[u16], x: &Q8Rows, row0: usize, out: &mut [f32]) {
    assert!(fits::<M>((qs, sc), x, row0, out));
    #[cfg(target_arch = "x86_64")]
    {
        if isa.avx512_vnni {
            // SAFETY: the CPU has the features (`isa` never claims more than detected), and the
            // extents were checked above.
            unsafe { x86::tile_avx512_vnni::<M>(qs, sc, x, row0, out) };
            return;
        }
        if isa.avx_vnni {
            // SAFETY: as above.
            unsafe { x86::tile_avx_vnni::<M>(qs, sc, x, row0, out) };
            return;
        }
        if isa.avx2 {
            // SAFETY: as above.
            unsafe { x86::tile_avx2::<M>(qs, sc, x, row0, out) };
            return;
        }
    }
    let _ = isa;
    tile_scalar::<M>(qs, sc, x, row0, out);
}

/// The reference: integer block sums, then `Σ_blocks sum · d_w · d_x` in block order.
fn tile_scalar<const M: usize>(qs: &[u8], sc: &[u16], x: &Q8Rows, row0: usize, out: &mut [f32]) {
    let kb = x.kp / BLOCK;
    for mi in 0..M {
        let m = row0 + mi;
        for i in 0..TILE {
            let mut acc = 0f32;
            for b in 0..kb {
                let mut sum = -x.corr[m * kb + b];
                for s in 0..BLOCK / 4 {
                    let xb = x.words[(m * kb + b) * 8 + s].to_le_bytes();
                    let off = b * TILE_BLOCK_BYTES + s * TILE * 4 + i * 4;
                    for j in 0..4 {
                        sum += qs[off + j] as i32 * xb[j] as i8 as i32;
                    }
                }
                acc += sum as f32 * (f16_to_f32(sc[b * TILE + i]) * x.d[m * kb + b]);
            }
            out[mi * TILE + i] = acc;
        }
    }
}

/// f32 → IEEE half (round to nearest even), as `half` does.
pub(crate) fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

#[cfg(test)]
mod tests {
    use super::super::grad::tests::vals as values;
    use super::*;

    /// f64 products of the dequantized operands: what every path must reproduce up to the f32
    /// rounding of the block accumulation.
    fn reference(w: &Q8Matrix, x: &Q8Rows) -> Vec<f64> {
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

    #[test]
    fn every_path_matches_the_dequantized_product() {
        // Sizes: a partial tile, several blocks, row groups of 1..4 and one of 4 + 1.
        for (m, n, k) in [
            (1, 5, 32),
            (2, 16, 64),
            (3, 21, 96),
            (5, 33, 64),
            (4, 16, 32),
            (2, 3, 8),
            (1, 4, 40),
        ] {
            let wf = values(n * k, (n * k) as u64);
            let w = Q8Matrix::from_f32(&wf, n, k).unwrap();
            let xf = values(m * k, 7 + m as u64);
            let x = Q8Rows::quantize(&xf, m, k).unwrap();
            let want = reference(&w, &x);
            for isa in Isa::testable() {
                let mut got = vec![f32::NAN; m * n];
                w.matmul_t_with(isa, &x, &mut got);
                for (g, r) in got.iter().zip(&want) {
                    assert!(
                        (*g as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()),
                        "{isa:?} m {m} n {n} k {k}: {g} vs {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn paired_tiles_give_the_bits_of_single_ones() {
        // Tiles paired or left single (odd counts, task boundaries) must sum identically: a
        // served stream's samples equal `speak`'s whatever the batch (docs/serving.md §3).
        // On one thread the 9 and 13 tiles below go in tasks of 3 and 4 tiles: pairs and
        // single tiles both occur.
        let one_thread = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        one_thread.install(|| {
            for (m, n, k) in [(1, 144, 64), (4, 203, 96), (6, 144, 32)] {
                let wf = values(n * k, 3 + (n * k) as u64);
                let w = Q8Matrix::from_f32(&wf, n, k).unwrap();
                let xf = values(m * k, 11 + m as u64);
                let x = Q8Rows::quantize(&xf, m, k).unwrap();
                for isa in Isa::testable() {
                    let mut whole = vec![f32::NAN; m * n];
                    w.matmul_t_with(isa, &x, &mut whole);
                    for t in 0..n.div_ceil(TILE) {
                        // A matrix of this tile's rows alone has one tile, never paired.
                        let rows = TILE.min(n - t * TILE);
                        let alone_w =
                            Q8Matrix::from_f32(&wf[t * TILE * k..(t * TILE + rows) * k], rows, k)
                                .unwrap();
                        let mut alone = vec![f32::NAN; m * rows];
                        alone_w.matmul_t_with(isa, &x, &mut alone);
                        for i in 0..m {
                            for r in 0..rows {
                                assert_eq!(
                                whole[i * n + t * TILE + r].to_bits(),
                                alone[i * rows + r].to_bits(),
                                "{isa:?} m {m} n {n} k {k}: tile {t} row {r}, activation row {i}"
                            );
                            }
                        }
                    }
                }
            }
        });
    }

    #[test]
    fn quantization_error_is_bounded_by_half_a_step() {
        let (n, k) = (3, 64);
        let wf = values(n * k, 3);
        let w = Q8Matrix::from_f32(&wf, n, k).unwrap();
        for r in 0..n {
            let back = w.dequantize_row(r);
            for (b, blk) in wf[r * k..(r + 1) * k].chunks(BLOCK).enumerate() {
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (c, v) in blk.iter().enumerate() {
                    let e = (back[b * BLOCK + c] - v).abs();
                    // half a step, plus the f16 rounding of the scale (2^-11 relative).
                    assert!(e <= amax / 127.0 * 0.5 + amax * 1e-3, "{e} at {r},{b},{c}");
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
        let a = Q8Matrix::from_bf16(&bits, n, k).unwrap();
        let b = Q8Matrix::from_f32(&widened, n, k).unwrap();
        assert_eq!((a.qs, a.scales), (b.qs, b.scales));
    }

    #[test]
    fn vector_quantization_matches_the_scalar_one() {
        let (n, k) = (3, 96);
        let bits: Vec<u16> = values(n * k, 21)
            .iter()
            .map(|v| half::bf16::from_f32(*v * 3.0).to_bits())
            .collect();
        let fast = Q8Matrix::from_bf16(&bits, n, k).unwrap();
        let widened: Vec<f32> = bits
            .iter()
            .map(|b| f32::from_bits((*b as u32) << 16))
            .collect();
        let mut q = vec![0u8; k];
        let mut d = vec![0u16; k / BLOCK];
        for r in 0..n {
            quantize_weight_row(&widened[r * k..(r + 1) * k], &mut q, &mut d);
            let back: Vec<f32> = q
                .iter()
                .enumerate()
                .map(|(c, v)| (*v as i32 - 128) as f32 * f16_to_f32(d[c / BLOCK]))
                .collect();
            assert_eq!(fast.dequantize_row(r), back, "row {r}");
        }
    }

    #[test]
    fn zero_rows_and_bad_shapes() {
        let w = Q8Matrix::from_f32(&[0.0; 64], 2, 32).unwrap();
        let x = Q8Rows::quantize(&[0.0; 32], 1, 32).unwrap();
        let mut out = [1.0f32; 2];
        w.matmul_t(&x, &mut out);
        assert_eq!(out, [0.0, 0.0]);
        assert_eq!(
            Q8Matrix::from_f32(&[0.0; 39], 2, 20).unwrap_err(),
            Q8Error::Len {
                expected: 40,
                got: 39
            }
        );
        assert!(matches!(
            Q8Rows::quantize(&[0.0; 31], 1, 32),
            Err(Q8Error::Len { .. })
        ));
    }
}
