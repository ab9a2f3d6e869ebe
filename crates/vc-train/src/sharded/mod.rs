//! The sharded trainer (docs/distributed.md §4): one rank of an FSDP run.
//!
//! Every trained tensor is split along dimension 0 over the ranks; a rank owns the fp32 master,
//! both AdamW moments and the gradient of its rows only. Two modes (`train.shard`):
//!
//! - `full` (ZeRO-3, FSDP FULL_SHARD): a unit's weights exist in full only while that unit runs.
//!   Forward, unit by unit: all-gather → compute every local micro-batch → keep the unit's inputs →
//!   free. Backward, in reverse: all-gather again → recompute the unit with `Var`s from the saved
//!   inputs → back-propagate the upstream gradient → reduce-scatter the weight gradients, summed
//!   over the step's micro-batches, into the owned rows → free. One all-gather per unit and pass
//!   and one reduce-scatter per unit per optimizer step, whatever `grad_accum` is.
//! - `grad-op` (ZeRO-2, SHARD_GRAD_OP): the weights are replicated in the storage dtype, each
//!   micro-batch runs forward and backward in one graph (no recompute), the summed gradients are
//!   reduce-scattered once per step, and after the update every unit is all-gathered back into
//!   the replicas.
//!
//! The text embedding (151 936 rows) stays row-sparse in both: only the rows of the step's text
//! tokens are gathered and their gradients reduced to their owners. The global batch of a step
//! and its order do not depend on the number of ranks: rank r takes micro-batches r, r+N, … of
//! the step, and the result equals single-device training up to the order of floating-point
//! sums. Losses, non-finite values and stop requests are agreed on by every rank before any acts.
//!
//! Hybrid sharding (docs/distributed.md §4.7): the ranks form shard groups of
//! `train.shard_group` consecutive ranks; the state is sharded within a group as above and
//! replicated across groups, each unit's gradient shard all-reduced across the groups after its
//! reduce-scatter. With one group (the default) that is the flat sharding above.
//!
//! Overlap (docs/distributed.md §4.6): with `train.prefetch` > 0 the passes gather the next
//! units while one computes and leave each unit's reduce-scatter (and all-reduce) running while
//! the next computes; the values and their summation order are those of the plain schedule.
//!
//! Files, one concern each: [`setup`] (loading this rank's shards, resuming), [`units`]
//! (gathering a unit's weights and reducing its gradients), [`overlap`] (what runs ahead of the
//! computation: the units gathered next, the gradients being reduced), [`full`] and [`grad_op`]
//! (the two passes), [`update`] (clipping and the AdamW step on the owned rows), [`save`] (this
//! rank's part of a checkpoint). The loop that drives them is the one every trainer shares
//! ([`crate::driver`]).
//!
//! No device work on empty tensors (docs/distributed.md §4.5): a rank that owns no rows of a
//! tensor holds it as an empty tensor on the CPU and skips it in every device operation, and
//! gathers and scatters with nothing to move for a rank do not launch anything for it.

mod full;
mod grad_op;
mod overlap;
mod save;
mod setup;
mod units;
mod update;

#[cfg(test)]
mod overlap_tests;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor, Var};

use crate::batch::{Batch, BatchTensors};
use crate::data::Dataset;
use crate::driver::{self, NonFinite};
use crate::metrics::{EvalMetrics, StepMetrics};
use crate::optim::{self, AdamState};
use crate::run_state::RunState;
use crate::step::params::Param;
use crate::validation;
use crate::{Backend, TEXT_EMBEDDING};
use vc_core::config::{Recompute, Shard as ShardMode};
use vc_dist::shard::RowSplit;
use vc_dist::{LinkBytes, Mesh, ReduceOp};
use vc_model::layers::{AdapterSpec, StepContext};
use vc_model::ops::Rope;

pub use self::full::PREDICTOR_CHUNK_FRAMES;
use self::grad_op::Replica;
use self::units::UnitShards;

