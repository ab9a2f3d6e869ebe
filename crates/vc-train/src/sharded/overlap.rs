//! Communication that runs beside the computation (docs/distributed.md §4.6):
//!
//! - [`Prefetch`]: a pass's units, each gathered `train.prefetch` units before it computes — the
//!   forward gathers unit k+1 while unit k computes, the backward unit k−1 while unit k
//!   back-propagates;
//! - [`Reducer`]: each unit's gradient reduce-scattered within the group as soon as its backward
//!   is done, and under hybrid sharding all-reduced across the groups as soon as that is done
//!   (chained where the collectives run); waited for once the reductions after it hold more
//!   than `1 + prefetch` times the largest unit: they run while the next units compute;
//! - [`Refresh`]: grad-op's replicas gathered unit by unit as the update finishes each unit.
//!
//! With `train.prefetch = 0` each of them waits for every collective where it is issued: the
//! plain schedule. Both schedules issue the same collectives in the same order on every rank
//! and compute the same values in the same order, so their results are the same bits.

use std::collections::VecDeque;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};

use super::grad_op::Replica;
use super::units::{PendingUnit, UnitShards, UnitSource};
use super::ShardedTrainer;
use crate::step::params::Param;
use vc_dist::unit_packing::{FlatLayout, PendingGather, PendingScatter};
use vc_dist::Collective;

/// The units of one pass, in the order it computes them, each started `prefetch` units ahead.
pub(super) struct Prefetch<'t> {
    trainer: &'t ShardedTrainer,
    order: Vec<usize>,
    /// The position in `order` of the next unit to start.
    next: usize,
    started: VecDeque<PendingUnit<'t>>,
    /// Whether the pass takes gradients (the units' tensors as `Var`s).
    vars: bool,
}

impl<'t> Prefetch<'t> {
    pub(super) fn new(trainer: &'t ShardedTrainer, order: Vec<usize>, vars: bool) -> Self {
        Self {
            trainer,
            order,
            next: 0,
            started: VecDeque::new(),
            vars,
        }
    }

    fn start_next(&mut self) -> Result<()> {
        let u = self.order[self.next];
        self.started.push_back(self.trainer.start_unit(u)?);
        self.next += 1;
        Ok(())
    }

    /// Starts the first units before the pass needs them (e.g. while the step's losses are
    /// agreed on); nothing with prefetching off.
    pub(super) fn prime(&mut self) -> Result<()> {
        while self.started.len() < self.trainer.prefetch && self.next < self.order.len() {
            self.start_next()?;
        }
        Ok(())
    }

    /// The next unit's weights, once gathered; the units after it are started first, up to
    /// `prefetch` of them.
    pub(super) fn next_unit(&mut self) -> Result<(UnitSource<'t>, Vec<Var>)> {
        if self.started.is_empty() {
            anyhow::ensure!(self.next < self.order.len(), "the pass has no unit left");
            self.start_next()?;
        }
        let this = self.started.pop_front().context("a started unit")?;
        while self.started.len() < self.trainer.prefetch && self.next < self.order.len() {
            self.start_next()?;
        }
        self.trainer.finish_unit(this, self.vars)
    }
}

/// The units' gradients on their way to their owners.
pub(super) struct Reducer<'t> {
    trainer: &'t ShardedTrainer,
    /// The reductions in flight, oldest first: unit, collective, the unit's values.
    in_flight: VecDeque<(usize, PendingScatter, usize)>,
    /// Values the reductions in flight may hold besides the newest one: `1 + prefetch` times
    /// the largest unit's.
    budget: usize,
}

impl<'t> Reducer<'t> {
    pub(super) fn new(trainer: &'t ShardedTrainer) -> Self {
        let largest = trainer
            .units
            .iter()
            .map(|u| u.layout.shard_len * u.layout.world)
            .max()
            .unwrap_or(0);
        Self {
            trainer,
            in_flight: VecDeque::new(),
            budget: (1 + trainer.prefetch) * largest,
        }
    }

