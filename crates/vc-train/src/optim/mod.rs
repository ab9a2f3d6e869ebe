//! The optimizer step of docs/training.md §6: AdamW over fp32 masters with fp32 moments (PyTorch's
//! decoupled form with bias correction), global-norm gradient clipping, and the learning-rate
//! schedule (linear warm-up, then cosine decay). Its state's forms: [`moments`] in memory,
//! [`saved_state`] in checkpoints; [`host_kernels`] are its loops over host memory.

pub mod host_kernels;
pub mod moments;
pub mod saved_state;

use candle_core::{DType, Result, Tensor};

use self::host_kernels::GradRows;
use self::moments::{Moment, Which};
use crate::step::params::Param;
use crate::step::text_grad::{self, RowGrad};

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

    /// The constants of step `t` (1-based) at rate `lr` with clipping factor `clip`, as f32, the
    /// way the element-wise loops and [`Self::update`] both use them.
    pub fn consts(&self, t: u64, lr: f64, clip: f64) -> vc_kernels::optim::StepConsts {
        let bc1 = 1.0 - self.beta1.powi(t as i32);
        let bc2 = 1.0 - self.beta2.powi(t as i32);
        vc_kernels::optim::StepConsts {
            weight1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            clip: clip as f32,
            decay: (1.0 - lr * self.weight_decay) as f32,
            step: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: self.eps as f32,
        }
    }

    /// One update of a parameter, `torch.optim.adamw._single_tensor_adamw`'s:
    /// `p *= 1 − lr·wd; m = lerp(m, g, 1−β1); v = β2·v + (1−β2)·g²;
    /// p −= lr/(1−β1^t) · m / (√v / √(1−β2^t) + eps)`. `t` is the 1-based step; all tensors
    /// f32. Every value is computed with the operations, in the order and with the f32 constants
    /// of the CPU kernels (`vc_kernels::optim`), so on the CPU both give the same bits: the
    /// optimizer offloaded to the host (kernels) updates as the device's tensor ops do.
    /// Returns the new `(p, m, v)`.
    pub fn update(
        &self,
        t: u64,
        lr: f64,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let k = self.consts(t, lr, 1.0);
        let p = if self.weight_decay != 0.0 {
            p.affine(k.decay as f64, 0.0)?
        } else {
            p.clone()
        };
        let m = (m + (g - m)?.affine(k.weight1 as f64, 0.0)?)?;
        let w2 = 1.0f32 - k.beta2;
        let v = (v.affine(k.beta2 as f64, 0.0)? + (g.affine(w2 as f64, 0.0)? * g)?)?;
        let bc2 = Tensor::new(k.bc2_sqrt, v.device())?;
        let denom = v.sqrt()?.broadcast_div(&bc2)?.affine(1.0, k.eps as f64)?;
        let p = (p - (m.div(&denom)?).affine(k.step as f64, 0.0)?)?;
        Ok((p, m, v))
    }

    /// One optimizer step over every parameter, all or nothing: every gradient is checked
    /// against its parameter first, then all parameters are updated (gradients scaled by
    /// `clip`), and only then is the step counted. `on_host` selects the CPU kernels, which
    /// update the host copies in place — the `Var`s themselves with the CPU kernels backend, the
    /// offloaded masters otherwise (docs/training.md §6.6), whose compute copies then follow;
    /// otherwise the update is computed with tensor ops ([`Self::update`]) where the state lies
    /// and the masters (and their compute copies) replaced.
    pub fn step(
        &self,
        state: &mut AdamState,
        params: &mut [Param],
        grads: &[Grad],
        lr: f64,
        clip: f64,
        on_host: bool,
    ) -> anyhow::Result<()> {
        self.step_each(state, params, grads, lr, clip, on_host, &mut |_, _| Ok(()))
    }

    /// [`Self::step`], calling `updated(i, params)` as soon as parameter `i` has its new value
    /// (in parameter order, empty shards included), e.g. to start sending it while the next
    /// ones are updated (docs/distributed.md §4.6). An error of `updated` stops the step with
    /// the parameters before it updated and the step not counted: for errors that end the run
    /// (a failed collective), never for a step to be retried.
    #[allow(clippy::too_many_arguments)]
    pub fn step_each(
        &self,
        state: &mut AdamState,
        params: &mut [Param],
        grads: &[Grad],
        lr: f64,
        clip: f64,
        on_host: bool,
        updated: &mut dyn FnMut(usize, &[Param]) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            grads.len() == params.len() && state.m.len() == params.len(),
            "optimizer: {} gradients and {} moment pairs for {} parameters",
            grads.len(),
            state.m.len(),
            params.len()
        );
        let mut dense = Vec::with_capacity(params.len());
        let mut fused = Vec::with_capacity(params.len());
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let shape = p.shape();
            if p.elem_count() == 0 {
                // A rank's empty shard of a tensor (docs/distributed.md §4.5): nothing to update,
                // and no device operation on an empty tensor.
                dense.push(None);
                fused.push(false);
                continue;
            }
            for (what, t) in [("exp_avg", &state.m[i]), ("exp_avg_sq", &state.v[i])] {
                anyhow::ensure!(
                    t.dims() == shape,
                    "optimizer: {what} of {} has shape {:?}, expected {shape:?}",
                    p.name,
                    t.dims(),
                );
            }
            // The three-pass in-place loops cover f32 masters with f32 moments; the rest
            // takes the fused update.
            let host = p.host_weights();
            let plain = host.is_some_and(|(_, comp)| comp.is_none())
                && matches!((&state.m[i], &state.v[i]), (Moment::F32(_), Moment::F32(_)));
            fused.push(!plain);
            let can = on_host && host.is_some() && moments_on_cpu(&state.m[i], &state.v[i]);
            dense.push(match g {
                Grad::Dense(g) => {
                    anyhow::ensure!(
                        g.dims() == shape,
                        "optimizer: the gradient of {} has shape {:?}, expected {shape:?}",
                        p.name,
                        g.dims()
                    );
                    anyhow::ensure!(
                        !on_host || can,
                        "optimizer: {} cannot be updated on the host",
                        p.name
                    );
                    Some(g.clone())
                }
                Grad::Rows(rows) => {
                    anyhow::ensure!(
                        can,
                        "optimizer: {}: row-sparse gradients need the in-place CPU update",
                        p.name
                    );
                    anyhow::ensure!(
                        [rows.rows(), rows.width()] == shape,
                        "optimizer: the row gradient of {} is {}×{}, expected {shape:?}",
                        p.name,
                        rows.rows(),
                        rows.width()
                    );
                    None
                }
            });
        }
        let t = state.step + 1;
        for (i, g) in grads.iter().enumerate() {
            let p = &mut params[i];
            if p.elem_count() == 0 {
                updated(i, params)?;
                continue;
            }
            let (m, v) = (&state.m[i], &state.v[i]);
            // Promoted to f32 (on the host: brought over first) one tensor at a time, so that
            // a step never holds an f32 copy of every gradient (docs/training.md §6.9).
            let dense_f32 = match &dense[i] {
                Some(g) if on_host => Some(
                    g.to_device(&candle_core::Device::Cpu)?
                        .to_dtype(DType::F32)?
                        .contiguous()?,
                ),
                Some(g) => Some(g.to_dtype(DType::F32)?.contiguous()?),
                None => None,
            };
            match (g, &dense_f32) {
                (Grad::Rows(rows), _) => {
                    self.apply_on_host(t, lr, clip, p, GradRows::Sparse(rows), m, v, fused[i])?
                }
                (Grad::Dense(_), Some(g)) if on_host => {
                    self.apply_on_host(t, lr, clip, p, GradRows::Dense(g), m, v, fused[i])?
                }
                (Grad::Dense(_), Some(g)) => {
                    let g = if clip < 1.0 {
                        g.affine(clip, 0.0)?
                    } else {
                        g.clone()
                    };
                    let (md, vd) = (m.decode()?, v.decode()?);
                    let (np, nm, nv) = self.update(t, lr, &p.master()?, &g, &md, &vd)?;
                    p.set_master(np)?;
                    state.m[i] = state.m[i].encode_like(&nm)?;
                    state.v[i] = state.v[i].encode_like(&nv)?;
                }
                (Grad::Dense(_), None) => unreachable!("dense gradients are prepared above"),
            }
            updated(i, params)?;
        }
        state.step = t;
        Ok(())
    }

    /// One update of `param`'s host copy with the CPU kernels (the three-pass loops, or the
    /// fused one for 8-bit moments and compensated weights), then its compute copy refreshed.
    #[allow(clippy::too_many_arguments)]
    fn apply_on_host(
        &self,
        t: u64,
        lr: f64,
        clip: f64,
        param: &mut Param,
        g: GradRows,
        m: &Moment,
        v: &Moment,
        fused: bool,
    ) -> Result<()> {
        let k = self.consts(t, lr, clip);
        {
            let Some((w, comp)) = param.host_weights() else {
                candle_core::bail!("{}: no host copy to update", param.name)
            };
            if fused {
                host_kernels::fused_update(&param.name, w, comp, g, m, v, &k)?;
            } else {
                let (m, v) = (f32_moment(m)?, f32_moment(v)?);
                match g {
                    GradRows::Dense(g) => self.apply_in_place(w, g, m, v, &k)?,
                    GradRows::Sparse(rows) => self.apply_rows(w, rows, m, v, &k)?,
                }
            }
        }
        param.refresh_from_host()
    }

    /// One in-place update of an f32 master with the three-pass CPU kernels.
    fn apply_in_place(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        k: &vc_kernels::optim::StepConsts,
    ) -> Result<()> {
        m.inplace_op2(
            g,
            &host_kernels::FirstMoment {
                weight: k.weight1,
                clip: k.clip,
            },
        )?;
        v.inplace_op2(
            g,
            &host_kernels::SecondMoment {
                beta2: k.beta2,
                clip: k.clip,
            },
        )?;
        p.inplace_op3(m, v, &param_update(k))
    }

    /// One update of a table `p` (updated in place on the CPU) with a row-sparse gradient;
    /// rows without a gradient are updated as with a zero gradient.
    fn apply_rows(
        &self,
        p: &Tensor,
        g: &RowGrad,
        m: &Tensor,
        v: &Tensor,
        k: &vc_kernels::optim::StepConsts,
    ) -> Result<()> {
        m.inplace_op1(&text_grad::SparseFirstMoment {
            grad: g,
            weight: k.weight1,
            clip: k.clip,
        })?;
        v.inplace_op1(&text_grad::SparseSecondMoment {
            grad: g,
            beta2: k.beta2,
            clip: k.clip,
        })?;
        p.inplace_op3(m, v, &param_update(k))
    }
}

