//! Causal 1-D convolutions of the codec on the CPU, in a channels-last layout.
//!
//! Activations are `(T, C)` row-major ([`Seq`]); a convolution is then a GEMM whose left operand
//! is a *strided view* of the (padded) input: output row `t` reads input rows
//! `t·stride .. t·stride + k_eff`, which for dilation 1 are contiguous, so the im2col matrix is the
//! input itself with row stride `stride·C_in` (no copy). Dilated convolutions are one
//! accumulating GEMM per tap. The time axis is cut into tiles of output rows processed by all
//! cores (rayon, dynamic scheduling; each tile owns its rows of the output, so no tile writes
//! another's); each tile builds its padded, activated input slice in a small per-worker buffer
//! (the activation that precedes every conv of the codec is fused in there), so intermediate
//! tensors stay in cache. A transposed convolution is rewritten as an ordinary causal conv with
//! `stride·C_out` output channels ([`crate::conv_transpose::CausalConvTranspose1d`]).
//!
//! Padding follows the official code exactly (docs/model.md §9.1, §9.2): causal convs pad
//! `k_eff − stride` on the left and `extra = ceil(L/stride)·stride − L` on the right (zeros, or
//! copies of the edge rows for `replicate`), so a conv maps L → ceil(L/stride); transposed convs
//! drop the last `k − stride` outputs, so they map L → L·stride.

use anyhow::{ensure, Result};

use super::act::Act;
use super::buf::{par_new_vec, Init, Uninit};
use super::few_rows::FEW_ROWS;
use super::gemm::{gemm, Acc, Par};
use super::mat::{MatMut, MatRef};

/// A channels-last sequence: `t` rows of `c` values.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Seq {
    pub data: Vec<f32>,
    pub t: usize,
    pub c: usize,
}

impl Seq {
    pub fn new(data: Vec<f32>, t: usize, c: usize) -> Self {
        assert_eq!(data.len(), t * c, "Seq data length");
        Seq { data, t, c }
    }

    pub fn zeros(t: usize, c: usize) -> Self {
        Seq::new(vec![0.0; t * c], t, c)
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.c..(i + 1) * self.c]
    }

    /// Rows `start..end` as a new sequence.
    pub fn rows(&self, start: usize, end: usize) -> Seq {
        Seq::new(
            self.data[start * self.c..end * self.c].to_vec(),
            end - start,
            self.c,
        )
    }

    /// The rows of several sequences of `c` channels, one after the other.
    pub fn stack(parts: &[Seq], c: usize) -> Seq {
        let t = parts.iter().map(|p| p.t).sum();
        let mut data = Vec::with_capacity(t * c);
        for p in parts {
            assert_eq!(p.c, c, "stacked sequences differ in channels");
            data.extend_from_slice(&p.data);
        }
        Seq::new(data, t, c)
    }

    /// The inverse of [`Self::stack`]: consecutive pieces of `rows[i]` rows.
    pub fn split(&self, rows: &[usize]) -> Vec<Seq> {
        assert_eq!(rows.iter().sum::<usize>(), self.t, "split rows");
        let mut at = 0;
        rows.iter()
            .map(|&r| {
                let piece = self.rows(at, at + r);
                at += r;
                piece
            })
            .collect()
    }

    /// `(C, T)` channels-first copy (the official layout), for tests and debugging.
    pub fn to_channels_first(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.data.len()];
        for t in 0..self.t {
            for c in 0..self.c {
                out[c * self.t + t] = self.data[t * self.c + c];
            }
        }
        out
    }

    /// From a `(C, T)` channels-first buffer.
    pub fn from_channels_first(data: &[f32], c: usize, t: usize) -> Self {
        assert_eq!(data.len(), c * t);
        let mut out = vec![0.0; data.len()];
        for ci in 0..c {
            for ti in 0..t {
                out[ti * c + ci] = data[ci * t + ti];
            }
        }
        Seq::new(out, t, c)
    }
}

/// How a causal conv pads its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PadMode {
    Zero,
    Replicate,
}

/// Left padding of a causal conv: `k_eff − stride` (`padding_total`).
pub fn causal_left_pad(k_eff: usize, stride: usize) -> usize {
    k_eff.saturating_sub(stride)
}

