//! What a training run is, set up the same way by the single-device trainer and the sharded one
//! (docs/training.md §7.3): the data, its held-out part (docs/training.md §14) and its order,
//! the speaker, the trained set, the identity that decides which checkpoints may be continued,
//! and the checkpoint index.

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::Tensor;
use sha2::{Digest, Sha256};

use crate::checkpoint::safetensors_stream;
use crate::checkpoint::{self, Identity, Index, ModelIdentity};
use crate::data::{self, Dataset};
use crate::heldout::Split;
use crate::sampler::{Cursor, Sampler};
use crate::step::lora::Lora;
use crate::step::trainable;
use crate::step::units::unit_of;
use crate::{Backend, TrainOptions};
use vc_model::config::Qwen3TtsConfig;

/// The parts of a run that do not depend on how it is computed.
pub struct RunSetup {
    pub cfg: Qwen3TtsConfig,
    /// What trains: the manifest less the held-out set.
    pub dataset: Dataset,
    /// The held-out set (docs/training.md §14), never trained on.
    pub heldout: Option<Dataset>,
    /// What choosing the held-out set found that the user should hear of.
    pub notes: Vec<String>,
    /// The speaker table `(S, H)`, f32, on the training device: row s is the x-vector of
    /// `dataset.speakers[s]` (one row for an unnamed speaker; docs/training.md §3.3).
    pub speaker: Tensor,
    /// The trained tensors, in parameter order (unit, then name), and their shapes.
    pub trained: Vec<String>,
    pub shapes: Vec<Vec<usize>>,
    /// The adapters of a LoRA run (docs/training.md §13).
    pub lora: Option<Lora>,
    pub identity: Identity,
    pub sampler: Sampler,
}

