//! In-place, multi-threaded CPU kernels for the optimizer step: the tensor-op formulation of
//! AdamW allocates a dozen parameter-sized temporaries per tensor (the 151936-row text embedding
//! alone is 1.2 GB in f32 at full size), which dominates a CPU step. These kernels update the
//! fp32 master, moments and accumulated gradients where they lie, in one pass each.
//!
//! The loops are in [`vc_kernels::optim`] and [`vc_kernels::loss`] (fixed chunks,
//! reductions in order: results do not depend on the number of threads, which exact resume
//! needs); this module wraps them as candle ops. Only f32 contiguous CPU tensors; callers fall
//! back to tensor ops elsewhere (CUDA).

use candle_core::{
    bail, CpuStorage, CustomOp1, InplaceOp2, InplaceOp3, Layout, Result, Shape, Tensor,
};

use crate::optim::moments::Moment;
use vc_kernels::{loss, optim};
use vc_model::autograd_ops::{cpu_f32, with_values};

fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [f32]> {
    let CpuStorage::F32(v) = s else {
        bail!("{what}: expected f32")
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("{what}: expected a contiguous tensor")
    };
    Ok(&mut v[a..b])
}

fn check_len(a: usize, b: usize, what: &str) -> Result<()> {
    if a != b {
        bail!("{what}: {a} vs {b} elements");
    }
    Ok(())
}

/// Whether the in-place kernels apply to `t`.
pub fn supported(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == candle_core::DType::F32 && t.is_contiguous()
}

/// `dst += src`.
pub struct AddAssign;

impl InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "add-assign"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let d = slice_mut(s1, l1, self.name())?;
        let s = cpu_f32(s2, l2, self.name())?;
        check_len(d.len(), s.len(), self.name())?;
        optim::add_assign(d, s);
        Ok(())
    }
}

/// First moment: `m = lerp(m, c·g, 1 − β1)` (torch's `exp_avg.lerp_(grad, 1 - beta1)`), with the
/// clipping factor `c` folded in.
pub struct FirstMoment {
    pub weight: f32,
    pub clip: f32,
}

impl InplaceOp2 for FirstMoment {
    fn name(&self) -> &'static str {
        "adamw-exp-avg"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let m = slice_mut(s1, l1, self.name())?;
        let g = cpu_f32(s2, l2, self.name())?;
        check_len(m.len(), g.len(), self.name())?;
        optim::first_moment(m, g, self.weight, self.clip);
        Ok(())
    }
}

/// Second moment: `v = β2·v + (1 − β2)·(c·g)²`.
pub struct SecondMoment {
    pub beta2: f32,
    pub clip: f32,
}

impl InplaceOp2 for SecondMoment {
    fn name(&self) -> &'static str {
        "adamw-exp-avg-sq"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let v = slice_mut(s1, l1, self.name())?;
        let g = cpu_f32(s2, l2, self.name())?;
        check_len(v.len(), g.len(), self.name())?;
        optim::second_moment(v, g, self.beta2, self.clip);
        Ok(())
    }
}

/// The parameter update: `p = p·(1 − lr·wd) − step_size · m / (√v / √bc2 + eps)`.
pub struct ParamUpdate {
    pub decay: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
}

impl InplaceOp3 for ParamUpdate {
    fn name(&self) -> &'static str {
        "adamw-param"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let p = slice_mut(s1, l1, self.name())?;
        let m = cpu_f32(s2, l2, self.name())?;
        let v = cpu_f32(s3, l3, self.name())?;
        check_len(p.len(), m.len(), self.name())?;
        check_len(p.len(), v.len(), self.name())?;
        let (decay, step, bc2, eps) = (self.decay, self.step_size, self.bc2_sqrt, self.eps);
        optim::param_update(p, m, v, decay, step, bc2, eps);
        Ok(())
    }
}

