//! The one GEMM entry point of the crate: `dst (=|+=) β · lhs · rhs` on bounds-checked views,
//! through the `gemm` crate (candle's CPU matmul uses the same crate).
//!
//! Every product is **row-invariant**: an element's value depends on its row of `lhs`, its
//! column of `rhs` and `k`, never on how many other rows or columns the call has, where it sits
//! in them, or the thread count (docs/model.md §9.5). That is what lets the streaming codec
//! decoder give bit for bit the samples of the offline one. The crate's general kernel already
//! sums each element as one FMA chain per block of the inner dimension; what this module adds:
//! the inner dimension is cut into blocks of [`K_BLOCK`] at fixed places (the crate's own block
//! size depends on `m` and `n`), and the shapes for which the crate switches to other
//! summation orders (matrix–vector products for one row or column, dot-product kernels for
//! small outputs with both operands contiguous along `k`, `k ≤ 2`) are copied into a padded
//! staging buffer that takes the general kernel instead.

use super::buf::{Init, Uninit};
use super::few_rows;
pub use super::gemm_call::{Acc, Par, K_BLOCK};
use super::mat::{MatMut, MatRef};

/// The `gemm` crate's name for `par`.
fn parallelism(par: Par) -> gemm::Parallelism {
    match par {
        Par::Seq => gemm::Parallelism::None,
        Par::Rayon => match rayon::current_num_threads() {
            0 | 1 => gemm::Parallelism::None,
            n => gemm::Parallelism::Rayon(n),
        },
    }
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
    if few_rows::applies(m, n, k, beta, &rhs) {
        // The same bits as the crate's kernel, reading `rhs` once (its module docs).
        return few_rows::product(dst, lhs, rhs, acc, beta, par);
    }
    let out = dst.data_mut();
    // SAFETY: `MatMut` guarantees that its `m` rows of `n` values at stride `rs` lie in `out`
    // and do not overlap, `MatRef` that every element it addresses lies in its slice; the
    // shapes agree (checked above); `out` is borrowed mutably, so it aliases neither operand.
    unsafe { raw(out.as_mut_ptr(), rs, m, n, k, acc, lhs, rhs, beta, par) }
}

/// Outputs up to this many elements with both operands contiguous along `k` take the `gemm`
/// crate's dot-product kernels (`gemm-common`'s horizontal path), whose sums are split over
/// SIMD lanes.
const DOT_KERNEL_MAX_OUTPUTS: usize = 16 * 16;

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
    let dot_kernels =
        both_contiguous_along_k(&lhs, &rhs) && m.max(2) * n.max(2) <= DOT_KERNEL_MAX_OUTPUTS;
    if k > 0 && (m < 2 || n < 2 || k < 3 || dot_kernels) {
        // SAFETY: the caller's contract, passed on unchanged.
        return unsafe { staged(dst, dst_rs, m, n, k, acc, lhs, rhs, beta, par) };
    }
    if k <= K_BLOCK {
        // SAFETY: the caller's contract.
        return unsafe { crate_gemm(dst, dst_rs, m, n, k, acc, lhs, rhs, beta, par) };
    }
    for k0 in (0..k).step_by(K_BLOCK) {
        let k1 = (k0 + K_BLOCK).min(k);
        let block_acc = if k0 == 0 { acc } else { Acc::Add };
        let (a, b) = (lhs.cols_range(k0, k1), rhs.rows_range(k0, k1));
        // SAFETY: the caller's `dst`; the blocks are sub-views of its operands.
        unsafe { crate_gemm(dst, dst_rs, m, n, k1 - k0, block_acc, a, b, beta, par) };
    }
}

/// Whether `lhs`'s rows and `rhs`'s columns are both contiguous (the layout of the crate's
/// dot-product kernels).
fn both_contiguous_along_k(lhs: &MatRef<'_>, rhs: &MatRef<'_>) -> bool {
    lhs.col_stride() == 1 && rhs.row_stride() == 1
}

