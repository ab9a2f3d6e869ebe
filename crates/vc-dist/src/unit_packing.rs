//! Moving a unit's sharded tensors through one collective each (docs/distributed.md §4): a
//! rank's rows of every tensor of a unit are packed, each padded to its tensor's shard size,
//! into one flat shard, so a unit is gathered with one all-gather and its gradients are reduced
//! with one reduce-scatter, each of which can be started and waited for later
//! (docs/distributed.md §4.6). Also the row-sparse exchange of a large table's rows.

use std::sync::Arc;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

use super::collective::{Collective, Pending};
use super::shard::RowSplit;

/// One tensor's place in a flat shard.
#[derive(Debug, Clone)]
pub struct FlatEntry {
    pub shape: Vec<usize>,
    pub split: RowSplit,
    /// Values per row (the product of the dimensions after the first).
    pub row_len: usize,
    /// Offset of this tensor's padded rows in the flat shard.
    pub offset: usize,
}

/// The flat-shard layout of a group of tensors split over `world` ranks.
#[derive(Debug, Clone)]
pub struct FlatLayout {
    pub entries: Vec<FlatEntry>,
    /// Values per flat shard (every rank sends this many).
    pub shard_len: usize,
    pub world: usize,
    pub rank: usize,
}

impl FlatLayout {
    pub fn new(shapes: &[Vec<usize>], world: usize, rank: usize) -> Self {
        let mut offset = 0;
        let entries = shapes
            .iter()
            .map(|shape| {
                let rows = shape.first().copied().unwrap_or(1);
                let row_len = shape.iter().skip(1).product::<usize>();
                let split = RowSplit::new(rows, world);
                let e = FlatEntry {
                    shape: shape.clone(),
                    split,
                    row_len,
                    offset,
                };
                offset += split.shard_rows() * row_len;
                e
            })
            .collect();
        Self {
            entries,
            shard_len: offset,
            world,
            rank,
        }
    }

    /// The shape of this rank's shard of entry `i`: its owned rows.
    pub fn shard_shape(&self, i: usize) -> Vec<usize> {
        let e = &self.entries[i];
        let mut shape = e.shape.clone();
        if let Some(rows) = shape.first_mut() {
            *rows = e.split.owned(self.rank).len();
        }
        shape
    }

    /// `parts[i]` (rank `q`'s rows of entry i) padded and concatenated into a flat shard on
    /// `device`. Entries rank `q` owns no rows of contribute only their padding: their (empty)
    /// parts are never touched, so they may live anywhere.
    fn pack(&self, parts: &[Tensor], q: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let mut pieces = Vec::with_capacity(2 * parts.len());
        for (e, p) in self.entries.iter().zip(parts) {
            let n = e.split.owned(q).len() * e.row_len;
            ensure!(
                p.elem_count() == n,
                "flat shard: {} values for {n} of a {:?} tensor",
                p.elem_count(),
                e.shape
            );
            if n > 0 {
                pieces.push(p.flatten_all()?.to_dtype(dtype)?);
            }
            let pad = e.split.shard_rows() * e.row_len - n;
            if pad > 0 {
                pieces.push(Tensor::zeros(pad, dtype, device)?);
            }
        }
        Ok(Tensor::cat(&pieces, 0)?)
    }