/// Runs `f` on the CPU storage of `t`, mutable: how a kernel that updates several tensors at
/// once (the fused update) gets at each of them. Nested calls must name distinct tensors.
fn with_storage_mut<R: Send>(
    t: &Tensor,
    f: impl FnOnce(&mut CpuStorage, &Layout) -> Result<R> + Send,
) -> Result<R> {
    struct Op<F, R> {
        f: std::sync::Mutex<Option<F>>,
        out: std::sync::Mutex<Option<Result<R>>>,
    }
    impl<F: FnOnce(&mut CpuStorage, &Layout) -> Result<R> + Send, R: Send> candle_core::InplaceOp1
        for Op<F, R>
    {
        fn name(&self) -> &'static str {
            "storage-mut"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
            let f = self.f.lock().expect("unpoisoned").take();
            if let Some(f) = f {
                *self.out.lock().expect("unpoisoned") = Some(f(s, l));
            }
            Ok(())
        }
    }
    if !t.device().is_cpu() || !t.is_contiguous() {
        bail!("in-place CPU kernels need contiguous CPU tensors");
    }
    let op = Op {
        f: std::sync::Mutex::new(Some(f)),
        out: std::sync::Mutex::new(None),
    };
    t.inplace_op1(&op)?;
    let out = op.out.into_inner().expect("unpoisoned");
    out.unwrap_or_else(|| bail!("in-place kernel did not run"))
}

fn contiguous<'a, T>(v: &'a mut [T], l: &Layout, what: &str) -> Result<&'a mut [T]> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("{what}: expected a contiguous tensor")
    };
    Ok(&mut v[a..b])
}

