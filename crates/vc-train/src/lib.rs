//! Fine-tuning (docs/training.md §1, docs/model.md §10): the corrected SFT objective on the
//! official batch layout, AdamW over fp32 masters, gradient accumulation and clipping, warm-up +
//! cosine schedule, exactly resumable checkpoints, metrics, and the export to the official model
//! layout.
//!
//! Modules, one job each: [`data`] (manifest → samples), [`sampler`] (epoch order, cursor),
//! [`batch`] (layout), [`loss`] (objective), [`trainable`], [`params`] and [`units`] (trained set), [`lora`]
//! (low-rank adapters),
//! [`optim`] (AdamW, clipping, schedule), [`checkpoint`], [`metrics`], [`export`], the one
//! training loop ([`driver`]) and what it drives: the single-device step here ([`Trainer`]) or
//! one rank of a sharded run ([`sharded`]).
//!
//! Around them: [`run_setup`] (what a run is, set up alike by both trainers), [`stages`] (the
//! forward pass cut at the units), [`cpu_ops`] and [`sparse`] (the optimizer's CPU kernels, the
//! text table's row-sparse gradients), [`moments`] and [`saved_state`] (the optimizer state's
//! forms in memory and on disk), [`checkpoint_layout`] and [`safetensors_stream`] (checkpoint
//! names, the streaming writer), [`plan`] (the memory plan), [`heldout`], [`validation`],
//! [`samples`], [`selection`], [`report`] and [`plot`] (training you can watch), [`lock`] (one
//! run per workspace), [`adapter_export`] (adapters alone in PEFT's format), [`hooks`] (test
//! seams).

pub mod adapter_export;
pub mod batch;
pub mod checkpoint;
pub mod checkpoint_layout;
pub mod cpu_ops;
pub mod data;
pub mod driver;
pub mod export;
pub mod heldout;
pub mod hooks;
pub mod lock;
pub mod lora;
pub mod loss;
pub mod metrics;
pub mod moments;
pub mod optim;
pub mod params;
pub mod plan;
pub mod plot;
pub mod report;
pub mod run_setup;
pub mod safetensors_stream;
pub mod sampler;
pub mod samples;
pub mod saved_state;
pub mod selection;
pub mod sharded;
pub mod sparse;
pub mod stages;
#[cfg(test)]
pub(crate) mod test_support;
pub mod trainable;
pub mod units;
pub mod validation;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};

use self::batch::{Batch, LayoutIds};
use self::checkpoint::{Identity, Index, TrainingState};
use self::data::Dataset;
use self::hooks::TrainHooks;
use self::metrics::{EvalMetrics, StepMetrics};
use self::optim::{AdamState, AdamW, Grad, Schedule};
use self::params::{ArithSource, Masters, ParamStore};
use self::run_setup::{IndexParts, RunSetup};
use self::sampler::{Cursor, Sampler};
use self::sparse::RowGrad;
use vc_core::config::{OptimizerState, ReduceDtype, TrainBackend, TrainConfig};
use vc_model::config::Qwen3TtsConfig;
use vc_model::files::ModelFiles;
use vc_model::ops::Numerics;
use vc_model::talker::Talker;

/// The text embedding table, whose gradient the CPU trainer keeps row-sparse.
pub const TEXT_EMBEDDING: &str = "talker.model.text_embedding.weight";

/// How a trainer computes; chosen once when it is built (docs/training.md §5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// CPU, f32: the kernels with hand-written backward passes, the trained `Var`s are their
    /// own masters and are updated in place, the text embedding's gradient is row-sparse.
    CpuKernels,
    /// Any device: candle's autograd over plain tensor ops, `Var`s stored in `Storage` copied
    /// from separate fp32 masters, dense gradients, AdamW in tensor ops. What CUDA runs (with
    /// bf16 storage); on the CPU the arithmetic is f32 on the stored values.
    Autograd(Storage),
}

/// The dtype the autograd backend stores its weights in: the compute copies of the masters,
/// the frozen tensors, and therefore everything gathered from them (docs/training.md §5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// bf16, as on CUDA.
    Bf16,
    /// f32 (exact against the CPU kernels and the official f32 references).
    F32,
}

impl Backend {
    /// The backend for `device`: the kernels on the CPU, autograd with bf16 storage elsewhere.
    pub fn auto(device: &Device) -> Self {
        if device.is_cpu() {
            Backend::CpuKernels
        } else {
            Backend::Autograd(Storage::Bf16)
        }
    }