    /// Starts gathering the full tensors of every entry on `device`, in `dtype`, from every
    /// rank's shards (`shards[i]`: this rank's rows of entry i; empty where it owns none).
    pub fn start_gather(
        &self,
        coll: &dyn Collective,
        shards: &[Tensor],
        dtype: DType,
        device: &Device,
    ) -> Result<PendingGather<'_>> {
        ensure!(
            shards.len() == self.entries.len(),
            "flat gather: wrong shard count"
        );
        if self.entries.is_empty() || self.shard_len == 0 {
            return Ok(PendingGather {
                layout: self,
                flat: None,
            });
        }
        let flat = self.pack(shards, self.rank, dtype, device)?;
        let all = coll.start_all_gather(&flat.reshape((1, self.shard_len))?)?; // (world, shard_len)
        Ok(PendingGather {
            layout: self,
            flat: Some(all),
        })
    }

    /// [`Self::start_gather`], waited for.
    pub fn gather(
        &self,
        coll: &dyn Collective,
        shards: &[Tensor],
        dtype: DType,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        self.start_gather(coll, shards, dtype, device)?.wait()
    }

    /// Starts the sum over ranks of every rank's full tensors `fulls` (on `device`), summed in
    /// `dtype` (f32 or bf16, `train.reduce_dtype`), of which this rank gets its own flat shard;
    /// with `across` (hybrid sharding) that shard then summed over `across`'s ranks too.
    /// [`Self::owned_parts`] cuts it into its rows of each entry.
    pub fn start_reduce_scatter(
        &self,
        coll: &dyn Collective,
        fulls: &[Tensor],
        dtype: DType,
        device: &Device,
        across: Option<Arc<dyn Collective>>,
    ) -> Result<PendingScatter> {
        ensure!(
            fulls.len() == self.entries.len(),
            "flat reduce-scatter: wrong tensor count"
        );
        if self.entries.is_empty() || self.shard_len == 0 {
            return Ok(PendingScatter { flat: None });
        }
        let mut per_rank = Vec::with_capacity(self.world);
        for q in 0..self.world {
            let parts = self
                .entries
                .iter()
                .zip(fulls)
                .map(|(e, t)| {
                    ensure!(
                        t.dims() == e.shape.as_slice(),
                        "flat reduce-scatter: a {:?} tensor for a {:?} entry",
                        t.dims(),
                        e.shape
                    );
                    let own = e.split.owned(q);
                    let rows = e.shape.first().copied().unwrap_or(1);
                    // A zero-length view: `pack` does not touch it.
                    Ok(t.reshape((rows, e.row_len))?
                        .narrow(0, own.start, own.len())?)
                })
                .collect::<Result<Vec<_>>>()?;
            per_rank.push(self.pack(&parts, q, dtype, device)?);
        }
        let full = Tensor::cat(&per_rank, 0)?.reshape((self.world, self.shard_len))?;
        let flat = match across {
            Some(across) => coll.start_reduce_scatter_across(&full, across)?,
            None => coll.start_reduce_scatter(&full)?,
        };
        Ok(PendingScatter { flat: Some(flat) })
    }

    /// This rank's rows of each entry, in f32 (the optimizer's), from its flat shard (`None`
    /// for a layout of nothing); an empty CPU tensor where it owns none.
    pub fn owned_parts(&self, flat: Option<Tensor>) -> Result<Vec<Tensor>> {
        let Some(flat) = flat else {
            ensure!(
                self.entries.is_empty() || self.shard_len == 0,
                "flat shard missing"
            );
            return Ok(Vec::new());
        };
        let mine = flat.flatten_all()?.to_dtype(DType::F32)?; // (shard_len,)
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let n = e.split.owned(self.rank).len() * e.row_len;
                let shape = self.shard_shape(i);
                if n == 0 {
                    return Ok(Tensor::zeros(shape.as_slice(), DType::F32, &Device::Cpu)?);
                }
                Ok(mine.narrow(0, e.offset, n)?.reshape(shape.as_slice())?)
            })
            .collect()
    }

    /// The sum over ranks of every rank's full tensors `fulls`: this rank's rows of each entry
    /// ([`Self::start_reduce_scatter`], waited for and cut by [`Self::owned_parts`]).
    pub fn reduce_scatter(
        &self,
        coll: &dyn Collective,
        fulls: &[Tensor],
        dtype: DType,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let flat = self
            .start_reduce_scatter(coll, fulls, dtype, device, None)?
            .wait()?;
        self.owned_parts(flat)
    }
}

/// A unit's gather in flight ([`FlatLayout::start_gather`]).
pub struct PendingGather<'a> {
    layout: &'a FlatLayout,
    flat: Option<Pending>,
}

