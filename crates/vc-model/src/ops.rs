//! Numeric primitives shared by the talker and the code predictor, in three modes chosen once
//! when a model is built ([`Numerics`]):
//!
//! - [`Numerics::Fused`]: inference. candle's fused kernels, and our bf16 matmul for
//!   bf16-stored weights; no gradients.
//! - [`Numerics::Autograd`]: training on any device and dtype through candle's autograd over
//!   plain tensor ops. In candle 0.11 `candle_nn::ops::{rms_norm, softmax_last_dim}` and
//!   `candle_nn::rotary_emb::rope` record **no backward op** (gradients silently stop there),
//!   so this mode builds the same functions from plain ops. It is what CUDA runs.
//! - [`Numerics::Kernels`]: training on the CPU in f32 through the kernels with hand-written
//!   backward passes in [`super::autograd_ops`] (one autograd node per layer function).
//!
//! All modes follow the official numerics (docs/model.md §4.1, §12): RMSNorm statistics in
//! f32, softmax in f32, RoPE tables computed in f32 and cast to the activation dtype.

use candle_core::{DType, Device, Result, Tensor, D};

use super::autograd_ops::RopeHalfTables;

/// How the blocks compute (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// candle's fused kernels; no gradients flow through them.
    #[default]
    Fused,
    /// Plain tensor ops under candle's autograd, on any device.
    Autograd,
    /// The CPU f32 training kernels with hand-written backward passes.
    Kernels,
}

impl Numerics {
    /// Whether gradients flow (the training modes).
    pub fn differentiable(self) -> bool {
        self != Numerics::Fused
    }

    /// Checks that this mode can run on `device` with activations in `dtype`.
    pub fn check(self, device: &Device, dtype: DType) -> Result<()> {
        if self == Numerics::Kernels && !(device.is_cpu() && dtype == DType::F32) {
            candle_core::bail!(
                "the CPU training kernels need f32 tensors on the CPU, not {dtype:?} on {device:?}"
            );
        }
        Ok(())
    }
}

/// `x @ w^T (+ b)` for `x` of shape `(..., in)` and `w` of shape `(out, in)` (PyTorch layout).
///
/// A weight stored narrower than the activations (bf16 matrices with f32 activations,
/// `bf16-weights`) is widened in the product only: products and sums stay in the
/// activation dtype (see [`super::bf16_matmul`]).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, numerics: Numerics) -> Result<Tensor> {
    if numerics == Numerics::Kernels {
        return super::autograd_ops::linear(x, w, b);
    }
    let dims = x.dims();
    let (out, inp) = w.dims2()?;
    let rows = x.elem_count() / inp.max(1);
    let x2 = x.reshape((rows, inp))?;
    let y = if w.dtype() == x.dtype() {
        x2.matmul(&w.t()?)?
    } else if let Some(y) = super::bf16_matmul::try_matmul_t(&x2, w)? {
        y
    } else {
        x2.matmul(&w.to_dtype(x.dtype())?.t()?)?
    };
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut shape = dims.to_vec();
    *shape.last_mut().expect("linear input has rank >= 1") = out;
    y.reshape(shape)
}

/// Rows of `table` `(V, H)` selected by integer `ids` of any shape; returns `ids.shape ++ [H]`.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (_, h) = table.dims2()?;
    let mut shape = ids.dims().to_vec();
    shape.push(h);
    table.index_select(&ids.flatten_all()?, 0)?.reshape(shape)
}

/// `Qwen3TTSRMSNorm` (docs/model.md §4.1): `x * rsqrt(mean(x²) + eps)` computed in f32, cast back
/// to the input dtype, then multiplied by `weight` (over the last dimension).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, numerics: Numerics) -> Result<Tensor> {
    match numerics {
        // The fused kernel also accumulates in f32 but multiplies by the weight before the cast
        // back; the difference only shows in bf16 and is below bf16 resolution.
        Numerics::Fused => candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps as f32),
        Numerics::Kernels => super::autograd_ops::rms_norm(x, weight, eps),
        Numerics::Autograd => {
            let dtype = x.dtype();
            let xf = x.to_dtype(DType::F32)?;
            let inv_rms = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
                .sqrt()?
                .recip()?;
            xf.broadcast_mul(&inv_rms)?
                .to_dtype(dtype)?
                .broadcast_mul(weight)
        }
    }
}

