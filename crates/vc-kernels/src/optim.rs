//! In-place, multi-threaded element-wise loops of the optimizer step: gradient accumulation,
//! AdamW's moments and parameter update, and the squared norm for gradient clipping. The
//! tensor-op formulation allocates a dozen parameter-sized temporaries per tensor (the
//! 151936-row text embedding alone is 1.2 GB in f32 at full size); these update the values
//! where they lie, in one pass each.
//!
//! Work is split into fixed-size chunks and reductions are summed chunk by chunk in order, so
//! results do not depend on the number of threads (exact resume needs that).

use rayon::prelude::*;

/// Values per parallel task (also the block of the ordered reduction in [`sum_squares`]).
pub const CHUNK: usize = 1 << 16;

/// `f(d, s)` for every pair of `dst` and `src`, in parallel chunks.
fn update_with(dst: &mut [f32], src: &[f32], f: impl Fn(&mut f32, f32) + Sync) {
    assert_eq!(dst.len(), src.len(), "element-wise update: sizes differ");
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| f(d, s)));
}

/// `dst += src`.
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    update_with(dst, src, |d, s| *d += s)
}

/// First moment: `m = lerp(m, c·g, weight)` (torch's `exp_avg.lerp_(grad, 1 - beta1)` with
/// `weight = 1 − β1`), the clipping factor `c` folded in.
pub fn first_moment(m: &mut [f32], g: &[f32], weight: f32, clip: f32) {
    update_with(m, g, |m, g| {
        let g = if clip == 1.0 { g } else { g * clip };
        *m += weight * (g - *m);
    })
}

/// Second moment: `v = β2·v + (1 − β2)·(c·g)²`.
pub fn second_moment(v: &mut [f32], g: &[f32], beta2: f32, clip: f32) {
    let w = 1.0 - beta2;
    update_with(v, g, |v, g| {
        let g = if clip == 1.0 { g } else { g * clip };
        *v = *v * beta2 + w * g * g;
    })
}

/// The parameter update `p = p·decay − step · m / (√v / bc2_sqrt + eps)`.
pub fn param_update(
    p: &mut [f32],
    m: &[f32],
    v: &[f32],
    decay: f32,
    step: f32,
    bc2_sqrt: f32,
    eps: f32,
) {
    assert!(
        p.len() == m.len() && p.len() == v.len(),
        "AdamW update: parameter, moments differ in size"
    );
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks(CHUNK))
        .zip(v.par_chunks(CHUNK))
        .for_each(|((p, m), v)| {
            for ((p, m), v) in p.iter_mut().zip(m).zip(v) {
                let denom = v.sqrt() / bc2_sqrt + eps;
                *p = *p * decay - step * (*m / denom);
            }
        });
}

/// One AdamW step's constants as the element-wise loops use them (see [`first_moment`],
/// [`second_moment`], [`param_update`]).
#[derive(Debug, Clone, Copy)]
pub struct StepConsts {
    /// `1 − β1`.
    pub weight1: f32,
    pub beta2: f32,
    pub clip: f32,
    pub decay: f32,
    pub step: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
}

/// The weights a fused update changes.
pub enum WeightsMut<'a> {
    /// f32 values that are their own master.
    Master(&'a mut [f32]),
    /// bf16 values (held in f32) with their bf16 compensation: the master is `w + comp`, and
    /// after the update `w = bf16(p)`, `comp = bf16(p − w)` (Kahan summation, so that updates
    /// below half a bf16 step accumulate, docs/training.md §6.5).
    Compensated {
        w: &'a mut [f32],
        comp: &'a mut [half::bf16],
    },
}

/// A moment as a fused update reads and writes it.
pub enum MomentMut<'a> {
    F32(&'a mut [f32]),
    /// 8-bit codes with one scale per block ([`super::moment8`]).
    Codes8 {
        codes: &'a mut [u8],
        scales: &'a mut [f32],
    },
}

