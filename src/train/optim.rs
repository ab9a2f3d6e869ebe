//! The optimizer step of DESIGN §5: AdamW over fp32 masters with fp32 moments (PyTorch's
//! decoupled form with bias correction), global-norm gradient clipping, and the learning-rate
//! schedule (linear warm-up, then cosine decay).

use candle_core::{DType, Result, Tensor};

use super::cpu_ops;
use super::params::Param;
use super::sparse::{self, RowGrad};

/// AdamW hyper-parameters (PyTorch defaults for betas and eps).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamW {
    pub fn new(weight_decay: f64) -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        }
    }

    /// One update of a parameter, exactly in the order of `torch.optim.adamw._single_tensor_adamw`:
    /// `p *= 1 − lr·wd; m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²;
    /// p −= lr/(1−β1^t) · m / (√v / √(1−β2^t) + eps)`. `t` is the 1-based step; all tensors
    /// f32. Returns the new `(p, m, v)`.
    pub fn update(
        &self,
        t: u64,
        lr: f64,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let p = if self.weight_decay != 0.0 {
            p.affine(1.0 - lr * self.weight_decay, 0.0)?
        } else {
            p.clone()
        };
        let m = (m.affine(self.beta1, 0.0)? + g.affine(1.0 - self.beta1, 0.0)?)?;
        let v = (v.affine(self.beta2, 0.0)? + g.sqr()?.affine(1.0 - self.beta2, 0.0)?)?;
        let bc1 = 1.0 - self.beta1.powi(t as i32);
        let bc2 = 1.0 - self.beta2.powi(t as i32);
        let denom = v.sqrt()?.affine(1.0 / bc2.sqrt(), self.eps)?;
        let p = (p - (m.div(&denom)?).affine(lr / bc1, 0.0)?)?;
        Ok((p, m, v))
    }

    /// One update of `param` with gradient `g` scaled by `clip`: in place with the CPU kernels
    /// when the master, moments and gradient are contiguous f32 CPU tensors, else through
    /// [`Self::update`]. Same formula either way.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        t: u64,
        lr: f64,
        clip: f64,
        param: &mut Param,
        g: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
    ) -> Result<()> {
        let bc1 = 1.0 - self.beta1.powi(t as i32);
        let bc2 = 1.0 - self.beta2.powi(t as i32);
        if let Some(p) = param.master_in_place() {
            if [p, g, &*m, &*v].iter().all(|x| cpu_ops::supported(x)) {
                m.inplace_op2(
                    g,
                    &cpu_ops::FirstMoment {
                        weight: (1.0 - self.beta1) as f32,
                        clip: clip as f32,
                    },
                )?;
                v.inplace_op2(
                    g,
                    &cpu_ops::SecondMoment {
                        beta2: self.beta2 as f32,
                        clip: clip as f32,
                    },
                )?;
                p.inplace_op3(
                    m,
                    v,
                    &cpu_ops::ParamUpdate {
                        decay: (1.0 - lr * self.weight_decay) as f32,
                        step_size: (lr / bc1) as f32,
                        bc2_sqrt: bc2.sqrt() as f32,
                        eps: self.eps as f32,
                    },
                )?;
                return Ok(());
            }
        }
        let g = if clip < 1.0 {
            g.affine(clip, 0.0)?
        } else {
            g.clone()
        };
        let (np, nm, nv) = self.update(t, lr, &param.master(), &g, m, v)?;
        param.set_master(np)?;
        *m = nm;
        *v = nv;
        Ok(())
    }
}

impl AdamW {
    /// One update of `param` (a table updated in place on the CPU) with a row-sparse gradient
    /// scaled by `clip`; rows without a gradient are updated as with a zero gradient.
    #[allow(clippy::too_many_arguments)]
    pub fn apply_rows(
        &self,
        t: u64,
        lr: f64,
        clip: f64,
        param: &Param,
        g: &RowGrad,
        m: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let Some(p) = param.master_in_place() else {
            candle_core::bail!("{}: row-sparse updates need an f32 master", param.name)
        };
        let bc1 = 1.0 - self.beta1.powi(t as i32);
        let bc2 = 1.0 - self.beta2.powi(t as i32);
        m.inplace_op1(&sparse::SparseFirstMoment {
            grad: g,
            weight: (1.0 - self.beta1) as f32,
            clip: clip as f32,
        })?;
        v.inplace_op1(&sparse::SparseSecondMoment {
            grad: g,
            beta2: self.beta2 as f32,
            clip: clip as f32,
        })?;
        p.inplace_op3(
            m,
            v,
            &cpu_ops::ParamUpdate {
                decay: (1.0 - lr * self.weight_decay) as f32,
                step_size: (lr / bc1) as f32,
                bc2_sqrt: bc2.sqrt() as f32,
                eps: self.eps as f32,
            },
        )
    }
}

/// `acc += g` (in place on the CPU).
pub fn accumulate(acc: Tensor, g: &Tensor) -> Result<Tensor> {
    if cpu_ops::supported(&acc) && cpu_ops::supported(g) {
        acc.inplace_op2(g, &cpu_ops::AddAssign)?;
        Ok(acc)
    } else {
        acc + g
    }
}

