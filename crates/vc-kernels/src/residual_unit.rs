//! The codec's residual unit `x + conv2(act2(conv1(act1(x))))` (docs/model.md §9.1, §9.2),
//! computed tile by tile so its hidden activations never leave the cache; `conv1` optionally
//! in Winograd form ([`WinogradConv`]).

use anyhow::{ensure, Result};

use crate::act::Act;
use crate::buf::par_new_vec;
use crate::conv::{tile_rows, CausalConv1d, PadMode, Seq};
use crate::mat::MatMut;
use crate::winograd::WinogradConv;

/// A residual unit `x + conv2(act2(conv1(act1(x))))` with stride-1 convs and `conv2` of kernel
/// 1: SEANet's `MimiResnetBlock` (ELU, k3, ELU, k1) and the decoder's
/// `Qwen3TTSTokenizerV2DecoderDecoderResidualUnit` (SnakeBeta, k7 dilated, SnakeBeta, k1).
/// Computed tile by tile, so the hidden activations never leave the cache.
#[derive(Debug, Clone)]
pub struct ResidualUnit {
    pub act1: Act,
    pub conv1: CausalConv1d,
    pub act2: Act,
    pub conv2: CausalConv1d,
    /// `conv1` as a Winograd `F(m, k)` conv, when enabled.
    wino: Option<WinogradConv>,
}

impl ResidualUnit {
    /// `winograd` outputs per Winograd tile for `conv1` (0: direct GEMM convolution; see
    /// [`WinogradConv`]).
    pub fn new(
        act1: Act,
        conv1: CausalConv1d,
        act2: Act,
        conv2: CausalConv1d,
        winograd: usize,
    ) -> Result<Self> {
        ensure!(
            conv1.stride == 1 && conv2.stride == 1 && conv2.kernel == 1,
            "residual unit: conv1 must have stride 1 and conv2 kernel 1"
        );
        ensure!(
            conv2.cin == conv1.cout && conv2.cout == conv1.cin,
            "residual unit channels"
        );
        ensure!(
            conv1.pad_mode == PadMode::Zero,
            "residual unit convs pad with zeros"
        );
        let m = winograd;
        let wino = if m > 0 && conv1.kernel > 1 {
            let bias = conv1.bias.clone().unwrap_or_else(|| vec![0.0; conv1.cout]);
            Some(WinogradConv::new(
                &conv1.w,
                conv1.cin,
                conv1.cout,
                conv1.kernel,
                conv1.dilation,
                bias,
                m,
            )?)
        } else {
            None
        };
        Ok(ResidualUnit {
            act1,
            conv1,
            act2,
            conv2,
            wino,
        })
    }

    /// Drops the Winograd form of `conv1` (direct GEMM convolution, for comparisons).
    pub fn without_winograd(mut self) -> Self {
        self.wino = None;
        self
    }

    pub fn forward(&self, x: &Seq) -> Seq {
        self.forward_range(x, 0, (0, x.t))
    }