    /// The backend `train.backend` asks for on `device`.
    pub fn resolve(choice: TrainBackend, device: &Device) -> Result<Self> {
        Ok(match choice {
            TrainBackend::Auto => Self::auto(device),
            TrainBackend::Kernels if device.is_cpu() => Backend::CpuKernels,
            TrainBackend::Kernels => bail!(
                "train.backend = \"kernels\" runs on the CPU only (this run trains on \
                 {device:?}); use \"auto\" or \"autograd\""
            ),
            TrainBackend::Autograd => Backend::Autograd(Storage::Bf16),
            TrainBackend::AutogradF32 => Backend::Autograd(Storage::F32),
        })
    }

    /// How `voiceclone train` names it (`train.backend`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::CpuKernels => "kernels",
            Backend::Autograd(Storage::Bf16) => "autograd",
            Backend::Autograd(Storage::F32) => "autograd-f32",
        }
    }

    pub fn numerics(self) -> Numerics {
        match self {
            Backend::CpuKernels => Numerics::CpuKernels,
            Backend::Autograd(_) => Numerics::Autograd,
        }
    }

    /// Whether the gradient sums run as in-place CPU kernels.
    pub fn in_place(self) -> bool {
        self == Backend::CpuKernels
    }

    /// Whether the optimizer step runs as the CPU kernels on host copies: always with the CPU
    /// kernels backend, and with `train.offload = "optimizer"` (docs/training.md §6.6).
    pub fn optimizer_on_host(self, config: &TrainConfig) -> bool {
        self.in_place() || config.offload == vc_core::config::Offload::Optimizer
    }

    /// Where a run on `opts.device` keeps its weights and optimizer state.
    pub fn placement(self, opts: &TrainOptions) -> params::Placement {
        params::Placement {
            device: opts.device.clone(),
            // The CPU kernels keep everything on the host already.
            offload: opts.config.offload == vc_core::config::Offload::Optimizer
                && self != Backend::CpuKernels,
        }
    }

    /// How a trained tensor of (full) `shape` keeps its master with optimizer-state mode
    /// `state`: small tensors (norms, biases, whose values are near 1, where a bf16
    /// compensation is too coarse for small updates) keep fp32 masters in every mode
    /// (docs/training.md §6.5).
    pub fn masters(self, state: OptimizerState, shape: &[usize]) -> Masters {
        match self {
            _ if saved_state::compensated(state, shape) => Masters::Compensated,
            Backend::CpuKernels => Masters::Shared,
            Backend::Autograd(_) => Masters::Separate,
        }
    }

    /// The dtype weights are stored in (the trained tensors' compute copies, the frozen ones).
    pub fn storage_dtype(self) -> DType {
        match self {
            Backend::CpuKernels | Backend::Autograd(Storage::F32) => DType::F32,
            Backend::Autograd(Storage::Bf16) => DType::BF16,
        }
    }

    /// The dtype the model computes in on `device`: the storage dtype, except that the CPU
    /// computes bf16-stored weights in f32 (candle has no bf16 matmul there), casting each
    /// weight as it is used.
    pub fn arith_dtype(self, device: &Device) -> DType {
        if device.is_cpu() {
            DType::F32
        } else {
            self.storage_dtype()
        }
    }
}

/// Everything a training run needs, resolved by the command layer.
pub struct TrainOptions {
    pub files: ModelFiles,
    /// `model.base` as configured (recorded in checkpoints).
    pub model_spec: String,
    pub manifest: PathBuf,
    /// Directory relative manifest paths are relative to (the workspace).
    pub base_dir: PathBuf,
    /// The x-vector file (`data/speaker.safetensors`), or with named speakers the directory of
    /// their files (`data/speakers/`, docs/training.md §3.3).
    pub speaker: PathBuf,
    /// `checkpoints/`.
    pub checkpoints: PathBuf,
    pub config: TrainConfig,
    pub device: Device,
    pub backend: Backend,
    /// Test seams ([`hooks::NoHooks`] in production).
    pub hooks: Arc<dyn TrainHooks>,
    /// Each speaker's reference clip (its lower-cased name as the export names it, and the
    /// clip), shown beside the samples in the report (docs/training.md §14.6).
    pub references: Vec<(String, PathBuf)>,
    /// What transcribes the samples for their word error rate (docs/training.md §14.4).
    pub whisper: samples::Listener,
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
    /// The last validation loss over the held-out set (docs/training.md §14).
    pub last_val_loss: Option<f64>,
    /// Stopped by `train.early_stop` (docs/training.md §14.3).
    pub early_stopped: bool,
    pub frames_per_second: Option<f64>,
}