fn param_update(k: &vc_kernels::optim::StepConsts) -> host_kernels::ParamUpdate {
    host_kernels::ParamUpdate {
        decay: k.decay,
        step_size: k.step,
        bc2_sqrt: k.bc2_sqrt,
        eps: k.eps,
    }
}

fn moments_on_cpu(m: &Moment, v: &Moment) -> bool {
    [m, v].iter().all(|x| match x {
        Moment::F32(t) => host_kernels::supported(t),
        Moment::Codes8(c) => c.codes.device().is_cpu() && c.scales.device().is_cpu(),
    })
}

fn f32_moment(m: &Moment) -> Result<&Tensor> {
    match m {
        Moment::F32(t) => Ok(t),
        Moment::Codes8(_) => candle_core::bail!("8-bit moments take the fused update"),
    }
}

/// The gradient of one parameter for [`AdamW::step`].
pub enum Grad<'a> {
    Dense(Tensor),
    /// Row-sparse (the text embedding on the CPU, see [`crate::step::text_grad`]).
    Rows(&'a RowGrad),
}

/// `acc += g`: in place with the CPU kernels (`in_place`, contiguous f32 CPU tensors), else a
/// tensor add.
pub fn accumulate(acc: Tensor, g: &Tensor, in_place: bool) -> Result<Tensor> {
    if in_place && host_kernels::supported(&acc) && host_kernels::supported(g) {
        acc.inplace_op2(g, &host_kernels::AddAssign)?;
        Ok(acc)
    } else {
        acc + g
    }
}