pub struct ShardedTrainer {
    /// The run's, the shard group's and the replicas' communicators.
    mesh: Mesh,
    /// Units gathered ahead of the one computing (`train.prefetch`; 0 where the group is one
    /// rank, which gathers nothing).
    prefetch: usize,
    /// Whether reductions run behind the computation (`train.prefetch` > 0 and something to
    /// communicate).
    overlap: bool,
    pub mode: ShardMode,
    /// The dtype weights are stored and gathered in ([`Backend::storage_dtype`]).
    storage: DType,
    /// The dtype the model computes in ([`Backend::arith_dtype`]).
    arith: DType,
    /// Where the run stands, as every trainer holds it.
    pub run: RunState,
    pub adam: AdamState,
    /// This rank's rows of every trained tensor, in parameter order (empty, on the CPU, where
    /// the rank owns none).
    pub params: Vec<Param>,
    shapes: Vec<Vec<usize>>,
    splits: Vec<RowSplit>,
    units: Vec<UnitShards>,
    /// The trained text table, when it is trained (row-sparse).
    text: Option<usize>,
    frozen: BTreeMap<String, Tensor>,
    /// The adapters of a LoRA run, which the model is built with (docs/training.md §13).
    adapters: Option<AdapterSpec>,
    rope: Rope,
    replica: Option<Replica>,
    /// Shared by the ranks (agreed at the rendezvous): names temporary checkpoint directories.
    tag: String,
    /// Frames per chunk of the code predictor's recomputation: [`PREDICTOR_CHUNK_FRAMES`];
    /// tests make it small to cut the fixture's short utterances into several chunks.
    predictor_chunk: usize,
}

/// Bytes a rank sends per step in its units' collectives ([`ShardedTrainer::unit_traffic`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnitTraffic {
    pub group: u64,
    pub replicas: u64,
}

/// One local micro-batch of a step.
struct Micro {
    /// Its position among the step's micro-batches.
    index: usize,
    batch: BatchTensors,
    frames: usize,
    /// Text ids into the step's gathered rows (or into the frozen table).
    text_ids: Tensor,
    /// RoPE tables and mask of the talker's layers.
    ctx: StepContext,
}

/// A rank's loss values of one micro-batch.
struct RankLosses {
    index: usize,
    total: f64,
    talker: f64,
    sub: f64,
    frames: usize,
}

/// The step's sums over every rank's micro-batches.
#[derive(Debug, Clone, Copy, Default)]
struct StepSums {
    loss: f64,
    talker: f64,
    sub: f64,
    frames: f64,
}

/// What a step's forward and backward passes leave for the update.
struct Pass {
    sums: StepSums,
    /// This rank's rows of every parameter's gradient (the text table's comes separately).
    grads: Vec<Option<Tensor>>,
    /// The step's text rows' gradient from this rank's micro-batches, `(ids, width)`.
    text_grad: Option<Tensor>,
}

impl ShardedTrainer {
    pub fn rank(&self) -> usize {
        self.mesh.world.rank()
    }

    pub fn world(&self) -> usize {
        self.mesh.world.world()
    }

    /// The ranks of this rank's shard group (docs/distributed.md §4.7); the run's ranks with
    /// flat sharding.
    pub fn group_size(&self) -> usize {
        self.mesh.shard.world()
    }

    /// Which shard of each tensor this rank holds: its place in its group.
    fn shard_index(&self) -> usize {
        self.mesh.shard.rank()
    }

    /// Whether this rank's group is the first, whose ranks write the checkpoints' rank files
    /// and count the gradient norm (the other groups hold the same shards).
    fn first_group(&self) -> bool {
        self.rank() < self.group_size()
    }

    /// Tensor bytes this rank has sent so far, by link (docs/distributed.md §8.1).
    pub fn sent(&self) -> LinkBytes {
        self.mesh.sent()
    }

    /// The backend this rank computes with (the run's `TrainOptions::backend`).
    pub fn backend(&self) -> Backend {
        self.run.opts.backend
    }

