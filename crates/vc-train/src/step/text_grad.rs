//! Row-sparse gradients for the text embedding (151936 rows, of which a batch touches a few
//! hundred). Through candle's autograd its gradient would be a dense table — allocated,
//! zero-filled, copied and read back every micro-batch (1.2 GB at full size). Instead the
//! trainer looks the batch's distinct rows up into a small trainable copy, collects their
//! gradients here, and AdamW applies them with the kernels below (rows not touched get the same
//! update as with a zero gradient, exactly as the dense kernels compute it).

use candle_core::{bail, CpuStorage, InplaceOp1, Layout, Result};
use rayon::prelude::*;

/// Rows per parallel work item.
const ROWS_PER_CHUNK: usize = 256;

/// The distinct ids of `ids` (sorted) and, for each id, its index among them.
pub fn distinct(ids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut uniq = ids.to_vec();
    uniq.sort_unstable();
    uniq.dedup();
    let local = ids
        .iter()
        .map(|id| uniq.binary_search(id).expect("present") as u32)
        .collect();
    (uniq, local)
}

/// The accumulated gradient of some rows of a `(rows, width)` table.
#[derive(Debug, Clone)]
pub struct RowGrad {
    width: usize,
    /// `slot[row]`: index of the row in `ids` / `data`, or -1.
    slot: Vec<i32>,
    ids: Vec<u32>,
    data: Vec<f32>,
}

impl RowGrad {
    pub fn new(rows: usize, width: usize) -> Self {
        Self {
            width,
            slot: vec![-1; rows],
            ids: Vec::new(),
            data: Vec::new(),
        }
    }

    /// Adds `grad` (`ids.len()` rows of `width`) to rows `ids` (distinct).
    pub fn add(&mut self, ids: &[u32], grad: &[f32]) -> Result<()> {
        if grad.len() != ids.len() * self.width {
            bail!("row gradient: {} values for {} rows", grad.len(), ids.len());
        }
        for (&id, g) in ids.iter().zip(grad.chunks(self.width)) {
            let Some(slot) = self.slot.get_mut(id as usize) else {
                bail!("row gradient: row {id} outside the table");
            };
            if *slot < 0 {
                *slot = self.ids.len() as i32;
                self.ids.push(id);
                self.data.extend_from_slice(g);
            } else {
                let at = *slot as usize * self.width;
                self.data[at..at + self.width]
                    .iter_mut()
                    .zip(g)
                    .for_each(|(d, g)| *d += *g);
            }
        }
        Ok(())
    }

    /// Rounds every value to bf16 (kept in f32): after an add, the sum is the bf16 sum that
    /// `train.reduce_dtype = "bf16"` asks for.
    pub fn round_to_bf16(&mut self) {
        for v in &mut self.data {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    }

    /// Rows of the table the gradient is for.
    pub fn rows(&self) -> usize {
        self.slot.len()
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// Σ g² in f64 (rows in the order they were first added).
    pub fn sum_squares(&self) -> f64 {
        self.data.iter().map(|&v| (v as f64) * (v as f64)).sum()
    }

    /// Row `r`'s gradient, if it has one.
    pub fn row(&self, r: usize) -> Option<&[f32]> {
        let s = self.slot[r];
        (s >= 0).then(|| &self.data[s as usize * self.width..(s as usize + 1) * self.width])
    }

    fn apply(
        &self,
        name: &str,
        s: &mut CpuStorage,
        l: &Layout,
        f: impl Fn(&mut [f32], Option<&[f32]>) + Sync,
    ) -> Result<()> {
        let CpuStorage::F32(v) = s else {
            bail!("{name}: expected f32")
        };
        let Some((a, b)) = l.contiguous_offsets() else {
            bail!("{name}: expected a contiguous tensor")
        };
        let v = &mut v[a..b];
        if v.len() != self.slot.len() * self.width {
            bail!(
                "{name}: the table has {} values, the gradient {} rows",
                v.len(),
                self.slot.len()
            );
        }
        let w = self.width;
        v.par_chunks_mut(w * ROWS_PER_CHUNK)
            .enumerate()
            .for_each(|(c, block)| {
                for (i, row) in block.chunks_mut(w).enumerate() {
                    f(row, self.row(c * ROWS_PER_CHUNK + i));
                }
            });
        Ok(())
    }
}

/// First moment with a row-sparse gradient: `m = lerp(m, c·g, 1 − β1)`, g = 0 off the rows.
pub struct SparseFirstMoment<'a> {
    pub grad: &'a RowGrad,
    pub weight: f32,
    pub clip: f32,
}

impl InplaceOp1 for SparseFirstMoment<'_> {
    fn name(&self) -> &'static str {
        "adamw-exp-avg-rows"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let (w, c) = (self.weight, self.clip);
        self.grad.apply(self.name(), s, l, |m, g| match g {
            Some(g) => m.iter_mut().zip(g).for_each(|(m, g)| {
                let g = if c == 1.0 { *g } else { *g * c };
                *m += w * (g - *m);
            }),
            None => m.iter_mut().for_each(|m| *m += w * (0.0 - *m)),
        })
    }
}