/// AdamW's per-parameter state: first and second moments (in parameter order, f32 or 8-bit,
/// [`Moment`]) and the number of updates taken.
#[derive(Debug, Clone)]
pub struct AdamState {
    pub step: u64,
    pub m: Vec<Moment>,
    pub v: Vec<Moment>,
}

impl AdamState {
    /// Zero moments for `params`, 8-bit where `eight_bit(param)` says so.
    pub fn zeros(params: &[Param], eight_bit: impl Fn(&Param) -> bool) -> Result<Self> {
        let z = |which| -> Result<Vec<Moment>> {
            params
                .iter()
                .map(|p| Moment::zeros(p.shape(), eight_bit(p), which, &p.state_device()))
                .collect()
        };
        Ok(Self {
            step: 0,
            m: z(Which::First)?,
            v: z(Which::Second)?,
        })
    }

    /// Bytes the moments hold.
    pub fn bytes(&self) -> usize {
        self.m.iter().chain(&self.v).map(Moment::bytes).sum()
    }
}

/// What the optimizer state of `params` takes, in bytes: the optimizer's copy of the weights
/// (an fp32 master — a `Var` that is its own master counts as one — or a compensation), the
/// moments, and gradient accumulators in `grad` (the reduce dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateBytes {
    pub masters: usize,
    pub moments: usize,
    pub gradients: usize,
}

