//! The codec's causal transposed convolution (`ConvTranspose1d` with the last `k − stride`
//! outputs dropped, docs/model.md §9.2), rewritten as an ordinary causal convolution with
//! `stride·C_out` output channels so it runs on [`CausalConv1d`]'s tiles.

use anyhow::{bail, ensure, Result};

use crate::act::Act;
use crate::conv::{CausalConv1d, ConvWindow, PadMode, Seq};

/// `Qwen3TTSTokenizerV2CausalTransConvNet`: `ConvTranspose1d(k, stride)` whose last `k − stride`
/// outputs are dropped, so L inputs give exactly L·stride outputs.
///
/// Output block `t` (rows `t·s .. t·s+s`) is `bias + Σ_q x[t−q] · W[:, :, q·s .. q·s+s]`,
/// q = 0..ceil(k/s): a causal conv over the input with `ceil(k/s)` taps and `s·C_out` output
/// channels, which is how it runs here.
#[derive(Debug, Clone)]
pub struct CausalConvTranspose1d {
    pub cin: usize,
    pub cout: usize,
    pub stride: usize,
    conv: CausalConv1d,
}

impl CausalConvTranspose1d {
    /// From a torch `ConvTranspose1d` weight `(cin, cout, kernel)` and bias `(cout)`.
    pub fn from_torch(
        weight: &[f32],
        shape: (usize, usize, usize),
        bias: Option<Vec<f32>>,
        stride: usize,
    ) -> Result<Self> {
        let (cin, cout, kernel) = shape;
        ensure!(
            weight.len() == cin * cout * kernel,
            "transposed conv weight size"
        );
        if kernel < stride {
            bail!("transposed conv with kernel {kernel} < stride {stride} is not supported");
        }
        let taps = kernel.div_ceil(stride);
        let n = stride * cout;
        // As a conv weight (n, cin, taps) in torch layout: conv tap j reads x[t − (taps−1−j)].
        let mut w = vec![0.0; n * cin * taps];
        for ci in 0..cin {
            for co in 0..cout {
                for k in 0..kernel {
                    let (q, j) = (k / stride, k % stride);
                    let tap = taps - 1 - q;
                    let o = j * cout + co;
                    w[(o * cin + ci) * taps + tap] = weight[(ci * cout + co) * kernel + k];
                }
            }
        }
        let bias = bias.map(|b| {
            let mut v = Vec::with_capacity(n);
            for _ in 0..stride {
                v.extend_from_slice(&b);
            }
            v
        });
        let conv = CausalConv1d::from_torch(&w, (n, cin, taps), bias, 1, 1, PadMode::Zero)?;
        Ok(CausalConvTranspose1d {
            cin,
            cout,
            stride,
            conv,
        })
    }

    pub fn forward(&self, x: &Seq, act: Option<&Act>) -> Seq {
        let y = self.conv.forward(x, act);
        Seq::new(y.data, y.t * self.stride, self.cout)
    }

    /// Output blocks `a..b` (`stride` rows each) for an input of `total` rows of which `x`
    /// holds rows `offset..` (at least the last `taps() − 1` before `a`), as
    /// [`CausalConv1d::forward_range`].
    pub fn forward_range(
        &self,
        x: &Seq,
        offset: usize,
        total: usize,
        act: Option<&Act>,
        range: (usize, usize),
    ) -> Seq {
        let y = self.conv.forward_range(x, offset, total, act, range);
        Seq::new(y.data, y.t * self.stride, self.cout)
    }

    /// [`Self::forward_range`] for several independent inputs, as
    /// [`CausalConv1d::forward_ranges`] (output blocks `range` of each).
    pub fn forward_ranges(&self, parts: &[ConvWindow<'_>], act: Option<&Act>) -> Vec<Seq> {
        self.conv
            .forward_ranges(parts, act)
            .into_iter()
            .map(|y| Seq::new(y.data, y.t * self.stride, self.cout))
            .collect()
    }

    /// Input samples each output block reads (`ceil(kernel / stride)`).
    pub fn taps(&self) -> usize {
        self.conv.kernel
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv::tests::{max_abs_diff, rand_vec};

    /// Literal `nn.ConvTranspose1d` followed by dropping the last `k − s` samples.
    #[allow(clippy::too_many_arguments)]
    fn ref_conv_transpose(
        x: &[f32],
        cin: usize,
        len: usize,
        w: &[f32],
        cout: usize,
        kernel: usize,
        b: &[f32],
        stride: usize,
    ) -> Vec<f32> {
        let full = (len - 1) * stride + kernel;
        let mut y = vec![0.0f64; cout * full];
        for co in 0..cout {
            for t in 0..full {
                y[co * full + t] = b[co] as f64;
            }
        }
        for ci in 0..cin {
            for t in 0..len {
                for co in 0..cout {
                    for k in 0..kernel {
                        y[co * full + t * stride + k] +=
                            x[ci * len + t] as f64 * w[(ci * cout + co) * kernel + k] as f64;
                    }
                }
            }
        }
        let keep = full - (kernel - stride);
        let mut out = Vec::with_capacity(cout * keep);
        for co in 0..cout {
            out.extend(y[co * full..co * full + keep].iter().map(|&v| v as f32));
        }
        out
    }

    #[test]
    fn transposed_conv_trims_the_right_end_only() {
        for &(cin, cout, kernel, stride, len) in &[
            (4, 3, 16, 8, 9),
            (3, 2, 10, 5, 7),
            (2, 2, 2, 2, 13),
            (5, 4, 6, 3, 1),
            (3, 3, 7, 3, 6), // kernel not a multiple of stride
        ] {
            let x = rand_vec(cin * len, 21);
            let w = rand_vec(cin * cout * kernel, 22);
            let b = rand_vec(cout, 23);
            let want = ref_conv_transpose(&x, cin, len, &w, cout, kernel, &b, stride);
            let tc =
                CausalConvTranspose1d::from_torch(&w, (cin, cout, kernel), Some(b.clone()), stride)
                    .unwrap();
            let got = tc.forward(&Seq::from_channels_first(&x, cin, len), None);
            assert_eq!(got.t, len * stride);
            assert!(max_abs_diff(&got.to_channels_first(), &want) < 1e-5);
        }
    }
}
