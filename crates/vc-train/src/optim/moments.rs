//! AdamW's moments in the form the optimizer-state mode keeps them (docs/training.md §6.5):
//! f32 tensors, or 8-bit block codes with per-block f32 scales ([`vc_kernels::moment8`]
//! has the codes). The CPU kernels update codes in place; the autograd backend (what CUDA
//! runs) decodes a tensor with tensor ops, updates it in f32 and encodes it again, producing
//! the same bytes on the CPU.

use candle_core::{DType, Device, Result, Tensor};

use vc_kernels::moment8;

/// Which moment: the first is signed, the second (kept as √v) is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    First,
    Second,
}

/// One moment of one parameter (or of a rank's rows of it).
#[derive(Debug, Clone)]
pub enum Moment {
    F32(Tensor),
    Codes8(Codes8),
}

/// 8-bit codes: `codes` u8 with the parameter's shape, `scales` f32 `(rows, blocks per row)`.
#[derive(Debug, Clone)]
pub struct Codes8 {
    pub codes: Tensor,
    pub scales: Tensor,
    pub which: Which,
}

impl Moment {
    /// Zeros for a tensor of `shape`, 8-bit when `eight_bit` (the caller decides from the
    /// full tensor's shape, [`moment8::quantizes`], so that every shard of it agrees).
    pub fn zeros(shape: &[usize], eight_bit: bool, which: Which, device: &Device) -> Result<Self> {
        if !eight_bit {
            return Ok(Moment::F32(Tensor::zeros(shape, DType::F32, device)?));
        }
        // What [`Self::encode`] makes of zeros, without its f32 temporaries (several times the
        // tensor's size, docs/training.md §6.9): scale 0, and the code of 0 — 128 for the signed
        // first moment, 0 for the second.
        let (rows, cols) = moment8::rows_cols(shape);
        let zero_code = match which {
            Which::First => 128u8,
            Which::Second => 0u8,
        };
        Ok(Moment::Codes8(Codes8 {
            codes: Tensor::full(zero_code, shape, device)?,
            scales: Tensor::zeros((rows, moment8::blocks_per_row(cols)), DType::F32, device)?,
            which,
        }))
    }

    /// `values` (f32) in the form `eight_bit` asks for.
    pub fn encode(values: &Tensor, eight_bit: bool, which: Which) -> Result<Self> {
        if !eight_bit {
            // A separate buffer: the CPU kernels update it in place.
            return Ok(Moment::F32(values.to_dtype(DType::F32)?.copy()?));
        }
        let shape = values.dims().to_vec();
        let (rows, cols) = moment8::rows_cols(&shape);
        let bw = moment8::block_width(cols);
        let nb = moment8::blocks_per_row(cols);
        let x = values.to_dtype(DType::F32)?.reshape((rows, nb, bw))?;
        let (codes, scales) = match which {
            Which::First => {
                let scale = x.abs()?.max_keepdim(2)?;
                let r = x.abs()?.broadcast_div(&nonzero(&scale)?)?;
                let k = r
                    .log()?
                    .affine(moment8::signed_log_factor() as f64, 127.0)?
                    .round()?
                    .clamp(0f32, 127f32)?;
                let codes = (k * x.sign()?)?.affine(1.0, 128.0)?;
                (codes, scale)
            }
            Which::Second => {
                let s = x.sqrt()?;
                let scale = s.max_keepdim(2)?;
                let r = s.broadcast_div(&nonzero(&scale)?)?;
                let k = r
                    .log()?
                    .affine(moment8::unsigned_log_factor() as f64, 255.0)?
                    .round()?
                    .clamp(1f32, 255f32)?;
                let codes = (k * r.gt(0f32)?.to_dtype(DType::F32)?)?;
                (codes, scale)
            }
        };
        Ok(Moment::Codes8(Codes8 {
            codes: codes.to_dtype(DType::U8)?.reshape(shape)?,
            scales: scales.reshape((rows, nb))?.contiguous()?,
            which,
        }))
    }