impl StateBytes {
    pub fn of(params: &[Param], adam: &AdamState, grad: DType) -> Self {
        let masters = params
            .iter()
            .map(|p| match p.master_bytes() {
                0 => p.elem_count() * 4,
                b => b,
            })
            .sum();
        let values: usize = params.iter().map(Param::elem_count).sum();
        Self {
            masters,
            moments: adam.bytes(),
            gradients: values * grad.size_in_bytes(),
        }
    }

    pub fn total(&self) -> usize {
        self.masters + self.moments + self.gradients
    }
}

impl std::fmt::Display for StateBytes {
    /// In MB (decimal), one decimal (three below 10 MB): "X MB (masters a, moments b,
    /// gradients c)".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let total = self.total() as f64 / 1e6;
        let digits = if total < 10.0 { 3 } else { 1 };
        let mb = |b: usize| format!("{:.*}", digits, b as f64 / 1e6);
        write!(
            f,
            "{} MB (masters {}, moments {}, gradients {})",
            mb(self.total()),
            mb(self.masters),
            mb(self.moments),
            mb(self.gradients)
        )
    }
}

/// Global L2 norm of `grads`: per-tensor sums of squares added up in f64 in the given order.
pub fn global_norm(grads: &[Tensor], kernels: bool) -> Result<f64> {
    let mut total = 0f64;
    for g in grads {
        total += sum_squares(g, kernels)?;
    }
    Ok(total.sqrt())
}

