//! The checkpoints already on disk: listing the complete ones, pruning beyond `keep`, finding
//! the one to resume from, validating one from its headers, and recovering after a crash (what
//! an interrupted write left is repaired, a damaged checkpoint moved aside to
//! `.damaged-step-N/`; docs/training.md §7.2).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::writer::sync_dir;
use super::{rank_file, read_index, speaker_file, speakers_file, INDEX, LATEST};

/// Complete checkpoint directories under `root`, oldest first.
pub fn list(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir(root) else {
        return Ok(out);
    };
    for e in rd {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse().ok()) {
            if e.path().join(INDEX).is_file() {
                out.push((step, e.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Deletes all but the newest `keep` complete checkpoints under `root`, sparing `current` and
/// the one `best` names.
pub fn prune(root: &Path, keep: usize, current: &str) -> Result<()> {
    // The chosen checkpoint stays, whatever its age (docs/training.md §14.3).
    let best = crate::selection::best_name(root);
    let all = list(root)?;
    let excess = all.len().saturating_sub(keep.max(1));
    for (_, dir) in all.into_iter().take(excess) {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.as_deref() == Some(current) || (name.is_some() && name == best) {
            continue;
        }
        fs::remove_dir_all(&dir).with_context(|| format!("cannot delete {}", dir.display()))?;
    }
    Ok(())
}

/// A checkpoint directory found damaged and moved aside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damaged {
    pub from: PathBuf,
    pub to: PathBuf,
    pub why: String,
}

/// What [`recover`] did.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Temporary and superseded directories removed.
    pub removed: Vec<PathBuf>,
    /// Damaged checkpoints moved aside (never deleted), newest first.
    pub damaged: Vec<Damaged>,
}

impl Recovery {
    /// One line per damaged checkpoint, for the user.
    pub fn warnings(&self) -> Vec<String> {
        self.damaged
            .iter()
            .map(|d| {
                format!(
                    "checkpoint {} is damaged ({}); moved it to {} and continuing from the newest                      complete checkpoint before it",
                    d.from.display(),
                    d.why,
                    d.to.display()
                )
            })
            .collect()
    }
}

/// Repairs what an interrupted checkpoint write left (temporary directories are removed, and a
/// checkpoint moved aside to be replaced by a new one of the same step is put back when the new
/// one never arrived), then makes sure the checkpoint a run would continue from is whole: a
/// damaged one — no `index.json`, an index that does not parse, a rank file that is missing,
/// truncated or lacks a tensor the index names — is moved to `.damaged-step-N/` (never deleted),
/// until the newest remaining one is whole (docs/training.md §7.2). One process must call it
/// at a time (rank 0 of a sharded run).
pub fn recover(root: &Path) -> Result<Recovery> {
    let mut out = Recovery::default();
    let Ok(rd) = fs::read_dir(root) else {
        return Ok(out);
    };
    let mut entries: Vec<_> = rd.collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in &entries {
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.path().is_dir() {
            continue;
        }
        let remove = |p: &Path| {
            fs::remove_dir_all(p).with_context(|| format!("cannot delete {}", p.display()))
        };
        if name.starts_with(".tmp-step-") {
            remove(&e.path())?;
            out.removed.push(e.path());
        } else if let Some(rest) = name.strip_prefix(".old-") {
            // `.old-step-NNNNNNN-PID`
            let step_name = rest.rsplit_once('-').map_or(rest, |(s, _)| s);
            let dest = root.join(step_name);
            if dest.join(INDEX).is_file() {
                remove(&e.path())?;
                out.removed.push(e.path());
            } else {
                if dest.exists() {
                    remove(&dest)?;
                }
                fs::rename(e.path(), &dest).with_context(|| {
                    format!(
                        "cannot restore {} to {}",
                        e.path().display(),
                        dest.display()
                    )
                })?;
            }
        }
    }
    // A step directory is only ever renamed into place complete: one without an index is damage.
    let mut steps: Vec<PathBuf> = fs::read_dir(root)
        .with_context(|| format!("cannot read {}", root.display()))?
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("step-")
                .is_some_and(|s| s.parse::<usize>().is_ok())
        })
        .map(|e| e.path())
        .collect();
    steps.sort();
    for dir in steps.iter().rev() {
        if !dir.join(INDEX).is_file() {
            out.damaged
                .push(move_damaged(root, dir, format!("it has no {INDEX}"))?);
        }
    }
    while let Some(dir) = find_latest(root)? {
        match validate(&dir) {
            Ok(()) => break,
            Err(e) => out
                .damaged
                .push(move_damaged(root, &dir, format!("{e:#}"))?),
        }
    }
    sync_dir(root);
    Ok(out)
}

/// Moves the checkpoint `dir` to the first free `.damaged-step-N[.K]` under `root`.
fn move_damaged(root: &Path, dir: &Path, why: String) -> Result<Damaged> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut to = root.join(format!(".damaged-{name}"));
    for k in 2.. {
        if !to.exists() {
            break;
        }
        to = root.join(format!(".damaged-{name}.{k}"));
    }
    fs::rename(dir, &to)
        .with_context(|| format!("cannot move {} to {}", dir.display(), to.display()))?;
    Ok(Damaged {
        from: dir.to_path_buf(),
        to,
        why,
    })
}