/// Right ("extra") padding of a causal conv for an input of `len` samples
/// (`_get_extra_padding_for_conv1d`): `ideal_len − len` with
/// `ideal_len = (ceil((len − k_eff + pad_left)/stride + 1) − 1)·stride + k_eff − pad_left`, which
/// simplifies to `ceil(len/stride)·stride − len` (the conv then outputs `ceil(len/stride)` rows).
pub fn causal_right_pad(len: usize, stride: usize) -> usize {
    len.div_ceil(stride) * stride - len
}

/// Threads the kernels run on (the current rayon pool: `RAYON_NUM_THREADS` or every core).
pub fn num_threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// Output rows per tile for `t` rows of a GEMM with inner size `k` and `n` outputs. The GEMM
/// packs the whole weight matrix (`k × n`) once per call, so tiles need a few hundred rows to
/// amortise that; beyond that, smaller tiles keep their activations in cache, and there must be
/// at least one tile per thread. A few rows are one tile.
pub fn tile_rows(t: usize, k: usize, n: usize) -> usize {
    /// Floats of the wider GEMM operand a tile aims at (~1 MB).
    const CACHE_FLOATS: usize = 1 << 18;
    /// Rows below which packing the weights once per tile starts to dominate.
    const MIN_ROWS: usize = 512;
    if t <= FEW_ROWS {
        // One tile whose product spreads its columns over the threads (`tile_par`).
        return t.max(1);
    }
    let want = (CACHE_FLOATS / k.max(n).max(1)).max(MIN_ROWS);
    t.div_ceil(num_threads()).clamp(1, want)
}

/// How a tile of `rows` output rows runs its products: a few rows on every thread (the weights
/// read once, split by columns, [`super::few_rows`]), more serially (the tiles are parallel).
pub(crate) fn tile_par(rows: usize) -> Par {
    if rows <= FEW_ROWS {
        Par::Rayon
    } else {
        Par::Seq
    }
}

/// A causal `Conv1d` (`MimiConv1d` / `Qwen3TTSTokenizerV2CausalConvNet`), groups = 1.
#[derive(Debug, Clone)]
pub struct CausalConv1d {
    pub cin: usize,
    pub cout: usize,
    pub kernel: usize,
    pub stride: usize,
    pub dilation: usize,
    pub pad_mode: PadMode,
    /// `(kernel·cin, cout)`: row `k·cin + ci`, column `co` holds torch `weight[co, ci, k]`.
    pub(crate) w: Vec<f32>,
    pub(crate) bias: Option<Vec<f32>>,
}

impl CausalConv1d {
    /// From a torch weight `(cout, cin, kernel)` (row-major) and optional bias `(cout)`.
    pub fn from_torch(
        weight: &[f32],
        shape: (usize, usize, usize),
        bias: Option<Vec<f32>>,
        stride: usize,
        dilation: usize,
        pad_mode: PadMode,
    ) -> Result<Self> {
        let (cout, cin, kernel) = shape;
        ensure!(weight.len() == cout * cin * kernel, "conv weight size");
        ensure!(stride >= 1 && dilation >= 1 && kernel >= 1, "conv geometry");
        if let Some(b) = &bias {
            ensure!(b.len() == cout, "conv bias size");
        }
        let mut w = vec![0.0; weight.len()];
        for co in 0..cout {
            for ci in 0..cin {
                for k in 0..kernel {
                    w[(k * cin + ci) * cout + co] = weight[(co * cin + ci) * kernel + k];
                }
            }
        }
        Ok(CausalConv1d {
            cin,
            cout,
            kernel,
            stride,
            dilation,
            pad_mode,
            w,
            bias,
        })
    }

    /// Effective kernel size with dilation.
    pub fn k_eff(&self) -> usize {
        (self.kernel - 1) * self.dilation + 1
    }

    pub fn pad_left(&self) -> usize {
        causal_left_pad(self.k_eff(), self.stride)
    }

    pub fn out_len(&self, len: usize) -> usize {
        len.div_ceil(self.stride)
    }