    /// The values as an f32 tensor.
    pub fn decode(&self) -> Result<Tensor> {
        match self {
            Moment::F32(t) => Ok(t.clone()),
            Moment::Codes8(c) => c.decode(),
        }
    }

    /// The same form (f32 or 8-bit) holding `values`.
    pub fn encode_like(&self, values: &Tensor) -> Result<Self> {
        match self {
            Moment::F32(_) => Ok(Moment::F32(values.to_dtype(DType::F32)?)),
            Moment::Codes8(c) => Self::encode(values, true, c.which),
        }
    }

    /// Bytes held (codes and scales for 8-bit moments).
    pub fn bytes(&self) -> usize {
        match self {
            Moment::F32(t) => t.elem_count() * 4,
            Moment::Codes8(c) => c.codes.elem_count() + c.scales.elem_count() * 4,
        }
    }

    pub fn dims(&self) -> &[usize] {
        match self {
            Moment::F32(t) => t.dims(),
            Moment::Codes8(c) => c.codes.dims(),
        }
    }
}

/// `scale`, with 1 where it is 0 (an all-zero block, whose values then divide to 0): the exact
/// scale otherwise, subnormal ones included, as the kernels divide by it.
fn nonzero(scale: &Tensor) -> Result<Tensor> {
    scale + scale.eq(0f32)?.to_dtype(DType::F32)?
}

impl Codes8 {
    pub fn decode(&self) -> Result<Tensor> {
        let shape = self.codes.dims().to_vec();
        let (rows, cols) = moment8::rows_cols(&shape);
        let nb = moment8::blocks_per_row(cols);
        let bw = moment8::block_width(cols);
        let dev = self.codes.device();
        let table = match self.which {
            Which::First => moment8::signed_table(),
            Which::Second => moment8::unsigned_table(),
        };
        let table = Tensor::new(table.as_slice(), dev)?;
        // u32 indices: candle's index_select reads the largest value of the index type as
        // "padding" (a zero row), and 255 is a code.
        let unit = table
            .index_select(&self.codes.flatten_all()?.to_dtype(DType::U32)?, 0)?
            .reshape((rows, nb, bw))?;
        let x = unit.broadcast_mul(&self.scales.reshape((rows, nb, 1))?)?;
        let x = match self.which {
            Which::First => x,
            Which::Second => x.sqr()?,
        };
        x.reshape(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-op codes (the CUDA path) equal the slice kernels' byte for byte on the CPU,
    /// and decode to the same values.
    #[test]
    fn zeros_are_the_encoding_of_zeros() {
        let dev = Device::Cpu;
        for shape in [&[6usize, 1024][..], &[300, 20], &[3, 7, 512]] {
            let z = Tensor::zeros(shape, DType::F32, &dev).unwrap();
            for which in [Which::First, Which::Second] {
                let (Moment::Codes8(a), Moment::Codes8(b)) = (
                    Moment::zeros(shape, true, which, &dev).unwrap(),
                    Moment::encode(&z, true, which).unwrap(),
                ) else {
                    panic!("8-bit moments expected");
                };
                let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                let f = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(bytes(&a.codes), bytes(&b.codes), "{shape:?} {which:?}");
                assert_eq!(a.codes.dims(), b.codes.dims());
                assert_eq!(f(&a.scales), f(&b.scales));
                assert_eq!(a.scales.dims(), b.scales.dims());
            }
        }
    }

    #[test]
    fn tensor_codes_equal_the_kernels() {
        let dev = Device::Cpu;
        let (rows, cols) = (6, 1024);
        // The last row is subnormal (a moment decayed for long without gradient).
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let tiny = if i >= (rows - 1) * cols { 1e-37 } else { 1.0 };
                (i as f32 * 0.37).sin() * (1.0 + (i % 13) as f32).powi(2) * 1e-3 * tiny
            })
            .collect();
        for which in [Which::First, Which::Second] {
            let vals: Vec<f32> = match which {
                Which::First => x.clone(),
                Which::Second => x.iter().map(|v| v * v).collect(),
            };
            let t = Tensor::from_vec(vals.clone(), (rows, cols), &dev).unwrap();
            let Moment::Codes8(c) = Moment::encode(&t, true, which).unwrap() else {
                panic!("not 8-bit")
            };
            let codes: Vec<u8> = c.codes.flatten_all().unwrap().to_vec1().unwrap();
            let scales: Vec<f32> = c.scales.flatten_all().unwrap().to_vec1().unwrap();
            let bw = moment8::block_width(cols);
            let mut want = vec![0u8; vals.len()];
            let mut want_scales = Vec::new();
            let mut want_back = vec![0f32; vals.len()];
            for (i, (blk, out)) in vals.chunks(bw).zip(want.chunks_mut(bw)).enumerate() {
                let s = match which {
                    Which::First => moment8::encode_signed(blk, out),
                    Which::Second => moment8::encode_sqrt(blk, out),
                };
                want_scales.push(s);
                let back = &mut want_back[i * bw..(i + 1) * bw];
                match which {
                    Which::First => moment8::decode_signed(out, s, back),
                    Which::Second => moment8::decode_sqrt(out, s, back),
                }
            }
            assert_eq!(codes, want, "{which:?}");
            assert_eq!(scales, want_scales, "{which:?}");
            let back: Vec<f32> = c
                .decode()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let diff = back
                .iter()
                .zip(&want_back)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                diff.is_none(),
                "{which:?}: value {diff:?} decodes to {:?}, the kernel to {:?}",
                diff.map(|i| back[i]),
                diff.map(|i| want_back[i])
            );
        }
    }
}

