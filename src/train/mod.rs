//! Fine-tuning (DESIGN §5, spec §10): the corrected SFT objective on the official batch layout,
//! AdamW over fp32 masters, gradient accumulation and clipping, warm-up + cosine schedule,
//! exactly resumable checkpoints, metrics, and the export to the official model layout.
//!
//! Modules, one job each: [`data`] (manifest → samples), [`sampler`] (epoch order, cursor),
//! [`batch`] (layout), [`loss`] (objective), [`params`] and [`units`] (trained set),
//! [`optim`] (AdamW, clipping, schedule), [`checkpoint`], [`metrics`], [`export`], and the loop
//! here ([`Trainer`]).

pub mod alloc;
pub mod batch;
pub mod checkpoint;
pub mod cpu_ops;
pub mod data;
pub mod export;
pub mod lock;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod params;
pub mod rng;
pub mod sampler;
pub mod signal;
pub mod sparse;
pub mod stwrite;
pub mod units;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use sha2::{Digest, Sha256};

use self::batch::{Batch, LayoutIds};
use self::checkpoint::{Identity, Index, ModelIdentity, OptimizerInfo, RngInfo, State};
use self::data::Dataset;
use self::metrics::{MetricsLog, StepMetrics};
use self::optim::{AdamState, AdamW, Schedule};
use self::params::ParamSet;
use self::sampler::Sampler;
use self::sparse::RowGrad;
use crate::config::TrainConfig;
use crate::model::config::Qwen3TtsConfig;
use crate::model::files::ModelFiles;
use crate::model::ops::Numerics;
use crate::model::talker::Talker;
use crate::progress::Progress;

/// Test hook: after this optimizer step, wait (up to 10 minutes) for a stop signal.
pub const PAUSE_AFTER_STEP_ENV: &str = "VOICECLONE_TEST_PAUSE_AFTER_STEP";
/// Test hook: pretend the loss of this optimizer step is NaN.
pub const NAN_AT_STEP_ENV: &str = "VOICECLONE_TEST_NAN_AT_STEP";
/// Name of the speaker embedding copy kept in every checkpoint (what the export uses).
pub const CHECKPOINT_SPEAKER: &str = "speaker.safetensors";
/// The text embedding table, whose gradient the CPU trainer keeps row-sparse.
pub const TEXT_EMBEDDING: &str = "talker.model.text_embedding.weight";
/// Tensor name of the speaker embedding (as written by `voiceclone embed`).
pub const SPEAKER_TENSOR: &str = "speaker_embedding";

/// Everything a training run needs, resolved by the command layer.
pub struct TrainOptions {
    pub files: ModelFiles,
    /// `model.base` as configured (recorded in checkpoints).
    pub model_spec: String,
    pub manifest: PathBuf,
    /// Directory relative manifest paths are relative to (the workspace).
    pub base_dir: PathBuf,
    /// The x-vector file (`data/speaker.safetensors`).
    pub speaker: PathBuf,
    /// `checkpoints/`.
    pub checkpoints: PathBuf,
    pub config: TrainConfig,
    pub device: Device,
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub start_step: usize,
    pub step: usize,
    pub total_steps: usize,
    /// The newest checkpoint (None only if no step was ever taken).
    pub checkpoint: Option<PathBuf>,
    /// Stopped by a signal before `total_steps`.
    pub interrupted: bool,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub frames_per_second: Option<f64>,
}

/// Reads the x-vector `(H,)` written by `voiceclone embed`.
pub fn load_speaker(path: &Path, hidden: usize, device: &Device) -> Result<Tensor> {
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .with_context(|| format!("cannot read the speaker embedding {}", path.display()))?;
    let t = tensors.get(SPEAKER_TENSOR).with_context(|| {
        format!(
            "{} has no tensor {SPEAKER_TENSOR} (was it written by `voiceclone embed`?)",
            path.display()
        )
    })?;
    if t.dims() != [hidden] {
        bail!(
            "the speaker embedding in {} has shape {:?}, but the model needs ({hidden},): it was \
             computed with another model; run `voiceclone embed` again with this model",
            path.display(),
            t.dims()
        );
    }
    Ok(t.to_dtype(DType::F32)?.to_device(device)?)
}