    /// A new tile of output rows holding the bias (or zeros).
    fn init_rows<'t>(&self, out: Uninit<'t>) -> Init<'t> {
        match &self.bias {
            Some(b) => out.fill_rows(b),
            None => out.fill(0.0),
        }
    }

    /// Fills `out` (`rows × cout`) with the bias (or zeros).
    pub(crate) fn set_rows(&self, out: &mut [f32]) {
        match &self.bias {
            Some(b) => out
                .chunks_exact_mut(self.cout)
                .for_each(|r| r.copy_from_slice(b)),
            None => out.fill(0.0),
        }
    }

    /// `out += conv(padded)` for the `out.rows()` output rows whose padded input rows start
    /// at row 0 of `padded` (row stride `cin`; it must hold `(rows−1)·stride + k_eff` rows).
    pub(crate) fn gemm_tile(&self, padded: &[f32], mut out: MatMut<'_>) {
        let rows = out.rows();
        let lhs_rs = self.stride * self.cin;
        if self.dilation == 1 || self.kernel == 1 {
            let lhs = MatRef::strided(padded, rows, self.kernel * self.cin, lhs_rs, 1);
            let rhs = MatRef::new(&self.w, self.kernel * self.cin, self.cout);
            gemm(out, lhs, rhs, Acc::Add, 1.0, tile_par(rows));
        } else {
            let taps = self.w.chunks_exact(self.cin * self.cout);
            for (k, wk) in taps.enumerate() {
                let at = k * self.dilation * self.cin;
                let lhs = MatRef::strided(&padded[at..], rows, self.cin, lhs_rs, 1);
                let rhs = MatRef::new(wk, self.cin, self.cout);
                gemm(out.rb_mut(), lhs, rhs, Acc::Add, 1.0, tile_par(rows));
            }
        }
    }

    /// Builds the padded, activated input rows `[p0, p1)` (padded coordinates) into `buf`.
    /// `x` holds rows `offset .. offset + x.t` of an input of `total` rows; every real row in
    /// the range must be among them (and, for replicate padding, the edge rows it copies).
    #[allow(clippy::too_many_arguments)]
    fn build_input(
        &self,
        x: &Seq,
        offset: usize,
        total: usize,
        act: Option<&Act>,
        p0: usize,
        p1: usize,
        buf: &mut Vec<f32>,
    ) {
        let c = self.cin;
        let pad_left = self.pad_left();
        buf.clear();
        buf.resize((p1 - p0) * c, 0.0);
        // Real rows covered by [p0, p1).
        let r0 = p0.saturating_sub(pad_left).min(total);
        let r1 = p1.saturating_sub(pad_left).min(total);
        if r1 > r0 {
            assert!(
                r0 >= offset && r1 <= offset + x.t,
                "conv window needs rows {r0}..{r1}, has {offset}..{}",
                offset + x.t
            );
            let dst = &mut buf[(r0 + pad_left - p0) * c..(r1 + pad_left - p0) * c];
            let src = &x.data[(r0 - offset) * c..(r1 - offset) * c];
            match act {
                Some(a) => a.apply(src, dst, c),
                None => dst.copy_from_slice(src),
            }
        }
        if self.pad_mode == PadMode::Replicate && total > 0 {
            // Edge rows of the (activated) input.
            let edge = |row: usize| -> Vec<f32> {
                assert!(
                    row >= offset && row < offset + x.t,
                    "replicated row {row} not in window"
                );
                let mut v = x.row(row - offset).to_vec();
                if let Some(a) = act {
                    a.apply_inplace(&mut v, c);
                }
                v
            };
            if p0 < pad_left {
                let first = edge(0);
                for p in p0..pad_left.min(p1) {
                    buf[(p - p0) * c..(p - p0 + 1) * c].copy_from_slice(&first);
                }
            }
            if p1 > pad_left + total {
                let last = edge(total - 1);
                for p in (pad_left + total).max(p0)..p1 {
                    buf[(p - p0) * c..(p - p0 + 1) * c].copy_from_slice(&last);
                }
            }
        }
    }

    /// Input rows (real coordinates, clipped to `0..total`) that output rows `a..b` read.
    pub fn input_rows(&self, a: usize, b: usize, total: usize) -> (usize, usize) {
        let pad_left = self.pad_left();
        let p0 = a * self.stride;
        let p1 = (b - 1) * self.stride + self.k_eff();
        (
            p0.saturating_sub(pad_left).min(total),
            p1.saturating_sub(pad_left).min(total),
        )
    }

    /// Output rows `a..b` of `conv(act(input))` for an input of `total` rows of which `x`
    /// holds rows `offset..` (at least [`Self::input_rows`]), single-threaded.
    pub fn forward_window(
        &self,
        x: &Seq,
        offset: usize,
        total: usize,
        act: Option<&Act>,
        (a, b): (usize, usize),
    ) -> Seq {
        let mut out = vec![0.0f32; (b - a) * self.cout];
        let mut buf = Vec::new();
        self.build_input(
            x,
            offset,
            total,
            act,
            a * self.stride,
            (b - 1) * self.stride + self.k_eff(),
            &mut buf,
        );
        self.set_rows(&mut out);
        self.gemm_tile(&buf, MatMut::new(&mut out, b - a, self.cout));
        Seq::new(out, b - a, self.cout)
    }

    /// `conv(act(x))` with the causal padding; `x.c` must be `cin`.
    pub fn forward(&self, x: &Seq, act: Option<&Act>) -> Seq {
        assert_eq!(x.c, self.cin, "conv input channels");
        if self.cin == 1 && self.stride == 1 && act.is_none() && self.pad_mode == PadMode::Zero {
            return self.forward_single_input(x);
        }
        let t_out = self.out_len(x.t);
        let (n, k_eff) = (self.cout, self.k_eff());
        let tile = tile_rows(t_out, self.kernel * self.cin, n);
        let out = par_new_vec(t_out * n, tile * n, Vec::new, |i, part, buf| {
            let (a, rows) = (i * tile, part.len() / n);
            let p0 = a * self.stride;
            let p1 = (a + rows - 1) * self.stride + k_eff;
            self.build_input(x, 0, x.t, act, p0, p1, buf);
            let mut o = self.init_rows(part);
            self.gemm_tile(buf, MatMut::new(&mut o, rows, n));
            o
        });
        Seq::new(out, t_out, n)
    }
}

