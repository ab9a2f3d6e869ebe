//! What a checkpoint says its run is (docs/training.md §7.3): the identity two runs must share
//! for one to resume or export the other's checkpoint — the model's (its config and a sample of
//! its weights, hashed), the trained set, the objective and the data order — and the speakers'
//! x-vectors the run trained with.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{speaker_file, speakers_file, Index};

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
    pub lora: Option<crate::step::lora::LoraIdentity>,
    /// The held-out set (docs/training.md §14); not written when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heldout: Option<crate::heldout::HeldoutId>,
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
            let show = |l: &Option<crate::step::lora::LoraIdentity>| match l {
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
            let show = |h: &Option<crate::heldout::HeldoutId>| match h {
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
    let mut f = fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
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
