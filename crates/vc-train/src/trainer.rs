//! The single-device trainer (docs/training.md §1): [`Trainer`] loads the model, the data and the
//! newest compatible checkpoint, takes optimizer steps (the corrected SFT objective, gradient
//! accumulation and clipping, AdamW), validates on the held-out set and saves checkpoints; the one
//! training loop ([`driver::run`]) drives it through [`driver::Engine`], as it drives one rank of a
//! sharded run ([`crate::sharded`]).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};

use crate::batch::{Batch, LayoutIds};
use crate::checkpoint::{self, Identity, Index, TrainingState};
use crate::data::{self, Dataset};
use crate::metrics::{EvalMetrics, StepMetrics};
use crate::optim::{self, AdamState, AdamW, Grad, Schedule};
use crate::params::{ArithSource, ParamStore};
use crate::run_setup::{self, IndexParts, RunSetup};
use crate::sampler::{Cursor, Sampler};
use crate::sparse::{self, RowGrad};
use crate::{
    driver, loss, saved_state, selection, trainable, validation, Backend, Outcome, TrainOptions,
    TEXT_EMBEDDING,
};
use vc_model::config::Qwen3TtsConfig;
use vc_model::talker::Talker;

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
        // dtype and then as the model computes with them: a LoRA run holds its frozen base in
        // f32 only where it computes in f32 (docs/training.md §13).
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
        let arith = backend.arith_dtype(&opts.device);
        params.add_frozen(&frozen, arith)?;
        drop(frozen);
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
            sent_within_node: None,
            sent_across_nodes: None,
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
