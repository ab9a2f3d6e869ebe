//! This rank's part of a checkpoint (docs/distributed.md §6): rank 0 creates the temporary
//! directory, every rank of the first shard group writes its rows (fp32 master and both
//! moments) into its own file — the other groups hold the same rows (docs/distributed.md §4.7) — and once every
//! rank reports its part done, rank 0 writes the index and commits.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::ShardedTrainer;
use crate::checkpoint::{self, ParamInfo, PendingCheckpoint, RankRows};
use vc_dist::ReduceOp;

impl ShardedTrainer {
    /// Every tensor's shards over the ranks of a group (the rank files), for the index.
    fn describe_params(&self) -> BTreeMap<String, ParamInfo> {
        let world = self.group_size();
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let shards = (0..world)
                    .filter_map(|q| {
                        let own = self.splits[i].owned(q);
                        (!own.is_empty()).then_some(RankRows {
                            rank: q,
                            rows: [own.start, own.end],
                        })
                    })
                    .collect();
                (
                    p.name.clone(),
                    ParamInfo {
                        shape: self.shapes[i].clone(),
                        unit: p.unit.to_string(),
                        shards,
                    },
                )
            })
            .collect()
    }

    fn write_rank_file(&self, path: &std::path::Path) -> Result<()> {
        let shapes: Vec<&[usize]> = self.shapes.iter().map(Vec::as_slice).collect();
        checkpoint::write_state(
            path,
            self.run.opts.config.optimizer_state,
            &self.params,
            &self.adam,
            &shapes,
        )
    }

    /// Saves a checkpoint: every rank of the first group writes its rows into the directory
    /// rank 0 created, and rank 0 commits it once every rank's file is complete. Returns the
    /// directory (on rank 0).
    pub fn save(&self) -> Result<Option<PathBuf>> {
        let (rank, root) = (self.rank(), &self.run.opts.checkpoints);
        let pending = if rank == 0 {
            Some(PendingCheckpoint::begin(root, self.run.step, &self.tag)?)
        } else {
            None
        };
        self.mesh.world.barrier()?;
        let dir = PendingCheckpoint::join(root, self.run.step, &self.tag).dir;
        let written = if self.first_group() {
            let file = dir.join(checkpoint::rank_file(rank));
            self.run
                .opts
                .hooks
                .rank_file_write(self.run.step, rank)
                .with_context(|| format!("cannot write {}", file.display()))
                .and_then(|()| self.write_rank_file(&file))
        } else {
            Ok(())
        };
        if written.is_ok() && self.first_group() {
            self.run.opts.hooks.rank_file_written(self.run.step, rank);
        }
        let failed = self
            .mesh
            .world
            .all_reduce_host(&[if written.is_ok() { 0.0 } else { 1.0 }], ReduceOp::Sum)?[0];
        if failed > 0.0 {
            if let Some(p) = pending {
                p.abandon();
            }
            written.with_context(|| format!("cannot write checkpoint {}", dir.display()))?;
            bail!(
                "another rank could not write its part of checkpoint step {}",
                self.run.step
            );
        }
        let out = match pending {
            Some(p) => {
                checkpoint::SpeakerSnapshot::new(&self.run.identity.speakers, &self.run.speaker)?
                    .write(&p.dir)?;
                let index =
                    self.run
                        .index(self.describe_params(), self.adam.step, self.group_size());
                Some(p.commit(
                    &index,
                    self.run.opts.config.keep,
                    self.run.opts.hooks.as_ref(),
                )?)
            }
            None => None,
        };
        self.mesh.world.barrier()?;
        Ok(out)
    }
}
