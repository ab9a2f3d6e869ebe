//! Training checkpoints (docs/training.md §7):
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
use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::hooks::{CheckpointPhase, TrainHooks};
use super::optim::AdamState;
use super::params::ParamStore;
use super::safetensors_stream::{self, TensorHeader};
use super::sampler::Cursor;

pub use super::checkpoint_layout::{
    rank_file, speaker_file, speakers_file, step_dir_name, INDEX, LATEST,
};

pub const FORMAT: &str = "voiceclone-train-checkpoint";
pub const VERSION: u32 = 1;
/// Version of the batch layout (docs/model.md §10.2) and objective (docs/model.md §10.3); part
/// of the identity of a run, stored in every checkpoint: the string itself must not change.
/// doc-refs: allow-next-line
pub const OBJECTIVE: &str = "qwen3-tts-12hz sft layout §10.2 + corrected objective §10.3, v1";

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
    /// SHA-256 of the speaker x-vector (f32 bytes) the run trains with; with named speakers, of
    /// the whole speaker table `(S, H)`.
    pub speaker_sha256: String,
    /// The named speakers in table order (rows 3000, 3001, … of the export); empty, and not
    /// written, for one unnamed speaker (docs/training.md §3.3).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub speakers: Vec<SpeakerId>,
    /// `train.speaker_balance` where it shapes the data order (named speakers only); not
    /// written when off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub speaker_balance: bool,
    /// The adapters' rank and α of a LoRA run (docs/training.md §13); not written for a full
    /// fine-tune.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<super::lora::LoraIdentity>,
    /// The held-out set (docs/training.md §14); not written when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heldout: Option<super::heldout::HeldoutId>,
}

/// One named speaker of a run: its name and the SHA-256 of its x-vector's f32 bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpeakerId {
    pub name: String,
    pub sha256: String,
}

impl SpeakerId {
    /// The ids of `names`, whose x-vectors are the rows of `table` `(S, H)`; none for one
    /// unnamed speaker (`names` empty).
    pub fn of(names: &[String], table: &Tensor) -> Result<Vec<SpeakerId>> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<Vec<f32>> = table.to_dtype(DType::F32)?.to_vec2()?;
        if rows.len() != names.len() {
            bail!(
                "{} speakers but a speaker table of {} rows",
                names.len(),
                rows.len()
            );
        }
        Ok(names
            .iter()
            .zip(rows)
            .map(|(name, row)| {
                let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
                SpeakerId {
                    name: name.clone(),
                    sha256: format!("{:x}", Sha256::digest(&bytes)),
                }
            })
            .collect())
    }
}

/// The bytes of the x-vector file(s) a checkpoint keeps: [`speaker_file`] for one unnamed
/// speaker (the speaker-file format, as `voiceclone embed` writes it), [`speakers_file`] for
/// named ones.
pub struct SpeakerSnapshot {
    named: bool,
    bytes: Vec<u8>,
}

impl SpeakerSnapshot {
    /// The snapshot of the speaker table `(S, H)` of a run with `speakers` (empty: one unnamed).
    pub fn new(speakers: &[SpeakerId], table: &Tensor) -> Result<Self> {
        let values: Vec<f32> = table.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        if speakers.is_empty() {
            return Ok(Self {
                named: false,
                bytes: vc_core::artifacts::speaker::to_bytes(&values, None)?,
            });
        }
        let width = values.len() / speakers.len();
        let rows: Vec<(&str, &[f32])> = speakers
            .iter()
            .zip(values.chunks(width.max(1)))
            .map(|(s, x)| (s.name.as_str(), x))
            .collect();
        let bytes = vc_core::artifacts::speaker::table_bytes(&rows)?;
        Ok(Self { named: true, bytes })
    }

    /// Writes the file into the (pending) checkpoint directory `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = if self.named {
            speakers_file(dir)
        } else {
            speaker_file(dir)
        };
        fs::write(&path, &self.bytes).with_context(|| format!("cannot write {}", path.display()))
    }
}

