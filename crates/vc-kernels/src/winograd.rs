//! Winograd (Toom–Cook) minimal filtering for the stride-1 convolutions inside the residual
//! units, which are most of the decoder's work.
//!
//! `F(m, r)` computes `m` outputs of an `r`-tap (dilated) filter from `α = m + r − 1` inputs
//! with α products instead of m·r: `y = Aᵀ[(G g) ⊙ (Bᵀ x)]`. Over channels, each of the α
//! products becomes one GEMM `(tiles × C_in) · (C_in × C_out)`, so the GEMM work drops from
//! `r` to `α / m` per output (F(2,7): 7 → 4). The matrices come from the transposed Toom–Cook
//! construction for the chosen interpolation points (plus ∞): with `V` the α×α Vandermonde
//! matrix, `Aᵀ = V_mᵀ`, `G = V_r`, `Bᵀ = V⁻ᵀ` (computed in f64). The rounding error this adds is
//! ~1e-6 relative (tested below), far inside the codec's parity tolerance.

use anyhow::{ensure, Result};

use super::gemm::{gemm, Acc, Par};
use super::mat::{MatMut, MatRef};

/// Interpolation points (∞ is added) for α − 1 finite points.
fn points(alpha: usize) -> Vec<f64> {
    let all = [
        0.0,
        1.0,
        -1.0,
        2.0,
        -2.0,
        0.5,
        -0.5,
        3.0,
        -3.0,
        1.0 / 3.0,
        -1.0 / 3.0,
        4.0,
        -4.0,
    ];
    all[..alpha - 1].to_vec()
}

/// Transform matrices of `F(m, r)`, row-major.
#[derive(Debug, Clone)]
pub struct Transform {
    pub m: usize,
    pub r: usize,
    pub alpha: usize,
    /// `m × α`
    pub at: Vec<f64>,
    /// `α × r`
    pub g: Vec<f64>,
    /// `α × α`
    pub bt: Vec<f64>,
}

impl Transform {
    pub fn new(m: usize, r: usize) -> Result<Self> {
        let alpha = m + r - 1;
        ensure!(
            (2..=14).contains(&alpha),
            "unsupported Winograd size F({m}, {r})"
        );
        let pts = points(alpha);
        // Row of a point: p^0..p^(n−1); the ∞ row is the unit vector on the last column.
        let vander = |n: usize| -> Vec<f64> {
            let mut v = vec![0.0; alpha * n];
            for (i, &p) in pts.iter().enumerate() {
                for k in 0..n {
                    v[i * n + k] = p.powi(k as i32);
                }
            }
            v[(alpha - 1) * n + n - 1] = 1.0;
            v
        };
        let v = vander(alpha);
        let vm = vander(m);
        let g = vander(r);
        let inv = invert(&v, alpha)?;
        // Bᵀ = V⁻ᵀ
        let mut bt = vec![0.0; alpha * alpha];
        for i in 0..alpha {
            for j in 0..alpha {
                bt[i * alpha + j] = inv[j * alpha + i];
            }
        }
        // Aᵀ = V_mᵀ
        let mut at = vec![0.0; m * alpha];
        for i in 0..m {
            for j in 0..alpha {
                at[i * alpha + j] = vm[j * m + i];
            }
        }
        Ok(Transform {
            m,
            r,
            alpha,
            at,
            g,
            bt,
        })
    }
}

/// Inverse of an `n × n` matrix (Gauss–Jordan with partial pivoting, f64).
fn invert(a: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut m = a.to_vec();
    let mut inv = vec![0.0; n * n];
    for i in 0..n {
        inv[i * n + i] = 1.0;
    }
    for col in 0..n {
        let piv = (col..n)
            .max_by(|&x, &y| m[x * n + col].abs().total_cmp(&m[y * n + col].abs()))
            .expect("rows");
        ensure!(
            m[piv * n + col].abs() > 1e-12,
            "singular Vandermonde matrix"
        );
        if piv != col {
            for k in 0..n {
                m.swap(piv * n + k, col * n + k);
                inv.swap(piv * n + k, col * n + k);
            }
        }
        let d = m[col * n + col];
        for k in 0..n {
            m[col * n + k] /= d;
            inv[col * n + k] /= d;
        }
        for row in 0..n {
            if row != col {
                let f = m[row * n + col];
                if f != 0.0 {
                    for k in 0..n {
                        m[row * n + k] -= f * m[col * n + k];
                        inv[row * n + k] -= f * inv[col * n + k];
                    }
                }
            }
        }
    }
    Ok(inv)
}