/// The gradient of a fused update: a dense f32 tensor, or row-sparse.
pub enum GradRows<'a> {
    Dense(&'a Tensor),
    Sparse(&'a crate::step::text_grad::RowGrad),
}

/// AdamW in place with [`optim::fused_update`] (8-bit moments, compensated weights) on the
/// f32 CPU weights `w` of parameter `name`, with their compensation.
pub fn fused_update(
    name: &str,
    w: &Tensor,
    comp: Option<&Tensor>,
    g: GradRows,
    m: &Moment,
    v: &Moment,
    k: &optim::StepConsts,
) -> Result<()> {
    let (rows, cols) = vc_kernels::moment8::rows_cols(w.dims());
    let update = |dense: Option<&[f32]>| -> Result<()> {
        let row = |r: usize| -> Option<&[f32]> {
            match &g {
                GradRows::Dense(_) => dense.map(|d| &d[r * cols..(r + 1) * cols]),
                GradRows::Sparse(rows) => rows.row(r),
            }
        };
        with_storage_mut(w, |ws, wl| {
            let w = slice_mut(ws, wl, "adamw-fused weights")?;
            with_comp(comp, w, |weights| {
                with_moment(m, |mm| {
                    with_moment(v, |vm| {
                        optim::fused_update(rows, cols, weights, mm, vm, &row, k);
                        Ok(())
                    })
                })
            })
        })
    };
    match &g {
        GradRows::Dense(t) => {
            if !supported(t) || t.elem_count() != w.elem_count() {
                bail!("{name}: the fused update needs a contiguous f32 gradient");
            }
            with_values(t, "adamw-fused", |d| update(Some(d)))
        }
        GradRows::Sparse(rg) => {
            if rg.rows() != rows || rg.width() != cols {
                bail!("{name}: the row gradient is {}×{}", rg.rows(), rg.width());
            }
            update(None)
        }
    }
}

fn with_comp(
    comp: Option<&Tensor>,
    w: &mut [f32],
    f: impl FnOnce(optim::WeightsMut) -> Result<()> + Send,
) -> Result<()> {
    match comp {
        None => f(optim::WeightsMut::Master(w)),
        Some(c) => with_storage_mut(c, |cs, cl| {
            let CpuStorage::BF16(cv) = cs else {
                bail!("the compensation must be bf16")
            };
            let comp = contiguous(cv, cl, "compensation")?;
            f(optim::WeightsMut::Compensated { w, comp })
        }),
    }
}

fn with_moment(m: &Moment, f: impl FnOnce(optim::MomentMut) -> Result<()> + Send) -> Result<()> {
    match m {
        Moment::F32(t) => with_storage_mut(t, |s, l| {
            f(optim::MomentMut::F32(slice_mut(s, l, "moment")?))
        }),
        Moment::Codes8(c) => with_storage_mut(&c.codes, |cs, cl| {
            let CpuStorage::U8(cv) = cs else {
                bail!("8-bit moment codes must be u8")
            };
            let codes = contiguous(cv, cl, "moment codes")?;
            with_storage_mut(&c.scales, |ss, sl| {
                let scales = slice_mut(ss, sl, "moment scales")?;
                f(optim::MomentMut::Codes8 { codes, scales })
            })
        }),
    }
}

/// Σ x² in f64, as a `()`-shaped f64 tensor (no parameter-sized temporary).
pub struct SumSquares;

impl CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = cpu_f32(s, l, self.name())?;
        let ss = optim::sum_squares(x);
        Ok((CpuStorage::F64(vec![ss]), Shape::from(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn kernels_match_the_tensor_formulas() {
        let dev = Device::Cpu;
        let n = 3 * optim::CHUNK + 17;
        let mk = |seed: f32| {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
            Tensor::from_vec(v, n, &dev).unwrap()
        };
        let (g, m, v) = (mk(1.0), mk(2.0), mk(3.0).abs().unwrap());
        let acc = mk(4.0).copy().unwrap();
        acc.inplace_op2(&g, &AddAssign).unwrap();
        let want = (mk(4.0) + &g).unwrap();
        assert_eq!(
            acc.to_vec1::<f32>().unwrap(),
            want.to_vec1::<f32>().unwrap()
        );
        let ss: f64 = g
            .apply_op1_no_bwd(&SumSquares)
            .unwrap()
            .to_scalar()
            .unwrap();
        let want: f64 = g
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum();
        assert!((ss - want).abs() < 1e-9 * want);
        let m2 = m.copy().unwrap();
        m2.inplace_op2(
            &g,
            &FirstMoment {
                weight: 0.1,
                clip: 0.5,
            },
        )
        .unwrap();
        let want = (&m + ((&g * 0.5).unwrap() - &m).unwrap() * 0.1).unwrap();
        let d = (m2 - want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-6);
        let v2 = v.copy().unwrap();
        v2.inplace_op2(
            &g,
            &SecondMoment {
                beta2: 0.999,
                clip: 0.5,
            },
        )
        .unwrap();
        let want = ((&v * 0.999).unwrap() + ((&g * 0.5).unwrap().sqr().unwrap() * 0.001).unwrap())
            .unwrap();
        let d = (v2 - want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-6);
    }
}

/// Mean cross-entropy of f32 logits `(M, V)` against u32 targets `(M,)` in one pass per row,
/// with a fused backward (`(softmax − onehot) · grad / M`): the composed version materialises a
/// handful of logits-sized temporaries forward and backward (the sub-talker's logits are
/// 15 × frames × 2048). Per-row losses are summed in f64, in row order.
/// Each row's `(max, Σ exp(x − max))`.
type RowStats = std::sync::Arc<Vec<(f32, f64)>>;

#[derive(Default)]
pub struct CrossEntropy {
    /// Each row's `(max, Σ exp(x − max))` from the forward pass, reused by the backward pass
    /// (two fewer passes over the logits).
    row_stats: std::sync::Mutex<Option<RowStats>>,
}

fn ce_inputs<'a>(
    s1: &'a CpuStorage,
    l1: &Layout,
    s2: &'a CpuStorage,
    l2: &Layout,
) -> Result<(&'a [f32], usize, usize, &'a [u32])> {
    let x = cpu_f32(s1, l1, "cross-entropy logits")?;
    let (m, v) = l1.shape().dims2()?;
    if v == 0 {
        bail!("cross-entropy: logits {:?} have no classes", l1.dims());
    }
    let CpuStorage::U32(t) = s2 else {
        bail!("cross-entropy: targets must be u32")
    };
    let Some((a, b)) = l2.contiguous_offsets() else {
        bail!("cross-entropy: targets must be contiguous")
    };
    let t = &t[a..b];
    check_len(t.len(), m, "cross-entropy targets")?;
    if let Some(bad) = t.iter().find(|&&c| c as usize >= v) {
        bail!("cross-entropy: target {bad} is outside the {v} classes");
    }
    Ok((x, m, v, t))
}

impl candle_core::CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, _, v, t) = ce_inputs(s1, l1, s2, l2)?;
        let (stats, mean) = loss::forward(x, v, t);
        *self.row_stats.lock().expect("poisoned") = Some(std::sync::Arc::new(stats));
        Ok((CpuStorage::F32(vec![mean as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let scale = grad_res
            .to_dtype(candle_core::DType::F32)?
            .to_scalar::<f32>()?;
        let stats = self.row_stats.lock().expect("poisoned").clone();
        let g = logits.apply_op2_no_bwd(targets, &CrossEntropyGrad { scale, stats })?;
        Ok((Some(g), None))
    }
}

/// `(softmax(x) − onehot(t)) · scale / M`.
struct CrossEntropyGrad {
    scale: f32,
    /// The forward pass's row statistics (recomputed when absent).
    stats: Option<RowStats>,
}

impl candle_core::CustomOp2 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, m, v, t) = ce_inputs(s1, l1, s2, l2)?;
        let g = loss::grad(
            x,
            v,
            t,
            self.stats.as_deref().map(|s| s.as_slice()),
            self.scale,
        );
        Ok((CpuStorage::F32(g), Shape::from((m, v))))
    }
}