/// The dtype gradients are reduced and accumulated in (`train.reduce_dtype`). The setting lives in
/// `vc-core`, which knows no tensors; the trainer maps it here.
pub fn reduce_dtype(setting: ReduceDtype) -> DType {
    match setting {
        ReduceDtype::Fp32 => DType::F32,
        ReduceDtype::Bf16 => DType::BF16,
    }
}

/// Reads the x-vector `(H,)` written by `voiceclone embed`, as an f32 tensor on `device`.
pub fn load_speaker(path: &Path, hidden: usize, device: &Device) -> Result<Tensor> {
    let x = vc_core::artifacts::speaker::read_for_model(path, hidden)?;
    Ok(Tensor::from_vec(x, hidden, device)?)
}

/// Runs one training step where `device` wants it: on the CPU on a worker of the rayon pool,
/// so that the step's parallel loops start inside the pool (docs/performance.md §2.4); a CUDA
/// step stays on the thread that owns the device's context.
pub(crate) fn run_step<R: Send>(device: &Device, step: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() {
        vc_kernels::pool::on_pool(step)
    } else {
        step()
    }
}

/// A set-up training run: model, trained parameters, optimizer state, data order.
pub struct Trainer {
    pub cfg: Qwen3TtsConfig,
    pub talker: Talker,
    pub params: ParamStore,
    pub adam: AdamState,
    pub adamw: AdamW,
    pub dataset: Dataset,
    /// The held-out set (docs/training.md §14), never trained on.
    heldout: Option<Dataset>,
    pub sampler: Sampler,
    /// The speaker table `(S, H)`: row s is the x-vector of `dataset.speakers[s]`.
    pub speaker: Tensor,
    pub identity: Identity,
    pub step: usize,
    pub layout: LayoutIds,
    /// The learning-rate schedule (public so that tests can pin a constant rate).
    pub schedule: Schedule,
    /// Index of the text embedding among the parameters when its gradient is kept row-sparse
    /// (the CPU kernels; see [`sparse`]).
    sparse_text: Option<usize>,
    backend: Backend,
    opts: TrainOptions,
    /// Checkpoint the run resumed from.
    pub resumed_from: Option<PathBuf>,
    /// Set when the data changed since the checkpoint (the epoch restarted).
    pub data_changed: bool,
    /// What setting up found and repaired that the user should hear of (damaged checkpoints
    /// moved aside).
    pub warnings: Vec<String>,
    last_loss: Option<f64>,
    /// What the validations found so far (docs/training.md §14.3), saved in each checkpoint.
    selection: selection::Selection,
}