/// A stride-1, dilated conv `C_in → C_out` with `r` taps, evaluated with `F(m, r)`.
#[derive(Debug, Clone)]
pub struct WinogradConv {
    pub cin: usize,
    pub cout: usize,
    pub dilation: usize,
    t: Transform,
    /// `α × α` f32 `Bᵀ`, as (row ℓ, col j) pairs with non-zero weight.
    bt: Vec<Vec<(usize, f32)>>,
    /// `m` rows of (ℓ, weight).
    at: Vec<Vec<(usize, f32)>>,
    /// α matrices `(C_in, C_out)`: `U_ℓ = Σ_k G[ℓ][k] · W_k`.
    u: Vec<f32>,
    bias: Vec<f32>,
}

impl WinogradConv {
    /// From the GEMM-layout weight `(r·C_in, C_out)` (row `k·C_in + ci`) of a causal conv.
    pub fn new(
        w: &[f32],
        cin: usize,
        cout: usize,
        r: usize,
        dilation: usize,
        bias: Vec<f32>,
        m: usize,
    ) -> Result<Self> {
        ensure!(
            w.len() == r * cin * cout && bias.len() == cout,
            "winograd weight size"
        );
        let t = Transform::new(m, r)?;
        let alpha = t.alpha;
        let mut u = vec![0.0f32; alpha * cin * cout];
        for l in 0..alpha {
            for i in 0..cin * cout {
                let mut acc = 0.0f64;
                for k in 0..r {
                    acc += t.g[l * r + k] * w[k * cin * cout + i] as f64;
                }
                u[l * cin * cout + i] = acc as f32;
            }
        }
        let sparse = |mat: &[f64], rows: usize| -> Vec<Vec<(usize, f32)>> {
            (0..rows)
                .map(|i| {
                    (0..alpha)
                        .filter(|&j| mat[i * alpha + j] != 0.0)
                        .map(|j| (j, mat[i * alpha + j] as f32))
                        .collect()
                })
                .collect()
        };
        Ok(WinogradConv {
            cin,
            cout,
            dilation,
            bt: sparse(&t.bt, alpha),
            at: sparse(&t.at, m),
            t,
            u,
            bias,
        })
    }

    pub fn m(&self) -> usize {
        self.t.m
    }

    /// Rows the padded input of a tile of `rows` outputs must have (zero rows past the real
    /// input are fine: they only feed discarded outputs).
    pub fn padded_rows(&self, rows: usize) -> usize {
        let group = self.t.m * self.dilation;
        rows.div_ceil(group) * group + (self.t.r - 1) * self.dilation
    }

