//! TensorBoard event files: `checkpoints/tensorboard/`, the numbers of `metrics.jsonl` and
//! each sample's audio, for watching a run in TensorBoard (docs/training.md §9.1). Written by
//! the reporting rank beside [`crate::metrics::MetricsLog`], with the same resume rule: a run
//! resumed after step S keeps what earlier runs recorded up to S and records the steps after
//! it, so that every step is there once.
//!
//! TensorBoard reads files as append-only logs and has no reliable way to forget steps, so the
//! rule is kept by rewriting: at [`TensorBoardLog::open`] the records of steps up to S from
//! every file this writer made (known by its name: `events.out.tfevents.<seconds>.<host>
//! .voiceclone`) go into one new file, renamed into place, and only then are the old ones
//! removed. A crash between the two leaves copies of the same records, which the next open
//! keeps once. Files of any other name are never touched.

mod proto;
mod record;
mod summaries;

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};

use self::proto::{fields, Wire};
use self::record::{frame, records};
use self::summaries::{EVENT_STEP, EVENT_SUMMARY, EVENT_WALL_TIME, SUMMARY_VALUE, VALUE_TAG};
use crate::metrics::{EvalMetrics, StepMetrics};

/// The directory under `checkpoints/`.
pub const TENSORBOARD_DIR: &str = "tensorboard";
/// TensorBoard reads every file whose name contains `tfevents`; the prefix is its writers'.
const PREFIX: &str = "events.out.tfevents.";
/// What marks a file as this writer's.
const SUFFIX: &str = ".voiceclone";
/// A new file before its rename, under a name TensorBoard does not read.
const TEMP_PREFIX: &str = ".voiceclone-events.tmp-";

/// The open event file of a run.
pub struct TensorBoardLog {
    path: PathBuf,
    file: File,
    /// What the samples' paths in the metrics are relative to.
    workspace: PathBuf,
}