#[cfg(test)]
mod step_tests {
    use super::*;
    use crate::optim::{AdamState, AdamW, Grad};
    use crate::step::params::{Masters, Param};
    use crate::step::units::Unit;

    /// One AdamW step on 8-bit moments through the tensor ops and through the fused CPU
    /// kernel: the same codes, scales and weights.
    #[test]
    fn the_fused_kernel_and_the_tensor_ops_agree_on_eight_bit_moments() {
        let dev = Device::Cpu;
        let (rows, cols) = (2048, 8);
        let vals = |seed: f32, zero_every: usize| -> Tensor {
            let v: Vec<f32> = (0..rows * cols)
                .map(|i| {
                    if (i / cols) % zero_every == 0 {
                        0.0
                    } else {
                        (i as f32 * 0.731 + seed).sin() * 1e-2
                    }
                })
                .collect();
            Tensor::from_vec(v, (rows, cols), &dev).unwrap()
        };
        let master = vals(1.0, 1_000_000);
        let opt = AdamW::new(0.01);
        let mut outs = Vec::new();
        for on_host in [false, true] {
            let p = Param::new(
                "talker.codec_head.weight".into(),
                Unit::Head,
                master.clone(),
                DType::BF16,
                Masters::Separate,
                &dev,
                false,
            )
            .unwrap();
            let mut params = vec![p];
            let mut state = AdamState::zeros(&params, |_| true).unwrap();
            for t in 0..3 {
                let g = vals(2.0 + t as f32, 3);
                opt.step(
                    &mut state,
                    &mut params,
                    &[Grad::Dense(g)],
                    1e-3,
                    0.5,
                    on_host,
                )
                .unwrap();
            }
            let Moment::Codes8(c) = &state.m[0] else {
                panic!("8-bit")
            };
            let codes: Vec<u8> = c.codes.flatten_all().unwrap().to_vec1().unwrap();
            let scales: Vec<f32> = c.scales.flatten_all().unwrap().to_vec1().unwrap();
            let w: Vec<f32> = params[0]
                .master()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            outs.push((codes, scales, w));
        }
        let i = outs[0].0.iter().zip(&outs[1].0).position(|(a, b)| a != b);
        assert!(
            i.is_none(),
            "codes differ at {i:?}: {:?} vs {:?}, scales {:?} vs {:?}",
            i.map(|i| outs[0].0[i]),
            i.map(|i| outs[1].0[i]),
            i.map(|i| outs[0].1[i / 8]),
            i.map(|i| outs[1].1[i / 8])
        );
        assert!(outs[0].1 == outs[1].1 && outs[0].2 == outs[1].2);
    }
}
