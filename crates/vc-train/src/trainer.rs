//! The single-device trainer (docs/training.md §1): [`Trainer`] loads the model, the data and the
//! newest compatible checkpoint, takes optimizer steps (the corrected SFT objective, gradient
//! accumulation and clipping, AdamW), validates on the held-out set and saves checkpoints; the one
//! training loop ([`driver::run`]) drives it through [`driver::Engine`], as it drives one rank of a
//! sharded run ([`crate::sharded`]).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};

use crate::batch::Batch;
use crate::checkpoint::{self, Index, TrainingState};
use crate::data;
use crate::metrics::{EvalMetrics, StepMetrics};
use crate::optim::saved_state;
use crate::optim::{self, AdamState, Grad};
use crate::run_setup::RunSetup;
use crate::run_state::RunState;
use crate::step::params::{ArithSource, ParamStore};
use crate::step::text_grad::{self, RowGrad};
use crate::step::{loss, trainable};
use crate::{driver, validation, Backend, TrainOptions, TEXT_EMBEDDING};
use vc_model::talker::Talker;

/// A set-up training run: model, trained parameters, optimizer state, data order.
pub struct Trainer {
    /// Where the run stands, as every trainer holds it.
    pub run: RunState,
    pub talker: Talker,
    pub params: ParamStore,
    pub adam: AdamState,
    /// Index of the text embedding among the parameters when its gradient is kept row-sparse
    /// (the CPU kernels; see [`text_grad`]).
    sparse_text: Option<usize>,
}