impl Trainer {
    /// Loads the model and the data, and the newest compatible checkpoint unless `fresh`.
    pub fn new(opts: TrainOptions, fresh: bool) -> Result<Self> {
        let backend = opts.backend;
        if backend == Backend::CpuKernels && !opts.device.is_cpu() {
            bail!("the CPU training kernels cannot run on {:?}", opts.device);
        }
        let setup = RunSetup::new(&opts)?;
        let cfg = setup.cfg.clone();
        let place = backend.placement(&opts);
        // The trained tensors in f32 (the masters), the frozen ones straight in the storage
        // dtype: a LoRA run never holds its frozen base in f32 (docs/training.md §13).
        let trained: std::collections::BTreeSet<&str> =
            setup.trained.iter().map(String::as_str).collect();
        let weights = opts
            .files
            .load_weights(DType::F32, &place.state_device(), |n| trained.contains(n))
            .context("cannot load the base model")?;
        let device = place.device.clone();
        let mut params = ParamStore::new(
            &weights,
            &setup.trained,
            backend.storage_dtype(),
            |shape| backend.masters(opts.config.optimizer_state, shape),
            place,
            setup.lora.as_ref(),
        )?;
        drop(weights);
        let frozen = opts
            .files
            .load_weights(backend.storage_dtype(), &device, |n| {
                n.starts_with(trainable::TRAINABLE_PREFIX) && !trained.contains(n)
            })
            .context("cannot load the base model")?;
        params.add_frozen(&frozen)?;
        drop(frozen);
        let arith = backend.arith_dtype(&opts.device);
        let talker =
            Talker::from_source(&ArithSource::new(&params, arith), &cfg, backend.numerics())?;
        let mode = opts.config.optimizer_state;
        let mut adam =
            AdamState::zeros(&params.params, |p| saved_state::eight_bit(mode, p.shape()))?;
        let RunSetup {
            dataset,
            heldout,
            notes,
            speaker,
            identity,
            mut sampler,
            ..
        } = setup;
        let (mut step, mut last_loss) = (0, None);
        let mut warnings = checkpoint::recover(&opts.checkpoints)?.warnings();
        warnings.extend(notes);
        let resume = run_setup::find_resume(&opts, &identity, &dataset, fresh)?;
        if let Some(r) = &resume {
            let mut reader = checkpoint::RowReader::open(&r.dir)?;
            let saved = r.index.optimizer.state;
            for (i, p) in params.params.iter_mut().enumerate() {
                let shape = p.shape().to_vec();
                let rows = shape.first().copied().unwrap_or(1);
                let dev = p.state_device();
                let (m, v) =
                    saved_state::restore(&mut reader, saved, mode, p, &shape, 0..rows, &dev)?;
                adam.m[i] = m;
                adam.v[i] = v;
            }
            warnings.extend(
                saved_state::Conversion {
                    from: saved,
                    to: mode,
                }
                .message(),
            );
            adam.step = r.index.optimizer.step;
            step = r.index.step;
            sampler = run_setup::resumed_sampler(&opts, &dataset, r.cursor);
            last_loss = r.index.loss;
        }
        let sparse_text = match backend {
            Backend::CpuKernels => params.params.iter().position(|p| p.name == TEXT_EMBEDDING),
            Backend::Autograd(_) => None,
        };
        let total = RunSetup::total_steps(&opts, &sampler);
        Ok(Self {
            sparse_text,
            backend,
            layout: LayoutIds::from_config(&cfg),
            schedule: RunSetup::schedule(&opts, total),
            cfg,
            talker,
            params,
            adam,
            adamw: AdamW::new(opts.config.weight_decay),
            dataset,
            heldout,
            sampler,
            speaker,
            identity,
            step,
            resumed_from: resume.as_ref().map(|r| r.dir.clone()),
            data_changed: resume.as_ref().is_some_and(|r| r.data_changed),
            warnings,
            selection: resume
                .as_ref()
                .and_then(|r| r.index.selection.clone())
                .unwrap_or_default(),
            opts,
            last_loss,
        })
    }

    /// Optimizer steps of the whole run: `epochs` × steps per epoch, capped by `max_steps`.
    pub fn total_steps(&self) -> usize {
        RunSetup::total_steps(&self.opts, &self.sampler)
    }

    /// What the optimizer state takes, in the run's memory modes.
    pub fn state_bytes(&self) -> optim::StateBytes {
        optim::StateBytes::of(
            &self.params.params,
            &self.adam,
            crate::reduce_dtype(self.opts.config.reduce_dtype),
        )
    }

    /// Rebuilds the model from the stored weights when it computes in another dtype than they
    /// are stored in: the cast copies it holds were taken before the last update.
    fn refresh_model(&mut self) -> Result<()> {
        let arith = self.backend.arith_dtype(&self.opts.device);
        if self.backend.storage_dtype() != arith {
            self.talker = Talker::from_source(
                &ArithSource::new(&self.params, arith),
                &self.cfg,
                self.backend.numerics(),
            )?;
        }
        Ok(())
    }

    /// The backend this trainer computes with.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The loss of one micro-batch of samples (indices into the dataset).
    pub fn batch_loss(&mut self, indices: &[usize]) -> Result<(loss::Loss, usize)> {
        self.refresh_model()?;
        let samples: Vec<&data::Sample> =
            indices.iter().map(|&i| &self.dataset.samples[i]).collect();
        self.samples_loss(&samples)
    }

