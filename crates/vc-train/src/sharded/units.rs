//! Moving a unit's weights and gradients (docs/distributed.md §4.2): the all-gather of a unit's
//! trained tensors in the storage dtype within the shard group, the reduce-scatter of its summed
//! gradients into the owned rows, and the row-sparse gather of the step's text-table rows. Each
//! gather and reduction is started here and finished where the pass needs its result
//! ([`super::overlap`]).

use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result};
use candle_core::{DType, Tensor, Var};

use super::ShardedTrainer;
use crate::step::params::at_arith;
use crate::step::units::Unit;
use vc_dist::unit_packing::{gather_rows, FlatLayout, PendingGather, PendingScatter};
use vc_model::layers::{trainable_or_frozen, AdapterSpec, TensorSource};

/// A unit's trained tensors (the text table excepted) and their flat-shard layout.
pub(super) struct UnitShards {
    pub unit: Unit,
    /// Indices into the parameters.
    pub members: Vec<usize>,
    pub layout: FlatLayout,
}

/// A unit's weights for one pass: gathered trained tensors and the frozen ones, read in the
/// arithmetic dtype (docs/training.md §5.5).
pub(super) struct UnitSource<'a> {
    pub tensors: HashMap<String, Tensor>,
    pub frozen: &'a BTreeMap<String, Tensor>,
    pub arith: DType,
    pub adapters: Option<AdapterSpec>,
}

impl TensorSource for UnitSource<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> anyhow::Result<Tensor> {
        let t = trainable_or_frozen(name, shape, self.tensors.get(name), self.frozen.get(name))?;
        at_arith(name, t, self.arith)
    }
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.frozen.contains_key(name)
    }
    fn adapters(&self) -> Option<AdapterSpec> {
        self.adapters
    }
}

/// Groups the parameters (in order) into the talker's units (`all`, in forward order), the text
/// table left out. A unit nobody trains (a LoRA run's embeddings and head, see
/// docs/training.md §13) has no members: its pass runs on frozen weights and moves nothing.
pub(super) fn group_units(
    all: &[Unit],
    units_of: impl IntoIterator<Item = (usize, Unit)>,
    text: Option<usize>,
    shapes: &[Vec<usize>],
    world: usize,
    rank: usize,
) -> Result<Vec<UnitShards>> {
    let mut units: Vec<UnitShards> = all
        .iter()
        .map(|&unit| UnitShards {
            unit,
            members: Vec::new(),
            layout: FlatLayout::new(&[], world, rank),
        })
        .collect();
    for (i, unit) in units_of {
        if Some(i) == text {
            continue;
        }
        let u = units
            .iter_mut()
            .find(|u| u.unit == unit)
            .with_context(|| format!("unit {unit} is not part of this model"))?;
        u.members.push(i);
    }
    for u in &mut units {
        let s: Vec<Vec<usize>> = u.members.iter().map(|&i| shapes[i].clone()).collect();
        u.layout = FlatLayout::new(&s, world, rank);
    }
    Ok(units)
}

/// A unit's weights on their way to a pass: its gather in flight, or nothing to wait for (its
/// replicas, in grad-op mode).
pub(super) struct PendingUnit<'t> {
    u: usize,
    gather: Option<PendingGather<'t>>,
}