    /// Bytes of this rank's masters, both moments and gradient shards: what sharding divides
    /// by the number of ranks (docs/distributed.md §7), in the run's memory modes.
    pub fn state_bytes(&self) -> crate::optim::StateBytes {
        crate::optim::StateBytes::of(
            &self.params,
            &self.adam,
            crate::reduce_dtype(self.run.opts.config.reduce_dtype),
        )
    }

    /// What a step sends per rank in its units' collectives by the ring algorithms
    /// (docs/distributed.md §8): to the others of its group (gathers and reduce-scatters) and to
    /// its replicas (the all-reduces of hybrid sharding). The text table's rows come on top in
    /// `full` mode (they depend on the step's text); grad-op gathers the whole table.
    pub fn unit_traffic(&self) -> UnitTraffic {
        let (s, g) = (
            self.group_size() as u64,
            (self.world() / self.group_size()) as u64,
        );
        let storage = self.storage.size_in_bytes() as u64;
        let reduce = crate::reduce_dtype(self.run.opts.config.reduce_dtype).size_in_bytes() as u64;
        let gathers = match self.mode {
            ShardMode::Full => 2,
            ShardMode::GradOp => 1,
        };
        let mut t = UnitTraffic::default();
        for u in &self.units {
            let n = u.layout.shard_len as u64;
            t.group += (s - 1) * n * (gathers * storage + reduce);
            t.replicas += 2 * (g - 1) * n.div_ceil(g) * reduce;
        }
        if let (ShardMode::GradOp, Some(text)) = (self.mode, self.text) {
            t.group += (s - 1) * self.text_layout(text).shard_len as u64 * storage;
        }
        t
    }

