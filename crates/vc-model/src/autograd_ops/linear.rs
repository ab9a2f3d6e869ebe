//! `x·wᵀ (+ b)` as one autograd node.

use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::{cpu_f32, needs_grad, new_tensor, with_values};
use vc_kernels::gemm::{matmul_new, Par};
use vc_kernels::grad::{add_bias_rows, column_sums};
use vc_kernels::mat::MatRef;

/// `x · wᵀ (+ b)` for `x` `(..., in)`, `w` `(out, in)` (PyTorch layout), `b` `(out,)`, as one
/// autograd node (no reshape or transpose nodes, whose backward passes each copy the gradient).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    match b {
        None => x.apply_op2(&w, LinearOp),
        Some(b) => x.apply_op3(&w, &b.contiguous()?, LinearOp),
    }
}

struct LinearOp;

impl LinearOp {
    fn shapes(x: &[usize], w: &[usize]) -> Result<(usize, usize, usize, Shape)> {
        let (&[out, inp], Some(&last)) = (w, x.last()) else {
            bail!("linear: weight {w:?} must be (out, in) and the input non-scalar")
        };
        if last != inp {
            bail!("linear: input {x:?} does not end in {inp} (weight {w:?})");
        }
        let rows = x.iter().product::<usize>() / inp.max(1);
        let mut shape = x.to_vec();
        *shape.last_mut().expect("non-empty") = out;
        Ok((rows, inp, out, Shape::from(shape)))
    }

    fn forward(
        x: &[f32],
        lx: &Layout,
        w: &[f32],
        lw: &Layout,
        b: Option<&[f32]>,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, inp, out, shape) = Self::shapes(lx.dims(), lw.dims())?;
        if let Some(b) = b {
            if b.len() != out {
                bail!("linear: bias has {} values, expected {out}", b.len());
            }
        }
        let x = MatRef::new(x, rows, inp);
        let mut y = matmul_new(x, MatRef::new(w, out, inp).t(), Par::Rayon);
        if let Some(b) = b {
            add_bias_rows(&mut y, b);
        }
        Ok((CpuStorage::F32(y), shape))
    }

    /// `dx = dy · w`, `dw = dyᵀ · x`, `db = Σ_rows dy` (block-ordered), each only for an
    /// operand in the graph ([`needs_grad`]: not for a frozen weight).
    fn backward(
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (rows, inp, out, _) = Self::shapes(x.dims(), w.dims())?;
        let what = "linear bwd";
        with_values(x, what, |xv| {
            with_values(w, what, |wv| {
                with_values(dy, what, |g| {
                    let gm = MatRef::new(g, rows, out);
                    let dx = needs_grad(x)
                        .then(|| matmul_new(gm, MatRef::new(wv, out, inp), Par::Rayon));
                    let dw = needs_grad(w)
                        .then(|| matmul_new(gm.t(), MatRef::new(xv, rows, inp), Par::Rayon));
                    let db = bias.filter(|b| needs_grad(b)).map(|_| column_sums(g, out));
                    Ok((
                        dx.map(|d| new_tensor(d, x)).transpose()?,
                        dw.map(|d| new_tensor(d, w)).transpose()?,
                        db.map(|d| Tensor::from_vec(d, out, x.device()))
                            .transpose()?,
                    ))
                })
            })
        })
    }
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "linear-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Self::forward(
            cpu_f32(s1, l1, "linear-grad")?,
            l1,
            cpu_f32(s2, l2, "linear-grad")?,
            l2,
            None,
        )
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = Self::backward(x, w, dy, None)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "linear-bias-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = CustomOp3::name(self);
        Self::forward(
            cpu_f32(s1, l1, name)?,
            l1,
            cpu_f32(s2, l2, name)?,
            l2,
            Some(cpu_f32(s3, l3, name)?),
        )
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Self::backward(x, w, dy, Some(b))
    }
}
