//! A depthwise causal convolution (`groups = channels`, stride 1): the ConvNeXt block's `dwconv`
//! in the codec's upsampler (docs/model.md §9.2), channels-last like [`crate::conv`].

use anyhow::{ensure, Result};

use crate::buf::par_new_vec;
use crate::conv::Seq;

/// A depthwise causal conv (`groups = channels`, ConvNeXt's `dwconv`), stride 1.
#[derive(Debug, Clone)]
pub struct DepthwiseCausalConv1d {
    pub channels: usize,
    pub kernel: usize,
    /// `(kernel, channels)`.
    w: Vec<f32>,
    bias: Vec<f32>,
}

impl DepthwiseCausalConv1d {
    /// From a torch weight `(channels, 1, kernel)` and bias `(channels)`.
    pub fn from_torch(
        weight: &[f32],
        channels: usize,
        kernel: usize,
        bias: Vec<f32>,
    ) -> Result<Self> {
        ensure!(
            weight.len() == channels * kernel && bias.len() == channels,
            "dwconv size"
        );
        let mut w = vec![0.0; weight.len()];
        for c in 0..channels {
            for k in 0..kernel {
                w[k * channels + c] = weight[c * kernel + k];
            }
        }
        Ok(DepthwiseCausalConv1d {
            channels,
            kernel,
            w,
            bias,
        })
    }

    /// Output rows `a..b` for an input of which `x` holds rows `offset..` (at least the
    /// `kernel − 1` before `a`), zeros before row 0.
    pub fn forward_range(&self, x: &Seq, offset: usize, (a, b): (usize, usize)) -> Seq {
        let c = self.channels;
        assert_eq!(x.c, c);
        let pad = self.kernel - 1;
        assert!(
            offset <= a.saturating_sub(pad) && b <= offset + x.t,
            "dwconv window needs rows {}..{b}, has {offset}..{}",
            a.saturating_sub(pad),
            offset + x.t
        );
        let mut out = Vec::with_capacity(b.saturating_sub(a) * c);
        for t in a..b {
            let start = out.len();
            out.extend_from_slice(&self.bias);
            let row = &mut out[start..];
            for k in 0..self.kernel {
                if t + k < pad {
                    continue;
                }
                let xi = x.row(t + k - pad - offset);
                let wk = &self.w[k * c..(k + 1) * c];
                for ((o, &xv), &wv) in row.iter_mut().zip(xi).zip(wk) {
                    *o += xv * wv;
                }
            }
        }
        Seq::new(out, b.saturating_sub(a), c)
    }

    pub fn forward(&self, x: &Seq) -> Seq {
        let c = self.channels;
        assert_eq!(x.c, c);
        let pad = self.kernel - 1;
        const TILE: usize = 256;
        let out = par_new_vec(
            x.t * c,
            TILE * c,
            || (),
            |i, part, _| {
                let mut rows = part.fill_rows(&self.bias);
                for (r, row) in rows.chunks_exact_mut(c).enumerate() {
                    let t = i * TILE + r;
                    for k in 0..self.kernel {
                        // input index t + k − pad (zero padding on the left)
                        if t + k < pad {
                            continue;
                        }
                        let xi = x.row(t + k - pad);
                        let wk = &self.w[k * c..(k + 1) * c];
                        for ((o, &xv), &wv) in row.iter_mut().zip(xi).zip(wk) {
                            *o += xv * wv;
                        }
                    }
                }
                rows
            },
        );
        Seq::new(out, x.t, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv::tests::{rand_vec, ref_conv};

    #[test]
    fn depthwise_matches_reference() {
        let (c, len, k) = (5, 40, 7);
        let x = rand_vec(c * len, 31);
        let w = rand_vec(c * k, 32);
        let b = rand_vec(c, 33);
        let dw = DepthwiseCausalConv1d::from_torch(&w, c, k, b.clone()).unwrap();
        let got = dw.forward(&Seq::from_channels_first(&x, c, len));
        for ch in 0..c {
            let (want, _) = ref_conv(
                &x[ch * len..(ch + 1) * len],
                1,
                len,
                &w[ch * k..(ch + 1) * k],
                1,
                k,
                Some(&b[ch..ch + 1]),
                1,
                1,
                false,
            );
            for (t, w) in want.iter().enumerate() {
                assert!((got.data[t * c + ch] - w).abs() < 1e-5);
            }
        }
    }
}
