//! Residual vector quantizers of the codec (docs/model.md §9.1, §9.2).
//!
//! Encoder (`MimiSplitResidualVectorQuantizer`): a semantic RVQ (the first
//! `num_semantic_quantizers` codebooks) and an acoustic RVQ (the rest) that **both take the same
//! latent** through their own `input_proj` (a k=1 conv, present when
//! `vector_quantization_hidden_dimension != hidden_size`); each RVQ picks, layer by layer, the
//! nearest entry of `embed = embed_sum / clamp(cluster_usage, 1e-5)` by Euclidean distance and
//! subtracts it from the residual.
//!
//! Decoder (`SplitResidualVectorQuantizer.decode`): `rvq_first` and `rvq_rest` each sum their
//! layers' entries and apply their `output_proj` (k=1 conv); the two results are added.

use anyhow::{ensure, Result};

use rayon::prelude::*;

use crate::weights::Weights;
use vc_kernels::conv::{tile_rows, Seq};
use vc_kernels::gemm::{gemm, Acc, Par};
use vc_kernels::mat::{MatMut, MatRef};
use vc_kernels::rows_linear::Linear;

/// Reads a tensor as a flat f32 vector after checking its shape.
pub(crate) fn vec_of(w: &Weights, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    Ok(w.get(name, shape)?.flatten_all()?.to_vec1::<f32>()?)
}

/// One codebook: `entries × dim`, with the squared norms of the entries.
#[derive(Debug, Clone)]
pub struct Codebook {
    pub entries: usize,
    pub dim: usize,
    /// `(entries, dim)` row-major.
    embed: Vec<f32>,
    /// `(dim, entries)`: the GEMM operand for `x · embedᵀ`.
    embed_t: Vec<f32>,
    norms: Vec<f32>,
}

impl Codebook {
    /// `embed = embed_sum / clamp(cluster_usage, 1e-5)[:, None]` (f32, as the official code).
    pub fn from_sums(embed_sum: &[f32], usage: &[f32], entries: usize, dim: usize) -> Self {
        assert_eq!(embed_sum.len(), entries * dim);
        assert_eq!(usage.len(), entries);
        let mut embed = vec![0.0f32; entries * dim];
        for e in 0..entries {
            let u = usage[e].max(1e-5);
            for d in 0..dim {
                embed[e * dim + d] = embed_sum[e * dim + d] / u;
            }
        }
        let mut embed_t = vec![0.0f32; entries * dim];
        for e in 0..entries {
            for d in 0..dim {
                embed_t[d * entries + e] = embed[e * dim + d];
            }
        }
        let norms = embed
            .chunks_exact(dim)
            .map(|r| r.iter().map(|v| v * v).sum())
            .collect();
        Codebook {
            entries,
            dim,
            embed,
            embed_t,
            norms,
        }
    }

    pub fn entry(&self, i: usize) -> &[f32] {
        &self.embed[i * self.dim..(i + 1) * self.dim]
    }

    /// Nearest entry of each row of `x` (`(rows, dim)`): argmin of
    /// `|x|² − 2·x·e + |e|²` (the matmul form `torch.cdist` uses for 2048 entries; `|x|²` is
    /// constant per row and dropped). Ties go to the lowest index, like `argmin`.
    pub fn nearest(&self, x: &[f32], rows: usize) -> Vec<u32> {
        assert_eq!(x.len(), rows * self.dim);
        let mut out = vec![0u32; rows];
        let (n, dim) = (self.entries, self.dim);
        let tile = tile_rows(rows, dim, n).min(256);
        out.par_chunks_mut(tile)
            .enumerate()
            .for_each_init(Vec::new, |scratch, (i, best)| {
                let (a, rows) = (i * tile, best.len());
                scratch.clear();
                scratch.resize(rows * n, 0.0);
                gemm(
                    MatMut::new(scratch, rows, n),
                    MatRef::new(&x[a * dim..(a + rows) * dim], rows, dim),
                    MatRef::new(&self.embed_t, dim, n),
                    Acc::Set,
                    1.0,
                    Par::Seq,
                );
                for (dots, best) in scratch.chunks_exact(n).zip(best.iter_mut()) {
                    let mut arg = 0usize;
                    let mut best_d = f32::INFINITY;
                    for (e, (&dot, &nrm)) in dots.iter().zip(&self.norms).enumerate() {
                        let d = nrm - 2.0 * dot;
                        if d < best_d {
                            best_d = d;
                            arg = e;
                        }
                    }
                    *best = arg as u32;
                }
            });
        out
    }
}