    /// The loss of `samples` as one micro-batch, on the model as it is.
    fn samples_loss(&self, samples: &[&data::Sample]) -> Result<(loss::Loss, usize)> {
        let batch = Batch::build(samples, &self.layout);
        let tensors = batch.to_tensors(&self.opts.device)?;
        Ok((
            loss::sft_loss(&self.talker, &tensors, &self.speaker)?,
            batch.frames,
        ))
    }

    /// The validation loss over the held-out set with the current weights: the training
    /// objective per micro-batch of [`validation::micro_batches`], averaged; nothing changes.
    pub fn validate(&mut self) -> Result<Option<EvalMetrics>> {
        if self.heldout.is_none() {
            return Ok(None);
        }
        let t0 = Instant::now();
        self.refresh_model()?;
        let heldout = self.heldout.as_ref().expect("checked above");
        let mut sums = validation::LossSums::default();
        for batch in validation::micro_batches(heldout, self.opts.config.batch_size) {
            let samples: Vec<&data::Sample> = batch.iter().map(|&i| &heldout.samples[i]).collect();
            let (l, _) = self.samples_loss(&samples)?;
            sums.add(
                l.total.to_scalar::<f32>()? as f64,
                l.talker.to_scalar::<f32>()? as f64,
                l.sub.to_scalar::<f32>()? as f64,
            );
        }
        Ok(Some(sums.metrics(
            self.step,
            heldout.samples.len(),
            t0.elapsed().as_secs_f64(),
        )))
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
    /// Nothing changes when it fails (a non-finite loss or gradient norm, or any error).
    pub fn step(&mut self, micro: &[Vec<usize>]) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let epoch = self.sampler.cursor().epoch;
        let n = micro.len() as f64;
        let in_place = self.backend.in_place();
        let grad_dtype = crate::reduce_dtype(self.opts.config.reduce_dtype);
        self.opts.hooks.step_start(self.step + 1, 0);
        self.refresh_model()?;
        let mut acc: Vec<Option<Tensor>> = vec![None; self.params.params.len()];
        let (mut sum, mut sum_talker, mut sum_sub, mut frames) = (0.0, 0.0, 0.0, 0);
        let mut text_rows = self.sparse_text.map(|i| {
            let shape = self.params.params[i].shape();
            RowGrad::new(shape[0], shape[1])
        });
        for indices in micro {
            let (l, f, rows) = self.micro_loss(indices)?;
            let value = l.total.to_scalar::<f32>()? as f64;
            let value = self.opts.hooks.loss(self.step + 1, 0, value);
            if !value.is_finite() {
                let lines: Vec<String> = indices
                    .iter()
                    .map(|&i| self.dataset.samples[i].line.to_string())
                    .collect();
                bail!(driver::NonFinite(format!(
                    "the loss became {value} at step {} (epoch {}, manifest lines {} of {}); \
                     this step was not applied and nothing was saved for it",
                    self.step + 1,
                    epoch + 1,
                    lines.join(", "),
                    self.dataset.manifest.display()
                )));
            }
            sum += value;
            sum_talker += l.talker.to_scalar::<f32>()? as f64;
            sum_sub += l.sub.to_scalar::<f32>()? as f64;
            frames += f;
            let grads = (l.total / n)?.backward()?;
            if let (Some(acc), Some((ids, rows))) = (text_rows.as_mut(), rows) {
                if let Some(g) = grads.get(rows.as_tensor()) {
                    // Summed in the reduce dtype: a bf16 sum of bf16 values, held in f32.
                    let g = g.to_dtype(grad_dtype)?.to_dtype(DType::F32)?;
                    acc.add(&ids, &g.flatten_all()?.to_vec1::<f32>()?)?;
                    if grad_dtype == DType::BF16 {
                        acc.round_to_bf16();
                    }
                }
            }
            for (a, p) in acc.iter_mut().zip(&self.params.params) {
                let Some(g) = grads.get(p.var.as_tensor()) else {
                    continue;
                };
                let g = g.to_dtype(grad_dtype)?;
                *a = Some(match a.take() {
                    Some(prev) => optim::accumulate(prev, &g, in_place)?,
                    None => g,
                });
            }
        }
        let sparse = self.sparse_text;
        let dense: Vec<Option<Tensor>> = acc
            .into_iter()
            .zip(&self.params.params)
            .enumerate()
            .map(|(i, (g, p))| match g {
                Some(g) => Ok(Some(g)),
                // The row-sparse text embedding has no dense gradient.
                None if Some(i) == sparse => Ok(None),
                None => Tensor::zeros(p.shape(), DType::F32, &self.opts.device).map(Some),
            })
            .collect::<candle_core::Result<_>>()?;
        let mut sum_sq = 0f64;
        for (i, g) in dense.iter().enumerate() {
            sum_sq += match (g, &text_rows) {
                (Some(g), _) => optim::sum_squares(g, in_place)?,
                (None, Some(rows)) if Some(i) == sparse => rows.sum_squares(),
                (None, _) => 0.0,
            };
        }
        let grad_norm = sum_sq.sqrt();
        if !grad_norm.is_finite() {
            bail!(driver::NonFinite(format!(
                "the gradient norm became {grad_norm} at step {}; this step was not applied and \
                 nothing was saved for it",
                self.step + 1
            )));
        }
        let clip = optim::clip_factor(grad_norm, self.opts.config.clip_norm);
        let lr = self.schedule.lr(self.step + 1);
        let grads: Vec<Grad> = dense
            .into_iter()
            .map(|g| match g {
                Some(g) => Grad::Dense(g),
                None => Grad::Rows(text_rows.as_ref().expect("sparse rows")),
            })
            .collect();
        self.adamw.step(
            &mut self.adam,
            &mut self.params.params,
            &grads,
            lr,
            clip,
            self.backend.optimizer_on_host(&self.opts.config),
        )?;
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
        let index = IndexParts {
            identity: &self.identity,
            dataset: &self.dataset,
            cursor: self.sampler.cursor(),
            step: self.step,
            adamw: &self.adamw,
            adam_step: self.adam.step,
            state: self.opts.config.optimizer_state,
            loss: self.last_loss,
            world_size: 1,
            selection: &self.selection,
        }
        .index(Index::describe_params(&self.params));
        let state = TrainingState {
            params: &self.params,
            adam: &self.adam,
            mode: self.opts.config.optimizer_state,
        };
        let speakers = checkpoint::SpeakerSnapshot::new(&self.identity.speakers, &self.speaker)?;
        checkpoint::save(
            &self.opts.checkpoints,
            &index,
            &state,
            self.opts.config.keep,
            self.opts.hooks.as_ref(),
            |dir| speakers.write(dir),
        )
    }