/// The product through zero-padded copies, which [`raw`] gives to the general kernel: `lhs` as
/// an `m'×k'` column-major matrix and/or `rhs` as a `k'×n'` row-major one (m' = max(m, 2),
/// n' = max(n, 2), k' = max(k, 3)), so that no dimension is too small and the operands are not
/// both contiguous along `k`. An operand that needs none of that is used in place (for one
/// row of activations times a weight matrix, only the row is copied). The zero padding adds
/// exact zeros to no element's sum.
///
/// # Safety
/// As [`raw`], with `k > 0`.
#[allow(clippy::too_many_arguments)]
unsafe fn staged(
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
    let (m2, n2, k2) = (m.max(2), n.max(2), k.max(3));
    // Both operands contiguous along `k`: copying either one (the smaller) breaks that.
    let dot = both_contiguous_along_k(&lhs, &rhs);
    let copy_lhs = m < 2 || k < 3 || (dot && m <= n);
    let copy_rhs = n < 2 || k < 3 || (dot && !copy_lhs);
    let lhs_buf: Vec<f32>;
    let a = if copy_lhs {
        let mut buf = vec![0f32; m2 * k2];
        for l in 0..k {
            for i in 0..m {
                buf[l * m2 + i] = lhs.get(i, l);
            }
        }
        lhs_buf = buf;
        MatRef::strided(&lhs_buf, m2, k2, 1, m2)
    } else {
        lhs
    };
    let rhs_buf: Vec<f32>;
    let b = if copy_rhs {
        let mut buf = vec![0f32; k2 * n2];
        for l in 0..k {
            for j in 0..n {
                buf[l * n2 + j] = rhs.get(l, j);
            }
        }
        rhs_buf = buf;
        MatRef::new(&rhs_buf, k2, n2)
    } else {
        rhs
    };
    let mut out = vec![0f32; m2 * n2];
    if acc == Acc::Add {
        for i in 0..m {
            // SAFETY: row i of the caller's `dst` holds `n` readable values at `i·dst_rs`.
            let row = unsafe { std::slice::from_raw_parts(dst.add(i * dst_rs), n) };
            out[i * n2..i * n2 + n].copy_from_slice(row);
        }
    }
    // SAFETY: `out` is an m2×n2 buffer of our own; `a` and `b` are views of live buffers
    // (or of the caller's operands) of the right shapes, none aliasing `out`.
    unsafe { raw(out.as_mut_ptr(), n2, m2, n2, k2, acc, a, b, beta, par) };
    for i in 0..m {
        // SAFETY: row i of the caller's `dst` holds `n` writable values at `i·dst_rs`, not
        // overlapping the other rows or `out`.
        let row = unsafe { std::slice::from_raw_parts_mut(dst.add(i * dst_rs), n) };
        row.copy_from_slice(&out[i * n2..i * n2 + n]);
    }
}

/// One call of the `gemm` crate.
///
/// # Safety
/// As [`raw`].
#[allow(clippy::too_many_arguments)]
unsafe fn crate_gemm(
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
            parallelism(par),
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

    /// Row-invariance (the module's promise): every element of a product equals, bit for bit,
    /// the same element computed by a call over a single row, a single column or any block of
    /// rows and columns; in the plain layout and with both operands contiguous along `k`, for
    /// `k` below 3, within one block and across several.
    #[test]
    fn every_element_is_summed_the_same_whatever_the_call_around_it() {
        let (m, n) = (6, 20);
        let ks: &[usize] = if cfg!(miri) {
            &[2, 600]
        } else {
            &[1, 2, 9, 600, 1100]
        };
        for &k in ks {
            let a = vals(m * k, k as u32);
            let b = vals(k * n, 7 * k as u32);
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let lhs = MatRef::new(&a, m, k);
            for (layout, rhs) in [
                ("row-major rhs", MatRef::new(&b, k, n)),
                ("rhs contiguous along k", MatRef::new(&bt, n, k).t()),
            ] {
                let full = matmul_new(lhs, rhs, Par::Rayon);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let check = |(r0, r1): (usize, usize), (c0, c1): (usize, usize)| {
                    let part = matmul_new(lhs.rows_range(r0, r1), rhs.cols_range(c0, c1), Par::Seq);
                    let want: Vec<f32> = (r0..r1)
                        .flat_map(|i| full[i * n + c0..i * n + c1].to_vec())
                        .collect();
                    assert_eq!(
                        bits(&part),
                        bits(&want),
                        "k {k}, {layout}: rows {r0}..{r1}, columns {c0}..{c1}"
                    );
                };
                for i in 0..m {
                    check((i, i + 1), (0, n));
                }
                for j in [0, 7, n - 1] {
                    check((0, m), (j, j + 1));
                }
                check((1, 4), (3, 17));
                check((5, 6), (19, 20));
            }
        }
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