/// The encoder side of one RVQ (`MimiResidualVectorQuantizer.encode`).
#[derive(Debug, Clone)]
pub struct RvqEncoder {
    pub input_proj: Option<Linear>,
    pub layers: Vec<Codebook>,
}

impl RvqEncoder {
    /// Codes `(rows, layers)` of `x` `(rows, hidden)`, with the projected input for tests.
    pub fn encode(&self, x: &Seq) -> (Vec<Vec<u32>>, Seq) {
        let projected = match &self.input_proj {
            Some(p) => p.forward(x, None),
            None => x.clone(),
        };
        let mut residual = projected.data.clone();
        let dim = projected.c;
        let mut codes = Vec::with_capacity(self.layers.len());
        for cb in &self.layers {
            let idx = cb.nearest(&residual, projected.t);
            for (r, &i) in idx.iter().enumerate() {
                for (v, e) in residual[r * dim..(r + 1) * dim]
                    .iter_mut()
                    .zip(cb.entry(i as usize))
                {
                    *v -= e;
                }
            }
            codes.push(idx);
        }
        (codes, projected)
    }
}

/// `MimiSplitResidualVectorQuantizer`, limited to the codebooks the codec keeps.
#[derive(Debug, Clone)]
pub struct SplitRvqEncoder {
    pub semantic: RvqEncoder,
    pub acoustic: RvqEncoder,
}

impl SplitRvqEncoder {
    /// Loads `{prefix}{semantic,acoustic}_residual_vector_quantizer.*` with `semantic` + `acoustic`
    /// layers (the checkpoint may hold more acoustic layers; they are not needed).
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        vq_dim: usize,
        codebook_dim: usize,
        entries: usize,
        semantic: usize,
        acoustic: usize,
    ) -> Result<Self> {
        let rvq = |name: &str, n: usize| -> Result<RvqEncoder> {
            let p = format!("{prefix}{name}.");
            let input_proj = if vq_dim != hidden {
                let wt = vec_of(w, &format!("{p}input_proj.weight"), &[vq_dim, hidden, 1])?;
                Some(Linear::from_torch(&wt, vq_dim, hidden, None)?)
            } else {
                None
            };
            let proj_dim = if vq_dim != hidden { vq_dim } else { hidden };
            ensure!(
                proj_dim == codebook_dim,
                "{p}: codebook_dim {codebook_dim} differs from the quantizer input width {proj_dim}"
            );
            let mut layers = Vec::with_capacity(n);
            for i in 0..n {
                let c = format!("{p}layers.{i}.codebook.");
                let sum = vec_of(w, &format!("{c}embed_sum"), &[entries, codebook_dim])?;
                let usage = vec_of(w, &format!("{c}cluster_usage"), &[entries])?;
                layers.push(Codebook::from_sums(&sum, &usage, entries, codebook_dim));
            }
            Ok(RvqEncoder { input_proj, layers })
        };
        Ok(SplitRvqEncoder {
            semantic: rvq("semantic_residual_vector_quantizer", semantic)?,
            acoustic: rvq("acoustic_residual_vector_quantizer", acoustic)?,
        })
    }

    /// Codes `(rows, semantic + acoustic)`, row-major per frame.
    pub fn encode(&self, x: &Seq) -> Vec<Vec<u32>> {
        let (sem, _) = self.semantic.encode(x);
        let (aco, _) = self.acoustic.encode(x);
        (0..x.t)
            .map(|t| sem.iter().chain(&aco).map(|layer| layer[t]).collect())
            .collect()
    }
}