impl ShardedTrainer {
    /// Starts all-gathering unit `u` within the shard group, in the storage dtype.
    pub(super) fn start_gather(&self, u: usize) -> Result<PendingGather<'_>> {
        let unit = &self.units[u];
        let shards: Vec<Tensor> = unit
            .members
            .iter()
            .map(|&i| self.params[i].var.as_tensor().clone())
            .collect();
        unit.layout.start_gather(
            self.mesh.shard.as_ref(),
            &shards,
            self.storage,
            &self.run.opts.device,
        )
    }

    /// Unit `u`'s gathered tensors `fulls` as a model source, as `Var`s when `vars`.
    fn gathered(
        &self,
        u: usize,
        fulls: Vec<Tensor>,
        vars: bool,
    ) -> Result<(UnitSource<'_>, Vec<Var>)> {
        let unit = &self.units[u];
        let mut tensors = HashMap::new();
        let mut out = Vec::new();
        for (&i, full) in unit.members.iter().zip(fulls) {
            let t = if vars {
                let v = Var::from_tensor(&full)?;
                let t = v.as_tensor().clone();
                out.push(v);
                t
            } else {
                // A world of one rank gathers the shard itself, a `Var`: detached, so that the
                // forward pass records no graph (docs/training.md §6.7).
                full.detach()
            };
            tensors.insert(self.params[i].name.clone(), t);
        }
        Ok((self.unit_source(tensors), out))
    }

    /// All-gathers unit `u`: its full tensors in the storage dtype, as `Var`s when `vars`.
    pub(super) fn gather(&self, u: usize, vars: bool) -> Result<(UnitSource<'_>, Vec<Var>)> {
        let fulls = self.start_gather(u)?.wait()?;
        self.gathered(u, fulls, vars)
    }

    /// Starts unit `u`'s weights for a pass: its gather in `full` mode, nothing with replicas.
    pub(super) fn start_unit(&self, u: usize) -> Result<PendingUnit<'_>> {
        let gather = match self.replica {
            Some(_) => None,
            None => Some(self.start_gather(u)?),
        };
        Ok(PendingUnit { u, gather })
    }

    /// A started unit's whole weights for a pass (with `Var`s when `vars`), once gathered.
    pub(super) fn finish_unit<'t>(
        &'t self,
        p: PendingUnit<'t>,
        vars: bool,
    ) -> Result<(UnitSource<'t>, Vec<Var>)> {
        match p.gather {
            Some(g) => self.gathered(p.u, g.wait()?, vars),
            None => self.replica_weights(p.u, vars),
        }
    }

    /// A model source of a unit's whole `tensors` and the frozen ones, read in the arithmetic
    /// dtype.
    pub(super) fn unit_source(&self, tensors: HashMap<String, Tensor>) -> UnitSource<'_> {
        UnitSource {
            tensors,
            frozen: &self.frozen,
            arith: self.arith,
            adapters: self.adapters,
        }
    }

    /// Starts summing `acc` (unit `u`'s full gradients from this rank's micro-batches; `None` =
    /// zero) over the shard group into this rank's rows, and under hybrid sharding over the
    /// groups, in `train.reduce_dtype`.
    pub(super) fn start_reduce(
        &self,
        u: usize,
        acc: Vec<Option<Tensor>>,
    ) -> Result<PendingScatter> {
        let unit = &self.units[u];
        let dtype = crate::reduce_dtype(self.run.opts.config.reduce_dtype);
        let fulls = unit
            .members
            .iter()
            .zip(acc)
            .map(|(&i, g)| match g {
                Some(g) => Ok(g),
                None => Ok(Tensor::zeros(
                    self.shapes[i].as_slice(),
                    dtype,
                    &self.run.opts.device,
                )?),
            })
            .collect::<Result<Vec<_>>>()?;
        unit.layout.start_reduce_scatter(
            self.mesh.shard.as_ref(),
            &fulls,
            dtype,
            &self.run.opts.device,
            self.mesh.replicas.clone(),
        )
    }

    /// Stores unit `u`'s summed gradient (this rank's flat shard of it, `None` for a unit that
    /// trains nothing) at the parameters' indices in `out`, as the optimizer's f32 rows.
    pub(super) fn store_reduced(
        &self,
        u: usize,
        flat: Option<Tensor>,
        out: &mut [Option<Tensor>],
    ) -> Result<()> {
        let unit = &self.units[u];
        for (&i, g) in unit.members.iter().zip(unit.layout.owned_parts(flat)?) {
            out[i] = Some(g);
        }
        Ok(())
    }

    pub(super) fn unit_index(&self, unit: Unit) -> Result<usize> {
        self.units
            .iter()
            .position(|u| u.unit == unit)
            .with_context(|| format!("unit {unit} is not part of this model"))
    }

    /// The rows `ids` (the step's, sorted and distinct) of the trained text table, from their
    /// owners in the shard group, in the storage dtype.
    pub(super) fn gather_text_rows(&self, t: usize, ids: &[u32]) -> Result<Tensor> {
        gather_rows(
            self.mesh.shard.as_ref(),
            &self.splits[t],
            self.params[t].var.as_tensor(),
            ids,
            &self.run.opts.device,
        )
    }

    /// The text table as a one-tensor flat layout over the shard group (grad-op gathers it
    /// whole).
    pub(super) fn text_layout(&self, t: usize) -> FlatLayout {
        FlatLayout::new(
            std::slice::from_ref(&self.shapes[t]),
            self.group_size(),
            self.shard_index(),
        )
    }
}
