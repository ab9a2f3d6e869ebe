//! A `Linear` layer (`x · Wᵀ + b`, an optional residual added) on channels-last rows: the
//! codec's pointwise projections, run as one GEMM over all rows.

use anyhow::{ensure, Result};

use crate::buf::par_new_vec;
use crate::conv::{tile_par, tile_rows, Seq};
use crate::gemm::{gemm, Acc};
use crate::mat::{MatMut, MatRef};

/// A `Linear` (`x · Wᵀ + b`) on channels-last rows.
#[derive(Debug, Clone)]
pub struct Linear {
    pub cin: usize,
    pub cout: usize,
    /// `(cin, cout)`.
    w: Vec<f32>,
    bias: Option<Vec<f32>>,
}

impl Linear {
    /// From a torch weight `(cout, cin)` (also a k=1 conv weight `(cout, cin, 1)`).
    pub fn from_torch(
        weight: &[f32],
        cout: usize,
        cin: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<Self> {
        ensure!(weight.len() == cout * cin, "linear weight size");
        let mut w = vec![0.0; weight.len()];
        for o in 0..cout {
            for i in 0..cin {
                w[i * cout + o] = weight[o * cin + i];
            }
        }
        Ok(Linear { cin, cout, w, bias })
    }

    /// Concatenates the outputs of several linears over the same input (e.g. q, k, v).
    pub fn concat(parts: &[Linear]) -> Result<Linear> {
        ensure!(!parts.is_empty(), "nothing to concatenate");
        let cin = parts[0].cin;
        ensure!(
            parts.iter().all(|p| p.cin == cin),
            "concatenated linears differ in input"
        );
        let cout: usize = parts.iter().map(|p| p.cout).sum();
        let mut w = vec![0.0; cin * cout];
        let mut off = 0;
        for p in parts {
            for i in 0..cin {
                w[i * cout + off..i * cout + off + p.cout]
                    .copy_from_slice(&p.w[i * p.cout..(i + 1) * p.cout]);
            }
            off += p.cout;
        }
        let bias = if parts.iter().any(|p| p.bias.is_some()) {
            let mut b = Vec::with_capacity(cout);
            for p in parts {
                match &p.bias {
                    Some(pb) => b.extend_from_slice(pb),
                    None => b.extend(std::iter::repeat_n(0.0, p.cout)),
                }
            }
            Some(b)
        } else {
            None
        };
        Ok(Linear { cin, cout, w, bias })
    }

    /// Multiplies every output channel by `scale[o]` (folds a LayerScale into the weights).
    pub fn scale_outputs(&mut self, scale: &[f32]) {
        assert_eq!(scale.len(), self.cout);
        for row in self.w.chunks_exact_mut(self.cout) {
            for (v, s) in row.iter_mut().zip(scale) {
                *v *= s;
            }
        }
        if let Some(b) = &mut self.bias {
            for (v, s) in b.iter_mut().zip(scale) {
                *v *= s;
            }
        }
    }

    /// `residual + x·Wᵀ + b` when `residual` is given (same shape as the output), else `x·Wᵀ + b`.
    pub fn forward(&self, x: &Seq, residual: Option<&Seq>) -> Seq {
        assert_eq!(x.c, self.cin);
        if let Some(r) = residual {
            assert_eq!((r.t, r.c), (x.t, self.cout));
        }
        let n = self.cout;
        let tile = tile_rows(x.t, self.cin, n);
        let out = par_new_vec(
            x.t * n,
            tile * n,
            || (),
            |i, part, _| {
                let (a, rows) = (i * tile, part.len() / n);
                let mut o = match residual {
                    Some(r) => part.copy_from(&r.data[a * n..(a + rows) * n]),
                    None => part.fill(0.0),
                };
                if let Some(bias) = &self.bias {
                    for row in o.chunks_exact_mut(n) {
                        for (v, &bv) in row.iter_mut().zip(bias) {
                            *v += bv;
                        }
                    }
                }
                let lhs = MatRef::new(&x.data[a * self.cin..(a + rows) * self.cin], rows, self.cin);
                let rhs = MatRef::new(&self.w, self.cin, n);
                gemm(
                    MatMut::new(&mut o, rows, n),
                    lhs,
                    rhs,
                    Acc::Add,
                    1.0,
                    tile_par(rows),
                );
                o
            },
        );
        Seq::new(out, x.t, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv::tests::rand_vec;

    #[test]
    fn linear_matches_reference() {
        let (c, len) = (5, 40);
        let lw = rand_vec(3 * c, 34);
        let lb = rand_vec(3, 35);
        let lin = Linear::from_torch(&lw, 3, c, Some(lb.clone())).unwrap();
        let xs = Seq::new(rand_vec(len * c, 36), len, c);
        let res = Seq::new(rand_vec(len * 3, 37), len, 3);
        let y = lin.forward(&xs, Some(&res));
        for t in 0..len {
            for o in 0..3 {
                let mut acc = lb[o] + res.data[t * 3 + o];
                for i in 0..c {
                    acc += lw[o * c + i] * xs.data[t * c + i];
                }
                assert!((y.data[t * 3 + o] - acc).abs() < 1e-5);
            }
        }
    }
}
