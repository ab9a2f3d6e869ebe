//! Training checkpoints (DESIGN §5):
//!
//! ```text
//! checkpoints/
//!   step-0000120/
//!     rank-00000.safetensors   fp32 rows of every trained tensor: master.NAME, exp_avg.NAME,
//!                              exp_avg_sq.NAME (one file per rank; one rank on a single device)
//!     index.json               world size, step, data cursor + RNG state, what the run is
//!                              (model identity, trained set, layout), per-tensor shape and
//!                              row ranges per rank
//!   latest                     "step-0000120": the newest complete checkpoint
//! ```
//! A checkpoint is written into `.tmp-step-…` and renamed into place once complete; `latest`
//! is updated after that, and older checkpoints beyond `keep` are deleted last. A run killed at
//! any point leaves the previous checkpoint intact and `latest` naming a complete one.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::optim::AdamState;
use super::params::ParamSet;
use super::sampler::Cursor;
use super::stwrite::{self, Entry};
use crate::model::weights::Weights;

pub const LATEST: &str = "latest";
pub const INDEX: &str = "index.json";
pub const FORMAT: &str = "voiceclone-train-checkpoint";
pub const VERSION: u32 = 1;
/// Version of the batch layout + objective; part of the identity of a run.
pub const OBJECTIVE: &str = "qwen3-tts-12hz sft layout §10.2 + corrected objective §10.3, v1";
/// Test hook: pause (before `index.json` is written) while saving the checkpoint of this step.
pub const PAUSE_ENV: &str = "VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE";

pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:07}")
}

pub fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// What makes two runs the same computation: a checkpoint is only resumed (or exported) when
/// these agree. Learning rate, schedule, clipping, step limits and saving may change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub model: ModelIdentity,
    /// SHA-256 over the sorted names of the trained tensors.
    pub trained_sha256: String,
    pub trained_tensors: usize,
    pub objective: String,
    pub batch_size: usize,
    pub shuffle: bool,
    pub seed: u64,
    /// SHA-256 of the speaker x-vector (f32 bytes) the run trains with.
    pub speaker_sha256: String,
}

impl Identity {
    pub fn digest(&self) -> String {
        let json = serde_json::to_string(self).expect("identity serializes");
        format!("{:x}", Sha256::digest(json.as_bytes()))
    }

    /// `Ok` when a checkpoint of `saved` may continue as `self`; otherwise every reason.
    pub fn check_compatible(&self, saved: &Identity) -> Result<()> {
        let mut why = Vec::new();
        if self.model != saved.model {
            why.push(format!(
                "it was trained from another base model ({}, config.json sha256 {}…), the configuration names {} (sha256 {}…)",
                saved.model.base,
                &saved.model.config_sha256[..12.min(saved.model.config_sha256.len())],
                self.model.base,
                &self.model.config_sha256[..12.min(self.model.config_sha256.len())]
            ));
        }
        if self.trained_sha256 != saved.trained_sha256 {
            why.push(format!(
                "it trains another set of tensors ({} then, {} now: did train.freeze change?)",
                saved.trained_tensors, self.trained_tensors
            ));
        }
        if self.objective != saved.objective {
            why.push(format!(
                "it was made with another training objective ({:?})",
                saved.objective
            ));
        }
        if self.batch_size != saved.batch_size {
            why.push(format!(
                "train.batch_size was {}, now {}",
                saved.batch_size, self.batch_size
            ));
        }
        if self.shuffle != saved.shuffle {
            why.push(format!(
                "train.shuffle was {}, now {}",
                saved.shuffle, self.shuffle
            ));
        }
        if self.seed != saved.seed {
            why.push(format!("train.seed was {}, now {}", saved.seed, self.seed));
        }
        if self.speaker_sha256 != saved.speaker_sha256 {
            why.push("the speaker embedding (data/speaker.safetensors) changed".into());
        }
        if why.is_empty() {
            Ok(())
        } else {
            bail!("{}", why.join("; "))
        }
    }
}

/// The base checkpoint a run starts from, identified by content rather than by path.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// `model.base` as configured (informational; not compared).
    pub base: String,
    pub config_sha256: String,
    /// SHA-256 over the safetensors headers, file sizes and 16 sampled 64 KiB chunks per file.
    pub weights_sha256: String,
}

impl PartialEq for ModelIdentity {
    fn eq(&self, other: &Self) -> bool {
        self.config_sha256 == other.config_sha256 && self.weights_sha256 == other.weights_sha256
    }
}
impl Eq for ModelIdentity {}