/// Checks that the checkpoint in `dir` can be read back whole, from its headers alone: the
/// index parses, every rank file it names is there and no shorter than its header says, and
/// holds every tensor (master and both moments, f32, the right shape) of its rows; the speaker
/// copy is there.
pub fn validate(dir: &Path) -> Result<()> {
    use std::io::Read;
    let index = read_index(dir)?;
    let speaker = if index.identity.speakers.is_empty() {
        speaker_file(dir)
    } else {
        speakers_file(dir)
    };
    if !speaker.is_file() {
        bail!("{} is missing", speaker.display());
    }
    for rank in 0..index.world_size {
        let path = dir.join(rank_file(rank));
        let mut f =
            fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        let size = f.metadata()?.len();
        let mut len = [0u8; 8];
        f.read_exact(&mut len)
            .with_context(|| format!("{} is truncated (no header)", path.display()))?;
        let n = u64::from_le_bytes(len);
        if 8 + n > size {
            bail!("{} is truncated (inside its header)", path.display());
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header)?;
        let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
            .with_context(|| format!("{} has no readable header", path.display()))?;
        for (name, info) in &index.params {
            for s in info
                .shards
                .iter()
                .filter(|s| s.rank == rank && s.rows[1] > s.rows[0])
            {
                let saved = crate::optim::saved_state::entries(
                    index.optimizer.state,
                    &info.shape,
                    s.rows[1] - s.rows[0],
                );
                for e in saved {
                    let key = format!("{}.{name}", e.kind);
                    let shape = e.shape;
                    let t = header
                        .get(&key)
                        .with_context(|| format!("{} has no tensor {key}", path.display()))?;
                    let dims: Option<Vec<usize>> = t["shape"].as_array().map(|a| {
                        a.iter()
                            .filter_map(|d| d.as_u64())
                            .map(|d| d as usize)
                            .collect()
                    });
                    let end = t["data_offsets"][1].as_u64().unwrap_or(u64::MAX);
                    let dtype = format!("{:?}", e.dtype);
                    let dims_ok = dims.as_deref() == Some(shape.as_slice())
                        || (info.shape.is_empty() && dims.as_deref() == Some(&[]));
                    if t["dtype"] != dtype.as_str() || !dims_ok {
                        bail!("{}: {key} is not {dtype} {shape:?}", path.display());
                    }
                    if 8 + n + end > size {
                        bail!(
                            "{} is truncated: it has {size} bytes, its tensors end at byte {}",
                            path.display(),
                            8 + n + end
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// The checkpoint to resume from: the one `latest` names, or (if `latest` is missing or
/// stale) the newest complete one.
pub fn find_latest(root: &Path) -> Result<Option<PathBuf>> {
    if let Ok(text) = fs::read_to_string(root.join(LATEST)) {
        let dir = root.join(text.trim());
        if dir.join(INDEX).is_file() && !text.trim().is_empty() {
            return Ok(Some(dir));
        }
    }
    Ok(list(root)?.pop().map(|(_, d)| d))
}