/// AdamW's per-parameter state: fp32 first and second moments (in parameter order) and the
/// number of updates taken.
#[derive(Debug, Clone)]
pub struct AdamState {
    pub step: u64,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
}

impl AdamState {
    /// Zero moments shaped like `masters` (fp32).
    pub fn zeros(masters: &[Tensor]) -> Result<Self> {
        // Separate buffers: the moments are updated in place.
        let z = || -> Result<Vec<Tensor>> {
            masters
                .iter()
                .map(|t| Tensor::zeros(t.shape(), DType::F32, t.device()))
                .collect()
        };
        Ok(Self {
            step: 0,
            m: z()?,
            v: z()?,
        })
    }
}

/// Global L2 norm of `grads`: per-tensor sums of squares (f64 on the CPU, f32 elsewhere) added
/// up in f64 in the given order.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    let mut total = 0f64;
    for g in grads {
        total += sum_squares(g)?;
    }
    Ok(total.sqrt())
}

/// Σ g² of one gradient (in f64 without temporaries on the CPU, f32 sums elsewhere).
pub fn sum_squares(g: &Tensor) -> Result<f64> {
    Ok(if cpu_ops::supported(g) {
        g.apply_op1_no_bwd(&cpu_ops::SumSquares)?
            .to_scalar::<f64>()?
    } else {
        g.to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f32>()? as f64
    })
}

/// `torch.nn.utils.clip_grad_norm_`'s factor: `min(1, max_norm / (norm + 1e-6))`; 1 when
/// clipping is off (`max_norm` 0).
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (norm + 1e-6)).min(1.0)
}

/// Learning-rate schedule: linear warm-up over `warmup` steps to `peak`, then cosine decay
/// towards 0 over the remaining steps of `total`. `step` is 1-based (the step being taken);
/// the last step still has a small positive rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub peak: f64,
    pub warmup: usize,
    pub total: usize,
}

impl Schedule {
    pub fn lr(&self, step: usize) -> f64 {
        if self.warmup > 0 && step <= self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        let decay = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup - 1) as f64 / decay).clamp(0.0, 1.0);
        self.peak * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adamw_matches_a_hand_computed_step() {
        let dev = Device::Cpu;
        let p = Tensor::new(&[1.0f32, -2.0], &dev).unwrap();
        let g = Tensor::new(&[0.5f32, 0.25], &dev).unwrap();
        let z = p.zeros_like().unwrap();
        let opt = AdamW::new(0.1);
        let (p1, m1, v1) = opt.update(1, 0.01, &p, &g, &z, &z).unwrap();
        // Step 1: m̂ = g, v̂ = g², so the Adam part is lr·g/(|g|+eps) = ±lr.
        let expect = [1.0 * (1.0 - 0.001) - 0.01, -2.0 * (1.0 - 0.001) - 0.01];
        let got: Vec<f32> = p1.to_vec1().unwrap();
        for (a, b) in got.iter().zip(expect) {
            assert!((*a as f64 - b).abs() < 1e-6, "{got:?}");
        }
        assert_eq!(m1.to_vec1::<f32>().unwrap(), vec![0.05, 0.025]);
        let v: Vec<f32> = v1.to_vec1().unwrap();
        assert!((v[0] - 0.00025).abs() < 1e-9 && (v[1] - 0.0000625).abs() < 1e-9);
        // Step 2 with the same gradient: bias correction keeps the step at ≈ lr.
        let (p2, _, _) = opt.update(2, 0.01, &p1, &g, &m1, &v1).unwrap();
        let d: Vec<f32> = (p2 - &p1.affine(1.0 - 0.001, 0.0).unwrap())
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            (d[0] + 0.01).abs() < 1e-6 && (d[1] + 0.01).abs() < 1e-6,
            "{d:?}"
        );
    }

    #[test]
    fn clipping_and_schedule() {
        let dev = Device::Cpu;
        let g = [
            Tensor::new(&[3.0f32], &dev).unwrap(),
            Tensor::new(&[[4.0f32]], &dev).unwrap(),
        ];
        assert_eq!(global_norm(&g).unwrap(), 5.0);
        assert!((clip_factor(5.0, 1.0) - 1.0 / (5.0 + 1e-6)).abs() < 1e-12);
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        assert_eq!(clip_factor(50.0, 0.0), 1.0);
        let s = Schedule {
            peak: 1.0,
            warmup: 4,
            total: 14,
        };
        assert_eq!(s.lr(1), 0.25);
        assert_eq!(s.lr(4), 1.0);
        assert_eq!(s.lr(5), 1.0);
        assert!((s.lr(10) - 0.5).abs() < 1e-12);
        assert!(s.lr(14) > 0.0 && s.lr(14) < 0.03);
        let flat = Schedule {
            peak: 2.0,
            warmup: 0,
            total: 1,
        };
        assert_eq!(flat.lr(1), 2.0);
    }
}
