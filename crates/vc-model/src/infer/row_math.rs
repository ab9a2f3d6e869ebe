//! The loops over one `f32` row that the decoder stack, its per-row step and the adapters
//! share: a dot product written to vectorise and RMS normalisation (docs/model.md §4.1). The
//! adapters, which the stack calls, use them without reaching back into the stack.

/// RMSNorm of every `weight.len()`-wide row (docs/model.md §4.1: f32 statistics).
pub(super) fn rms_norm_rows(x: &mut [f32], weight: &[f32], eps: f64) {
    for row in x.chunks_exact_mut(weight.len()) {
        rms_norm_row(row, weight, eps);
    }
}

/// RMSNorm of one row (a head, for the per-head q/k norms).
pub(super) fn rms_norm_row(row: &mut [f32], weight: &[f32], eps: f64) {
    let mean = dot(row, row) / row.len() as f32;
    let inv = 1.0 / (mean + eps as f32).sqrt();
    row.iter_mut()
        .zip(weight)
        .for_each(|(v, w)| *v = *v * inv * w);
}

/// Dot product with 8 independent accumulators (vectorisable), the lanes then summed in order,
/// then the tail. Plain `*` and `+`, not `mul_add`: this crate compiles for baseline x86-64,
/// where a fused multiply-add is a library call. No reference fixes the order (the official
/// model sums its own way; docs/model.md §14 tolerances allow for it). What matters is that
/// attention scores, RMSNorm statistics and adapter factors all go through this one function,
/// so that [`super::row_step`] gives a row the bits of its one-row forward (docs/serving.md §3).
/// A new order changes every float the row inference path computes.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 8;
    let mut acc = [0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (pa, pb) in ca.zip(cb) {
        for l in 0..L {
            acc[l] += pa[l] * pb[l];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}