    /// `out[0..rows] = bias + conv(inp)`, where `inp` holds [`Self::padded_rows`] rows of the
    /// padded input (output row o reads rows o, o+d, …, o+(r−1)d) and `out` rows of `C_out`.
    pub fn forward_tile(&self, inp: &[f32], rows: usize, out: &mut [f32], scratch: &mut Vec<f32>) {
        let (m, alpha, d) = (self.t.m, self.t.alpha, self.dilation);
        let (ci, co) = (self.cin, self.cout);
        let group = m * d;
        let groups = rows.div_ceil(group);
        let tiles = groups * d;
        debug_assert!(inp.len() >= self.padded_rows(rows) * ci);
        scratch.clear();
        scratch.resize(alpha * tiles * (ci + co), 0.0);
        let (v, prod) = scratch.split_at_mut(alpha * tiles * ci);
        // Input transform: V_ℓ[tile] = Σ_j Bᵀ[ℓ][j] · x[row(tile, j)], tile = (group, residue).
        for g in 0..groups {
            for res in 0..d {
                let tile = g * d + res;
                let base = g * group + res;
                for (l, row) in self.bt.iter().enumerate() {
                    let dst = &mut v[(l * tiles + tile) * ci..(l * tiles + tile + 1) * ci];
                    for &(j, b) in row {
                        let src = &inp[(base + j * d) * ci..(base + j * d + 1) * ci];
                        for (o, &x) in dst.iter_mut().zip(src) {
                            *o += b * x;
                        }
                    }
                }
            }
        }
        // α GEMMs: M_ℓ = V_ℓ · U_ℓ.
        let products = prod.chunks_exact_mut(tiles * co);
        let inputs = v.chunks_exact(tiles * ci).zip(self.u.chunks_exact(ci * co));
        for (m_l, (v_l, u_l)) in products.zip(inputs) {
            gemm(
                MatMut::new(m_l, tiles, co),
                MatRef::new(v_l, tiles, ci),
                MatRef::new(u_l, ci, co),
                Acc::Set,
                1.0,
                Par::Seq,
            );
        }
        // Output transform: y[row(tile, i)] = bias + Σ_ℓ Aᵀ[i][ℓ] · M_ℓ[tile].
        for g in 0..groups {
            for res in 0..d {
                let tile = g * d + res;
                for (i, row) in self.at.iter().enumerate() {
                    let o = g * group + res + i * d;
                    if o >= rows {
                        continue;
                    }
                    let dst = &mut out[o * co..(o + 1) * co];
                    dst.copy_from_slice(&self.bias);
                    for &(l, a) in row {
                        let src = &prod[(l * tiles + tile) * co..(l * tiles + tile + 1) * co];
                        for (y, &p) in dst.iter_mut().zip(src) {
                            *y += a * p;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::conv::tests::rand_vec;
    use super::*;

    #[test]
    fn transforms_compute_correlation_exactly_in_f64() {
        for (m, r) in [(2, 3), (2, 7), (3, 7), (4, 7), (4, 3)] {
            let t = Transform::new(m, r).unwrap();
            let a = t.alpha;
            let x: Vec<f64> = rand_vec(a, 1).iter().map(|&v| v as f64).collect();
            let g: Vec<f64> = rand_vec(r, 2).iter().map(|&v| v as f64).collect();
            let gx: Vec<f64> = (0..a)
                .map(|l| (0..r).map(|k| t.g[l * r + k] * g[k]).sum())
                .collect();
            let bx: Vec<f64> = (0..a)
                .map(|l| (0..a).map(|j| t.bt[l * a + j] * x[j]).sum())
                .collect();
            for i in 0..m {
                let y: f64 = (0..a).map(|l| t.at[i * a + l] * gx[l] * bx[l]).sum();
                let want: f64 = (0..r).map(|k| g[k] * x[i + k]).sum();
                assert!(
                    (y - want).abs() < 1e-9,
                    "F({m},{r}) output {i}: {y} vs {want}"
                );
            }
        }
    }

    /// Direct dilated correlation on a zero-extended padded input, f64 accumulation.
    #[allow(clippy::too_many_arguments)]
    fn direct(
        inp: &[f32],
        rows: usize,
        w: &[f32],
        ci: usize,
        co: usize,
        r: usize,
        d: usize,
        b: &[f32],
    ) -> Vec<f32> {
        let mut out = vec![0.0f32; rows * co];
        for o in 0..rows {
            for c in 0..co {
                let mut acc = b[c] as f64;
                for k in 0..r {
                    for i in 0..ci {
                        acc += w[(k * ci + i) * co + c] as f64 * inp[(o + k * d) * ci + i] as f64;
                    }
                }
                out[o * co + c] = acc as f32;
            }
        }
        out
    }

    #[test]
    fn tile_matches_direct_conv() {
        for (m, d, rows) in [(2, 1, 37), (2, 3, 50), (2, 9, 100), (4, 1, 33), (4, 3, 64)] {
            let (ci, co, r) = if cfg!(miri) { (5, 3, 7) } else { (24, 16, 7) };
            let w = rand_vec(r * ci * co, 3);
            let b = rand_vec(co, 4);
            let wc = WinogradConv::new(&w, ci, co, r, d, b.clone(), m).unwrap();
            let prow = wc.padded_rows(rows);
            let real = rows + (r - 1) * d;
            let mut inp = rand_vec(prow * ci, 5);
            inp[real * ci..].fill(0.0);
            let mut out = vec![0.0f32; rows * co];
            let mut scratch = Vec::new();
            wc.forward_tile(&inp, rows, &mut out, &mut scratch);
            let want = direct(&inp, rows, &w, ci, co, r, d, &b);
            let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let err = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                err < 2e-6 * scale.max(1.0) * (m as f32),
                "F({m},7) d={d}: {err} (scale {scale})"
            );
        }
    }
}