/// The compute dtype on `device`: f32 on the CPU (no bf16 matmul there), bf16 on CUDA with
/// fp32 masters.
pub fn compute_dtype(device: &Device) -> DType {
    if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    }
}

/// A set-up training run: model, trained parameters, optimizer state, data order.
pub struct Trainer {
    pub cfg: Qwen3TtsConfig,
    pub talker: Talker,
    pub params: ParamSet,
    pub adam: AdamState,
    pub adamw: AdamW,
    pub dataset: Dataset,
    pub sampler: Sampler,
    pub speaker: Tensor,
    pub identity: Identity,
    pub step: usize,
    pub layout: LayoutIds,
    /// The learning-rate schedule (public so that tests can pin a constant rate).
    pub schedule: Schedule,
    /// Index of the text embedding among the parameters when its gradient is kept row-sparse
    /// (trained, f32 master updated in place on the CPU; see [`sparse`]).
    sparse_text: Option<usize>,
    opts: TrainOptions,
    /// Checkpoint the run resumed from.
    pub resumed_from: Option<PathBuf>,
    /// Set when the data changed since the checkpoint (the epoch restarted).
    pub data_changed: bool,
    last_loss: Option<f64>,
}

impl Trainer {
    /// Loads the model and the data, and the newest compatible checkpoint unless `fresh`.
    pub fn new(opts: TrainOptions, fresh: bool) -> Result<Self> {
        let cfg = opts.files.config.clone();
        let c = &opts.config;
        let tokenizer = opts.files.text_tokenizer()?;
        let codebook = cfg.talker_config.code_predictor_config.vocab_size as u32;
        let dataset = data::load(&opts.manifest, &opts.base_dir, &tokenizer, codebook)?;
        let speaker = load_speaker(&opts.speaker, cfg.talker_config.hidden_size, &opts.device)?;

        let weights = opts
            .files
            .load_weights(DType::F32, &opts.device, |n| {
                n.starts_with(params::TRAINABLE_PREFIX)
            })
            .context("cannot load the base model")?;
        let names = weights.names_with_prefix(params::TRAINABLE_PREFIX);
        let (trained, _frozen) =
            params::select_trainable(names.iter().map(String::as_str), &c.freeze)?;
        let mut params = ParamSet::new(&weights, &trained, compute_dtype(&opts.device))?;
        drop(weights);
        let talker = Talker::from_source(&params, &cfg, Numerics::Differentiable)?;

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
            speaker_sha256: tensor_sha256(&speaker)?,
        };
        let lengths: Vec<usize> = dataset.samples.iter().map(|s| s.seq_len()).collect();
        let masters: Vec<Tensor> = params.params.iter().map(|p| p.master()).collect();
        let mut adam = AdamState::zeros(&masters)?;
        drop(masters);
        let mut sampler = Sampler::new(lengths.clone(), c.batch_size, c.shuffle, c.seed);
        let mut step = 0;
        let mut resumed_from = None;
        let mut data_changed = false;
        let mut last_loss = None;