impl ModelIdentity {
    pub fn compute(base: &str, config_path: &Path, shards: &[PathBuf]) -> Result<Self> {
        let config = fs::read(config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        let mut h = Sha256::new();
        for shard in shards {
            sample_file(shard, &mut h)
                .with_context(|| format!("cannot read {}", shard.display()))?;
        }
        Ok(Self {
            base: base.to_string(),
            config_sha256: format!("{:x}", Sha256::digest(&config)),
            weights_sha256: format!("{:x}", h.finalize()),
        })
    }
}

fn sample_file(path: &Path, h: &mut Sha256) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = fs::File::open(path)?;
    let size = f.metadata()?.len();
    h.update(size.to_le_bytes());
    let mut len = [0u8; 8];
    f.read_exact(&mut len)?;
    let header_len = u64::from_le_bytes(len).min(size.saturating_sub(8));
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)?;
    h.update(&header);
    const CHUNK: u64 = 64 * 1024;
    let mut buf = vec![0u8; CHUNK as usize];
    for i in 0..16u64 {
        let at = (size.saturating_sub(CHUNK)) * i / 15;
        f.seek(SeekFrom::Start(at))?;
        let n = f.read(&mut buf)?;
        h.update(&buf[..n]);
    }
    Ok(())
}

/// Rows `[start, end)` of a tensor held by `rank`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub rank: usize,
    pub rows: [usize; 2],
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamInfo {
    pub shape: Vec<usize>,
    pub unit: String,
    pub shards: Vec<Shard>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerInfo {
    pub name: String,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Updates taken (AdamW's bias-correction step count).
    pub step: u64,
}

/// `index.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    pub format: String,
    pub version: u32,
    pub world_size: usize,
    /// Optimizer steps completed.
    pub step: usize,
    /// Epoch of the data cursor (0-based).
    pub epoch: usize,
    pub cursor: Cursor,
    /// The data-order RNG: algorithm and its state at the start of `epoch`.
    pub rng: RngInfo,
    /// SHA-256 of `identity`.
    pub config_digest: String,
    pub identity: Identity,
    /// SHA-256 of the training samples (text ids and codes) the cursor refers to.
    pub data_sha256: String,
    pub optimizer: OptimizerInfo,
    /// Loss of the last step before this checkpoint.
    pub loss: Option<f64>,
    pub params: BTreeMap<String, ParamInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngInfo {
    pub algorithm: String,
    pub state: u64,
}

impl Index {
    /// Describes the parameter set of a single-device run (every row on rank 0).
    pub fn describe_params(params: &ParamSet) -> BTreeMap<String, ParamInfo> {
        params
            .params
            .iter()
            .map(|p| {
                let rows = p.shape().first().copied().unwrap_or(1);
                (
                    p.name.clone(),
                    ParamInfo {
                        shape: p.shape().to_vec(),
                        unit: p.unit.to_string(),
                        shards: vec![Shard {
                            rank: 0,
                            rows: [0, rows],
                        }],
                    },
                )
            })
            .collect()
    }
}

/// Everything a checkpoint saves besides the index.
pub struct State<'a> {
    pub params: &'a ParamSet,
    pub adam: &'a AdamState,
}

/// Writes checkpoint `index.step` under `root` (see the module docs) and prunes old ones;
/// `extra` may add files to the (temporary) checkpoint directory. Returns the checkpoint
/// directory.
pub fn save(
    root: &Path,
    index: &Index,
    state: &State,
    keep: usize,
    extra: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    fs::create_dir_all(root).with_context(|| format!("cannot create {}", root.display()))?;
    let name = step_dir_name(index.step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp)?;
    }
    fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = (|| -> Result<()> {
        write_rank_file(&tmp.join(rank_file(0)), state)?;
        extra(&tmp)?;
        test_pause(index.step);
        let json = serde_json::to_string_pretty(index)?;
        let mut f = fs::File::create(tmp.join(INDEX))?;
        f.write_all(json.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        sync_dir(&tmp);
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e.context(format!("cannot write checkpoint {}", tmp.display())));
    }
    let dest = root.join(&name);
    if dest.exists() {
        // The same step saved again (e.g. stopped right after resuming): replace it.
        let old = root.join(format!(".old-{name}-{}", std::process::id()));
        fs::rename(&dest, &old)?;
        fs::rename(&tmp, &dest)?;
        fs::remove_dir_all(&old)?;
    } else {
        fs::rename(&tmp, &dest)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), dest.display()))?;
    }
    sync_dir(root);
    crate::fsutil::write_atomic(&root.join(LATEST), format!("{name}\n").as_bytes())?;
    prune(root, keep, &name)?;
    Ok(dest)
}