/// Σ g² of one gradient: in f64 without temporaries with the CPU kernels (`kernels`, a
/// contiguous f32 CPU tensor), else an f32 tensor reduction.
pub fn sum_squares(g: &Tensor, kernels: bool) -> Result<f64> {
    Ok(if kernels && host_kernels::supported(g) {
        g.apply_op1_no_bwd(&host_kernels::SumSquares)?
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
        // 1 − β2 is formed in f32 (0.001000047), as the CPU kernels form it.
        assert!((v[0] / 0.00025 - 1.0).abs() < 1e-4 && (v[1] / 0.0000625 - 1.0).abs() < 1e-4);
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

    /// A step whose second gradient is wrong fails before anything is updated: no parameter,
    /// moment or step count is half-applied (in both update paths).
    #[test]
    fn a_failed_step_changes_nothing() {
        use crate::step::params::{Masters, ParamStore};
        use vc_model::weights::Weights;
        let dev = Device::Cpu;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let tensors = std::collections::HashMap::from([
            (
                "talker.codec_head.weight".to_string(),
                Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev).unwrap(),
            ),
            (
                "talker.model.norm.weight".to_string(),
                Tensor::new(&[1.0f32, -1.0], &dev).unwrap(),
            ),
        ]);
        candle_core::safetensors::save(&tensors, &path).unwrap();
        let weights = Weights::load(&[path], DType::F32, &dev, |_| true).unwrap();
        let names: Vec<String> = tensors.keys().cloned().collect();
        let opt = AdamW::new(0.1);
        for (masters, in_place) in [(Masters::Shared, true), (Masters::Separate, false)] {
            let place = crate::step::params::Placement {
                device: dev.clone(),
                offload: false,
            };
            let mut store =
                ParamStore::new(&weights, &names, DType::F32, |_| masters, place, None).unwrap();
            let before: Vec<Vec<f32>> = store
                .params
                .iter()
                .map(|p| {
                    p.master()
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                })
                .collect();
            let mut state = AdamState::zeros(&store.params, |_| false).unwrap();
            assert_eq!(store.params[0].name, "talker.codec_head.weight");
            let good = Tensor::ones((2, 2), DType::F32, &dev).unwrap();
            let wrong = Tensor::ones(3, DType::F32, &dev).unwrap();
            let grads = [Grad::Dense(good.clone()), Grad::Dense(wrong)];
            let e = opt
                .step(&mut state, &mut store.params, &grads, 0.1, 1.0, in_place)
                .unwrap_err()
                .to_string();
            assert!(e.contains("talker.model.norm.weight"), "{e}");
            assert_eq!(state.step, 0, "{masters:?}");
            for (p, b) in store.params.iter().zip(&before) {
                let now: Vec<f32> = p
                    .master()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert_eq!(&now, b, "{masters:?}: {} was updated", p.name);
            }
            for m in state.m.iter().chain(&state.v) {
                assert_eq!(
                    m.decode()
                        .unwrap()
                        .abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap(),
                    0.0
                );
            }
            // A correct step afterwards is step 1.
            let ok = [
                Grad::Dense(good),
                Grad::Dense(Tensor::ones(2, DType::F32, &dev).unwrap()),
            ];
            opt.step(&mut state, &mut store.params, &ok, 0.1, 1.0, in_place)
                .unwrap();
            assert_eq!(state.step, 1);
            assert_ne!(
                store.params[1].master().unwrap().to_vec1::<f32>().unwrap(),
                before[1]
            );
        }
    }

    /// The tensor-op update (the device path) and the CPU kernels (the host path) give the same
    /// bits: an offloaded optimizer updates as the device would (docs/training.md §6.6).
    #[test]
    fn the_tensor_update_equals_the_kernels_bit_for_bit() {
        let dev = Device::Cpu;
        let n = 3 * vc_kernels::optim::CHUNK + 5;
        let mk = |seed: f32, scale: f32| -> Tensor {
            let v: Vec<f32> = (0..n)
                .map(|i| (i as f32 * 0.37 + seed).sin() * scale)
                .collect();
            Tensor::from_vec(v, n, &dev).unwrap()
        };
        let opt = AdamW::new(0.01);
        let (p0, m0) = (mk(1.0, 0.05), mk(2.0, 1e-3));
        let v0 = mk(3.0, 1e-3).sqr().unwrap();
        let (lr, clip) = (2e-4, 0.37);
        for t in [1u64, 7] {
            let g = mk(4.0 + t as f32, 0.3);
            let (p, m, v) = (p0.copy().unwrap(), m0.copy().unwrap(), v0.copy().unwrap());
            let k = opt.consts(t, lr, clip);
            opt.apply_in_place(&p, &g, &m, &v, &k).unwrap();
            let (tp, tm, tv) = opt
                .update(t, lr, &p0, &g.affine(clip, 0.0).unwrap(), &m0, &v0)
                .unwrap();
            let bits = |x: &Tensor| -> Vec<u32> {
                x.to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert!(bits(&tm) == bits(&m), "step {t}: first moments differ");
            assert!(bits(&tv) == bits(&v), "step {t}: second moments differ");
            assert!(bits(&tp) == bits(&p), "step {t}: weights differ");
        }
    }

    #[test]
    fn clipping_and_schedule() {
        let dev = Device::Cpu;
        let g = [
            Tensor::new(&[3.0f32], &dev).unwrap(),
            Tensor::new(&[[4.0f32]], &dev).unwrap(),
        ];
        assert_eq!(global_norm(&g, true).unwrap(), 5.0);
        assert_eq!(global_norm(&g, false).unwrap(), 5.0);
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