    /// Trained parameters of the whole run (every rank's rows).
    pub fn full_parameters(&self) -> usize {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    /// The largest unit once gathered, in bytes of the storage dtype.
    pub fn largest_unit_bytes(&self) -> usize {
        let size = self.storage.size_in_bytes();
        self.units
            .iter()
            .map(|u| {
                u.members
                    .iter()
                    .map(|&i| self.shapes[i].iter().product::<usize>() * size)
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
    }

    /// The distinct text ids of micro-batches `micro` of `data`, sorted (the same on every
    /// rank).
    fn step_text_ids(&self, data: &Dataset, micro: &[Vec<usize>]) -> Vec<u32> {
        let mut ids: Vec<u32> = micro
            .iter()
            .flatten()
            .flat_map(|&s| data.samples[s].text_ids.iter().copied())
            .chain(self.run.layout.text_specials())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    fn build_micro(
        &self,
        index: usize,
        data: &Dataset,
        samples: &[usize],
        text_ids: &[u32],
    ) -> Result<Micro> {
        let s: Vec<&crate::data::Sample> = samples.iter().map(|&i| &data.samples[i]).collect();
        let batch = Batch::build(&s, &self.run.layout);
        let dev = &self.run.opts.device;
        let ids = if self.text.is_some() {
            let local: Vec<u32> = batch
                .text_ids
                .iter()
                .map(|id| text_ids.partition_point(|&u| u < *id) as u32)
                .collect();
            Tensor::from_vec(local, (batch.rows, batch.len), dev)?
        } else {
            Tensor::from_slice(&batch.text_ids, (batch.rows, batch.len), dev)?
        };
        let ctx = StepContext::causal(
            &self.rope,
            batch.rows,
            batch.len - 1,
            self.arith,
            self.backend().numerics(),
            dev,
        )?;
        Ok(Micro {
            index,
            frames: batch.frames,
            batch: batch.to_tensors(dev)?,
            text_ids: ids,
            ctx,
        })
    }

    /// The text table the embedding unit reads: the step's gathered rows, or the frozen table.
    fn text_table(&self, rows: Option<&Tensor>) -> Result<Tensor> {
        match rows {
            Some(r) => Ok(r.clone()),
            None => self
                .frozen
                .get(TEXT_EMBEDDING)
                .cloned()
                .context("the text embedding is neither trained nor frozen"),
        }
    }

    /// One optimizer step over the step's micro-batches (this rank takes every `world`-th).
    /// Nothing changes when it fails.
    pub fn step(&mut self, micro: &[Vec<usize>]) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let sent_before = self.sent();
        let (rank, world) = (self.rank(), self.world());
        self.run.opts.hooks.step_start(self.run.step + 1, rank);
        let epoch = self.run.sampler.cursor().epoch;
        let text_ids = self.step_text_ids(&self.run.dataset, micro);
        let mine: Vec<Micro> = (0..micro.len())
            .filter(|i| i % world == rank)
            .map(|i| self.build_micro(i, &self.run.dataset, &micro[i], &text_ids))
            .collect::<Result<_>>()?;
        let rows = match self.text {
            Some(t) => Some(self.gather_text_rows(t, &text_ids)?),
            None => None,
        };
        // `full` always recomputes; `grad-op` does with `train.recompute = "layers"`, from its
        // replicas (docs/training.md §6.7).
        let pass = match (self.mode, self.run.opts.config.recompute) {
            (ShardMode::GradOp, Recompute::None) => {
                self.grad_op_pass(&mine, rows.as_ref(), micro, epoch)?
            }
            _ => self.full_pass(&mine, rows.as_ref(), micro, epoch)?,
        };
        let mut m = self.apply(pass, &text_ids, epoch, micro.len(), t0)?;
        let sent = self.sent() - sent_before;
        let most = self.mesh.world.all_reduce_host(
            &[sent.within_node as f64, sent.across_nodes as f64],
            ReduceOp::Max,
        )?;
        if world > 1 {
            m.sent_within_node = Some(most[0] as u64);
            m.sent_across_nodes = Some(most[1] as u64);
        }
        Ok(m)
    }

    /// The validation loss over the held-out set (docs/training.md §14): the micro-batches of
    /// [`validation::micro_batches`] shared out as a step's are (rank r takes r, r+N, …), at
    /// most `grad_accum` of them per rank and pass, each pass the forward half of the `full`
    /// pass; the losses summed over every rank.
    pub fn validate(&self) -> Result<Option<EvalMetrics>> {
        match &self.run.heldout {
            Some(heldout) => self.validate_on(heldout).map(Some),
            None => Ok(None),
        }
    }

    fn validate_on(&self, heldout: &Dataset) -> Result<EvalMetrics> {
        let t0 = Instant::now();
        let (rank, world) = (self.rank(), self.world());
        let batches = validation::micro_batches(heldout, self.run.opts.config.batch_size);
        let mut sums = [0.0f64; 4];
        for pass in batches.chunks(self.run.opts.config.grad_accum * world) {
            let text_ids = self.step_text_ids(heldout, pass);
            let mine: Vec<Micro> = (0..pass.len())
                .filter(|i| i % world == rank)
                .map(|i| self.build_micro(i, heldout, &pass[i], &text_ids))
                .collect::<Result<_>>()?;
            let rows = match self.text {
                Some(t) => Some(self.gather_text_rows(t, &text_ids)?),
                None => None,
            };
            for l in self.forward(&mine, rows.as_ref())?.local {
                sums[0] += l.total;
                sums[1] += l.talker;
                sums[2] += l.sub;
                sums[3] += 1.0;
            }
        }
        let all = self.mesh.world.all_reduce_host(&sums, ReduceOp::Sum)?;
        let sums = validation::LossSums {
            total: all[0],
            talker: all[1],
            sub: all[2],
            batches: all[3] as usize,
        };
        Ok(sums.metrics(
            self.run.step,
            heldout.samples.len(),
            t0.elapsed().as_secs_f64(),
        ))
    }

    /// Agrees on the step's losses (sums over every rank's micro-batches); when any micro-batch's
    /// loss is not finite, every rank fails with the same message naming its manifest lines.
    fn agree_losses(
        &self,
        local: &[RankLosses],
        micro: &[Vec<usize>],
        epoch: usize,
    ) -> Result<StepSums> {
        let step = self.run.step + 1;
        let mut sums = [0.0f64; 4];
        let mut bad = f64::NEG_INFINITY;
        for l in local {
            let total = self.run.opts.hooks.loss(step, self.rank(), l.total);
            if !total.is_finite() {
                bad = bad.max(-(l.index as f64));
            } else {
                sums[0] += total;
            }
            sums[1] += l.talker;
            sums[2] += l.sub;
            sums[3] += l.frames as f64;
        }
        let all = self.mesh.world.all_reduce_host(&sums, ReduceOp::Sum)?;
        let first_bad = self.mesh.world.all_reduce_host(&[bad], ReduceOp::Max)?[0];
        if first_bad.is_finite() {
            let index = (-first_bad) as usize;
            let lines: Vec<String> = micro[index]
                .iter()
                .map(|&i| self.run.dataset.samples[i].line.to_string())
                .collect();
            anyhow::bail!(NonFinite(format!(
                "the loss became NaN at step {step} (epoch {}, manifest lines {} of {}); this \
                 step was not applied and nothing was saved for it",
                epoch + 1,
                lines.join(", "),
                self.run.dataset.manifest.display()
            )));
        }
        Ok(StepSums {
            loss: all[0],
            talker: all[1],
            sub: all[2],
            frames: all[3],
        })
    }
}

impl driver::Engine for ShardedTrainer {
    fn run(&self) -> &RunState {
        &self.run
    }
    fn run_mut(&mut self) -> &mut RunState {
        &mut self.run
    }
    fn step(&mut self, micro: &[Vec<usize>]) -> Result<StepMetrics> {
        ShardedTrainer::step(self, micro)
    }
    fn save(&mut self) -> Result<Option<PathBuf>> {
        ShardedTrainer::save(self)
    }
    fn validate(&mut self) -> Result<Option<EvalMetrics>> {
        ShardedTrainer::validate(self)
    }
    fn any_rank(&self, flag: bool) -> Result<bool> {
        let v = if flag { 1.0 } else { 0.0 };
        Ok(self.mesh.world.all_reduce_host(&[v], ReduceOp::Max)?[0] > 0.0)
    }
    fn broadcast_from_reporter(&self, values: &[f64]) -> Result<Vec<f64>> {
        // The others add zeros: the sum is rank 0's values, bit for bit.
        let mine: Vec<f64> = if self.rank() == 0 {
            values.to_vec()
        } else {
            vec![0.0; values.len()]
        };
        self.mesh.world.all_reduce_host(&mine, ReduceOp::Sum)
    }
    fn is_reporter(&self) -> bool {
        self.rank() == 0
    }
    fn world(&self) -> usize {
        ShardedTrainer::world(self)
    }
}

fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64)
}

/// `acc += g` in `dtype` (`train.reduce_dtype`; in place with the CPU kernels in f32).
fn add_into(acc: &mut Option<Tensor>, g: &Tensor, dtype: DType, in_place: bool) -> Result<()> {
    let g = g.to_dtype(dtype)?;
    *acc = Some(match acc.take() {
        Some(prev) => optim::accumulate(prev, &g, in_place)?,
        None => g,
    });
    Ok(())
}

/// Adds each gathered `Var`'s gradient in `grads` to its accumulator.
fn accumulate_vars(
    grads: &candle_core::backprop::GradStore,
    vars: &[Var],
    acc: &mut [Option<Tensor>],
    dtype: DType,
    in_place: bool,
) -> Result<()> {
    for (v, a) in vars.iter().zip(acc.iter_mut()) {
        if let Some(g) = grads.get(v.as_tensor()) {
            add_into(a, g, dtype, in_place)?;
        }
    }
    Ok(())
}