impl CausalConv1d {
    /// Output rows `a..b` of `conv(act(input))` for an input of `total` rows of which `x` holds
    /// rows `offset..offset + x.t` (at least [`Self::input_rows`] of `a..b`), on all threads:
    /// the streaming decoder's step (docs/model.md §9.2), where `x` is the rows kept from the
    /// previous steps followed by the new ones.
    pub fn forward_range(
        &self,
        x: &Seq,
        offset: usize,
        total: usize,
        act: Option<&Act>,
        (a, b): (usize, usize),
    ) -> Seq {
        assert_eq!(x.c, self.cin, "conv input channels");
        let rows = b.saturating_sub(a);
        if rows == 0 {
            return Seq::new(Vec::new(), 0, self.cout);
        }
        let (n, k_eff) = (self.cout, self.k_eff());
        let tile = tile_rows(rows, self.kernel * self.cin, n);
        let out = par_new_vec(rows * n, tile * n, Vec::new, |i, part, buf| {
            let (t0, tr) = (a + i * tile, part.len() / n);
            let p0 = t0 * self.stride;
            let p1 = (t0 + tr - 1) * self.stride + k_eff;
            self.build_input(x, offset, total, act, p0, p1, buf);
            let mut o = self.init_rows(part);
            self.gemm_tile(buf, MatMut::new(&mut o, tr, n));
            o
        });
        Seq::new(out, rows, n)
    }
}

/// One stream's part of a batched streaming step ([`CausalConv1d::forward_ranges`]): output rows
/// `range` of an input of `total` rows of which `x` holds rows `offset..`, as
/// [`CausalConv1d::forward_range`] takes them.
#[derive(Debug, Clone, Copy)]
pub struct ConvWindow<'a> {
    pub x: &'a Seq,
    pub offset: usize,
    pub total: usize,
    pub range: (usize, usize),
}

/// Rows up to which [`CausalConv1d::forward_ranges`] gathers the windows of several streams into
/// one product (above, the weights are read by each stream's tiles anyway).
const GATHER_ROWS: usize = 64;