/// The x-vectors of checkpoint `dir` with its `index`: `[(None, x)]` for one unnamed speaker,
/// else `(Some(name), x)` per speaker in table order.
pub fn read_speakers(dir: &Path, index: &Index) -> Result<Vec<(Option<String>, Vec<f32>)>> {
    if index.identity.speakers.is_empty() {
        return Ok(vec![(
            None,
            vc_core::artifacts::speaker::read(&speaker_file(dir))?,
        )]);
    }
    let path = speakers_file(dir);
    let table = vc_core::artifacts::speaker::read_table(&path)?;
    let names: Vec<&String> = table.iter().map(|(n, _)| n).collect();
    let want: Vec<&String> = index.identity.speakers.iter().map(|s| &s.name).collect();
    if names != want {
        bail!(
            "{} holds the speakers {names:?}, its index.json {want:?}",
            path.display()
        );
    }
    Ok(table.into_iter().map(|(n, x)| (Some(n), x)).collect())
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
                "it trains another set of tensors ({} then, {} now: did train.freeze, \
                 train.lora_targets or train.lora_full change?)",
                saved.trained_tensors, self.trained_tensors
            ));
        }
        if self.lora != saved.lora {
            let show = |l: &Option<super::lora::LoraIdentity>| match l {
                Some(l) => format!("adapters of rank {} and alpha {}", l.rank, l.alpha),
                None => "a full fine-tune".to_string(),
            };
            why.push(format!(
                "it was {}, the configuration asks for {}",
                show(&saved.lora),
                show(&self.lora)
            ));
        }
        if self.heldout != saved.heldout {
            let show = |h: &Option<super::heldout::HeldoutId>| match h {
                Some(h) => format!(
                    "{} utterance(s) (sha256 {}…)",
                    h.utterances,
                    &h.sha256[..12.min(h.sha256.len())]
                ),
                None => "none".to_string(),
            };
            why.push(format!(
                "it held out {}, this run would hold out {}: utterances that trained \
                 would be validated on, or held-out ones trained (did train.val_fraction, \
                 train.val_manifest, train.seed or the data change? Set train.val_manifest to \
                 keep a held-out set fixed while the data grows)",
                show(&saved.heldout),
                show(&self.heldout)
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
        let names = |v: &[SpeakerId]| {
            v.iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match (saved.speakers.is_empty(), self.speakers.is_empty()) {
            (true, true) => {
                if self.speaker_sha256 != saved.speaker_sha256 {
                    why.push("the speaker embedding (data/speaker.safetensors) changed".into());
                }
            }
            (true, false) => why.push(format!(
                "it was trained on one unnamed speaker; the manifest now names the speakers {}",
                names(&self.speakers)
            )),
            (false, true) => why.push(format!(
                "it was trained on the named speakers {}; the manifest now has one unnamed speaker",
                names(&saved.speakers)
            )),
            (false, false) => {
                if names(&saved.speakers) != names(&self.speakers) {
                    why.push(format!(
                        "the speaker set changed: {} then, {} now",
                        names(&saved.speakers),
                        names(&self.speakers)
                    ));
                } else {
                    for (a, b) in saved.speakers.iter().zip(&self.speakers) {
                        if a.sha256 != b.sha256 {
                            why.push(format!(
                                "the x-vector of speaker {:?} (data/speakers/{}) changed",
                                b.name,
                                vc_core::artifacts::speaker::file_name(&b.name)
                            ));
                        }
                    }
                }
            }
        }
        if self.speaker_balance != saved.speaker_balance {
            why.push(format!(
                "train.speaker_balance was {}, now {}",
                saved.speaker_balance, self.speaker_balance
            ));
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
pub struct RankRows {
    pub rank: usize,
    pub rows: [usize; 2],
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamInfo {
    pub shape: Vec<usize>,
    pub unit: String,
    pub shards: Vec<RankRows>,
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
    /// How the state is kept (docs/training.md §6.5); checkpoints from before the modes are
    /// fp32.
    #[serde(default)]
    pub state: vc_core::config::OptimizerState,
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
    /// What the validations up to this step found (docs/training.md §14.3); absent in
    /// checkpoints of runs that never validated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<super::selection::Selection>,
    pub params: BTreeMap<String, ParamInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngInfo {
    pub algorithm: String,
    pub state: u64,
}

impl Index {
    /// Describes the parameter set of a single-device run (every row on rank 0).
    pub fn describe_params(params: &ParamStore) -> BTreeMap<String, ParamInfo> {
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
                        shards: vec![RankRows {
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
            fs::remove_dir_all(&dir)?;
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
    /// directory exists; while an old directory of the same step is moved aside, [`recover`]
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
/// moments in `mode`'s entries ([`super::saved_state::entries`]); parameters with no rows
/// (a rank's empty shard) are left out.
pub fn write_state(
    path: &Path,
    mode: vc_core::config::OptimizerState,
    params: &[super::params::Param],
    adam: &AdamState,
    full_shapes: &[&[usize]],
) -> Result<()> {
    use super::saved_state;
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
        super::saved_state::bytes(&sources[i], entries[i].dtype)
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

/// Deletes all but the newest `keep` complete checkpoints under `root`, sparing `current` and
/// the one `best` names.
pub fn prune(root: &Path, keep: usize, current: &str) -> Result<()> {
    // The chosen checkpoint stays, whatever its age (docs/training.md §14.3).
    let best = super::selection::best_name(root);
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
        if name.starts_with(".tmp-step-") {
            fs::remove_dir_all(e.path())?;
            out.removed.push(e.path());
        } else if let Some(rest) = name.strip_prefix(".old-") {
            // `.old-step-NNNNNNN-PID`
            let step_name = rest.rsplit_once('-').map_or(rest, |(s, _)| s);
            let dest = root.join(step_name);
            if dest.join(INDEX).is_file() {
                fs::remove_dir_all(e.path())?;
                out.removed.push(e.path());
            } else {
                if dest.exists() {
                    fs::remove_dir_all(&dest)?;
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
    let mut steps: Vec<PathBuf> = fs::read_dir(root)?
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
                let saved = super::saved_state::entries(
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

/// Records `selection` in the index of the complete checkpoint `dir` (atomically): what an
/// evaluation found after the checkpoint was written (its samples' score,
/// docs/training.md §14.5). Killed before, the checkpoint keeps the selection it was written with.
pub fn write_selection(dir: &Path, selection: &super::selection::Selection) -> Result<()> {
    let mut index = read_index(dir)?;
    index.selection = Some(selection.clone());
    let mut json = serde_json::to_string_pretty(&index)?;
    json.push('\n');
    vc_core::fsutil::write_atomic(&dir.join(INDEX), json.as_bytes())
        .with_context(|| format!("cannot update {}", dir.join(INDEX).display()))
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

    /// Rows `rows` of `KIND.NAME` (an entry of [`super::saved_state::entries`]) as a tensor
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
            if super::saved_state::compensated(self.index.optimizer.state, &shape) {
                m = (m + self
                    .rows("comp", &name, 0..rows, device)?
                    .to_dtype(DType::F32)?)?;
            }
            out.insert(name, m);
        }
        Ok(out)
    }
}

impl super::saved_state::SavedRows for RowReader {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::NoHooks;

    fn index(step: usize) -> Index {
        let model = ModelIdentity {
            base: "m".into(),
            config_sha256: "c".into(),
            weights_sha256: "w".into(),
        };
        let identity = Identity {
            model,
            trained_sha256: "t".into(),
            trained_tensors: 0,
            objective: OBJECTIVE.into(),
            batch_size: 1,
            shuffle: false,
            seed: 0,
            speaker_sha256: "s".into(),
            speakers: Vec::new(),
            speaker_balance: false,
            lora: None,
            heldout: None,
        };
        Index {
            format: FORMAT.into(),
            version: VERSION,
            world_size: 1,
            step,
            epoch: 0,
            cursor: Cursor {
                epoch: 0,
                batch: step,
                rng_state: 0,
            },
            rng: RngInfo {
                algorithm: "splitmix64".into(),
                state: 0,
            },
            config_digest: identity.digest(),
            identity,
            data_sha256: "d".into(),
            optimizer: OptimizerInfo {
                name: "adamw".into(),
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
                step: step as u64,
                state: vc_core::config::OptimizerState::Fp32,
            },
            loss: None,
            selection: None,
            params: BTreeMap::new(),
        }
    }

    /// A checkpoint without tensors whose rank file carries `content` in its metadata.
    fn write(root: &Path, step: usize, content: &str, hooks: &dyn TrainHooks) -> Result<PathBuf> {
        let p = PendingCheckpoint::begin(root, step, "test")?;
        let meta = std::collections::HashMap::from([("content".to_string(), content.to_string())]);
        let empty: Vec<(&str, safetensors::tensor::TensorView)> = Vec::new();
        fs::write(
            p.dir.join(rank_file(0)),
            safetensors::serialize(empty, Some(meta))?,
        )?;
        fs::write(speaker_file(&p.dir), b"x")?;
        p.commit(&index(step), 3, hooks)
    }

    /// Panics (like a crash: no cleanup runs) at one phase.
    struct CrashAt(CheckpointPhase);
    impl TrainHooks for CrashAt {
        fn checkpoint(&self, _step: usize, phase: CheckpointPhase) {
            if phase == self.0 {
                panic!("simulated crash at {}", phase.name());
            }
        }
    }

    fn content_of_latest(root: &Path) -> String {
        let dir = find_latest(root).unwrap().expect("a checkpoint");
        validate(&dir).expect("the checkpoint is whole");
        let bytes = fs::read(dir.join(rank_file(0))).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        meta.metadata().as_ref().unwrap()["content"].clone()
    }

    #[test]
    fn a_crash_at_any_point_of_a_write_leaves_the_last_complete_checkpoint() {
        for resave in [false, true] {
            for phase in CheckpointPhase::ALL {
                let dir = tempfile::tempdir().unwrap();
                let root = dir.path().join("checkpoints");
                write(&root, 2, "step 2", &NoHooks).unwrap();
                if resave {
                    write(&root, 4, "step 4, first save", &NoHooks).unwrap();
                }
                let before = content_of_latest(&root);
                let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    write(&root, 4, "step 4, new save", &CrashAt(phase))
                }));
                let reached = crashed.is_err();
                // Only a re-save moves an old directory aside.
                assert_eq!(
                    reached,
                    resave || phase != CheckpointPhase::OldMovedAside,
                    "{phase:?}"
                );
                recover(&root).unwrap();
                let after = content_of_latest(&root);
                let expected = match phase {
                    _ if !reached => "step 4, new save",
                    CheckpointPhase::RankFilesWritten
                    | CheckpointPhase::IndexWritten
                    | CheckpointPhase::OldMovedAside => before.as_str(),
                    // In place but `latest` not yet updated: a fresh step is not committed yet,
                    // a re-saved one already replaced its directory.
                    CheckpointPhase::InPlace if !resave => "step 2",
                    CheckpointPhase::InPlace | CheckpointPhase::LatestWritten => "step 4, new save",
                };
                assert_eq!(after, expected, "resave {resave}, crash at {phase:?}");
                // Nothing temporary is left, and the next save works.
                let leftovers: Vec<_> = fs::read_dir(&root)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with('.'))
                    .collect();
                assert!(leftovers.is_empty(), "{leftovers:?}");
                write(&root, 6, "step 6", &NoHooks).unwrap();
                assert_eq!(content_of_latest(&root), "step 6");
            }
        }
    }

    #[test]
    fn speaker_sets_are_part_of_the_identity_and_kept_in_the_checkpoint() {
        let table = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let names = vec!["ann".to_string(), "bob".to_string()];
        let ids = SpeakerId::of(&names, &table).unwrap();
        assert_eq!(ids.len(), 2);
        assert_ne!(ids[0].sha256, ids[1].sha256);
        // One unnamed speaker: the identity JSON has no new keys.
        let single = index(1).identity;
        let json = serde_json::to_string(&single).unwrap();
        assert!(
            !json.contains("speakers") && !json.contains("speaker_balance"),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Identity>(&json).unwrap(), single);

        let named = Identity {
            speakers: ids.clone(),
            ..single.clone()
        };
        let e = named.check_compatible(&single).unwrap_err().to_string();
        assert!(
            e.contains("one unnamed speaker; the manifest now names the speakers ann, bob"),
            "{e}"
        );
        let e = single.check_compatible(&named).unwrap_err().to_string();
        assert!(e.contains("trained on the named speakers ann, bob"), "{e}");
        let three = Identity {
            speakers: SpeakerId::of(
                &["ann".into(), "bob".into(), "cy".into()],
                &Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &Device::Cpu).unwrap(),
            )
            .unwrap(),
            ..single.clone()
        };
        let e = three.check_compatible(&named).unwrap_err().to_string();
        assert!(
            e.contains("the speaker set changed: ann, bob then, ann, bob, cy now"),
            "{e}"
        );
        let mut moved = named.clone();
        moved.speakers[1].sha256 = "other".into();
        let e = moved.check_compatible(&named).unwrap_err().to_string();
        assert!(
            e.contains("the x-vector of speaker \"bob\" (data/speakers/bob.safetensors)"),
            "{e}"
        );
        let balanced = Identity {
            speaker_balance: true,
            ..named.clone()
        };
        let e = balanced.check_compatible(&named).unwrap_err().to_string();
        assert!(
            e.contains("train.speaker_balance was false, now true"),
            "{e}"
        );
        assert!(named.check_compatible(&named.clone()).is_ok());

        // The checkpoint's x-vector files: the single one in the speaker-file format.
        let dir = tempfile::tempdir().unwrap();
        let one = Tensor::new(&[[0.5f32, -1.0]], &Device::Cpu).unwrap();
        SpeakerSnapshot::new(&[], &one)
            .unwrap()
            .write(dir.path())
            .unwrap();
        assert_eq!(
            fs::read(speaker_file(dir.path())).unwrap(),
            vc_core::artifacts::speaker::to_bytes(&[0.5, -1.0], None).unwrap()
        );
        assert_eq!(
            read_speakers(dir.path(), &index(1)).unwrap(),
            vec![(None, vec![0.5, -1.0])]
        );
        SpeakerSnapshot::new(&ids, &table)
            .unwrap()
            .write(dir.path())
            .unwrap();
        let mut idx = index(1);
        idx.identity.speakers = ids;
        assert_eq!(
            read_speakers(dir.path(), &idx).unwrap(),
            vec![
                (Some("ann".to_string()), vec![1.0, 2.0]),
                (Some("bob".to_string()), vec![3.0, 4.0])
            ]
        );
        idx.identity.speakers.reverse();
        assert!(read_speakers(dir.path(), &idx).is_err());
    }
}
