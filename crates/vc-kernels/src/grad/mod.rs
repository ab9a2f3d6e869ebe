//! Inner loops of the training kernels with hand-written backward passes (f32): linear
//! layers' bias and reductions, RMSNorm, the per-head q/k norm fused with RoPE, attention and
//! SwiGLU (docs/model.md §4.1, §12). The candle custom ops that call them (shapes, autograd)
//! are in `vc_model::autograd_ops`.
//!
//! Work is split over independent rows or (batch, kv-head) pairs and every sum runs in a fixed
//! order — reductions over rows go through per-block partials added in block order
//! ([`sum_in_order`]) — so results do not depend on the thread count (exact training resume
//! relies on that).

pub mod attention;
pub mod norm;
pub mod swiglu;

use rayon::prelude::*;

/// Rows per parallel task for row-wise kernels; also the block size of ordered reductions.
pub const ROW_BLOCK: usize = 64;

/// The element-wise sum of per-block partial vectors (`len` values each), added in block order
/// so the result does not depend on how the blocks were scheduled.
pub fn sum_in_order(partial: &[Vec<f32>], len: usize) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for p in partial {
        sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    sum
}

/// Sums of the columns of a row-major `(rows, cols)` matrix, block by block in order.
pub fn column_sums(v: &[f32], cols: usize) -> Vec<f32> {
    if cols == 0 {
        return Vec::new();
    }
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

/// `y[r] += b` for every row `r` of `y` (rows of `b.len()` values).
pub fn add_bias_rows(y: &mut [f32], b: &[f32]) {
    let out = b.len();
    if out == 0 {
        return;
    }
    y.par_chunks_mut(out * ROW_BLOCK).for_each(|y| {
        for row in y.chunks_exact_mut(out) {
            row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
        }
    });
}

/// Runs `f(row, dx_row, x_row, dy_row, dw)` over the rows (`width` values each) of `x` and
/// `dy`, blocks of rows in parallel, each block with its own weight gradient (`d` values); the
/// blocks' weight gradients are summed in order. Returns `(dx, dw)`.
pub fn rowwise_grad(
    x: &[f32],
    dy: &[f32],
    width: usize,
    d: usize,
    f: impl Fn(usize, &mut [f32], &[f32], &[f32], &mut [f32]) + Sync,
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(
        x.len(),
        dy.len(),
        "rowwise gradient: x and dy differ in size"
    );
    let mut dx = vec![0f32; x.len()];
    if width == 0 {
        return (dx, vec![0f32; d]);
    }
    let block = width * ROW_BLOCK;
    let partial: Vec<Vec<f32>> = dx
        .par_chunks_mut(block)
        .zip(x.par_chunks(block).zip(dy.par_chunks(block)))
        .enumerate()
        .map(|(b, (dx, (x, dy)))| {
            let mut dw = vec![0f32; d];
            let rows = dx
                .chunks_exact_mut(width)
                .zip(x.chunks_exact(width))
                .zip(dy.chunks_exact(width));
            for (r, ((dx, x), dy)) in rows.enumerate() {
                f(b * ROW_BLOCK + r, dx, x, dy, &mut dw);
            }
            dw
        })
        .collect();
    (dx, sum_in_order(&partial, d))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub use crate::test_values::vals;

    /// `f` on a pool of `threads` threads.
    pub fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool")
            .install(f)
    }

    #[test]
    fn reductions_are_ordered_and_thread_independent() {
        let cols = 3;
        let rows = if cfg!(miri) {
            2 * ROW_BLOCK + 5
        } else {
            40 * ROW_BLOCK + 5
        };
        let v = vals(rows * cols, 1);
        let sums = on_threads(1, || column_sums(&v, cols));
        assert_eq!(on_threads(3, || column_sums(&v, cols)), sums);
        for (c, &s) in sums.iter().enumerate() {
            let want: f64 = v.iter().skip(c).step_by(cols).map(|&x| x as f64).sum();
            assert!((s as f64 - want).abs() < 1e-4, "column {c}: {s} vs {want}");
        }
        let mut y = vec![1f32; 2 * cols];
        add_bias_rows(&mut y, &[1.0, 2.0, 3.0]);
        assert_eq!(y, [2.0, 3.0, 4.0, 2.0, 3.0, 4.0]);
        let (dx, dw) = rowwise_grad(&v, &v, cols, 1, |r, dx, x, dy, dw| {
            dx[0] = r as f32;
            dw[0] += x[1] * dy[2];
        });
        assert_eq!(dx[(rows - 1) * cols], (rows - 1) as f32);
        let want: f64 = v.chunks(cols).map(|r| (r[1] * r[2]) as f64).sum();
        assert!((dw[0] as f64 - want).abs() < 1e-4);
    }
}
