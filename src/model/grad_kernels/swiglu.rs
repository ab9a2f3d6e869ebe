//! SwiGLU gating.

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{cpu_f32, new_tensor, with_values};
use crate::model::fast_math::{self, with_avx2};

/// `silu(gate) · up` (the MLP's gating, docs/model.md §4.1).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

struct SwiGlu;

/// Values per parallel task.
const CHUNK: usize = 1 << 14;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fast_math::exp(-x))
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (cpu_f32(s1, l1, self.name())?, cpu_f32(s2, l2, self.name())?);
        if l1.dims() != l2.dims() {
            bail!("swiglu: gate {:?} vs up {:?}", l1.dims(), l2.dims());
        }
        let mut y = vec![0f32; g.len()];
        y.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
            .for_each(|(y, (g, u))| {
                with_avx2(|| {
                    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                        *y = g / (1.0 + fast_math::exp(-g)) * u;
                    }
                })
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    /// `d gate = dy·up·σ(g)(1 + g(1 − σ(g)))`, `d up = dy·silu(g)`.
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let what = "swiglu bwd";
        let (dg, du) = with_values(gate, what, |g| {
            with_values(up, what, |u| {
                with_values(dy, what, |d| {
                    let mut dg = vec![0f32; g.len()];
                    let mut du = vec![0f32; g.len()];
                    dg.par_chunks_mut(CHUNK)
                        .zip(du.par_chunks_mut(CHUNK))
                        .zip(
                            g.par_chunks(CHUNK)
                                .zip(u.par_chunks(CHUNK))
                                .zip(d.par_chunks(CHUNK)),
                        )
                        .for_each(|((dg, du), ((g, u), d))| {
                            with_avx2(|| {
                                let outs = dg.iter_mut().zip(du.iter_mut());
                                for ((dg, du), ((&g, &u), &d)) in outs.zip(g.iter().zip(u).zip(d)) {
                                    let sg = sigmoid(g);
                                    *dg = d * u * sg * (1.0 + g * (1.0 - sg));
                                    *du = d * g * sg;
                                }
                            })
                        });
                    Ok((dg, du))
                })
            })
        })?;
        Ok((Some(new_tensor(dg, gate)?), Some(new_tensor(du, up)?)))
    }
}
