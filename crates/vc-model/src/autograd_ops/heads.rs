//! The code predictor's teacher-forced output heads.

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::{cpu_f32, needs_grad, new_tensor, with_values};
use vc_kernels::gemm::{gemm, matmuls_new, Acc, Par};
use vc_kernels::mat::{MatMut, MatRef};

/// The teacher-forced code-predictor heads (docs/model.md §5.1, §10.3): head `j` reads position
/// `j+1` of `x` `(N, G, H)` and `heads` is `(G−1, V, H)`; returns logits `(G−1, N, V)`,
/// codebook-major, without copying the strided positions out (one node instead of 2·(G−1)
/// narrow/stack nodes).
pub fn shifted_heads(x: &Tensor, heads: &Tensor) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2(&heads.contiguous()?, ShiftedHeads)
}

struct ShiftedHeads;

impl ShiftedHeads {
    fn dims(x: &[usize], w: &[usize]) -> Result<(usize, usize, usize, usize)> {
        let (&[n, g, h], &[j, v, wh]) = (x, w) else {
            bail!("shifted heads: x {x:?} must be (N, G, H) and heads {w:?} (G-1, V, H)")
        };
        if wh != h || j + 1 != g {
            bail!("shifted heads: x {x:?} does not fit heads {w:?}");
        }
        Ok((n, g, h, v))
    }

    /// Position `j+1` of every row of `x` `(N, G, H)` as an `(N, H)` view.
    fn position(x: &[f32], n: usize, g: usize, h: usize, j: usize) -> MatRef<'_> {
        MatRef::strided(&x[(j + 1) * h..], n, h, g * h, 1)
    }
}

impl CustomOp2 for ShiftedHeads {
    fn name(&self) -> &'static str {
        "shifted-heads-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, g, h, v) = Self::dims(l1.dims(), l2.dims())?;
        let (x, w) = (cpu_f32(s1, l1, self.name())?, cpu_f32(s2, l2, self.name())?);
        let y = matmuls_new(g - 1, n, v, Par::Rayon, |j| {
            let wj = &w[j * v * h..(j + 1) * v * h];
            (Self::position(x, n, g, h, j), MatRef::new(wj, v, h).t())
        });
        Ok((CpuStorage::F32(y), Shape::from((g - 1, n, v))))
    }

    /// `dx[:, j+1] = dy_j · w_j` (position 0 gets none), `dw_j = dy_jᵀ · x[:, j+1]`; each only
    /// for an operand in the graph ([`needs_grad`]: not for frozen heads).
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, g, h, v) = Self::dims(x.dims(), w.dims())?;
        let what = "shifted heads bwd";
        let (dx, dw) = with_values(x, what, |xv| {
            with_values(w, what, |wv| {
                with_values(dy, what, |gv| {
                    let dx = needs_grad(x).then(|| {
                        let mut dx = vec![0f32; xv.len()];
                        for j in 0..g - 1 {
                            let gj = &gv[j * n * v..(j + 1) * n * v];
                            let wj = &wv[j * v * h..(j + 1) * v * h];
                            gemm(
                                MatMut::strided(&mut dx[(j + 1) * h..], n, h, g * h),
                                MatRef::new(gj, n, v),
                                MatRef::new(wj, v, h),
                                Acc::Set,
                                1.0,
                                Par::Rayon,
                            );
                        }
                        dx
                    });
                    let dw = needs_grad(w).then(|| {
                        matmuls_new(g - 1, v, h, Par::Rayon, |j| {
                            let gj = &gv[j * n * v..(j + 1) * n * v];
                            (MatRef::new(gj, n, v).t(), Self::position(xv, n, g, h, j))
                        })
                    });
                    Ok((dx, dw))
                })
            })
        })?;
        Ok((
            dx.map(|d| new_tensor(d, x)).transpose()?,
            dw.map(|d| new_tensor(d, w)).transpose()?,
        ))
    }
}
