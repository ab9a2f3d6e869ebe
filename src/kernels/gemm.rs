//! The one GEMM entry point of the crate: `dst (=|+=) β · lhs · rhs` on bounds-checked views,
//! through the `gemm` crate (candle's CPU matmul uses the same crate).

use super::buf::{Init, Uninit};
use super::mat::{MatMut, MatRef};

/// Whether a product may use several threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Par {
    /// One thread: the caller parallelises (e.g. over row tiles).
    Seq,
    /// Every thread of the current rayon pool.
    Rayon,
}

impl Par {
    fn to_gemm(self) -> gemm::Parallelism {
        match self {
            Par::Seq => gemm::Parallelism::None,
            Par::Rayon => match rayon::current_num_threads() {
                0 | 1 => gemm::Parallelism::None,
                n => gemm::Parallelism::Rayon(n),
            },
        }
    }
}

/// What happens to the destination's previous values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acc {
    /// `dst = β·lhs·rhs` (`dst` is not read).
    Set,
    /// `dst = dst + β·lhs·rhs`.
    Add,
}

fn check_dims(m: usize, n: usize, lhs: &MatRef<'_>, rhs: &MatRef<'_>) -> usize {
    let k = lhs.cols();
    assert!(
        lhs.rows() == m && rhs.rows() == k && rhs.cols() == n,
        "gemm: {m}×{n} destination for {}×{} · {}×{}",
        lhs.rows(),
        k,
        rhs.rows(),
        rhs.cols()
    );
    k
}

/// `dst = β·lhs·rhs` ([`Acc::Set`]) or `dst += β·lhs·rhs` ([`Acc::Add`]).
///
/// Products with k = 0 set `dst` to zero (or leave it). The summation order depends only on
/// the shapes and the instruction set, never on the thread count (the `gemm` crate splits the
/// output, not the inner dimension, over threads).
pub fn gemm(mut dst: MatMut<'_>, lhs: MatRef<'_>, rhs: MatRef<'_>, acc: Acc, beta: f32, par: Par) {
    let (m, n, rs) = (dst.rows(), dst.cols(), dst.row_stride());
    let k = check_dims(m, n, &lhs, &rhs);
    let out = dst.data_mut();
    // SAFETY: `MatMut` guarantees that its `m` rows of `n` values at stride `rs` lie in `out`
    // and do not overlap, `MatRef` that every element it addresses lies in its slice; the
    // shapes agree (checked above); `out` is borrowed mutably, so it aliases neither operand.
    unsafe { raw(out.as_mut_ptr(), rs, m, n, k, acc, lhs, rhs, beta, par) }
}

/// # Safety
/// `dst` must be valid for writes (and, with [`Acc::Add`], reads) of `m` rows of `n` values at
/// row stride `dst_rs`, not overlapping each other or the operands; `lhs` is `m × k` and
/// `rhs` is `k × n`.
#[allow(clippy::too_many_arguments)]
unsafe fn raw(
    dst: *mut f32,
    dst_rs: usize,
    m: usize,
    n: usize,
    k: usize,
    acc: Acc,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    beta: f32,
    par: Par,
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the caller's extents for `dst`; the operands' pointers come from views whose
    // elements are all in bounds (`MatRef`'s constructors check it). With `read_dst = false`
    // the crate never reads `dst` (alpha is zeroed and every element is stored), so it may be
    // uninitialised memory ([`Uninit::gemm`]).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            acc == Acc::Add,
            lhs.data().as_ptr(),
            lhs.col_stride() as isize,
            lhs.row_stride() as isize,
            rhs.data().as_ptr(),
            rhs.col_stride() as isize,
            rhs.row_stride() as isize,
            1.0,
            beta,
            false,
            false,
            false,
            par.to_gemm(),
        )
    }
}

impl<'t> Uninit<'t> {
    /// `lhs · rhs` as this part's `rows × n` row-major values (`rows·n` must be its length).
    pub fn gemm(self, lhs: MatRef<'_>, rhs: MatRef<'_>, par: Par) -> Init<'t> {
        let (m, n) = (lhs.rows(), rhs.cols());
        let k = check_dims(m, n, &lhs, &rhs);
        assert_eq!(Some(self.slot.len()), m.checked_mul(n), "gemm: output size");
        let dst = self.slot.as_mut_ptr().cast::<f32>();
        // SAFETY: the slot holds exactly m contiguous rows of n values, borrowed mutably (so
        // it aliases no operand); with `Acc::Set` they are written, never read.
        unsafe { raw(dst, n, m, n, k, Acc::Set, lhs, rhs, 1.0, par) };
        // SAFETY: `raw` with `Acc::Set` stores every one of the m·n values (for k = 0, zeros).
        unsafe { self.assume_init() }
    }
}