        checkpoint::clean_partial(&opts.checkpoints)?;
        if !fresh {
            if let Some(dir) = checkpoint::find_latest(&opts.checkpoints)? {
                let index = checkpoint::read_index(&dir)?;
                identity.check_compatible(&index.identity).map_err(|why| {
                    anyhow::anyhow!(
                        "checkpoint {} cannot be continued with this configuration: {why}. \
                         Run `voiceclone train --fresh` to start a new run (the old checkpoints \
                         are moved aside, not deleted), or restore the previous settings.",
                        dir.display()
                    )
                })?;
                let tensors = checkpoint::load_tensors(
                    &dir,
                    &index,
                    &["master", "exp_avg", "exp_avg_sq"],
                    &opts.device,
                )?;
                let take = |key: String| {
                    tensors
                        .get(&key)
                        .cloned()
                        .with_context(|| format!("checkpoint {} has no {key}", dir.display()))
                };
                for (i, p) in params.params.iter_mut().enumerate() {
                    p.set_master(take(format!("master.{}", p.name))?)?;
                    adam.m[i] = take(format!("exp_avg.{}", p.name))?;
                    adam.v[i] = take(format!("exp_avg_sq.{}", p.name))?;
                }
                adam.step = index.optimizer.step;
                step = index.step;
                let mut cursor = index.cursor;
                if index.data_sha256 != dataset.digest {
                    data_changed = true;
                    cursor.batch = 0;
                }
                sampler = Sampler::resume(lengths, c.batch_size, c.shuffle, cursor);
                last_loss = index.loss;
                resumed_from = Some(dir);
            }
        }
        let sparse_text = params.params.iter().position(|p| {
            p.name == TEXT_EMBEDDING && p.master_in_place().is_some_and(cpu_ops::supported)
        });
        let mut trainer = Self {
            sparse_text,
            layout: LayoutIds::from_config(&cfg),
            schedule: Schedule {
                peak: c.lr,
                warmup: c.warmup_steps,
                total: 0,
            },
            cfg,
            talker,
            params,
            adam,
            adamw: AdamW::new(c.weight_decay),
            dataset,
            sampler,
            speaker,
            identity,
            step,
            opts,
            resumed_from,
            data_changed,
            last_loss,
        };
        trainer.schedule.total = trainer.total_steps();
        Ok(trainer)
    }

    /// Optimizer steps of the whole run: `epochs` × steps per epoch, capped by `max_steps`.
    pub fn total_steps(&self) -> usize {
        let c = &self.opts.config;
        let full = c.epochs * self.sampler.steps_per_epoch(c.grad_accum);
        if c.max_steps > 0 {
            full.min(c.max_steps)
        } else {
            full
        }
    }

    /// The loss of one micro-batch of samples (indices into the dataset).
    pub fn batch_loss(&self, indices: &[usize]) -> Result<(loss::Loss, usize)> {
        let samples: Vec<&data::Sample> =
            indices.iter().map(|&i| &self.dataset.samples[i]).collect();
        let batch = Batch::build(&samples, &self.layout);
        let tensors = batch.to_tensors(&self.opts.device)?;
        Ok((
            loss::sft_loss(&self.talker, &tensors, &self.speaker)?,
            batch.frames,
        ))
    }

    /// A micro-batch's loss inside an optimizer step; with the row-sparse text embedding also
    /// the batch's distinct text rows and the trainable copy of them the loss was computed from.
    #[allow(clippy::type_complexity)]
    fn micro_loss(
        &self,
        indices: &[usize],
    ) -> Result<(loss::Loss, usize, Option<(Vec<u32>, Var)>)> {
        let samples: Vec<&data::Sample> =
            indices.iter().map(|&i| &self.dataset.samples[i]).collect();
        let batch = Batch::build(&samples, &self.layout);
        let tensors = batch.to_tensors(&self.opts.device)?;
        let Some(i) = self.sparse_text else {
            let l = loss::sft_loss(&self.talker, &tensors, &self.speaker)?;
            return Ok((l, batch.frames, None));
        };
        let (uniq, local) = sparse::distinct(&batch.text_ids);
        let dev = &self.opts.device;
        let table = self.params.params[i].var.as_tensor();
        let rows = Var::from_tensor(&table.index_select(&Tensor::new(uniq.as_slice(), dev)?, 0)?)?;
        let ids = Tensor::from_vec(local, (batch.rows, batch.len), dev)?;
        let text = loss::TextRows {
            table: rows.as_tensor(),
            ids: &ids,
        };
        let l = loss::sft_loss_with(&self.talker, &tensors, &self.speaker, Some(text))?;
        Ok((l, batch.frames, Some((uniq, rows))))
    }

    /// One optimizer step over `micro` micro-batches: averaged gradients, clipping, AdamW.
    pub fn step(&mut self, micro: &[Vec<usize>]) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let epoch = self.sampler.cursor().epoch;
        let n = micro.len() as f64;
        let mut acc: Vec<Option<Tensor>> = vec![None; self.params.params.len()];
        let (mut sum, mut sum_talker, mut sum_sub, mut frames) = (0.0, 0.0, 0.0, 0);
        let poison = std::env::var(NAN_AT_STEP_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            == Some(self.step + 1);
        let mut text_rows = self.sparse_text.map(|i| {
            let shape = self.params.params[i].shape();
            RowGrad::new(shape[0], shape[1])
        });
        for indices in micro {
            let (l, f, rows) = self.micro_loss(indices)?;
            let mut value = l.total.to_scalar::<f32>()? as f64;
            if poison {
                value = f64::NAN;
            }
            if !value.is_finite() {
                let lines: Vec<String> = indices
                    .iter()
                    .map(|&i| self.dataset.samples[i].line.to_string())
                    .collect();
                bail!(
                    "the loss became {value} at step {} (epoch {}, manifest lines {} of {}); \
                     this step was not applied and nothing was saved for it",
                    self.step + 1,
                    epoch + 1,
                    lines.join(", "),
                    self.dataset.manifest.display()
                );
            }
            sum += value;
            sum_talker += l.talker.to_scalar::<f32>()? as f64;
            sum_sub += l.sub.to_scalar::<f32>()? as f64;
            frames += f;
            let grads = (l.total / n)?.backward()?;
            if let (Some(acc), Some((ids, rows))) = (text_rows.as_mut(), rows) {
                if let Some(g) = grads.get(rows.as_tensor()) {
                    acc.add(&ids, &g.flatten_all()?.to_vec1::<f32>()?)?;
                }
            }
            for (a, p) in acc.iter_mut().zip(&self.params.params) {
                let Some(g) = grads.get(p.var.as_tensor()) else {
                    continue;
                };
                let g = g.to_dtype(DType::F32)?;
                *a = Some(match a.take() {
                    Some(prev) => optim::accumulate(prev, &g)?,
                    None => g,
                });
            }
        }
        let sparse = self.sparse_text;
        let grads: Vec<Tensor> = acc
            .into_iter()
            .zip(&self.params.params)
            .enumerate()
            .map(|(i, (g, p))| match g {
                Some(g) => Ok(g),
                // The row-sparse text embedding has no dense gradient: a placeholder.
                None if Some(i) == sparse => Tensor::zeros(0, DType::F32, &self.opts.device),
                None => Tensor::zeros(p.shape(), DType::F32, &self.opts.device),
            })
            .collect::<candle_core::Result<_>>()?;
        let mut sum_sq = 0f64;
        for (i, g) in grads.iter().enumerate() {
            sum_sq += match &text_rows {
                Some(rows) if Some(i) == sparse => rows.sum_squares(),
                _ => optim::sum_squares(g)?,
            };
        }
        let grad_norm = sum_sq.sqrt();
        if !grad_norm.is_finite() {
            bail!(
                "the gradient norm became {grad_norm} at step {}; this step was not applied and \
                 nothing was saved for it",
                self.step + 1
            );
        }
        let clip = optim::clip_factor(grad_norm, self.opts.config.clip_norm);
        let lr = self.schedule.lr(self.step + 1);
        self.adam.step += 1;
        for (i, (p, g)) in self.params.params.iter_mut().zip(&grads).enumerate() {
            if let Some(rows) = text_rows.as_ref().filter(|_| Some(i) == sparse) {
                self.adamw.apply_rows(
                    self.adam.step,
                    lr,
                    clip,
                    p,
                    rows,
                    &self.adam.m[i],
                    &self.adam.v[i],
                )?;
                continue;
            }
            self.adamw.apply(
                self.adam.step,
                lr,
                clip,
                p,
                g,
                &mut self.adam.m[i],
                &mut self.adam.v[i],
            )?;
        }
        self.step += 1;
        let loss = sum / n;
        self.last_loss = Some(loss);
        Ok(StepMetrics {
            step: self.step,
            epoch,
            loss,
            loss_talker: sum_talker / n,
            loss_sub: sum_sub / n,
            grad_norm,
            lr,
            frames,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Saves a checkpoint of the current state (and a copy of the speaker embedding).
    pub fn save(&self) -> Result<PathBuf> {
        let c = &self.opts.config;
        let cursor = self.sampler.cursor();
        let index = Index {
            format: checkpoint::FORMAT.into(),
            version: checkpoint::VERSION,
            world_size: 1,
            step: self.step,
            epoch: cursor.epoch,
            cursor,
            rng: RngInfo {
                algorithm: "splitmix64".into(),
                state: cursor.rng_state,
            },
            config_digest: self.identity.digest(),
            identity: self.identity.clone(),
            data_sha256: self.dataset.digest.clone(),
            optimizer: OptimizerInfo {
                name: "adamw".into(),
                beta1: self.adamw.beta1,
                beta2: self.adamw.beta2,
                eps: self.adamw.eps,
                weight_decay: self.adamw.weight_decay,
                step: self.adam.step,
            },
            loss: self.last_loss,
            params: Index::describe_params(&self.params),
        };
        let state = State {
            params: &self.params,
            adam: &self.adam,
        };
        let speaker: Vec<f32> = self.speaker.to_dtype(DType::F32)?.to_vec1()?;
        let speaker_bytes = crate::commands::embed::serialize_embedding(&speaker, None)?;
        checkpoint::save(&self.opts.checkpoints, &index, &state, c.keep, |dir| {
            std::fs::write(dir.join(CHECKPOINT_SPEAKER), &speaker_bytes)?;
            Ok(())
        })
    }

    /// Trains until the total step count (or a stop signal); saves checkpoints on the way and
    /// at the end.
    pub fn run(&mut self) -> Result<Outcome> {
        let total = self.total_steps();
        let start_step = self.step;
        let mut outcome = Outcome {
            start_step,
            step: self.step,
            total_steps: total,
            checkpoint: self.resumed_from.clone(),
            interrupted: false,
            first_loss: None,
            last_loss: None,
            frames_per_second: None,
        };
        if self.step >= total {
            return Ok(outcome);
        }
        let log = MetricsLog::open(&self.opts.checkpoints, self.step)?;
        signal::install();
        let progress = Progress::new(total as u64, "steps", "train");
        progress.set_position(self.step as u64);
        let c = self.opts.config.clone();
        let (mut frames, mut seconds) = (0usize, 0f64);
        let pause_after = std::env::var(PAUSE_AFTER_STEP_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok());
        while self.step < total {
            let micro = self.sampler.next_step(c.grad_accum);
            let m = match self.step(&micro) {
                Ok(m) => m,
                Err(e) => {
                    progress.finish();
                    signal::restore();
                    let last = checkpoint::find_latest(&self.opts.checkpoints)?;
                    let hint = match last {
                        Some(d) => format!(
                            "the last good checkpoint is {}; lower train.lr (now {}) and run \
                             `voiceclone train` again to continue from it",
                            d.display(),
                            c.lr
                        ),
                        None => format!(
                            "no checkpoint was saved yet; lower train.lr (now {}) and start again",
                            c.lr
                        ),
                    };
                    return Err(e.context(hint));
                }
            };
            log.append(&m)?;
            frames += m.frames;
            seconds += m.seconds;
            outcome.first_loss.get_or_insert(m.loss);
            outcome.last_loss = Some(m.loss);
            outcome.step = self.step;
            let fps = frames as f64 / seconds.max(1e-9);
            outcome.frames_per_second = Some(fps);
            progress.set_position(self.step as u64);
            progress.set_message(format!(
                "epoch {}/{} · loss {:.4} (talker {:.4}, sub {:.4}) · lr {:.2e} · {:.0} frames/s",
                m.epoch + 1,
                c.epochs,
                m.loss,
                m.loss_talker,
                m.loss_sub,
                m.lr,
                fps
            ));
            if pause_after == Some(self.step) {
                progress.println(format!("test hook: paused after step {}", self.step));
                let until = Instant::now() + Duration::from_secs(600);
                while !signal::stop_requested() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let stop = signal::stop_requested();
            let due = c.save_every > 0 && self.step.is_multiple_of(c.save_every);
            if due || stop || self.step == total {
                let dir = self.save()?;
                log.plot()?;
                let shown = match self.opts.checkpoints.parent() {
                    Some(base) => crate::fsutil::display_relative(&dir, base),
                    None => dir.display().to_string(),
                };
                progress.println(format!(
                    "step {}/{total}: loss {:.4}; saved {shown}",
                    self.step, m.loss,
                ));
                outcome.checkpoint = Some(dir);
            }
            if stop {
                outcome.interrupted = true;
                break;
            }
        }
        progress.finish();
        signal::restore();
        Ok(outcome)
    }

    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }
}

fn tensor_sha256(t: &Tensor) -> Result<String> {
    let bytes = stwrite::f32_bytes(t)?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}