impl TensorBoardLog {
    /// Opens `checkpoints/tensorboard/` for a run that continues after `resumed_step` (0 for a
    /// new run): keeps the earlier runs' records of steps up to it, drops later ones and the
    /// unreadable tail of a killed run, and appends from there.
    pub fn open(checkpoints: &Path, resumed_step: usize) -> Result<Self> {
        let dir = checkpoints.join(TENSORBOARD_DIR);
        fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        remove_stale_temps(&dir);
        let ours = our_files(&dir)?;
        let contents = ours
            .iter()
            .map(|p| fs::read(p).with_context(|| format!("cannot read {}", p.display())))
            .collect::<Result<Vec<_>>>()?;
        let mut kept = Vec::new();
        let mut seen = HashSet::new();
        let mut clean = ours.len() == 1;
        for (path, bytes) in ours.iter().zip(&contents) {
            let (found, whole) = records(bytes);
            clean &= whole;
            for data in found {
                let Some(r) = Record::parse(data)
                    .with_context(|| format!("a damaged record in {}", path.display()))?
                else {
                    continue;
                };
                let before = r.values.len();
                let r = r.keep_new(resumed_step, &mut seen);
                clean &= r.as_ref().is_some_and(|r| r.values.len() == before);
                kept.extend(r);
            }
        }
        let path = if clean {
            // Nothing to drop: append to the one file, as TensorBoard expects of a log.
            ours[0].clone()
        } else {
            let path = write_new(&dir, &ours, &kept)?;
            for old in &ours {
                fs::remove_file(old).with_context(|| format!("cannot remove {}", old.display()))?;
            }
            path
        };
        let file = OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let workspace = checkpoints.parent().unwrap_or(Path::new(".")).to_path_buf();
        Ok(Self {
            path,
            file,
            workspace,
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn append_step(&self, m: &StepMetrics) -> Result<()> {
        self.append(m.step, &summaries::step_values(m))
    }

    /// An evaluation, with its samples' audio read from their WAV files.
    pub fn append_eval(&self, e: &EvalMetrics) -> Result<()> {
        self.append(e.step, &summaries::eval_values(e, &self.workspace)?)
    }

    /// One record, in one write: a killed run loses nothing it had appended, and leaves at
    /// most a torn last record, which the next open drops.
    fn append(&self, step: usize, values: &[Vec<u8>]) -> Result<()> {
        let event = summaries::event(now(), step, values.iter().map(|v| &v[..]));
        (&self.file)
            .write_all(&frame(&event))
            .with_context(|| format!("cannot write {}", self.path.display()))
    }
}

/// A record of one of our files: its step, and its values with their tags.
struct Record<'a> {
    wall_time: f64,
    step: u64,
    values: Vec<(String, &'a [u8])>,
}

impl<'a> Record<'a> {
    /// `None` for an event without a summary (the file-version record, which every new file
    /// writes again).
    fn parse(data: &'a [u8]) -> Result<Option<Self>> {
        let (mut wall_time, mut step, mut summary) = (0.0, 0, None);
        for (field, wire) in fields(data)? {
            match (field, wire) {
                (EVENT_WALL_TIME, Wire::Fixed64(bits)) => wall_time = f64::from_bits(bits),
                (EVENT_STEP, Wire::Varint(v)) => step = v,
                (EVENT_SUMMARY, Wire::Len(b)) => summary = Some(b),
                _ => {}
            }
        }
        let Some(summary) = summary else {
            return Ok(None);
        };
        let mut values = Vec::new();
        for (field, wire) in fields(summary)? {
            if let (SUMMARY_VALUE, Wire::Len(value)) = (field, wire) {
                let tag = fields(value)?.into_iter().find_map(|(f, w)| match (f, w) {
                    (VALUE_TAG, Wire::Len(t)) => Some(String::from_utf8_lossy(t).into_owned()),
                    _ => None,
                });
                let Some(tag) = tag else {
                    bail!("a summary value without a tag at step {step}");
                };
                values.push((tag, value));
            }
        }
        Ok(Some(Self {
            wall_time,
            step,
            values,
        }))
    }

    /// The record as the resume rule keeps it: `None` after `resumed_step`, else without the
    /// values whose (tag, step) `seen` already holds.
    fn keep_new(mut self, resumed_step: usize, seen: &mut HashSet<(String, u64)>) -> Option<Self> {
        if self.step > resumed_step as u64 {
            return None;
        }
        let step = self.step;
        self.values
            .retain(|(tag, _)| seen.insert((tag.clone(), step)));
        (!self.values.is_empty()).then_some(self)
    }

    fn encode(&self) -> Vec<u8> {
        summaries::event(
            self.wall_time,
            self.step as usize,
            self.values.iter().map(|(_, v)| *v),
        )
    }
}

/// Our files in `dir`, in TensorBoard's reading order (by name).
fn our_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let e = e.with_context(|| format!("cannot list {}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(PREFIX) && name.ends_with(SUFFIX) && e.path().is_file() {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}

/// A new file holding `kept`, after the version record; written under a name TensorBoard
/// does not read (a temporary name with `tfevents` in it would be), synced, then renamed. Its
/// name sorts after every file of `ours`, so that a TensorBoard already watching the directory
/// moves on to it.
fn write_new(dir: &Path, ours: &[PathBuf], kept: &[Record]) -> Result<PathBuf> {
    let newest = ours
        .iter()
        .filter_map(|p| seconds_of(p))
        .max()
        .map_or(0, |s| s + 1);
    let seconds = (now() as u64).max(newest);
    let path = dir.join(format!("{PREFIX}{seconds:010}.{}{SUFFIX}", host()));
    if path.exists() {
        bail!("{} exists already", path.display());
    }
    let tmp = dir.join(format!("{TEMP_PREFIX}{}", std::process::id()));
    let result = (|| -> Result<()> {
        let mut f =
            File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut bytes = frame(&summaries::version_event(now()));
        for r in kept {
            bytes.extend_from_slice(&frame(&r.encode()));
        }
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        fs::rename(&tmp, &path)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map(|()| path)
}

/// Removes what a run killed while writing a new file left: one run at a time holds the
/// workspace (docs/training.md §8.3), so every temporary file found at the start is stale.
fn remove_stale_temps(dir: &Path) {
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// The seconds in one of our file names.
fn seconds_of(path: &Path) -> Option<u64> {
    let name = path.file_name()?.to_str()?;
    name.strip_prefix(PREFIX)?.split('.').next()?.parse().ok()
}

/// The machine's name, as TensorBoard's own writers put it in the file name (characters that
/// do not belong in a host name left out).
fn host() -> String {
    let name = fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    let name: String = name
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests;
