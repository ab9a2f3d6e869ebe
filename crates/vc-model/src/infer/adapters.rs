//! Low-rank adapters kept factored on the row inference path (docs/serving.md §7): one base
//! model in memory, several adapters beside it, and each batch row computing with its own. A
//! decoder-layer matrix becomes a [`AdaptedProjection`]: the base matrix in the precision's format and,
//! per adapter that changes it, `scale · B·A` as its two f32 factors.
//!
//! A row with adapter `a` gets `x·Wᵀ + scale·(x·Aᵀ)·Bᵀ` — what training computes
//! (docs/training.md §13) — where `speak --adapter` computes `x·(W + scale·B·A)ᵀ` with the
//! product merged at load: the two differ by float rounding only. Each row's correction is
//! computed on its own, so a row's result does not depend on the other rows of the batch
//! (docs/serving.md §3).

use anyhow::{ensure, Result};

use super::row_math::dot;
use vc_kernels::team;

use crate::linear::{Input, LinearWeight};

/// An adapter put on a [`super::RowTalker`], numbered in the order they were added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AdapterId(pub(super) usize);

/// `scale · B·A` of one `(out, in)` matrix, factored: `a` `(r, in)` and `b` transposed,
/// `bt` `(r, out)`, so that both products of a row run over contiguous rows.
pub(super) struct FactoredDelta {
    a: Vec<f32>,
    bt: Vec<f32>,
    rank: usize,
    scale: f32,
}

impl FactoredDelta {
    /// Adds `scale·B·(A·x)` to `y` for one input row `x`: `r` dot products of the input width,
    /// then `r` scaled row additions of the output width, each output value summed over `q` in
    /// order. `split` spreads both over the team (one row alone); the values are the same.
    fn add_row(&self, x: &[f32], y: &mut [f32], split: bool) {
        let (k, n, r) = (x.len(), y.len(), self.rank);
        let parts = if split {
            rayon::current_num_threads().max(1)
        } else {
            1
        };
        let mut u = vec![0f32; r];
        let dots = |i: usize, chunk: &mut [f32], per: usize| {
            for (j, uq) in chunk.iter_mut().enumerate() {
                let q = i * per + j;
                *uq = dot(&self.a[q * k..(q + 1) * k], x) * self.scale;
            }
        };
        let per_u = r.div_ceil(parts);
        let per_y = n.div_ceil(parts).next_multiple_of(16);
        let adds = |i: usize, ys: &mut [f32], u: &[f32]| {
            let o0 = i * per_y;
            for (q, &uq) in u.iter().enumerate() {
                let b = &self.bt[q * n + o0..q * n + o0 + ys.len()];
                ys.iter_mut().zip(b).for_each(|(yo, bo)| *yo += uq * bo);
            }
        };
        if parts > 1 {
            team::for_each_chunk(&mut u, per_u, |i, c| dots(i, c, per_u));
            team::for_each_chunk(y, per_y, |i, ys| adds(i, ys, &u));
        } else {
            dots(0, &mut u, r);
            adds(0, y, &u);
        }
    }

    /// Values held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.a.len() + self.bt.len()
    }
}

/// A decoder-layer matrix with the adapters that change it.
pub(super) struct AdaptedProjection {
    pub weight: LinearWeight,
    /// By [`AdapterId`]; `None` where that adapter leaves this matrix alone.
    deltas: Vec<Option<FactoredDelta>>,
}

impl AdaptedProjection {
    pub fn new(weight: LinearWeight) -> Self {
        AdaptedProjection {
            weight,
            deltas: Vec::new(),
        }
    }

    /// Puts adapter `id`'s factors on this matrix: `a` `(r, in)`, `b` `(out, r)`.
    pub fn add(
        &mut self,
        id: AdapterId,
        rank: usize,
        a: Vec<f32>,
        b: Vec<f32>,
        scale: f64,
    ) -> Result<()> {
        let (n, k) = self.weight.dims();
        ensure!(
            rank > 0 && a.len() == rank * k && b.len() == n * rank,
            "factors of {} and {} values at rank {rank} do not make a ({n}, {k}) update",
            a.len(),
            b.len()
        );
        if self.deltas.len() <= id.0 {
            self.deltas.resize_with(id.0 + 1, || None);
        }
        ensure!(
            self.deltas[id.0].is_none(),
            "adapter {} changes this matrix twice",
            id.0
        );
        let mut bt = vec![0f32; n * rank];
        for (o, row) in b.chunks_exact(rank).enumerate() {
            for (q, v) in row.iter().enumerate() {
                bt[q * n + o] = *v;
            }
        }
        self.deltas[id.0] = Some(FactoredDelta {
            a,
            bt,
            rank,
            scale: scale as f32,
        });
        Ok(())
    }