    /// Output rows `a..b` for an input of which `x` holds rows `offset..` (at least the
    /// `k_eff − 1` before `a`), zeros before row 0: [`Self::forward`] is the whole range; the
    /// streaming decoder (docs/model.md §9.2) passes the kept rows followed by the new ones.
    pub fn forward_range(&self, x: &Seq, offset: usize, (a, b): (usize, usize)) -> Seq {
        let c = self.conv1.cin;
        let hidden = self.conv1.cout;
        assert_eq!(x.c, c);
        let k_eff = self.conv1.k_eff();
        let pad = k_eff - 1;
        let n = b.saturating_sub(a);
        assert!(
            offset <= a.saturating_sub(pad) && b <= offset + x.t,
            "residual unit window needs rows {}..{b}, has {offset}..{}",
            a.saturating_sub(pad),
            offset + x.t
        );
        if n == 0 {
            return Seq::new(Vec::new(), 0, c);
        }
        let tile = tile_rows(n, self.conv1.kernel * c, hidden.max(c));
        // Per worker: the tile's padded input and hidden rows, and the Winograd transforms.
        let scratch = || (Vec::new(), Vec::new());
        let out = par_new_vec(n * c, tile * c, scratch, |i, part, (buf, wino_buf)| {
            let rows = part.len() / c;
            let a = a + i * tile;
            let b = a + rows;
            // Padded coordinates: output row t reads padded rows t .. t + k_eff.
            let in_rows = match &self.wino {
                Some(w) => w.padded_rows(rows),
                None => rows - 1 + k_eff,
            };
            let in_len = in_rows * c;
            let h_len = rows * hidden;
            buf.clear();
            buf.resize(in_len + h_len, 0.0);
            let (inp, rest) = buf.split_at_mut(in_len);
            let h = &mut rest[..h_len];
            // Activated input rows (zero rows before the start of x and after the tile).
            let r0 = a.saturating_sub(pad);
            let skip = (pad.saturating_sub(a)) * c;
            self.act1.apply(
                &x.data[(r0 - offset) * c..(b - offset) * c],
                &mut inp[skip..skip + (b - r0) * c],
                c,
            );
            match &self.wino {
                Some(w) => w.forward_tile(inp, rows, h, wino_buf),
                None => {
                    self.conv1.set_rows(h);
                    self.conv1.gemm_tile(inp, MatMut::new(h, rows, hidden));
                }
            }
            self.act2.apply_inplace(h, hidden);
            let mut o = part.copy_from(&x.data[(a - offset) * c..(b - offset) * c]);
            if let Some(bias) = &self.conv2.bias {
                for row in o.chunks_exact_mut(c) {
                    for (v, &bv) in row.iter_mut().zip(bias) {
                        *v += bv;
                    }
                }
            }
            self.conv2.gemm_tile(h, MatMut::new(&mut o, rows, c));
            o
        });
        Seq::new(out, n, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act::SnakeParams;
    use crate::conv::tests::{max_abs_diff, rand_vec};

    #[test]
    fn residual_unit_matches_unfused_layers() {
        let (c, len) = (6, if cfg!(miri) { 40 } else { 3000 });
        let snake = |seed, ch: usize| {
            let p = rand_vec(2 * ch, seed);
            Act::Snake(SnakeParams::from_log(&p[..ch], &p[ch..]))
        };
        for (dilation, hidden) in [(1, 6), (3, 6), (9, 3)] {
            let w1 = rand_vec(hidden * c * 7, 40 + dilation as u64);
            let w2 = rand_vec(c * hidden, 41);
            let conv1 = CausalConv1d::from_torch(
                &w1,
                (hidden, c, 7),
                Some(rand_vec(hidden, 42)),
                1,
                dilation,
                PadMode::Zero,
            )
            .unwrap();
            let conv2 = CausalConv1d::from_torch(
                &w2,
                (c, hidden, 1),
                Some(rand_vec(c, 43)),
                1,
                1,
                PadMode::Zero,
            )
            .unwrap();
            let unit = ResidualUnit::new(
                snake(44, c),
                conv1.clone(),
                snake(45, hidden),
                conv2.clone(),
                2,
            );
            let (a1, a2) = (snake(44, c), snake(45, hidden));
            let unit = unit.unwrap();
            let x = Seq::new(rand_vec(len * c, 46), len, c);
            let h = conv1.forward(&x, Some(&a1));
            let y = conv2.forward(&h, Some(&a2));
            let want: Vec<f32> = y.data.iter().zip(&x.data).map(|(a, b)| a + b).collect();
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let direct = unit.clone().without_winograd().forward(&x);
            let err = max_abs_diff(&direct.data, &want);
            assert!(
                err < 1e-5 * scale,
                "direct, dilation {dilation}: {err} (scale {scale})"
            );
            // Winograd F(2,7) / F(4,7): only rounding differs.
            for m in [2, 4] {
                let wino = WinogradConv::new(
                    &conv1.w,
                    c,
                    hidden,
                    7,
                    dilation,
                    conv1.bias.clone().unwrap(),
                    m,
                )
                .unwrap();
                let mut u = unit.clone();
                u.wino = Some(wino);
                let err = max_abs_diff(&u.forward(&x).data, &want);
                assert!(
                    err < 1e-5 * scale,
                    "F({m},7), dilation {dilation}: {err} (scale {scale})"
                );
            }
        }
    }
}