#[cfg(test)]
mod ce_tests {
    use super::*;
    use candle_core::{DType, Device, D};

    #[test]
    fn fused_cross_entropy_matches_the_composed_one() {
        let dev = Device::Cpu;
        let (m, v) = (37, 301);
        let x: Vec<f32> = (0..m * v).map(|i| (i as f32 * 0.731).sin() * 6.0).collect();
        let t: Vec<u32> = (0..m).map(|i| (i * 17 % v) as u32).collect();
        let var = candle_core::Var::from_vec(x, (m, v), &dev).unwrap();
        let targets = Tensor::from_vec(t, m, &dev).unwrap();
        let fused = var
            .as_tensor()
            .apply_op2(&targets, CrossEntropy::default())
            .unwrap();
        let composed = {
            let l = var.as_tensor();
            let max = l.max_keepdim(D::Minus1).unwrap().detach();
            let s = l.broadcast_sub(&max).unwrap();
            let lse = s
                .exp()
                .unwrap()
                .sum_keepdim(D::Minus1)
                .unwrap()
                .log()
                .unwrap();
            let picked = s.gather(&targets.unsqueeze(1).unwrap(), 1).unwrap();
            (lse - picked).unwrap().mean_all().unwrap()
        };
        let (a, b) = (
            fused.to_scalar::<f32>().unwrap(),
            composed.to_scalar::<f32>().unwrap(),
        );
        assert!((a - b).abs() < 1e-5 * b.abs(), "{a} vs {b}");
        let ga = (fused * 3.0)
            .unwrap()
            .backward()
            .unwrap()
            .get(var.as_tensor())
            .unwrap()
            .clone();
        let gb = (composed * 3.0)
            .unwrap()
            .backward()
            .unwrap()
            .get(var.as_tensor())
            .unwrap()
            .clone();
        let d = (ga - &gb)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-6, "gradient differs by {d}");
    }
}