impl<'a> WeightsMut<'a> {
    fn split(self, at: usize) -> (Self, Self) {
        match self {
            WeightsMut::Master(p) => {
                let (a, b) = p.split_at_mut(at);
                (WeightsMut::Master(a), WeightsMut::Master(b))
            }
            WeightsMut::Compensated { w, comp } => {
                let (wa, wb) = w.split_at_mut(at);
                let (ca, cb) = comp.split_at_mut(at);
                (
                    WeightsMut::Compensated { w: wa, comp: ca },
                    WeightsMut::Compensated { w: wb, comp: cb },
                )
            }
        }
    }
    fn len(&self) -> usize {
        match self {
            WeightsMut::Master(p) => p.len(),
            WeightsMut::Compensated { w, .. } => w.len(),
        }
    }
}

impl<'a> MomentMut<'a> {
    /// Splits after `rows` rows (`cols` values and `blocks` scales each).
    fn split(self, rows: usize, cols: usize, blocks: usize) -> (Self, Self) {
        match self {
            MomentMut::F32(m) => {
                let (a, b) = m.split_at_mut(rows * cols);
                (MomentMut::F32(a), MomentMut::F32(b))
            }
            MomentMut::Codes8 { codes, scales } => {
                let (ca, cb) = codes.split_at_mut(rows * cols);
                let (sa, sb) = scales.split_at_mut(rows * blocks);
                (
                    MomentMut::Codes8 {
                        codes: ca,
                        scales: sa,
                    },
                    MomentMut::Codes8 {
                        codes: cb,
                        scales: sb,
                    },
                )
            }
        }
    }
    fn check(&self, rows: usize, cols: usize, blocks: usize) -> bool {
        match self {
            MomentMut::F32(m) => m.len() == rows * cols,
            MomentMut::Codes8 { codes, scales } => {
                codes.len() == rows * cols && scales.len() == rows * blocks
            }
        }
    }
}

/// AdamW on a `rows × cols` tensor in one pass per block of a row, for the states the
/// three-pass loops above do not cover: 8-bit moments (decoded per block, updated, encoded
/// again) and compensated bf16 weights. `grad(r)` is row `r`'s gradient (`None`: zero, for a
/// row-sparse gradient). Every value is computed with exactly the arithmetic of
/// [`first_moment`], [`second_moment`] and [`param_update`].
pub fn fused_update<'g>(
    rows: usize,
    cols: usize,
    weights: WeightsMut,
    m: MomentMut,
    v: MomentMut,
    grad: &(dyn Fn(usize) -> Option<&'g [f32]> + Sync),
    k: &StepConsts,
) {
    let bw = super::moment8::block_width(cols);
    let blocks = super::moment8::blocks_per_row(cols);
    assert!(
        weights.len() == rows * cols && m.check(rows, cols, blocks) && v.check(rows, cols, blocks),
        "fused AdamW update: the weights or moments do not have {rows}×{cols} values"
    );
    let per_task = (CHUNK / cols.max(1)).max(1);
    let mut pieces = Vec::with_capacity(rows.div_ceil(per_task));
    let (mut w, mut m, mut v) = (weights, m, v);
    let mut row0 = 0;
    while row0 < rows {
        let n = per_task.min(rows - row0);
        let (wa, wb) = w.split(n * cols);
        let (ma, mb) = m.split(n, cols, blocks);
        let (va, vb) = v.split(n, cols, blocks);
        pieces.push((row0, n, wa, ma, va));
        (w, m, v) = (wb, mb, vb);
        row0 += n;
    }
    pieces
        .into_par_iter()
        .for_each(|(row0, n, mut w, mut m, mut v)| {
            let mut ms = vec![0f32; bw];
            let mut vs = vec![0f32; bw];
            let w2 = 1.0 - k.beta2;
            for r in 0..n {
                let g_row = grad(row0 + r);
                for b in 0..blocks {
                    let (lo, hi) = (b * bw, ((b + 1) * bw).min(cols));
                    let at = r * cols + lo;
                    let len = hi - lo;
                    let (ms, vs) = (&mut ms[..len], &mut vs[..len]);
                    load(&m, at, r * blocks + b, ms, false);
                    load(&v, at, r * blocks + b, vs, true);
                    for j in 0..len {
                        let g = g_row.map_or(0.0, |g| g[lo + j]);
                        let g = if k.clip == 1.0 { g } else { g * k.clip };
                        ms[j] += k.weight1 * (g - ms[j]);
                        vs[j] = vs[j] * k.beta2 + w2 * g * g;
                        let denom = vs[j].sqrt() / k.bc2_sqrt + k.eps;
                        let delta = k.step * (ms[j] / denom);
                        match &mut w {
                            WeightsMut::Master(p) => p[at + j] = p[at + j] * k.decay - delta,
                            WeightsMut::Compensated { w, comp } => {
                                let p = w[at + j] + comp[at + j].to_f32();
                                let p = p * k.decay - delta;
                                let rounded = half::bf16::from_f32(p).to_f32();
                                w[at + j] = rounded;
                                comp[at + j] = half::bf16::from_f32(p - rounded);
                            }
                        }
                    }
                    store(&mut m, at, r * blocks + b, ms, false);
                    store(&mut v, at, r * blocks + b, vs, true);
                }
            }
        });
}

