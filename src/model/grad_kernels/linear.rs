//! `x·wᵀ (+ b)` as one autograd node, and the GEMM helpers the other kernels share.

use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{cpu_f32, new_tensor, sum_in_order, with_values, ROW_BLOCK};

fn gemm_parallelism() -> gemm::Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// A row-major matrix view: `rows × cols`, element `(i, j)` at `ptr[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(super) struct Mat {
    pub(super) ptr: *const f32,
    pub(super) rs: usize,
    pub(super) cs: usize,
}

impl Mat {
    pub(super) fn rows(v: &[f32], cols: usize) -> Self {
        Self {
            ptr: v.as_ptr(),
            rs: cols,
            cs: 1,
        }
    }
    /// The transpose of a row-major `rows × cols` matrix stored in `v`.
    pub(super) fn transposed(v: &[f32], cols: usize) -> Self {
        Self {
            ptr: v.as_ptr(),
            rs: 1,
            cs: cols,
        }
    }
}

/// `count` products `a_j (m×k) · b_j (k×n)` (operands of product j from `operands(j)`), stacked
/// into a new row-major `(count, m, n)` buffer, multi-threaded. The GEMM writes every value,
/// so the buffer is not zero-filled first (that pass cost as much as a small product).
pub(super) fn matmuls_new(
    count: usize,
    m: usize,
    n: usize,
    k: usize,
    operands: impl Fn(usize) -> (Mat, Mat),
) -> Vec<f32> {
    let len = count * m * n;
    let mut out: Vec<f32> = Vec::with_capacity(len);
    for j in 0..count {
        let (a, b) = operands(j);
        // SAFETY: block j of the allocation has room for m·n values; `gemm_raw` writes all of
        // them without reading them (zeros when k = 0).
        unsafe { gemm_raw(out.as_mut_ptr().add(j * m * n), n, m, n, k, a, b) };
    }
    // SAFETY: every block was written above.
    unsafe { out.set_len(len) };
    out
}

/// `dst (m×n, row stride dst_rs) = a (m×k) · b (k×n)`, multi-threaded.
///
/// # Safety
/// `dst`, `a` and `b` must be valid for the implied extents.
pub(super) unsafe fn gemm_raw(
    dst: *mut f32,
    dst_rs: usize,
    m: usize,
    n: usize,
    k: usize,
    a: Mat,
    b: Mat,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            std::ptr::write_bytes(dst.add(i * dst_rs), 0, n);
        }
        return;
    }
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        false,
        a.ptr,
        a.cs as isize,
        a.rs as isize,
        b.ptr,
        b.cs as isize,
        b.rs as isize,
        0.0,
        1.0,
        false,
        false,
        false,
        gemm_parallelism(),
    )
}

/// `x · wᵀ (+ b)` for `x` `(..., in)`, `w` `(out, in)` (PyTorch layout), `b` `(out,)`, as one
/// autograd node (no reshape or transpose nodes, whose backward passes each copy the gradient).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    match b {
        None => x.apply_op2(&w, Linear),
        Some(b) => x.apply_op3(&w, &b.contiguous()?, Linear),
    }
}

struct Linear;

impl Linear {
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
        let mut y = matmuls_new(1, rows, out, inp, |_| {
            (Mat::rows(x, inp), Mat::transposed(w, inp))
        });
        if let Some(b) = b {
            if b.len() != out {
                bail!("linear: bias has {} values, expected {out}", b.len());
            }
            y.par_chunks_mut(out * ROW_BLOCK).for_each(|y| {
                for row in y.chunks_exact_mut(out) {
                    row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
                }
            });
        }
        Ok((CpuStorage::F32(y), shape))
    }

    /// `dx = dy · w`, `dw = dyᵀ · x`, `db = Σ_rows dy` (block-ordered).
    fn backward(
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        bias: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let (rows, inp, out, _) = Self::shapes(x.dims(), w.dims())?;
        let what = "linear bwd";
        with_values(x, what, |xv| {
            with_values(w, what, |wv| {
                with_values(dy, what, |g| {
                    let dx = matmuls_new(1, rows, inp, out, |_| {
                        (Mat::rows(g, out), Mat::rows(wv, inp))
                    });
                    let dw = matmuls_new(1, out, inp, rows, |_| {
                        (Mat::transposed(g, out), Mat::rows(xv, inp))
                    });
                    let db = bias.then(|| column_sums(g, out));
                    Ok((
                        new_tensor(dx, x)?,
                        new_tensor(dw, w)?,
                        db.map(|d| Tensor::from_vec(d, out, x.device()))
                            .transpose()?,
                    ))
                })
            })
        })
    }
}

/// Sums of the columns of a row-major `(rows, cols)` matrix, block by block in order.
fn column_sums(v: &[f32], cols: usize) -> Vec<f32> {
    let partial: Vec<Vec<f32>> = v
        .par_chunks(cols * ROW_BLOCK)
        .map(|block| {
            let mut s = vec![0f32; cols];
            for row in block.chunks_exact(cols) {
                s.iter_mut().zip(row).for_each(|(s, v)| *s += v);
            }
            s
        })
        .collect();
    sum_in_order(&partial, cols)
}

impl CustomOp2 for Linear {
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
        let (dx, dw, _) = Self::backward(x, w, dy, false)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for Linear {
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
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = Self::backward(x, w, dy, true)?;
        Ok((Some(dx), Some(dw), db))
    }
}