/// `lhs · rhs` as a new row-major `rows × cols` vector (not zero-filled first).
pub fn matmul_new(lhs: MatRef<'_>, rhs: MatRef<'_>, par: Par) -> Vec<f32> {
    let len = lhs.rows() * rhs.cols();
    super::buf::new_vec(len, len, |_, part| part.gemm(lhs, rhs, par))
}

/// `count` products `lhs_j (m×k) · rhs_j (k×n)` (operands of product j from `operands(j)`),
/// stacked into a new row-major `(count, m, n)` vector; each product uses `par`.
pub fn matmuls_new<'a>(
    count: usize,
    m: usize,
    n: usize,
    par: Par,
    operands: impl Fn(usize) -> (MatRef<'a>, MatRef<'a>),
) -> Vec<f32> {
    super::buf::new_vec(count * m * n, m * n, |j, part| {
        let (a, b) = operands(j);
        part.gemm(a, b, par)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &MatRef<'_>, b: &MatRef<'_>) -> Vec<f64> {
        let mut out = vec![0f64; a.rows() * b.cols()];
        for i in 0..a.rows() {
            for j in 0..b.cols() {
                for l in 0..a.cols() {
                    out[i * b.cols() + j] += a.get(i, l) as f64 * b.get(l, j) as f64;
                }
            }
        }
        out
    }

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0
                    - 0.5
            })
            .collect()
    }

    #[test]
    fn products_match_a_naive_loop() {
        // Small enough for Miri; covers strided, transposed and accumulating calls.
        let (m, n, k) = (5, 3, 7);
        let a = vals(m * k, 1);
        let b = vals(k * n, 2);
        let (av, bv) = (MatRef::new(&a, m, k), MatRef::new(&b, k, n));
        let want = naive(&av, &bv);
        let close = |got: &[f32], want: &[f64]| {
            got.iter()
                .zip(want)
                .all(|(g, w)| (*g as f64 - w).abs() < 1e-5)
        };
        let got = matmul_new(av, bv, Par::Seq);
        assert!(close(&got, &want));
        // The same product with `a` stored transposed and written at a row stride of 4.
        let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let mut out = vec![1f32; (m - 1) * 4 + n];
        gemm(
            MatMut::strided(&mut out, m, n, 4),
            MatRef::new(&at, k, m).t(),
            bv,
            Acc::Add,
            2.0,
            Par::Rayon,
        );
        for i in 0..m {
            for j in 0..n {
                let w = 1.0 + 2.0 * want[i * n + j];
                assert!((out[i * 4 + j] as f64 - w).abs() < 1e-5);
            }
            if i + 1 < m {
                assert_eq!(out[i * 4 + 3], 1.0, "the gap between rows is untouched");
            }
        }
        // k = 0: Set writes zeros, Add leaves the values.
        let empty = MatRef::new(&[], m, 0);
        let z = matmul_new(empty, MatRef::new(&[], 0, n), Par::Seq);
        assert_eq!(z, vec![0.0; m * n]);
        let mut keep = vec![3f32; m * n];
        gemm(
            MatMut::new(&mut keep, m, n),
            empty,
            MatRef::new(&[], 0, n),
            Acc::Add,
            1.0,
            Par::Seq,
        );
        assert_eq!(keep, vec![3.0; m * n]);
        let stacked = matmuls_new(2, m, n, Par::Seq, |j| {
            (
                if j == 0 {
                    av
                } else {
                    MatRef::new(&at, k, m).t()
                },
                bv,
            )
        });
        assert!(close(&stacked[..m * n], &want) && close(&stacked[m * n..], &want));
    }

    #[test]
    #[should_panic(expected = "gemm: 2×2 destination")]
    fn mismatched_shapes_are_refused() {
        let a = [0f32; 6];
        let mut d = [0f32; 4];
        gemm(
            MatMut::new(&mut d, 2, 2),
            MatRef::new(&a, 2, 3),
            MatRef::new(&a, 2, 3),
            Acc::Set,
            1.0,
            Par::Seq,
        );
    }
}