    /// Starts reducing unit `u`'s summed gradients `acc` (`None` = zero): the reduce-scatter
    /// within the group and, under hybrid sharding, the all-reduce across groups that follows it
    /// where the collectives run. The oldest reductions in flight are waited for while those
    /// besides this one hold more than the budget: a large unit's reduction runs on while the
    /// smaller ones after it compute. Results land in `out` at the parameters' indices.
    pub(super) fn push(
        &mut self,
        u: usize,
        acc: Vec<Option<Tensor>>,
        out: &mut [Option<Tensor>],
    ) -> Result<()> {
        let started = self.trainer.start_reduce(u, acc)?;
        if !self.trainer.overlap {
            return self.trainer.store_reduced(u, started.wait()?, out);
        }
        let layout = &self.trainer.units[u].layout;
        self.in_flight
            .push_back((u, started, layout.shard_len * layout.world));
        loop {
            let older: usize = self.in_flight.iter().rev().skip(1).map(|s| s.2).sum();
            if older <= self.budget {
                return Ok(());
            }
            let (v, oldest, _) = self.in_flight.pop_front().context("a reduction")?;
            self.trainer.store_reduced(v, oldest.wait()?, out)?;
        }
    }

    /// Waits for what is still in flight, in the order it was started.
    pub(super) fn finish(mut self, out: &mut [Option<Tensor>]) -> Result<()> {
        while let Some((v, p, _)) = self.in_flight.pop_front() {
            self.trainer.store_reduced(v, p.wait()?, out)?;
        }
        Ok(())
    }
}

/// grad-op's replicas refreshed during the update: as soon as the update has taken every
/// parameter of a unit (or the text table), its gather starts, and the gather before it is
/// waited for and copied into the replicas.
pub(super) struct Refresh<'a> {
    pub(super) units: &'a [UnitShards],
    pub(super) shard: &'a dyn Collective,
    pub(super) replica: &'a Replica,
    /// The text table's parameter and its layout over the group, when it is trained.
    pub(super) text: Option<(usize, &'a FlatLayout)>,
    pub(super) storage: DType,
    pub(super) device: &'a Device,
    /// Members of each unit the update has not taken yet.
    pub(super) left: Vec<usize>,
    /// The gather in flight: the names of its tensors.
    pub(super) gathering: Option<(Vec<String>, PendingGather<'a>)>,
}

impl<'a> Refresh<'a> {
    /// Parameter `i` (of `params`) has been updated.
    pub(super) fn updated(&mut self, i: usize, params: &[Param]) -> Result<()> {
        let (members, layout) = match self.text {
            Some((t, layout)) if t == i => (vec![t], layout),
            _ => {
                let Some(u) = self.units.iter().position(|u| u.members.contains(&i)) else {
                    return Ok(());
                };
                self.left[u] -= 1;
                if self.left[u] > 0 {
                    return Ok(());
                }
                (self.units[u].members.clone(), &self.units[u].layout)
            }
        };
        let shards: Vec<Tensor> = members
            .iter()
            .map(|&m| params[m].var.as_tensor().clone())
            .collect();
        let started = layout.start_gather(self.shard, &shards, self.storage, self.device)?;
        let names = members.iter().map(|&m| params[m].name.clone()).collect();
        if let Some(before) = self.gathering.replace((names, started)) {
            self.copy(before)?;
        }
        Ok(())
    }

    fn copy(&self, (names, gather): (Vec<String>, PendingGather<'a>)) -> Result<()> {
        for (name, full) in names.iter().zip(gather.wait()?) {
            self.replica.vars[name].set(&full)?;
        }
        Ok(())
    }

    /// Waits for the last gather.
    pub(super) fn finish(mut self) -> Result<()> {
        match self.gathering.take() {
            Some(last) => self.copy(last),
            None => Ok(()),
        }
    }
}
