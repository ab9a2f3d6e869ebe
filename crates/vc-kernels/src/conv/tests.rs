//! The tests of the convolution kernels against plain reference loops, and the small
//! reference helpers the sibling kernels' tests (transposed, depthwise) reuse.

use super::*;

pub use crate::test_values::rand_vec;

/// Straightforward channels-first reference of the official causal conv (f64 accumulate).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ref_conv(
    x: &[f32],
    cin: usize,
    len: usize,
    w: &[f32],
    cout: usize,
    kernel: usize,
    bias: Option<&[f32]>,
    stride: usize,
    dilation: usize,
    replicate: bool,
) -> (Vec<f32>, usize) {
    let k_eff = (kernel - 1) * dilation + 1;
    let pad_l = k_eff - stride;
    // Literal transcription of `_get_extra_padding_for_conv1d` (float division + ceil).
    let n_frames = (len as f64 - k_eff as f64 + pad_l as f64) / stride as f64 + 1.0;
    let ideal = (n_frames.ceil() as i64 - 1) * stride as i64 + (k_eff - pad_l) as i64;
    let extra = (ideal - len as i64) as usize;
    let plen = pad_l + len + extra;
    let get = |c: usize, p: usize| -> f64 {
        if p < pad_l {
            if replicate {
                x[c * len] as f64
            } else {
                0.0
            }
        } else if p - pad_l >= len {
            if replicate {
                x[c * len + len - 1] as f64
            } else {
                0.0
            }
        } else {
            x[c * len + p - pad_l] as f64
        }
    };
    let lout = (plen - k_eff) / stride + 1;
    let mut y = vec![0.0f32; cout * lout];
    for co in 0..cout {
        for t in 0..lout {
            let mut acc = bias.map_or(0.0, |b| b[co] as f64);
            for ci in 0..cin {
                for k in 0..kernel {
                    acc +=
                        w[(co * cin + ci) * kernel + k] as f64 * get(ci, t * stride + k * dilation);
                }
            }
            y[co * lout + t] = acc as f32;
        }
    }
    (y, lout)
}

pub(crate) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn padding_arithmetic_matches_official_formula() {
    for stride in 1..9 {
        for kernel in [1, 2, 3, 4, 7, 8, 10, 12, 16] {
            if kernel < stride {
                continue;
            }
            for len in 1..60 {
                let pad_l = causal_left_pad(kernel, stride);
                let n_frames = (len as f64 - kernel as f64 + pad_l as f64) / stride as f64 + 1.0;
                let ideal = (n_frames.ceil() as i64 - 1) * stride as i64 + (kernel - pad_l) as i64;
                assert_eq!(causal_right_pad(len, stride) as i64, ideal - len as i64);
                let total = pad_l + len + causal_right_pad(len, stride);
                assert_eq!((total - kernel) / stride + 1, len.div_ceil(stride));
            }
        }
    }
}

#[test]
fn conv_matches_reference_all_geometries() {
    for &(cin, cout, kernel, stride, dilation, replicate, len) in &[
        (3, 5, 7, 1, 1, false, 50),
        (4, 6, 3, 1, 3, false, 41),
        (4, 6, 7, 1, 9, false, if cfg!(miri) { 70 } else { 100 }),
        (2, 4, 8, 4, 1, false, 37),
        (5, 3, 10, 5, 1, false, 23),
        (6, 6, 4, 2, 1, true, 11),
        (6, 6, 4, 2, 1, true, 12),
        (1, 4, 7, 1, 1, false, 9),
        (1, 64, 7, 1, 2, false, if cfg!(miri) { 90 } else { 9000 }),
        (3, 2, 1, 1, 1, false, 5),
        (3, 3, 12, 6, 1, false, 3),
    ] {
        let x = rand_vec(cin * len, 1 + len as u64);
        let w = rand_vec(cout * cin * kernel, 2);
        let b = rand_vec(cout, 3);
        let (want, lout) = ref_conv(
            &x,
            cin,
            len,
            &w,
            cout,
            kernel,
            Some(&b),
            stride,
            dilation,
            replicate,
        );
        let pad = if replicate {
            PadMode::Replicate
        } else {
            PadMode::Zero
        };
        let conv = CausalConv1d::from_torch(
            &w,
            (cout, cin, kernel),
            Some(b.clone()),
            stride,
            dilation,
            pad,
        )
        .unwrap();
        let got = conv.forward(&Seq::from_channels_first(&x, cin, len), None);
        assert_eq!(got.t, lout);
        let err = max_abs_diff(&got.to_channels_first(), &want);
        assert!(
            err < 1e-5,
            "conv {cin}->{cout} k{kernel} s{stride} d{dilation}: {err}"
        );
    }
}

#[test]
fn conv_tiles_agree_with_one_tile() {
    // Long input: many tiles on several threads, with halos and replicate edges.
    let (cin, cout, len) = (8, 8, if cfg!(miri) { 300 } else { 5000 });
    let x = Seq::new(rand_vec(cin * len, 9), len, cin);
    let w = rand_vec(cout * cin * 4, 10);
    for (stride, pad) in [(2, PadMode::Replicate), (1, PadMode::Zero)] {
        let conv = CausalConv1d::from_torch(&w, (cout, cin, 4), None, stride, 1, pad).unwrap();
        let got = conv.forward(&x, Some(&Act::Elu));
        let mut xa = x.clone();
        Act::Elu.apply_inplace(&mut xa.data, cin);
        let (want, _) = ref_conv(
            &xa.to_channels_first(),
            cin,
            len,
            &w,
            cout,
            4,
            None,
            stride,
            1,
            pad == PadMode::Replicate,
        );
        assert!(max_abs_diff(&got.to_channels_first(), &want) < 1e-5);
    }
}