impl CausalConv1d {
    /// [`Self::forward_range`] for several independent inputs (the streams of a batched decoding
    /// step, docs/serving.md §4): their output rows go through one product per tap, so the
    /// weights are read once for all of them. Each output is the one `forward_range` gives for
    /// its window alone, to the bit: the products are row-invariant and the taps are summed in
    /// the same order (one product over `kernel·cin` for dilation 1, one per tap otherwise).
    pub fn forward_ranges(&self, parts: &[ConvWindow<'_>], act: Option<&Act>) -> Vec<Seq> {
        let rows: Vec<usize> = parts
            .iter()
            .map(|p| p.range.1.saturating_sub(p.range.0))
            .collect();
        let total_rows: usize = rows.iter().sum();
        if parts.len() < 2 || total_rows > GATHER_ROWS || total_rows == 0 {
            return parts
                .iter()
                .map(|p| self.forward_range(p.x, p.offset, p.total, act, p.range))
                .collect();
        }
        let (cin, n, k_eff) = (self.cin, self.cout, self.k_eff());
        let one_product = self.dilation == 1 || self.kernel == 1;
        // Gathered left operands: one matrix of `kernel·cin` columns, or one of `cin` per tap.
        let (width, mats) = if one_product {
            (self.kernel * cin, 1)
        } else {
            (cin, self.kernel)
        };
        let mut lhs = vec![Vec::with_capacity(total_rows * width); mats];
        let mut buf = Vec::new();
        for (p, &r) in parts.iter().zip(&rows) {
            if r == 0 {
                continue;
            }
            assert_eq!(p.x.c, cin, "conv input channels");
            let (a, b) = p.range;
            let p0 = a * self.stride;
            self.build_input(
                p.x,
                p.offset,
                p.total,
                act,
                p0,
                (b - 1) * self.stride + k_eff,
                &mut buf,
            );
            for t in 0..r {
                let at = t * self.stride * cin;
                if one_product {
                    lhs[0].extend_from_slice(&buf[at..at + width]);
                } else {
                    for (j, m) in lhs.iter_mut().enumerate() {
                        let tap = at + j * self.dilation * cin;
                        m.extend_from_slice(&buf[tap..tap + cin]);
                    }
                }
            }
        }
        let tile = tile_rows(total_rows, self.kernel * cin, n);
        let out = par_new_vec(
            total_rows * n,
            tile * n,
            || (),
            |i, part, _| {
                let (r0, tr) = (i * tile, part.len() / n);
                let mut o = self.init_rows(part);
                for (j, m) in lhs.iter().enumerate() {
                    let a = MatRef::new(&m[r0 * width..(r0 + tr) * width], tr, width);
                    let w = &self.w[j * width * n..(j + 1) * width * n];
                    gemm(
                        MatMut::new(&mut o, tr, n),
                        a,
                        MatRef::new(w, width, n),
                        Acc::Add,
                        1.0,
                        tile_par(tr),
                    );
                }
                o
            },
        );
        let mut outs = Vec::with_capacity(parts.len());
        let mut at = 0;
        for &r in &rows {
            outs.push(Seq::new(out[at * n..(at + r) * n].to_vec(), r, n));
            at += r;
        }
        outs
    }
}

impl CausalConv1d {
    /// One input channel (the waveform conv): a GEMM with inner size `kernel` would waste most
    /// of its time packing, so this runs directly, vectorised over the output channels.
    fn forward_single_input(&self, x: &Seq) -> Seq {
        let (n, pad) = (self.cout, self.pad_left());
        const TILE: usize = 4096;
        let out = par_new_vec(
            x.t * n,
            TILE * n,
            || (),
            |i, part, _| {
                let mut rows = self.init_rows(part);
                for (r, row) in rows.chunks_exact_mut(n).enumerate() {
                    let t = i * TILE + r;
                    for k in 0..self.kernel {
                        let p = t + k * self.dilation;
                        if p < pad {
                            continue;
                        }
                        let xv = x.data[p - pad];
                        for (o, &wv) in row.iter_mut().zip(&self.w[k * n..(k + 1) * n]) {
                            *o += xv * wv;
                        }
                    }
                }
                rows
            },
        );
        Seq::new(out, x.t, n)
    }
}

#[cfg(test)]
pub(crate) mod tests;
