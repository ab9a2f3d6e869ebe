//! Writing a checkpoint (docs/training.md §7.2): every rank's rows into a temporary directory,
//! the index, then the rename into place and `latest`, with the test seams between the steps;
//! a run killed at any point leaves the previous checkpoint whole.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::checkpoint::safetensors_stream::{self, TensorHeader};
use crate::hooks::{CheckpointPhase, TrainHooks};
use crate::optim::AdamState;
use crate::step::params::ParamStore;

use super::{prune, rank_file, step_dir_name, Index, FORMAT, INDEX, LATEST};

/// Everything a checkpoint saves besides the index.
pub struct TrainingState<'a> {
    pub params: &'a ParamStore,
    pub adam: &'a AdamState,
    pub mode: vc_core::config::OptimizerState,
}

/// A checkpoint being written: a temporary directory next to the finished ones, which only
/// becomes a checkpoint when [`PendingCheckpoint::commit`] renames it into place.
pub struct PendingCheckpoint {
    root: PathBuf,
    pub dir: PathBuf,
    step: usize,
}

impl PendingCheckpoint {
    /// Creates `root/.tmp-step-N-TAG` (empty). `tag` makes the name unique to the run (a
    /// process id, or a tag every rank of a distributed run agreed on).
    pub fn begin(root: &Path, step: usize, tag: &str) -> Result<Self> {
        fs::create_dir_all(root).with_context(|| format!("cannot create {}", root.display()))?;
        let dir = root.join(format!(".tmp-{}-{tag}", step_dir_name(step)));
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("cannot delete {}", dir.display()))?;
        }
        fs::create_dir(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        Ok(Self {
            root: root.to_path_buf(),
            dir,
            step,
        })
    }

    /// The directory of a pending checkpoint another process (rank 0) created.
    pub fn join(root: &Path, step: usize, tag: &str) -> Self {
        Self {
            root: root.to_path_buf(),
            dir: root.join(format!(".tmp-{}-{tag}", step_dir_name(step))),
            step,
        }
    }

    /// Writes `index.json`, renames the directory into place (replacing an earlier checkpoint
    /// of the same step), points `latest` at it and prunes all but the newest `keep`. A crash at
    /// any point leaves the previous checkpoint loadable: before the rename only a temporary
    /// directory exists; while an old directory of the same step is moved aside, [`super::recover`]
    /// puts it back; `latest` is written atomically after the rename.
    pub fn commit(self, index: &Index, keep: usize, hooks: &dyn TrainHooks) -> Result<PathBuf> {
        let step = self.step;
        hooks.checkpoint(step, CheckpointPhase::RankFilesWritten);
        let written = (|| -> Result<()> {
            let json = serde_json::to_string_pretty(index)?;
            let mut f = fs::File::create(self.dir.join(INDEX))?;
            f.write_all(json.as_bytes())?;
            f.write_all(b"\n")?;
            f.sync_all()?;
            sync_dir(&self.dir);
            Ok(())
        })();
        if let Err(e) = written {
            let _ = fs::remove_dir_all(&self.dir);
            return Err(e.context(format!("cannot write checkpoint {}", self.dir.display())));
        }
        hooks.checkpoint(step, CheckpointPhase::IndexWritten);
        let name = step_dir_name(step);
        let dest = self.root.join(&name);
        if dest.exists() {
            // The same step saved again (e.g. after a crash before `latest` was written).
            let old = self
                .root
                .join(format!(".old-{name}-{}", std::process::id()));
            fs::rename(&dest, &old)
                .with_context(|| format!("cannot move {} aside", dest.display()))?;
            sync_dir(&self.root);
            hooks.checkpoint(step, CheckpointPhase::OldMovedAside);
            fs::rename(&self.dir, &dest).with_context(|| {
                format!("cannot move {} to {}", self.dir.display(), dest.display())
            })?;
            sync_dir(&self.root);
            fs::remove_dir_all(&old).with_context(|| format!("cannot delete {}", old.display()))?;
        } else {
            fs::rename(&self.dir, &dest).with_context(|| {
                format!("cannot move {} to {}", self.dir.display(), dest.display())
            })?;
            sync_dir(&self.root);
        }
        hooks.checkpoint(step, CheckpointPhase::InPlace);
        vc_core::fsutil::write_atomic(&self.root.join(LATEST), format!("{name}\n").as_bytes())?;
        hooks.checkpoint(step, CheckpointPhase::LatestWritten);
        prune(&self.root, keep, &name)?;
        Ok(dest)
    }

    /// Removes the temporary directory (after an error elsewhere).
    pub fn abandon(self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Writes checkpoint `index.step` of a single-device run under `root` (see the module docs)
/// and prunes old ones; `extra` may add files to the (temporary) checkpoint directory. Returns
/// the checkpoint directory.
pub fn save(
    root: &Path,
    index: &Index,
    state: &TrainingState,
    keep: usize,
    hooks: &dyn TrainHooks,
    extra: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let pending = PendingCheckpoint::begin(root, index.step, &std::process::id().to_string())?;
    let written = (|| -> Result<()> {
        write_rank_file(&pending.dir.join(rank_file(0)), state)?;
        extra(&pending.dir)
    })();
    if let Err(e) = written {
        let dir = pending.dir.clone();
        pending.abandon();
        return Err(e.context(format!("cannot write checkpoint {}", dir.display())));
    }
    pending.commit(index, keep, hooks)
}

fn write_rank_file(path: &Path, state: &TrainingState) -> Result<()> {
    let shapes: Vec<&[usize]> = state.params.params.iter().map(|p| p.shape()).collect();
    write_state(path, state.mode, &state.params.params, state.adam, &shapes)
}

/// Writes the rank file of `params` (with `full_shapes`, the whole tensors' shapes) and their
/// moments in `mode`'s entries ([`crate::optim::saved_state::entries`]); parameters with no rows
/// (a rank's empty shard) are left out.
pub fn write_state(
    path: &Path,
    mode: vc_core::config::OptimizerState,
    params: &[crate::step::params::Param],
    adam: &AdamState,
    full_shapes: &[&[usize]],
) -> Result<()> {
    use crate::optim::saved_state;
    let mut entries = Vec::new();
    let mut sources = Vec::new();
    for (i, p) in params.iter().enumerate() {
        if p.shape().first() == Some(&0) {
            continue;
        }
        let rows = p.shape().first().copied().unwrap_or(1);
        let saved = saved_state::entries(mode, full_shapes[i], rows);
        let tensors = saved_state::tensors(p, &adam.m[i], &adam.v[i])?;
        anyhow::ensure!(
            saved.len() == tensors.len(),
            "{}: the optimizer state does not match mode {}",
            p.name,
            mode.name()
        );
        for (e, t) in saved.into_iter().zip(tensors) {
            anyhow::ensure!(
                t.dims().iter().product::<usize>() == e.shape.iter().product::<usize>(),
                "{}: {} has {:?}, the checkpoint entry {:?}",
                p.name,
                e.kind,
                t.dims(),
                e.shape
            );
            entries.push(TensorHeader {
                name: format!("{}.{}", e.kind, p.name),
                dtype: e.dtype,
                shape: e.shape,
            });
            sources.push(t);
        }
    }
    write_tensors(path, &entries, |i| {
        crate::optim::saved_state::bytes(&sources[i], entries[i].dtype)
    })
}

/// Writes a rank file: `entries` with their bytes from `bytes(i)`, synced to disk.
pub fn write_tensors(
    path: &Path,
    entries: &[TensorHeader],
    bytes: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<()> {
    let meta = BTreeMap::from([("format".to_string(), FORMAT.to_string())]);
    let file =
        fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = BufWriter::new(file);
    safetensors_stream::write(&mut w, entries, &meta, bytes)?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(())
}

pub(super) fn sync_dir(dir: &Path) {
    if let Ok(f) = fs::File::open(dir) {
        let _ = f.sync_all();
    }
}
