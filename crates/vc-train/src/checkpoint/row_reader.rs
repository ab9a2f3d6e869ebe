//! Reading any rows of a checkpoint's tensors, whatever the world size that wrote them
//! (docs/distributed.md §6): each rank file mapped once, only the rows asked for copied.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};

use super::{rank_file, read_index, Index};

/// Reads row ranges of the tensors of a checkpoint written by any number of ranks (a sharded
/// run resuming at another world size, docs/distributed.md §6): each rank file is mapped once,
/// and only the rows asked for are copied.
pub struct RowReader {
    dir: PathBuf,
    pub index: Index,
    files: BTreeMap<usize, memmap2::Mmap>,
}

impl RowReader {
    /// Opens the checkpoint in `dir` and checks that, for every tensor, the saved row ranges
    /// cover its rows exactly once.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = read_index(dir)?;
        for (name, info) in &index.params {
            let rows = info.shape.first().copied().unwrap_or(1);
            let mut ranges: Vec<[usize; 2]> = info.shards.iter().map(|s| s.rows).collect();
            ranges.sort();
            let mut next = 0;
            for r in &ranges {
                if r[0] != next || r[1] < r[0] {
                    bail!(
                        "checkpoint {}: the saved rows of {name} do not cover rows {next}.. of {rows} \
                         exactly once ({ranges:?})",
                        dir.display()
                    );
                }
                next = r[1];
            }
            if next != rows {
                bail!(
                    "checkpoint {}: the saved rows of {name} end at {next}, the tensor has {rows}",
                    dir.display()
                );
            }
            for s in &info.shards {
                if s.rank >= index.world_size {
                    bail!(
                        "checkpoint {}: {name} names rank {} of {}",
                        dir.display(),
                        s.rank,
                        index.world_size
                    );
                }
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            index,
            files: BTreeMap::new(),
        })
    }

    fn file(&mut self, rank: usize) -> Result<&memmap2::Mmap> {
        if !self.files.contains_key(&rank) {
            let path = self.dir.join(rank_file(rank));
            let f = fs::File::open(&path).with_context(|| {
                format!(
                    "checkpoint {} is incomplete: cannot open {}",
                    self.dir.display(),
                    path.display()
                )
            })?;
            // SAFETY: a read-only private mapping of a finished checkpoint file, which nothing
            // writes to once its directory is in place.
            let map = unsafe { memmap2::Mmap::map(&f)? };
            self.files.insert(rank, map);
        }
        Ok(&self.files[&rank])
    }

    /// Rows `rows` of `KIND.NAME` (an entry of [`crate::optim::saved_state::entries`]) as a tensor
    /// of the dtype it was saved in (f32, bf16 or u8), shaped as saved with `rows.len()` rows.
    pub fn rows(
        &mut self,
        kind: &str,
        name: &str,
        rows: std::ops::Range<usize>,
        device: &Device,
    ) -> Result<Tensor> {
        let info = self
            .index
            .params
            .get(name)
            .with_context(|| format!("checkpoint {} has no tensor {name}", self.dir.display()))?
            .clone();
        let mut bytes: Vec<u8> = Vec::new();
        let mut shards = info.shards.clone();
        shards.sort_by_key(|s| s.rows[0]);
        let key = format!("{kind}.{name}");
        let dir = self.dir.clone();
        let mut form: Option<(safetensors::Dtype, Vec<usize>)> = None;
        for s in &shards {
            let have = s.rows[0]..s.rows[1];
            let want = vc_dist::shard::overlap(&have, &rows);
            if want.is_empty() {
                continue;
            }
            let path = dir.join(rank_file(s.rank));
            let map = self.file(s.rank)?;
            let st = safetensors::SafeTensors::deserialize(map)
                .with_context(|| format!("{} is not a safetensors file", path.display()))?;
            let view = st
                .tensor(&key)
                .map_err(|_| anyhow::anyhow!("{} has no tensor {key}", path.display()))?;
            // A 0-dimensional tensor is one row.
            let vshape = if view.shape().is_empty() {
                vec![1]
            } else {
                view.shape().to_vec()
            };
            let rest = vshape[1..].to_vec();
            let dtype = view.dtype();
            if vshape[0] != have.len()
                || !matches!(
                    dtype,
                    safetensors::Dtype::F32 | safetensors::Dtype::BF16 | safetensors::Dtype::U8
                )
                || form.as_ref().is_some_and(|f| f != &(dtype, rest.clone()))
            {
                bail!(
                    "{}: {key} is {dtype:?} {:?}, the index says {} rows of it are here",
                    path.display(),
                    view.shape(),
                    have.len()
                );
            }
            let row_bytes = rest.iter().product::<usize>() * dtype.bitsize() / 8;
            bytes.extend_from_slice(
                &view.data()
                    [(want.start - have.start) * row_bytes..(want.end - have.start) * row_bytes],
            );
            form = Some((dtype, rest));
        }
        let Some((dtype, rest)) = form else {
            bail!(
                "checkpoint {}: rows {rows:?} of {name} are not saved",
                self.dir.display()
            );
        };
        let row_bytes = rest.iter().product::<usize>() * dtype.bitsize() / 8;
        anyhow::ensure!(
            bytes.len() == rows.len() * row_bytes,
            "checkpoint {}: rows {rows:?} of {key} are not all saved",
            self.dir.display()
        );
        let mut shape = vec![rows.len()];
        shape.extend(rest);
        if info.shape.is_empty() {
            shape.clear();
        }
        Ok(safetensors::tensor::TensorView::new(dtype, shape, &bytes)
            .map_err(|e| anyhow::anyhow!("checkpoint {}: {key}: {e}", self.dir.display()))?
            .load(device)?)
    }

    /// The full fp32 master of every trained tensor (for a compensated checkpoint, weight plus
    /// compensation).
    pub fn masters(&mut self, device: &Device) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        let names: Vec<(String, usize)> = self
            .index
            .params
            .iter()
            .map(|(n, i)| (n.clone(), i.shape.first().copied().unwrap_or(1)))
            .collect();
        for (name, rows) in names {
            let mut m = self
                .rows("master", &name, 0..rows, device)?
                .to_dtype(DType::F32)?;
            let shape = self.index.params[&name].shape.clone();
            if crate::optim::saved_state::compensated(self.index.optimizer.state, &shape) {
                m = (m + self
                    .rows("comp", &name, 0..rows, device)?
                    .to_dtype(DType::F32)?)?;
            }
            out.insert(name, m);
        }
        Ok(out)
    }
}

impl crate::optim::saved_state::SavedRows for RowReader {
    fn rows(
        &mut self,
        kind: &str,
        name: &str,
        rows: std::ops::Range<usize>,
        device: &Device,
    ) -> Result<Tensor> {
        RowReader::rows(self, kind, name, rows, device)
    }
}