/// Softmax over the last dimension (callers pass f32 scores, docs/model.md §12). `-inf` entries
/// give exact zeros; every row must have at least one finite entry.
pub fn softmax_last_dim(x: &Tensor, numerics: Numerics) -> Result<Tensor> {
    match numerics {
        Numerics::Fused => candle_nn::ops::softmax_last_dim(&x.contiguous()?),
        Numerics::Autograd | Numerics::Kernels => {
            // The max only stabilises the exponent; its gradient cancels, so it is detached.
            let max = x.max_keepdim(D::Minus1)?.detach();
            let e = x.broadcast_sub(&max)?.exp()?;
            e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
        }
    }
}

/// 1-D rotary position embedding, NeoX `rotate_half` layout (docs/model.md §4.1, §12): channel `i`
/// and `i + head_dim/2` rotate together with frequency `inv_freq[i] = theta^(-2i/head_dim)`.
#[derive(Debug, Clone)]
pub struct Rope {
    /// `(1, 1, head_dim/2)` f32.
    inv_freq: Tensor,
    head_dim: usize,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f64, device: &candle_core::Device) -> Result<Self> {
        if !head_dim.is_multiple_of(2) {
            candle_core::bail!("RoPE needs an even head_dim, got {head_dim}");
        }
        let half = head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)) as f32)
            .collect();
        Ok(Self {
            inv_freq: Tensor::from_vec(inv, (1, 1, half), device)?,
            head_dim,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// cos/sin tables for `positions` `(B, S)` (f32; B may be 1 when every row shares them),
    /// computed in f32 (`freqs = pos * inv_freq`, as HF) and cast to `dtype`.
    pub fn tables(
        &self,
        positions: &Tensor,
        dtype: DType,
        numerics: Numerics,
    ) -> Result<RopeTables> {
        let freqs = positions
            .unsqueeze(D::Minus1)?
            .broadcast_mul(&self.inv_freq)?; // (B, S, half)
        let (cos, sin) = (freqs.cos()?, freqs.sin()?);
        // The CPU training kernels rotate token-major `(B, S, heads·head_dim)` tensors directly.
        let token_major = if numerics == Numerics::Kernels {
            Some(RopeHalfTables::new(&cos, &sin)?)
        } else {
            None
        };
        let (cos, sin) = match numerics {
            // candle's kernel takes half-width tables, (S, half) or (B, S, half).
            Numerics::Fused => {
                let b = cos.dim(0)?;
                let (cos, sin) = if b == 1 {
                    (cos.squeeze(0)?, sin.squeeze(0)?)
                } else {
                    (cos, sin)
                };
                (
                    cos.to_dtype(dtype)?.contiguous()?,
                    sin.to_dtype(dtype)?.contiguous()?,
                )
            }
            // Full width `cat(freqs, freqs)`, shaped (B, 1, S, head_dim) to broadcast over heads.
            Numerics::Autograd | Numerics::Kernels => {
                let full = |t: &Tensor| -> Result<Tensor> {
                    Tensor::cat(&[t, t], D::Minus1)?
                        .to_dtype(dtype)?
                        .unsqueeze(1)
                };
                (full(&cos)?, full(&sin)?)
            }
        };
        Ok(RopeTables {
            cos,
            sin,
            numerics,
            token_major,
        })
    }
}

/// Position-specific RoPE tables for one forward pass, shared by all layers.
#[derive(Debug, Clone)]
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
    numerics: Numerics,
    token_major: Option<RopeHalfTables>,
}

impl RopeTables {
    /// The CPU training kernels' tables ([`Numerics::Kernels`] only).
    pub fn token_major(&self) -> Option<&RopeHalfTables> {
        self.token_major.as_ref()
    }

    /// Rotates `x` of shape `(B, heads, S, head_dim)`: `x*cos + rotate_half(x)*sin`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        match self.numerics {
            Numerics::Fused => candle_nn::rotary_emb::rope(&x.contiguous()?, &self.cos, &self.sin),
            Numerics::Autograd | Numerics::Kernels => {
                x.broadcast_mul(&self.cos)? + rotate_half(x)?.broadcast_mul(&self.sin)?
            }
        }
    }
}

