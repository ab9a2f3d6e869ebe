//! The update of a sharded step (docs/distributed.md §4.4): the text rows' gradients reduced to
//! their owners (and across the groups, docs/distributed.md §4.7), the global gradient norm from the squared shard
//! norms of one group, clipping, and the AdamW step on this rank's rows (then, in grad-op mode,
//! the replicas refreshed — unit by unit during the update when communication overlaps, docs/distributed.md §4.6).

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

use super::overlap::Refresh;
use super::{Pass, ShardedTrainer};
use crate::driver::NonFinite;
use crate::metrics::StepMetrics;
use crate::optim::{self, Grad};
use crate::step::text_grad::RowGrad;
use vc_core::config::Shard as ShardMode;
use vc_dist::unit_packing::reduce_scatter_rows;
use vc_dist::ReduceOp;

impl ShardedTrainer {
    /// Reduces the text rows' gradient to their owners, clips on the global norm, takes the
    /// AdamW step on this rank's rows and (grad-op) refreshes the replicas.
    pub(super) fn apply(
        &mut self,
        pass: Pass,
        text_ids: &[u32],
        epoch: usize,
        n: usize,
        t0: Instant,
    ) -> Result<StepMetrics> {
        let in_place = self.backend().in_place();
        let Pass {
            sums,
            mut grads,
            text_grad,
        } = pass;
        let dev = self.run.opts.device.clone();
        let mut rows_grad: Option<RowGrad> = None;
        if let Some(t) = self.text {
            let width = self.shapes[t][1];
            let g = match text_grad {
                Some(g) => g,
                None => Tensor::zeros((text_ids.len(), width), DType::F32, &dev)?,
            };
            let reduce_dtype = crate::reduce_dtype(self.run.opts.config.reduce_dtype);
            let (local, summed) = reduce_scatter_rows(
                self.mesh.shard.as_ref(),
                &self.splits[t],
                &g,
                text_ids,
                reduce_dtype,
                &dev,
            )?;
            // Across the groups: the same rows are this rank's on every replica (the step's ids
            // are the same everywhere), or none of them are.
            let summed = match &self.mesh.replicas {
                Some(r) if !local.is_empty() => r
                    .all_reduce(&summed.to_dtype(reduce_dtype)?)?
                    .to_dtype(DType::F32)?,
                _ => summed,
            };
            let owned = self.splits[t].owned(self.shard_index()).len();
            if in_place {
                let mut rg = RowGrad::new(owned, width);
                if !local.is_empty() {
                    rg.add(&local, &summed.flatten_all()?.to_vec1::<f32>()?)?;
                }
                rows_grad = Some(rg);
            } else {
                let dense = Tensor::zeros((owned, width), DType::F32, &dev)?;
                grads[t] = Some(if local.is_empty() {
                    dense
                } else {
                    let ids = Tensor::new(local.as_slice(), &dev)?;
                    dense.index_add(&ids, &summed, 0)?
                });
            }
        }
        let mut sum_sq = 0f64;
        for (i, g) in grads.iter().enumerate() {
            sum_sq += match (g, &rows_grad) {
                (Some(g), _) if g.elem_count() == 0 => 0.0,
                (Some(g), _) => optim::sum_squares(g, in_place)?,
                (None, Some(r)) if Some(i) == self.text => r.sum_squares(),
                (None, _) => 0.0,
            };
        }
        // The other groups hold the same shards: one group's count.
        let mine = if self.first_group() { sum_sq } else { 0.0 };
        let grad_norm = self.mesh.world.all_reduce_host(&[mine], ReduceOp::Sum)?[0].sqrt();
        if !grad_norm.is_finite() {
            bail!(NonFinite(format!(
                "the gradient norm became {grad_norm} at step {}; this step was not applied and \
                 nothing was saved for it",
                self.run.step + 1
            )));
        }
        let clip = optim::clip_factor(grad_norm, self.run.opts.config.clip_norm);
        let lr = self.run.schedule.lr(self.run.step + 1);
        let grads: Vec<Grad> = grads
            .into_iter()
            .enumerate()
            .map(|(i, g)| match g {
                Some(g) => Ok(Grad::Dense(g)),
                None => match &rows_grad {
                    Some(r) => Ok(Grad::Rows(r)),
                    None => bail!("no gradient for {}", self.params[i].name),
                },
            })
            .collect::<Result<_>>()?;
        let on_host = self.backend().optimizer_on_host(&self.run.opts.config);
        match (&self.replica, self.mode) {
            (Some(replica), ShardMode::GradOp) if self.overlap => {
                let text_layout = self.text.map(|t| (t, self.text_layout(t)));
                let mut refresh = Refresh {
                    units: &self.units,
                    shard: self.mesh.shard.as_ref(),
                    replica,
                    text: text_layout.as_ref().map(|(t, l)| (*t, l)),
                    storage: self.storage,
                    device: &self.run.opts.device,
                    left: self.units.iter().map(|u| u.members.len()).collect(),
                    gathering: None,
                };
                self.run.adamw.step_each(
                    &mut self.adam,
                    &mut self.params,
                    &grads,
                    lr,
                    clip,
                    on_host,
                    &mut |i, params| refresh.updated(i, params),
                )?;
                refresh.finish()?;
            }
            _ => {
                self.run
                    .adamw
                    .step(&mut self.adam, &mut self.params, &grads, lr, clip, on_host)?;
                if self.mode == ShardMode::GradOp {
                    self.refresh_replica()?;
                }
            }
        }
        self.run.step += 1;
        let n = n as f64;
        let loss = sums.loss / n;
        self.run.last_loss = Some(loss);
        Ok(StepMetrics {
            step: self.run.step,
            epoch,
            loss,
            loss_talker: sums.talker / n,
            loss_sub: sums.sub / n,
            grad_norm,
            lr,
            frames: sums.frames as usize,
            seconds: t0.elapsed().as_secs_f64(),
            sent_within_node: None,
            sent_across_nodes: None,
        })
    }
}