impl RunSetup {
    /// Reads the data, the speaker and the trained set (from the checkpoint headers; no weights
    /// are loaded).
    pub fn new(opts: &TrainOptions) -> Result<Self> {
        if opts.backend == Backend::Kernels && !opts.device.is_cpu() {
            anyhow::bail!("the CPU training kernels cannot run on {:?}", opts.device);
        }
        let cfg = opts.files.config.clone();
        let c = &opts.config;
        let tokenizer = opts.files.text_tokenizer()?;
        let codebook = cfg.talker_config.code_predictor_config.vocab_size as u32;
        let all = data::load(&opts.manifest, &opts.base_dir, &tokenizer, codebook)?;
        let split = if c.val_manifest.is_empty() {
            Split::by_fraction(all, c.val_fraction, c.seed)
        } else {
            let path = opts.base_dir.join(&c.val_manifest);
            let heldout = data::load(&path, &opts.base_dir, &tokenizer, codebook)
                .context("cannot read the held-out manifest (train.val_manifest)")?;
            Split::by_manifest(all, heldout)?
        };
        let heldout_id = split.id();
        let Split {
            train: dataset,
            heldout,
            mut notes,
        } = split;
        if heldout.is_none() && c.early_stop > 0 {
            notes.push(format!(
                "nothing is held out, so train.early_stop = {} cannot stop the run \
                 (docs/training.md §14.3)",
                c.early_stop
            ));
        }
        let hidden = cfg.talker_config.hidden_size;
        let speaker = data::speaker_table(&opts.speaker, &dataset, hidden, &opts.device)?;
        let checkpoint = &opts.files.checkpoint;
        let mut names: Vec<&str> = checkpoint
            .tensor_names()
            .filter(|n| n.starts_with(trainable::TRAINABLE_PREFIX))
            .collect();
        names.sort();
        let with_shapes: Vec<(&str, &[usize])> = names
            .iter()
            .filter_map(|&n| checkpoint.tensor(n).map(|t| (n, t.shape.as_slice())))
            .collect();
        let lora = Lora::from_config(c, &with_shapes)?;
        let mut trained = match &lora {
            Some(l) => l.trained(),
            None => trainable::select_trainable(names, &c.freeze)?.0,
        };
        let units = trained
            .iter()
            .map(|n| unit_of(n))
            .collect::<Result<Vec<_>>>()?;
        let mut order: Vec<usize> = (0..trained.len()).collect();
        order.sort_by(|&a, &b| (units[a], &trained[a]).cmp(&(units[b], &trained[b])));
        trained = order.into_iter().map(|i| trained[i].clone()).collect();
        let shapes = trained
            .iter()
            .map(|n| {
                lora.as_ref()
                    .and_then(|l| l.factor_shape(n))
                    .or_else(|| checkpoint.tensor(n).map(|t| t.shape.clone()))
                    .with_context(|| format!("the base model has no tensor {n}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let identity = Identity {
            model: ModelIdentity::compute(
                &opts.model_spec,
                &opts.files.config_path,
                &opts.files.checkpoint.shards,
            )?,
            trained_sha256: {
                let mut h = Sha256::new();
                let mut sorted = trained.clone();
                sorted.sort();
                for n in &sorted {
                    h.update(n.as_bytes());
                    h.update([0]);
                }
                format!("{:x}", h.finalize())
            },
            trained_tensors: trained.len(),
            objective: checkpoint::OBJECTIVE.to_string(),
            batch_size: c.batch_size,
            shuffle: c.shuffle,
            seed: c.seed,
            speaker_sha256: {
                let bytes = safetensors_stream::f32_bytes(&speaker)?;
                format!("{:x}", Sha256::digest(&bytes))
            },
            speakers: checkpoint::SpeakerId::of(&dataset.speakers, &speaker)?,
            speaker_balance: dataset.balance_groups(c.speaker_balance).is_some(),
            lora: lora.as_ref().map(Lora::identity),
            heldout: heldout_id,
        };
        let sampler = Sampler::new(dataset.lengths(), c.batch_size, c.shuffle, c.seed)
            .with_balance(dataset.balance_groups(c.speaker_balance));
        Ok(Self {
            cfg,
            dataset,
            heldout,
            notes,
            speaker,
            trained,
            shapes,
            lora,
            identity,
            sampler,
        })
    }
}

/// The checkpoint a run continues from.
pub struct Resume {
    pub dir: PathBuf,
    pub index: Index,
    /// Where the data order continues (the epoch restarts when the data changed).
    pub cursor: Cursor,
    pub data_changed: bool,
}

/// The newest checkpoint under `opts.checkpoints` that this run may continue, unless `fresh`;
/// a checkpoint of another run is an error that says why. What an interrupted write left must
/// have been repaired first ([`checkpoint::recover`], by one process: rank 0 of a sharded run).
pub fn find_resume(
    opts: &TrainOptions,
    identity: &Identity,
    dataset: &Dataset,
    fresh: bool,
) -> Result<Option<Resume>> {
    if fresh {
        return Ok(None);
    }
    let Some(dir) = checkpoint::find_latest(&opts.checkpoints)? else {
        return Ok(None);
    };
    let index = checkpoint::read_index(&dir)?;
    identity.check_compatible(&index.identity).map_err(|why| {
        anyhow::anyhow!(
            "checkpoint {} cannot be continued with this configuration: {why}. Run `voiceclone \
             train --fresh` to start a new run (the old checkpoints are moved aside, not \
             deleted), or restore the previous settings.",
            dir.display()
        )
    })?;
    let mut cursor = index.cursor;
    let data_changed = index.data_sha256 != dataset.digest;
    if data_changed {
        cursor.batch = 0;
    }
    Ok(Some(Resume {
        dir,
        index,
        cursor,
        data_changed,
    }))
}

/// The sampler of `dataset` continuing at `cursor` (a checkpoint's).
pub fn resumed_sampler(opts: &TrainOptions, dataset: &Dataset, cursor: Cursor) -> Sampler {
    let c = &opts.config;
    Sampler::resume(dataset.lengths(), c.batch_size, c.shuffle, cursor)
        .with_balance(dataset.balance_groups(c.speaker_balance))
}