/// `cat(-x2, x1)` where `x1, x2` are the two halves of the last dimension.
pub fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        // Deterministic pseudo-random values without depending on a global RNG.
        let n: usize = shape.iter().product();
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn modes_agree() {
        let x = randn(&[2, 3, 5, 8], 1);
        let w = randn(&[8], 2);
        let a = rms_norm(&x, &w, 1e-6, Numerics::Fused).unwrap();
        let b = rms_norm(&x, &w, 1e-6, Numerics::Autograd).unwrap();
        assert!(max_diff(&a, &b) < 1e-5);

        let mut s = randn(&[2, 3, 5, 7], 3);
        // A masked entry must come out as an exact zero in both modes.
        let mask: Vec<f32> = (0..7)
            .map(|i| if i == 2 { f32::NEG_INFINITY } else { 0.0 })
            .collect();
        s = s
            .broadcast_add(&Tensor::new(mask.as_slice(), &Device::Cpu).unwrap())
            .unwrap();
        let a = softmax_last_dim(&s, Numerics::Fused).unwrap();
        let b = softmax_last_dim(&s, Numerics::Autograd).unwrap();
        assert!(max_diff(&a, &b) < 1e-6);
        let masked = b
            .narrow(3, 2, 1)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(masked, 0.0);

        let rope = Rope::new(8, 1e6, &Device::Cpu).unwrap();
        for b_rows in [1usize, 2] {
            let pos: Vec<f32> = (0..b_rows * 5)
                .map(|i| (i % 5 + 3 * (i / 5)) as f32)
                .collect();
            let pos = Tensor::from_vec(pos, (b_rows, 5), &Device::Cpu).unwrap();
            let x = randn(&[2, 3, 5, 8], 4);
            let a = rope
                .tables(&pos, DType::F32, Numerics::Fused)
                .unwrap()
                .apply(&x)
                .unwrap();
            let b = rope
                .tables(&pos, DType::F32, Numerics::Autograd)
                .unwrap()
                .apply(&x)
                .unwrap();
            assert!(max_diff(&a, &b) < 1e-5, "rope rows={b_rows}");
        }
    }

    #[test]
    fn rope_matches_definition() {
        // Channel i pairs with i + d/2 and rotates by pos * theta^(-2i/d).
        let rope = Rope::new(4, 100.0, &Device::Cpu).unwrap();
        let x = Tensor::new(&[[[[1f32, 2., 3., 4.]]]], &Device::Cpu).unwrap();
        let pos = Tensor::new(&[[7f32]], &Device::Cpu).unwrap();
        let y = rope
            .tables(&pos, DType::F32, Numerics::Autograd)
            .unwrap()
            .apply(&x)
            .unwrap();
        let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
        let (a0, a1): (f64, f64) = (7.0, 7.0 / 10.0);
        let want = [
            1.0 * a0.cos() - 3.0 * a0.sin(),
            2.0 * a1.cos() - 4.0 * a1.sin(),
            3.0 * a0.cos() + 1.0 * a0.sin(),
            4.0 * a1.cos() + 2.0 * a1.sin(),
        ];
        for (g, w) in y.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-5, "{y:?} vs {want:?}");
        }
    }

    #[test]
    fn differentiable_mode_has_gradients_fused_does_not() {
        let x = Var::from_tensor(&randn(&[2, 4, 8], 5)).unwrap();
        let w = Var::from_tensor(&randn(&[8], 6)).unwrap();
        for (numerics, expect) in [
            (Numerics::Autograd, true),
            (Numerics::Kernels, true),
            (Numerics::Fused, false),
        ] {
            let y = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6, numerics).unwrap();
            let y = softmax_last_dim(&y, numerics).unwrap();
            let loss = (y * randn(&[2, 4, 8], 7)).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            assert_eq!(grads.get(w.as_tensor()).is_some(), expect, "{numerics:?}");
            assert_eq!(grads.get(x.as_tensor()).is_some(), expect, "{numerics:?}");
        }
    }

    #[test]
    fn linear_and_embedding_shapes() {
        let x = randn(&[2, 3, 4], 8);
        let w = randn(&[5, 4], 9);
        let b = randn(&[5], 10);
        let manual = x
            .broadcast_matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap();
        for numerics in [Numerics::Fused, Numerics::Autograd, Numerics::Kernels] {
            let y = linear(&x, &w, Some(&b), numerics).unwrap();
            assert_eq!(y.dims(), &[2, 3, 5]);
            assert!(max_diff(&y, &manual) < 1e-5, "{numerics:?}");
        }
        assert!(Numerics::Kernels.check(&Device::Cpu, DType::BF16).is_err());
        assert!(Numerics::Autograd.check(&Device::Cpu, DType::BF16).is_ok());
        let ids = Tensor::new(&[[1u32, 0], [4, 4]], &Device::Cpu).unwrap();
        let e = embedding(&w, &ids).unwrap();
        assert_eq!(e.dims(), &[2, 2, 4]);
        assert!(max_diff(&e.get(1).unwrap().get(0).unwrap(), &w.get(4).unwrap()) == 0.0);
    }
}