fn load(m: &MomentMut, at: usize, block: usize, out: &mut [f32], second: bool) {
    match m {
        MomentMut::F32(x) => out.copy_from_slice(&x[at..at + out.len()]),
        MomentMut::Codes8 { codes, scales } => {
            let c = &codes[at..at + out.len()];
            if second {
                super::moment8::decode_sqrt(c, scales[block], out)
            } else {
                super::moment8::decode_signed(c, scales[block], out)
            }
        }
    }
}

fn store(m: &mut MomentMut, at: usize, block: usize, vals: &[f32], second: bool) {
    match m {
        MomentMut::F32(x) => x[at..at + vals.len()].copy_from_slice(vals),
        MomentMut::Codes8 { codes, scales } => {
            let c = &mut codes[at..at + vals.len()];
            scales[block] = if second {
                super::moment8::encode_sqrt(vals, c)
            } else {
                super::moment8::encode_signed(vals, c)
            };
        }
    }
}

/// Σ x² in f64 (per chunk, the chunks summed in order).
pub fn sum_squares(x: &[f32]) -> f64 {
    let parts: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
        .collect();
    parts.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn updates_match_their_formulas() {
        let n = if cfg!(miri) {
            2 * CHUNK / 512 + 3
        } else {
            3 * CHUNK + 17
        };
        let mk =
            |seed: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect() };
        let (g, m0) = (mk(1.0), mk(2.0));
        let v0: Vec<f32> = mk(3.0).iter().map(|x| x.abs()).collect();
        let acc0 = mk(4.0);
        let mut acc = acc0.clone();
        add_assign(&mut acc, &g);
        let mut m = m0.clone();
        first_moment(&mut m, &g, 0.1, 0.5);
        let mut v = v0.clone();
        second_moment(&mut v, &g, 0.999, 0.5);
        let mut p = mk(5.0);
        let p0 = p.clone();
        param_update(&mut p, &m, &v, 0.99, 1e-3, 0.5, 1e-8);
        for i in 0..n {
            assert_eq!(acc[i], acc0[i] + g[i]);
            let gc = g[i] * 0.5;
            assert!((m[i] - (m0[i] + 0.1 * (gc - m0[i]))).abs() < 1e-6);
            assert!((v[i] - (0.999 * v0[i] + 0.001 * gc * gc)).abs() < 1e-6);
            let want = p0[i] * 0.99 - 1e-3 * (m[i] / (v[i].sqrt() / 0.5 + 1e-8));
            assert!((p[i] - want).abs() < 1e-6);
        }
        let want: f64 = g.iter().map(|&x| (x as f64).powi(2)).sum();
        assert!((sum_squares(&g) - want).abs() < 1e-9 * want);
    }
}