/// The decoder's `SplitResidualVectorQuantizer.decode`.
#[derive(Debug, Clone)]
pub struct RvqDecoder {
    /// Codebooks of `rvq_first` then of `rvq_rest`.
    first: Vec<Codebook>,
    rest: Vec<Codebook>,
    first_out: Linear,
    rest_out: Linear,
    pub out_dim: usize,
}

impl RvqDecoder {
    /// `{prefix}rvq_first` (`n_semantic` layers) and `{prefix}rvq_rest` (`n_total − n_semantic`),
    /// entries `vq_dim` wide, `output_proj` to `out_dim`.
    pub fn load(
        w: &Weights,
        prefix: &str,
        entries: usize,
        vq_dim: usize,
        out_dim: usize,
        n_semantic: usize,
        n_total: usize,
    ) -> Result<Self> {
        let part = |name: &str, n: usize| -> Result<(Vec<Codebook>, Linear)> {
            let p = format!("{prefix}{name}.");
            let mut books = Vec::with_capacity(n);
            for i in 0..n {
                let c = format!("{p}vq.layers.{i}._codebook.");
                let sum = vec_of(w, &format!("{c}embedding_sum"), &[entries, vq_dim])?;
                let usage = vec_of(w, &format!("{c}cluster_usage"), &[entries])?;
                books.push(Codebook::from_sums(&sum, &usage, entries, vq_dim));
            }
            let wt = vec_of(w, &format!("{p}output_proj.weight"), &[out_dim, vq_dim, 1])?;
            Ok((books, Linear::from_torch(&wt, out_dim, vq_dim, None)?))
        };
        let (first, first_out) = part("rvq_first", n_semantic)?;
        let (rest, rest_out) = part("rvq_rest", n_total - n_semantic)?;
        Ok(RvqDecoder {
            first,
            rest,
            first_out,
            rest_out,
            out_dim,
        })
    }

    pub fn num_quantizers(&self) -> usize {
        self.first.len() + self.rest.len()
    }

    pub fn entries(&self) -> usize {
        self.first[0].entries
    }

    /// `(T, out_dim)` from codes `(T, num_quantizers)` (already range-checked).
    pub fn decode(&self, codes: &[&[u32]]) -> Seq {
        let t = codes.len();
        let nf = self.first.len();
        let sum = |books: &[Codebook], offset: usize| -> Seq {
            let dim = books[0].dim;
            let mut out = vec![0.0f32; t * dim];
            for (i, cb) in books.iter().enumerate() {
                for (r, frame) in codes.iter().enumerate() {
                    let e = cb.entry(frame[offset + i] as usize);
                    for (v, x) in out[r * dim..(r + 1) * dim].iter_mut().zip(e) {
                        *v += x;
                    }
                }
            }
            Seq::new(out, t, dim)
        };
        let first = self.first_out.forward(&sum(&self.first, 0), None);
        if self.rest.is_empty() {
            return first;
        }
        self.rest_out.forward(&sum(&self.rest, nf), Some(&first))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vc_kernels::test_values::rand_vec;

    #[test]
    fn nearest_matches_exact_search() {
        let (entries, dim, rows) = (300, 6, 257);
        let sums = rand_vec(entries * dim, 1);
        let usage: Vec<f32> = rand_vec(entries, 2).iter().map(|u| u.abs() + 0.1).collect();
        let mut usage0 = usage.clone();
        usage0[5] = 0.0; // exercises the 1e-5 clamp
        let cb = Codebook::from_sums(&sums, &usage0, entries, dim);
        assert_eq!(cb.entry(5)[0], sums[5 * dim] / 1e-5);
        let x = rand_vec(rows * dim, 3);
        let got = cb.nearest(&x, rows);
        for r in 0..rows {
            let xr = &x[r * dim..(r + 1) * dim];
            let mut best = (f64::INFINITY, 0usize);
            for e in 0..entries {
                let d: f64 = xr
                    .iter()
                    .zip(cb.entry(e))
                    .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
                    .sum();
                if d < best.0 {
                    best = (d, e);
                }
            }
            assert_eq!(got[r] as usize, best.1, "row {r}");
        }
    }
}