    /// Trains until the total step count (or a stop signal); saves checkpoints on the way and
    /// at the end ([`driver::run`]).
    pub fn run(&mut self) -> Result<Outcome> {
        driver::run(self)
    }

    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }
}

impl driver::Engine for Trainer {
    fn warnings(&self) -> &[String] {
        &self.warnings
    }
    fn data_changed(&self) -> bool {
        self.data_changed
    }
    fn data(&self, grad_accum: usize) -> (&Dataset, Cursor, usize) {
        (
            &self.dataset,
            self.sampler.cursor(),
            self.sampler.steps_per_epoch(grad_accum),
        )
    }
    fn heldout(&self) -> Option<&Dataset> {
        self.heldout.as_ref()
    }
    fn selection(&self) -> &selection::Selection {
        &self.selection
    }
    fn set_selection(&mut self, s: selection::Selection) {
        self.selection = s;
    }
    fn options(&self) -> &TrainOptions {
        &self.opts
    }
    fn step_count(&self) -> usize {
        self.step
    }
    fn total_steps(&self) -> usize {
        Trainer::total_steps(self)
    }
    fn resumed_from(&self) -> Option<PathBuf> {
        self.resumed_from.clone()
    }
    fn next_step_batches(&mut self, grad_accum: usize) -> Vec<Vec<usize>> {
        self.sampler.next_step(grad_accum)
    }
    fn step(&mut self, micro: &[Vec<usize>]) -> Result<StepMetrics> {
        Trainer::step(self, micro)
    }
    fn save(&mut self) -> Result<Option<PathBuf>> {
        Trainer::save(self).map(Some)
    }
    fn validate(&mut self) -> Result<Option<EvalMetrics>> {
        Trainer::validate(self)
    }
    fn any_rank(&self, flag: bool) -> Result<bool> {
        Ok(flag)
    }
    fn broadcast_from_reporter(&self, values: &[f64]) -> Result<Vec<f64>> {
        Ok(values.to_vec())
    }
    fn is_reporter(&self) -> bool {
        true
    }
    fn world(&self) -> usize {
        1
    }
}