/// Second moment with a row-sparse gradient: `v = β2·v + (1 − β2)·(c·g)²`.
pub struct SparseSecondMoment<'a> {
    pub grad: &'a RowGrad,
    pub beta2: f32,
    pub clip: f32,
}

impl InplaceOp1 for SparseSecondMoment<'_> {
    fn name(&self) -> &'static str {
        "adamw-exp-avg-sq-rows"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let (b2, c) = (self.beta2, self.clip);
        let w = 1.0 - b2;
        self.grad.apply(self.name(), s, l, |v, g| match g {
            Some(g) => v.iter_mut().zip(g).for_each(|(v, g)| {
                let g = if c == 1.0 { *g } else { *g * c };
                *v = *v * b2 + w * g * g;
            }),
            None => v.iter_mut().for_each(|v| *v = *v * b2 + w * 0.0 * 0.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::host_kernels::{FirstMoment, SecondMoment};
    use candle_core::{Device, Tensor};

    #[test]
    fn sparse_updates_equal_dense_ones_with_zero_rows() {
        let dev = Device::Cpu;
        let (rows, width) = (1000, 3);
        let (uniq, local) = distinct(&[7, 3, 7, 999, 3]);
        assert_eq!(uniq, [3, 7, 999]);
        assert_eq!(local, [1, 0, 1, 2, 0]);
        let mut rg = RowGrad::new(rows, width);
        rg.add(&[3, 7], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        rg.add(&[7, 999], &[0.5, 0.5, 0.5, -1.0, -2.0, -3.0])
            .unwrap();
        let mut dense = vec![0f32; rows * width];
        dense[9..12].copy_from_slice(&[1.0, 2.0, 3.0]);
        dense[21..24].copy_from_slice(&[4.5, 5.5, 6.5]);
        dense[2997..3000].copy_from_slice(&[-1.0, -2.0, -3.0]);
        let want_ss: f64 = dense.iter().map(|&x| (x as f64).powi(2)).sum();
        assert!((rg.sum_squares() - want_ss).abs() < 1e-9);
        let g = Tensor::from_vec(dense, (rows, width), &dev).unwrap();
        let init: Vec<f32> = (0..rows * width).map(|i| (i as f32 * 0.1).cos()).collect();
        for clip in [1.0f32, 0.3] {
            let (a, b) = (
                Tensor::from_vec(init.clone(), (rows, width), &dev).unwrap(),
                Tensor::from_vec(init.clone(), (rows, width), &dev).unwrap(),
            );
            a.inplace_op2(&g, &FirstMoment { weight: 0.1, clip })
                .unwrap();
            b.inplace_op1(&SparseFirstMoment {
                grad: &rg,
                weight: 0.1,
                clip,
            })
            .unwrap();
            assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
            let (a, b) = (a.abs().unwrap(), b.abs().unwrap());
            a.inplace_op2(&g, &SecondMoment { beta2: 0.999, clip })
                .unwrap();
            b.inplace_op1(&SparseSecondMoment {
                grad: &rg,
                beta2: 0.999,
                clip,
            })
            .unwrap();
            assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        }
    }
}
