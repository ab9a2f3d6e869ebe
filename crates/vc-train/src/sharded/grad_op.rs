//! The `grad-op` pass (ZeRO-2, docs/distributed.md §4.3): the weights replicated on every rank
//! as `Var`s in the storage dtype, each local micro-batch forward and backward in one graph, the
//! summed gradients reduce-scattered once per unit (each unit's reduction running while the
//! next is packed, docs/distributed.md §4.6); after the update the replicas are refreshed by
//! gathering every unit again.

use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result};
use candle_core::{Tensor, Var};

use super::overlap::Reducer;
use super::units::UnitSource;
use super::{add_into, scalar, Micro, Pass, RankLosses, ShardedTrainer};
use crate::step::loss;
use crate::step::units::forward::TextRows;
use vc_model::talker::Talker;

/// Every trained tensor in full, as a `Var` in the storage dtype.
pub(super) struct Replica {
    pub(super) vars: BTreeMap<String, Var>,
}

impl ShardedTrainer {
    /// Every trained tensor gathered in full (the text table too, whole).
    pub(super) fn build_replica(&self) -> Result<Replica> {
        let mut vars = BTreeMap::new();
        for u in 0..self.units.len() {
            let (_, gathered) = self.gather(u, true)?;
            for (&i, v) in self.units[u].members.iter().zip(gathered) {
                vars.insert(self.params[i].name.clone(), v);
            }
        }
        if let Some(t) = self.text {
            let table = self.gather_text_table(t)?;
            vars.insert(self.params[t].name.clone(), Var::from_tensor(&table)?);
        }
        Ok(Replica { vars })
    }

    /// After the update, every replica takes the new values of every tensor.
    pub(super) fn refresh_replica(&self) -> Result<()> {
        let replica = self.replica()?;
        for u in 0..self.units.len() {
            let (src, _) = self.gather(u, false)?;
            for &i in &self.units[u].members {
                let name = &self.params[i].name;
                replica.vars[name].set(&src.tensors[name])?;
            }
        }
        if let Some(t) = self.text {
            let table = self.gather_text_table(t)?;
            replica.vars[&self.params[t].name].set(&table)?;
        }
        Ok(())
    }

    /// Unit `u`'s weights from the replicas (with `Var`s when `vars`).
    pub(super) fn replica_weights(
        &self,
        u: usize,
        vars: bool,
    ) -> Result<(UnitSource<'_>, Vec<Var>)> {
        let replica = self.replica()?;
        let mut tensors = HashMap::new();
        let mut out = Vec::new();
        for &i in &self.units[u].members {
            let name = &self.params[i].name;
            let v = &replica.vars[name];
            // Without `vars` (the forward pass) detached: a graph recorded through the replicas
            // would keep every unit's activations alive through the kept inputs
            // (docs/training.md §6.7).
            let t = if vars {
                out.push(v.clone());
                v.as_tensor().clone()
            } else {
                v.as_tensor().detach()
            };
            tensors.insert(name.clone(), t);
        }
        Ok((self.unit_source(tensors), out))
    }

    fn replica(&self) -> Result<&Replica> {
        self.replica
            .as_ref()
            .context("grad-op mode without a replica")
    }

    /// The whole text table from every rank's rows, in the storage dtype.
    fn gather_text_table(&self, t: usize) -> Result<Tensor> {
        let shard = self.params[t].var.as_tensor().clone();
        let mut full = self.text_layout(t).gather(
            self.mesh.shard.as_ref(),
            std::slice::from_ref(&shard),
            self.storage,
            &self.run.opts.device,
        )?;
        Ok(full.remove(0))
    }

    /// The model on the replicas, read in the arithmetic dtype. Built for each pass: where the
    /// arithmetic dtype differs from the storage dtype, it holds casts of the current values.
    fn replica_model(&self) -> Result<Talker> {
        let replica = self.replica()?;
        let tensors: HashMap<String, Tensor> = replica
            .vars
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        let src = self.unit_source(tensors);
        Talker::from_source(&src, &self.run.cfg, self.backend().numerics())
    }

    /// Every local micro-batch forward and backward on the replicated model, the summed
    /// gradients reduced once per unit.
    pub(super) fn grad_op_pass(
        &self,
        mine: &[Micro],
        rows: Option<&Tensor>,
        micro: &[Vec<usize>],
        epoch: usize,
    ) -> Result<Pass> {
        let replica = self.replica()?;
        let talker = self.replica_model()?;
        let in_place = self.backend().in_place();
        let grad_dtype = crate::reduce_dtype(self.run.opts.config.reduce_dtype);
        let table = self.text_table(rows)?;
        let rows_var = rows.map(Var::from_tensor).transpose()?;
        let scale = 1.0 / micro.len() as f64;
        let mut full: Vec<Option<Tensor>> = vec![None; self.params.len()];
        let mut text_grad: Option<Tensor> = None;
        let mut local = Vec::with_capacity(mine.len());
        for m in mine {
            let t = match &rows_var {
                Some(v) => v.as_tensor().clone(),
                None => table.clone(),
            };
            let l = loss::sft_loss_with(
                &talker,
                &m.batch,
                &self.run.speaker,
                Some(TextRows {
                    table: &t,
                    ids: &m.text_ids,
                }),
            )?;
            local.push(RankLosses {
                index: m.index,
                total: scalar(&l.total)?,
                talker: scalar(&l.talker)?,
                sub: scalar(&l.sub)?,
                frames: m.frames,
            });
            let g = (l.total * scale)?.backward()?;
            for (i, p) in self.params.iter().enumerate() {
                if Some(i) == self.text {
                    continue;
                }
                if let Some(t) = replica.vars.get(&p.name).and_then(|v| g.get(v.as_tensor())) {
                    add_into(&mut full[i], t, grad_dtype, in_place)?;
                }
            }
            if let Some(v) = &rows_var {
                if let Some(t) = g.get(v.as_tensor()) {
                    add_into(&mut text_grad, t, grad_dtype, in_place)?;
                }
            }
        }
        let sums = self.agree_losses(&local, micro, epoch)?;
        let mut grads: Vec<Option<Tensor>> = vec![None; self.params.len()];
        // Unit by unit: the reduction of one runs while the next is packed.
        let mut reducer = Reducer::new(self);
        for u in 0..self.units.len() {
            let acc = self.units[u]
                .members
                .iter()
                .map(|&i| full[i].take())
                .collect();
            reducer.push(u, acc, &mut grads)?;
        }
        reducer.finish(&mut grads)?;
        Ok(Pass {
            sums,
            grads,
            text_grad,
        })
    }
}
