//! Where a run stands, held once for every way of training (docs/training.md §1.1): its
//! options, the data and its order, the held-out set, the speaker table, the identity its
//! checkpoints carry, the step, the schedule, AdamW's settings and what the validations chose.
//! A trainer adds only how a step computes and how its weights and moments are held and saved;
//! the loop ([`crate::driver`]) reads and moves this state directly.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use candle_core::Tensor;

use crate::batch::LayoutIds;
use crate::checkpoint::{self, Identity, Index, OptimizerInfo, ParamInfo, RngInfo};
use crate::data::Dataset;
use crate::optim::saved_state;
use crate::optim::{AdamW, Schedule};
use crate::run_setup::{self, Resume, RunSetup};
use crate::sampler::Sampler;
use crate::selection::Selection;
use crate::TrainOptions;
use vc_model::config::Qwen3TtsConfig;

/// The state every trainer shares.
pub struct RunState {
    pub opts: TrainOptions,
    pub cfg: Qwen3TtsConfig,
    /// What trains: the manifest less the held-out set.
    pub dataset: Dataset,
    /// The held-out set (docs/training.md §14), never trained on.
    pub heldout: Option<Dataset>,
    pub sampler: Sampler,
    pub layout: LayoutIds,
    /// The speaker table `(S, H)`: row s is the x-vector of `dataset.speakers[s]`.
    pub speaker: Tensor,
    pub identity: Identity,
    /// Optimizer steps taken (restored from a checkpoint on resume).
    pub step: usize,
    /// The learning-rate schedule (public so that tests can pin a constant rate).
    pub schedule: Schedule,
    pub adamw: AdamW,
    /// The checkpoint the run continued from.
    pub resumed_from: Option<PathBuf>,
    /// Whether the data changed since that checkpoint (the epoch restarted).
    pub data_changed: bool,
    /// What setting up found and repaired that the user should hear of (on the reporting
    /// rank; empty on the others).
    pub warnings: Vec<String>,
    pub last_loss: Option<f64>,
    /// What the validations found so far (docs/training.md §14.3), saved in each checkpoint.
    pub selection: Selection,
}

impl RunState {
    /// The state of a run set up as `setup`, continued from the newest compatible checkpoint
    /// unless `fresh`. The reporting rank repairs what an interrupted checkpoint write left
    /// ([`checkpoint::recover`]) and `after_repair` holds the other ranks until it has: ranks
    /// repairing the shared `checkpoints/` together would race on the same renames. Returns the
    /// checkpoint continued from, whose moments the trainer restores into its own form.
    pub fn start(
        opts: TrainOptions,
        setup: RunSetup,
        reporter: bool,
        after_repair: impl FnOnce() -> Result<()>,
        fresh: bool,
    ) -> Result<(Self, Option<Resume>)> {
        let RunSetup {
            cfg,
            dataset,
            heldout,
            notes,
            speaker,
            identity,
            sampler,
            ..
        } = setup;
        let mut warnings = Vec::new();
        if reporter {
            warnings = checkpoint::recover(&opts.checkpoints)?.warnings();
            warnings.extend(notes);
        }
        after_repair()?;
        let resume = run_setup::find_resume(&opts, &identity, &dataset, fresh)?;
        let mut run = Self {
            layout: LayoutIds::from_config(&cfg),
            schedule: Schedule {
                peak: opts.config.lr,
                warmup: opts.config.warmup_steps,
                total: 0,
            },
            adamw: AdamW::new(opts.config.weight_decay),
            cfg,
            dataset,
            heldout,
            sampler,
            speaker,
            identity,
            step: 0,
            resumed_from: None,
            data_changed: false,
            warnings,
            last_loss: None,
            selection: Selection::default(),
            opts,
        };
        if let Some(r) = &resume {
            if reporter {
                run.warnings.extend(
                    saved_state::Conversion {
                        from: r.index.optimizer.state,
                        to: run.opts.config.optimizer_state,
                    }
                    .message(),
                );
            }
            run.step = r.index.step;
            run.sampler = run_setup::resumed_sampler(&run.opts, &run.dataset, r.cursor);
            run.last_loss = r.index.loss;
            run.selection = r.index.selection.clone().unwrap_or_default();
            run.resumed_from = Some(r.dir.clone());
            run.data_changed = r.data_changed;
        }
        run.schedule.total = run.total_steps();
        Ok((run, resume))
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

    /// The micro-batches (sample indices) of the next optimizer step.
    pub fn next_step_batches(&mut self) -> Vec<Vec<usize>> {
        self.sampler.next_step(self.opts.config.grad_accum)
    }

    /// The index of a checkpoint of this state: the parameters' layout `params`, written by
    /// ranks of a group of `world_size`, with AdamW at step `adam_step`.
    pub fn index(
        &self,
        params: BTreeMap<String, ParamInfo>,
        adam_step: u64,
        world_size: usize,
    ) -> Index {
        let cursor = self.sampler.cursor();
        Index {
            format: checkpoint::FORMAT.into(),
            version: checkpoint::VERSION,
            world_size,
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
                step: adam_step,
                state: self.opts.config.optimizer_state,
            },
            loss: self.last_loss,
            selection: (self.selection != Selection::default()).then(|| self.selection.clone()),
            params,
        }
    }
}