impl Trainer {
    /// Loads the model and the data, and the newest compatible checkpoint unless `fresh`.
    pub fn new(opts: TrainOptions, fresh: bool) -> Result<Self> {
        let backend = opts.backend;
        let setup = RunSetup::new(&opts)?;
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
        drop(trained);
        let arith = backend.arith_dtype(&opts.device);
        params.add_frozen(&frozen, arith)?;
        drop(frozen);
        let talker = Talker::from_source(
            &ArithSource::new(&params, arith),
            &setup.cfg,
            backend.numerics(),
        )?;
        let mode = opts.config.optimizer_state;
        let mut adam =
            AdamState::zeros(&params.params, |p| saved_state::eight_bit(mode, p.shape()))?;
        let (run, resume) = RunState::start(opts, setup, true, || Ok(()), fresh)?;
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
            adam.step = r.index.optimizer.step;
        }
        let sparse_text = match backend {
            Backend::Kernels => params.params.iter().position(|p| p.name == TEXT_EMBEDDING),
            Backend::Autograd(_) => None,
        };
        Ok(Self {
            run,
            talker,
            params,
            adam,
            sparse_text,
        })
    }

    /// What the optimizer state takes, in the run's memory modes.
    pub fn state_bytes(&self) -> optim::StateBytes {
        optim::StateBytes::of(
            &self.params.params,
            &self.adam,
            crate::reduce_dtype(self.run.opts.config.reduce_dtype),
        )
    }

    /// Rebuilds the model from the stored weights when it computes in another dtype than they
    /// are stored in: the cast copies it holds were taken before the last update.
    fn refresh_model(&mut self) -> Result<()> {
        let arith = self.backend().arith_dtype(&self.run.opts.device);
        if self.backend().storage_dtype() != arith {
            self.talker = Talker::from_source(
                &ArithSource::new(&self.params, arith),
                &self.run.cfg,
                self.backend().numerics(),
            )?;
        }
        Ok(())
    }

    /// The backend this trainer computes with (the run's `TrainOptions::backend`).
    pub fn backend(&self) -> Backend {
        self.run.opts.backend
    }

    /// The loss of one micro-batch of samples (indices into the dataset).
    pub fn batch_loss(&mut self, indices: &[usize]) -> Result<(loss::Loss, usize)> {
        self.refresh_model()?;
        let samples: Vec<&data::Sample> = indices
            .iter()
            .map(|&i| &self.run.dataset.samples[i])
            .collect();
        self.samples_loss(&samples)
    }

    /// The loss of `samples` as one micro-batch, on the model as it is.
    fn samples_loss(&self, samples: &[&data::Sample]) -> Result<(loss::Loss, usize)> {
        let batch = Batch::build(samples, &self.run.layout);
        let tensors = batch.to_tensors(&self.run.opts.device)?;
        Ok((
            loss::sft_loss(&self.talker, &tensors, &self.run.speaker)?,
            batch.frames,
        ))
    }

    /// The validation loss over the held-out set with the current weights: the training
    /// objective per micro-batch of [`validation::micro_batches`], averaged; nothing changes.
    pub fn validate(&mut self) -> Result<Option<EvalMetrics>> {
        if self.run.heldout.is_none() {
            return Ok(None);
        }
        let t0 = Instant::now();
        self.refresh_model()?;
        let heldout = self.run.heldout.as_ref().expect("checked above");
        let mut sums = validation::LossSums::default();
        for batch in validation::micro_batches(heldout, self.run.opts.config.batch_size) {
            let samples: Vec<&data::Sample> = batch.iter().map(|&i| &heldout.samples[i]).collect();
            let (l, _) = self.samples_loss(&samples)?;
            sums.add(
                l.total.to_scalar::<f32>()? as f64,
                l.talker.to_scalar::<f32>()? as f64,
                l.sub.to_scalar::<f32>()? as f64,
            );
        }
        Ok(Some(sums.metrics(
            self.run.step,
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
        let samples: Vec<&data::Sample> = indices
            .iter()
            .map(|&i| &self.run.dataset.samples[i])
            .collect();
        let batch = Batch::build(&samples, &self.run.layout);
        let tensors = batch.to_tensors(&self.run.opts.device)?;
        let Some(i) = self.sparse_text else {
            let l = loss::sft_loss(&self.talker, &tensors, &self.run.speaker)?;
            return Ok((l, batch.frames, None));
        };
        let (uniq, local) = text_grad::distinct(&batch.text_ids);
        let dev = &self.run.opts.device;
        let table = self.params.params[i].var.as_tensor();
        let rows = Var::from_tensor(&table.index_select(&Tensor::new(uniq.as_slice(), dev)?, 0)?)?;
        let ids = Tensor::from_vec(local, (batch.rows, batch.len), dev)?;
        let text = crate::step::units::forward::TextRows {
            table: rows.as_tensor(),
            ids: &ids,
        };
        let l = loss::sft_loss_with(&self.talker, &tensors, &self.run.speaker, Some(text))?;
        Ok((l, batch.frames, Some((uniq, rows))))
    }

    /// One optimizer step over `micro` micro-batches: averaged gradients, clipping, AdamW.
    /// Nothing changes when it fails (a non-finite loss or gradient norm, or any error).
    pub fn step(&mut self, micro: &[Vec<usize>]) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let epoch = self.run.sampler.cursor().epoch;
        let n = micro.len() as f64;
        let in_place = self.backend().in_place();
        let grad_dtype = crate::reduce_dtype(self.run.opts.config.reduce_dtype);
        self.run.opts.hooks.step_start(self.run.step + 1, 0);
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
            let value = self.run.opts.hooks.loss(self.run.step + 1, 0, value);
            if !value.is_finite() {
                let lines: Vec<String> = indices
                    .iter()
                    .map(|&i| self.run.dataset.samples[i].line.to_string())
                    .collect();
                bail!(driver::NonFinite(format!(
                    "the loss became {value} at step {} (epoch {}, manifest lines {} of {}); \
                     this step was not applied and nothing was saved for it",
                    self.run.step + 1,
                    epoch + 1,
                    lines.join(", "),
                    self.run.dataset.manifest.display()
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
                None => Tensor::zeros(p.shape(), DType::F32, &self.run.opts.device).map(Some),
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
                self.run.step + 1
            )));
        }
        let clip = optim::clip_factor(grad_norm, self.run.opts.config.clip_norm);
        let lr = self.run.schedule.lr(self.run.step + 1);
        let grads: Vec<Grad> = dense
            .into_iter()
            .map(|g| match g {
                Some(g) => Grad::Dense(g),
                None => Grad::Rows(text_rows.as_ref().expect("sparse rows")),
            })
            .collect();
        let on_host = self.backend().optimizer_on_host(&self.run.opts.config);
        self.run.adamw.step(
            &mut self.adam,
            &mut self.params.params,
            &grads,
            lr,
            clip,
            on_host,
        )?;
        self.run.step += 1;
        let loss = sum / n;
        self.run.last_loss = Some(loss);
        Ok(StepMetrics {
            step: self.run.step,
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
        let index = self
            .run
            .index(Index::describe_params(&self.params), self.adam.step, 1);
        let state = TrainingState {
            params: &self.params,
            adam: &self.adam,
            mode: self.run.opts.config.optimizer_state,
        };
        let speakers =
            checkpoint::SpeakerSnapshot::new(&self.run.identity.speakers, &self.run.speaker)?;
        checkpoint::save(
            &self.run.opts.checkpoints,
            &index,
            &state,
            self.run.opts.config.keep,
            self.run.opts.hooks.as_ref(),
            |dir| speakers.write(dir),
        )
    }
}

impl driver::Engine for Trainer {
    fn run(&self) -> &RunState {
        &self.run
    }
    fn run_mut(&mut self) -> &mut RunState {
        &mut self.run
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