    /// f32 values the adapters hold on this matrix.
    #[cfg(test)]
    pub fn adapter_values(&self) -> usize {
        self.deltas.iter().flatten().map(FactoredDelta::len).sum()
    }

    /// `x (m, k) · Wᵀ`, plus each row's adapter correction: row `t` of `x` (its raw f32
    /// values, also behind `inp`) speaks with `rows[t]` (`rows` empty: every row with the base).
    /// Each row's correction is computed on its own (rows in parallel on the team).
    pub fn forward(&self, inp: &Input<'_>, x: &[f32], rows: &[Option<AdapterId>]) -> Vec<f32> {
        let mut y = self.weight.forward(inp);
        let delta = |t: usize| {
            rows.get(t)
                .copied()
                .flatten()
                .and_then(|id| self.deltas.get(id.0))
                .and_then(Option::as_ref)
        };
        let (n, k) = self.weight.dims();
        debug_assert!(
            rows.is_empty() || rows.len() * k == x.len(),
            "one adapter per row"
        );
        let adapted: Vec<(usize, &FactoredDelta)> = (0..rows.len())
            .filter_map(|t| delta(t).map(|d| (t, d)))
            .collect();
        match adapted[..] {
            [] => {}
            // One row (a stream's step): its products spread over the team.
            [(t, d)] => d.add_row(&x[t * k..(t + 1) * k], &mut y[t * n..(t + 1) * n], true),
            _ => team::for_each_chunk(&mut y, n, |t, out| {
                if let Some(d) = delta(t) {
                    d.add_row(&x[t * k..(t + 1) * k], out, false);
                }
            }),
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut r = vc_core::rng::SplitMix64::new(seed);
        (0..n).map(|_| r.next_f64() as f32 - 0.5).collect()
    }

    /// Each row gets `x·(W + s·B·A)ᵀ` of its own adapter (within f32 rounding), the base
    /// rows `x·Wᵀ` exactly; factors that do not fit the matrix are refused.
    #[test]
    fn rows_compute_with_their_own_adapter() {
        let (n, k, r) = (50, 7, 3);
        let w = values(n * k, 1);
        let mut p = AdaptedProjection::new(LinearWeight::F32 { w: w.clone(), n, k });
        let factors = [
            (values(r * k, 2), values(n * r, 3), 2.0),
            (values(r * k, 4), values(n * r, 5), 0.5),
        ];
        for (i, (a, b, s)) in factors.iter().enumerate() {
            p.add(AdapterId(i), r, a.clone(), b.clone(), *s).unwrap();
        }
        assert!(p
            .add(AdapterId(2), r, values(r * k, 6), values(n, 7), 1.0)
            .is_err());
        assert!(p
            .add(AdapterId(0), r, values(r * k, 6), values(n * r, 7), 1.0)
            .is_err());
        assert_eq!(p.adapter_values(), 2 * (r * k + n * r));
        let rows = [
            Some(AdapterId(1)),
            None,
            Some(AdapterId(0)),
            Some(AdapterId(1)),
        ];
        let x = values(rows.len() * k, 8);
        let y = p.forward(&Input::new(&x, rows.len(), k), &x, &rows);
        let plain = p.forward(&Input::new(&x, rows.len(), k), &x, &[]);
        for (t, slot) in rows.iter().enumerate() {
            let xr = &x[t * k..(t + 1) * k];
            for o in 0..n {
                let mut want = 0f64;
                for j in 0..k {
                    let mut wv = w[o * k + j] as f64;
                    if let Some(id) = slot {
                        let (a, b, s) = &factors[id.0];
                        wv += s
                            * (0..r)
                                .map(|q| b[o * r + q] as f64 * a[q * k + j] as f64)
                                .sum::<f64>();
                    }
                    want += wv * xr[j] as f64;
                }
                let got = y[t * n + o] as f64;
                assert!(
                    (got - want).abs() < 1e-5,
                    "row {t} out {o}: {got} vs {want}"
                );
            }
            if slot.is_none() {
                assert_eq!(&y[t * n..(t + 1) * n], &plain[t * n..(t + 1) * n]);
            }
        }
        // A row adapted alone (its products spread over the team) gets the same bits.
        let solo = [None, Some(AdapterId(0))];
        let x2 = &x[k..3 * k];
        let y2 = p.forward(&Input::new(x2, 2, k), x2, &solo);
        assert_eq!(&y2[n..], &y[2 * n..3 * n]);
    }
}