fn write_rank_file(path: &Path, state: &State) -> Result<()> {
    let mut entries = Vec::new();
    let mut sources = Vec::new();
    for (i, p) in state.params.params.iter().enumerate() {
        for (kind, t) in [
            ("master", p.master()),
            ("exp_avg", state.adam.m[i].clone()),
            ("exp_avg_sq", state.adam.v[i].clone()),
        ] {
            entries.push(Entry {
                name: format!("{kind}.{}", p.name),
                dtype: safetensors::Dtype::F32,
                shape: p.shape().to_vec(),
            });
            sources.push(t);
        }
    }
    let meta = BTreeMap::from([("format".to_string(), FORMAT.to_string())]);
    let file =
        fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = BufWriter::new(file);
    stwrite::write(&mut w, &entries, &meta, |i| stwrite::f32_bytes(&sources[i]))?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(())
}

fn test_pause(step: usize) {
    if let Ok(v) = std::env::var(PAUSE_ENV) {
        if v.trim().parse::<usize>().ok() == Some(step) {
            eprintln!("test hook: paused in checkpoint write at step {step}");
            std::thread::sleep(std::time::Duration::from_secs(600));
        }
    }
}

fn sync_dir(dir: &Path) {
    if let Ok(f) = fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

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

fn prune(root: &Path, keep: usize, current: &str) -> Result<()> {
    let all = list(root)?;
    let excess = all.len().saturating_sub(keep.max(1));
    for (_, dir) in all.into_iter().take(excess) {
        if dir.file_name().is_some_and(|n| n == current) {
            continue;
        }
        fs::remove_dir_all(&dir).with_context(|| format!("cannot delete {}", dir.display()))?;
    }
    Ok(())
}

/// Removes temporary directories left by interrupted checkpoint writes.
pub fn clean_partial(root: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let Ok(rd) = fs::read_dir(root) else {
        return Ok(removed);
    };
    for e in rd {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if (name.starts_with(".tmp-step-") || name.starts_with(".old-step-")) && e.path().is_dir() {
            fs::remove_dir_all(e.path())?;
            removed.push(e.path());
        }
    }
    Ok(removed)
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

pub fn read_index(dir: &Path) -> Result<Index> {
    let path = dir.join(INDEX);
    let text =
        fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let index: Index = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a voiceclone checkpoint index", path.display()))?;
    if index.format != FORMAT || index.version != VERSION {
        bail!(
            "{}: unsupported checkpoint format {:?} version {}",
            path.display(),
            index.format,
            index.version
        );
    }
    Ok(index)
}

/// The full fp32 tensors of `kind` ("master", "exp_avg", "exp_avg_sq") of the checkpoint in
/// `dir`, reassembled from the row ranges of every rank.
pub fn load_tensors(
    dir: &Path,
    index: &Index,
    kinds: &[&str],
    device: &Device,
) -> Result<BTreeMap<String, Tensor>> {
    let files: Vec<PathBuf> = (0..index.world_size)
        .map(|r| dir.join(rank_file(r)))
        .collect();
    for f in &files {
        if !f.is_file() {
            bail!(
                "checkpoint {} is incomplete: {} is missing",
                dir.display(),
                f.display()
            );
        }
    }
    let mut out = BTreeMap::new();
    // One rank file at a time keeps peak memory near one copy of the state.
    let mut parts: BTreeMap<String, Vec<(usize, Tensor)>> = BTreeMap::new();
    for (rank, file) in files.iter().enumerate() {
        let w = Weights::load(std::slice::from_ref(file), DType::F32, device, |n| {
            kinds.iter().any(|k| n.starts_with(&format!("{k}.")))
        })?;
        for (name, info) in &index.params {
            for s in info
                .shards
                .iter()
                .filter(|s| s.rank == rank && s.rows[1] > s.rows[0])
            {
                let mut shape = info.shape.clone();
                if let Some(rows) = shape.first_mut() {
                    *rows = s.rows[1] - s.rows[0];
                }
                for k in kinds {
                    let key = format!("{k}.{name}");
                    parts
                        .entry(key.clone())
                        .or_default()
                        .push((s.rows[0], w.get(&key, &shape)?));
                }
            }
        }
    }
    for (key, mut p) in parts {
        p.sort_by_key(|(start, _)| *start);
        let ts: Vec<Tensor> = p.into_iter().map(|(_, t)| t).collect();
        let t = if ts.len() == 1 {
            ts.into_iter().next().expect("one part")
        } else {
            Tensor::cat(&ts, 0)?
        };
        out.insert(key, t);
    }
    Ok(out)
}
