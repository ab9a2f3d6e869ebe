//! In-place, multi-threaded CPU kernels for the optimizer step: the tensor-op formulation of
//! AdamW allocates a dozen parameter-sized temporaries per tensor (the 151936-row text embedding
//! alone is 1.2 GB in f32 at full size), which dominates a CPU step. These kernels update the
//! fp32 master, moments and accumulated gradients where they lie, in one pass each.
//!
//! Element-wise work is split into fixed-size chunks and reductions are summed chunk by chunk
//! in order, so results do not depend on the number of threads (exact resume needs that).
//! Only f32 contiguous CPU tensors; callers fall back to tensor ops elsewhere (CUDA).

use candle_core::{
    bail, CpuStorage, CustomOp1, InplaceOp2, InplaceOp3, Layout, Result, Shape, Tensor,
};
use rayon::prelude::*;

const CHUNK: usize = 1 << 16;

fn slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        bail!("{what}: expected f32")
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("{what}: expected a contiguous tensor")
    };
    Ok(&v[a..b])
}

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
        let s = slice(s2, l2, self.name())?;
        check_len(d.len(), s.len(), self.name())?;
        d.par_chunks_mut(CHUNK)
            .zip(s.par_chunks(CHUNK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d += *s));
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
        let g = slice(s2, l2, self.name())?;
        check_len(m.len(), g.len(), self.name())?;
        let (w, c) = (self.weight, self.clip);
        m.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .for_each(|(m, g)| {
                for (m, g) in m.iter_mut().zip(g) {
                    let g = if c == 1.0 { *g } else { *g * c };
                    *m += w * (g - *m);
                }
            });
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
        let g = slice(s2, l2, self.name())?;
        check_len(v.len(), g.len(), self.name())?;
        let (b2, c) = (self.beta2, self.clip);
        let w = 1.0 - b2;
        v.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .for_each(|(v, g)| {
                for (v, g) in v.iter_mut().zip(g) {
                    let g = if c == 1.0 { *g } else { *g * c };
                    *v = *v * b2 + w * g * g;
                }
            });
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
        let m = slice(s2, l2, self.name())?;
        let v = slice(s3, l3, self.name())?;
        check_len(p.len(), m.len(), self.name())?;
        check_len(p.len(), v.len(), self.name())?;
        let (decay, step, bc2, eps) = (self.decay, self.step_size, self.bc2_sqrt, self.eps);
        p.par_chunks_mut(CHUNK)
            .zip(m.par_chunks(CHUNK))
            .zip(v.par_chunks(CHUNK))
            .for_each(|((p, m), v)| {
                for ((p, m), v) in p.iter_mut().zip(m).zip(v) {
                    let denom = v.sqrt() / bc2 + eps;
                    *p = *p * decay - step * (*m / denom);
                }
            });
        Ok(())
    }
}

/// Σ x² in f64, as a `()`-shaped f64 tensor (no parameter-sized temporary).
pub struct SumSquares;

impl CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = slice(s, l, self.name())?;
        let parts: Vec<f64> = x
            .par_chunks(CHUNK)
            .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
            .collect();
        Ok((CpuStorage::F64(vec![parts.iter().sum()]), Shape::from(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn kernels_match_the_tensor_formulas() {
        let dev = Device::Cpu;
        let n = 3 * CHUNK + 17;
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