impl PendingGather<'_> {
    /// The full tensors of every entry, once every rank's shard arrived.
    pub fn wait(self) -> Result<Vec<Tensor>> {
        let Some(flat) = self.flat else {
            return Ok(Vec::new());
        };
        let all = flat.wait()?; // (world, shard_len)
        let layout = self.layout;
        layout
            .entries
            .iter()
            .map(|e| {
                let parts = (0..layout.world)
                    .filter(|&q| !e.split.owned(q).is_empty())
                    .map(|q| {
                        all.get(q)?
                            .narrow(0, e.offset, e.split.owned(q).len() * e.row_len)
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                ensure!(
                    !parts.is_empty(),
                    "flat gather: a {:?} tensor has no rows",
                    e.shape
                );
                Ok(Tensor::cat(&parts, 0)?.reshape(e.shape.as_slice())?)
            })
            .collect()
    }
}

/// A unit's reduce-scatter in flight ([`FlatLayout::start_reduce_scatter`]).
pub struct PendingScatter {
    flat: Option<Pending>,
}

impl PendingScatter {
    /// This rank's flat shard of the sum, in the dtype it was summed in (`None` for a layout of
    /// nothing).
    pub fn wait(self) -> Result<Option<Tensor>> {
        self.flat.map(|p| p.wait()).transpose()
    }
}

/// The positions in `ids` (sorted, distinct) of the rows rank `q` owns: a contiguous range.
fn owned_positions(split: &RowSplit, ids: &[u32], q: usize) -> std::ops::Range<usize> {
    let own = split.owned(q);
    let a = ids.partition_point(|&i| (i as usize) < own.start);
    let b = ids.partition_point(|&i| (i as usize) < own.end);
    a..b
}

/// Rows `ids` (sorted, distinct, the same on every rank) of a table split by `split`, of which
/// this rank holds `shard` (its owned rows): `(ids.len(), width)` on `device` in the order of
/// `ids`. A rank that owns none of `ids` sends padding only (no lookup of no rows).
pub fn gather_rows(
    coll: &dyn Collective,
    split: &RowSplit,
    shard: &Tensor,
    ids: &[u32],
    device: &Device,
) -> Result<Tensor> {
    let (rank, world) = (coll.rank(), coll.world());
    let width = shard.dim(1)?;
    let dtype = shard.dtype();
    let counts: Vec<usize> = (0..world)
        .map(|q| owned_positions(split, ids, q).len())
        .collect();
    let kmax = counts.iter().copied().max().unwrap_or(0);
    ensure!(kmax > 0, "gather_rows: no rows asked for");
    let start = split.owned(rank).start as u32;
    let local: Vec<u32> = ids[owned_positions(split, ids, rank)]
        .iter()
        .map(|&i| i - start)
        .collect();
    let mine = if local.is_empty() {
        Tensor::zeros((kmax, width), dtype, device)?
    } else {
        let rows = shard.index_select(&Tensor::new(local.as_slice(), device)?, 0)?;
        if local.len() < kmax {
            let pad = Tensor::zeros((kmax - local.len(), width), dtype, device)?;
            Tensor::cat(&[&rows, &pad], 0)?
        } else {
            rows
        }
    };
    let all = coll.all_gather(&mine)?; // (world × kmax, width)
    let parts = (0..world)
        .filter(|&q| counts[q] > 0)
        .map(|q| all.narrow(0, q * kmax, counts[q]))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// The sum over ranks of `grads` (`(ids.len(), width)` on `device`, rows in the order of `ids`),
/// summed in `dtype` (f32 or bf16), each owner receiving its rows: `(local row ids in its shard,
/// their summed gradients in f32)`; a rank that owns none of `ids` gets no ids and an empty CPU
/// tensor.
pub fn reduce_scatter_rows(
    coll: &dyn Collective,
    split: &RowSplit,
    grads: &Tensor,
    ids: &[u32],
    dtype: DType,
    device: &Device,
) -> Result<(Vec<u32>, Tensor)> {
    let (rank, world) = (coll.rank(), coll.world());
    let width = grads.dim(1)?;
    let ranges: Vec<_> = (0..world).map(|q| owned_positions(split, ids, q)).collect();
    let kmax = ranges.iter().map(|r| r.len()).max().unwrap_or(0);
    ensure!(kmax > 0, "reduce_scatter_rows: no rows to reduce");
    let mut parts = Vec::with_capacity(2 * world);
    for r in &ranges {
        if !r.is_empty() {
            parts.push(grads.narrow(0, r.start, r.len())?.to_dtype(dtype)?);
        }
        if r.len() < kmax {
            parts.push(Tensor::zeros((kmax - r.len(), width), dtype, device)?);
        }
    }
    let full = Tensor::cat(&parts, 0)?;
    let mine = coll.reduce_scatter(&full)?.to_dtype(DType::F32)?; // (kmax, width)
    let own = &ranges[rank];
    if own.is_empty() {
        return Ok((
            Vec::new(),
            Tensor::zeros((0, width), DType::F32, &Device::Cpu)?,
        ));
    }
    let start = split.owned(rank).start as u32;
    let local = ids[own.clone()].iter().map(|&i| i - start).collect();
    Ok((local, mine.narrow(0, 0, own.len())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::Local;

    fn seq(shape: &[usize], scale: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| i as f32 * scale).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn gathered_units_and_scattered_gradients_round_trip() {
        // Rows that do not divide by 3, a 1-D tensor, and one with fewer rows than ranks.
        let shapes = vec![vec![7, 2], vec![5], vec![2, 3]];
        let full: Vec<Tensor> = shapes.iter().map(|s| seq(s, 1.0)).collect();
        let ranks = Local::world(3);
        let results: Vec<(Vec<Tensor>, Vec<Tensor>)> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .into_iter()
                .map(|c| {
                    let (shapes, full) = (&shapes, &full);
                    s.spawn(move || {
                        let layout = FlatLayout::new(shapes, 3, c.rank());
                        let shards: Vec<Tensor> = full
                            .iter()
                            .zip(&layout.entries)
                            .map(|(t, e)| {
                                let own = e.split.owned(c.rank());
                                t.narrow(0, own.start, own.len()).unwrap()
                            })
                            .collect();
                        let gathered = layout
                            .gather(&c, &shards, DType::F32, &Device::Cpu)
                            .unwrap();
                        // Every rank contributes (rank + 1) × the full tensors.
                        let grads: Vec<Tensor> = full
                            .iter()
                            .map(|t| (t * (c.rank() as f64 + 1.0)).unwrap())
                            .collect();
                        (
                            gathered,
                            layout
                                .reduce_scatter(&c, &grads, DType::F32, &Device::Cpu)
                                .unwrap(),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (gathered, reduced)) in results.iter().enumerate() {
            for (g, f) in gathered.iter().zip(&full) {
                assert_eq!(
                    g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    f.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                );
            }
            let layout = FlatLayout::new(&shapes, 3, rank);
            for ((r, f), e) in reduced.iter().zip(&full).zip(&layout.entries) {
                let own = e.split.owned(rank);
                let want = (f.narrow(0, own.start, own.len()).unwrap() * 6.0).unwrap();
                assert_eq!(r.dims(), want.dims());
                assert_eq!(
                    r.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    want.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                );
            }
        }
    }

    #[test]
    fn sparse_rows_are_gathered_from_and_reduced_to_their_owners() {
        let table = seq(&[10, 2], 1.0);
        let split = RowSplit::new(10, 3); // rows 0..4, 4..8, 8..10
        let ids = [1u32, 2, 8, 9];
        let ranks = Local::world(3);
        let out: Vec<(Vec<f32>, Vec<u32>, Vec<f32>)> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .into_iter()
                .map(|c| {
                    let table = &table;
                    s.spawn(move || {
                        let own = split.owned(c.rank());
                        let shard = table.narrow(0, own.start, own.len()).unwrap();
                        let rows = gather_rows(&c, &split, &shard, &ids, &Device::Cpu).unwrap();
                        let g = Tensor::ones((4, 2), DType::F32, &Device::Cpu).unwrap();
                        let (local, summed) =
                            reduce_scatter_rows(&c, &split, &g, &ids, DType::F32, &Device::Cpu)
                                .unwrap();
                        (
                            rows.flatten_all().unwrap().to_vec1().unwrap(),
                            local,
                            summed.flatten_all().unwrap().to_vec1().unwrap(),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rows, _, _) in &out {
            assert_eq!(rows, &[2.0, 3.0, 4.0, 5.0, 16.0, 17.0, 18.0, 19.0]);
        }
        assert_eq!(out[0].1, vec![1, 2]);
        assert_eq!(out[0].2, vec![3.0; 4]);
        assert!(out[1].1.is_empty() && out[1].2.is_empty());
        assert_eq!(out[2].1, vec![0, 1]);
        assert_eq!(out[2].2, vec![3.0; 4]);
    }
}
