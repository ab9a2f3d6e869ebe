//! The `full` pass (ZeRO-3, docs/distributed.md §4.2): forward unit by unit on gathered
//! weights, keeping each unit's inputs; then backward in reverse, gathering each unit again and
//! recomputing it with `Var`s from the saved inputs, its weight gradients summed over the local
//! micro-batches and reduce-scattered once. The gathers run ahead of the computation and the
//! reductions behind it (docs/distributed.md §4.6, [`super::overlap`]). The same pass
//! recomputes `grad-op` runs with `train.recompute = "layers"`, taking each unit from the
//! replicas instead of gathering it (docs/training.md §6.7).

use anyhow::Result;
use candle_core::{DType, Tensor, Var};

use super::overlap::{Prefetch, Reducer};
use super::{accumulate_vars, add_into, scalar, Micro, Pass, RankLosses, ShardedTrainer};
use crate::step::units::forward::{
    sub_loss, Embedded, EmbeddingUnit, HeadUnit, TextRows, SUB_LOSS_WEIGHT,
};
use crate::step::units::Unit;
use vc_model::code_predictor::CodePredictor;
use vc_model::layers::{DecoderLayer, DecoderStackConfig};

/// Frames of one chunk of the code predictor's recomputation (docs/training.md §6.7): 512
/// positions through its 5 layers, a graph of about 0.4 GB for the 0.6B in bf16, where a batch
/// of four 15-second utterances would keep 10 GB.
pub const PREDICTOR_CHUNK_FRAMES: usize = 32;

/// The chunks of `frames` frames, `chunk` at a time: start, length, and share of the frames
/// (the weight of the chunk's mean loss in the mean over all).
fn predictor_chunks(frames: usize, chunk: usize) -> impl Iterator<Item = (usize, usize, f64)> {
    (0..frames).step_by(chunk).map(move |start| {
        let n = chunk.min(frames - start);
        (start, n, n as f64 / frames as f64)
    })
}

/// What the forward half of the `full` pass leaves: every unit's inputs, for the backward
/// half, and the local micro-batches' losses.
pub(super) struct Forward {
    embedded: Vec<Embedded>,
    /// The inputs of every decoder layer, per local micro-batch.
    inputs: Vec<Vec<Tensor>>,
    head_in: Vec<Tensor>,
    frame_hidden: Vec<Tensor>,
    pub(super) local: Vec<RankLosses>,
}

impl ShardedTrainer {
    /// The units of the talker: the embeddings, each decoder layer, the head and the code
    /// predictor.
    fn unit_indices(&self) -> Result<(usize, Vec<usize>, usize, usize)> {
        let layers = self.run.cfg.talker_config.num_hidden_layers;
        Ok((
            self.unit_index(Unit::Embeddings)?,
            (0..layers)
                .map(|l| self.unit_index(Unit::Layer(l)))
                .collect::<Result<_>>()?,
            self.unit_index(Unit::Head)?,
            self.unit_index(Unit::CodePredictor)?,
        ))
    }

    /// The forward pass unit by unit on gathered weights (the first half of the `full` pass,
    /// and the whole of a validation), keeping every unit's inputs. No gradient is taken.
    pub(super) fn forward(&self, mine: &[Micro], rows: Option<&Tensor>) -> Result<Forward> {
        let numerics = self.backend().numerics();
        let cfg = &self.run.cfg;
        let tcfg = DecoderStackConfig::talker(&cfg.talker_config)?;
        let (emb_u, layer_u, head_u, cp_u) = self.unit_indices()?;
        let layer_name = |l: usize| format!("talker.model.layers.{l}");
        let table = self.text_table(rows)?;
        let mut order = vec![emb_u];
        order.extend(&layer_u);
        order.extend([head_u, cp_u]);
        let mut units = Prefetch::new(self, order, false);
        let embedded: Vec<Embedded> = {
            let (src, _) = units.next_unit()?;
            let unit = EmbeddingUnit::load(&src, cfg, numerics)?;
            mine.iter()
                .map(|m| {
                    let text = TextRows {
                        table: &table,
                        ids: &m.text_ids,
                    };
                    unit.forward(&m.batch, &self.run.speaker, text)
                })
                .collect::<candle_core::Result<_>>()?
        };
        let mut inputs: Vec<Vec<Tensor>> = Vec::with_capacity(layer_u.len());
        let mut x: Vec<Tensor> = embedded.iter().map(|e| e.inputs.clone()).collect();
        for l in 0..layer_u.len() {
            let (src, _) = units.next_unit()?;
            let layer = DecoderLayer::load(&src, &layer_name(l), tcfg, numerics)?;
            let next = mine
                .iter()
                .zip(&x)
                .map(|(m, x)| layer.forward(x, &m.ctx, None))
                .collect::<candle_core::Result<Vec<_>>>()?;
            inputs.push(std::mem::replace(&mut x, next));
        }
        let head_in = x;
        let (l_talker, frame_hidden): (Vec<Tensor>, Vec<Tensor>) = {
            let (src, _) = units.next_unit()?;
            let head = HeadUnit::load(&src, cfg, numerics)?;
            mine.iter()
                .zip(&head_in)
                .map(|(m, x)| head.forward(x, &m.batch))
                .collect::<candle_core::Result<Vec<_>>>()?
                .into_iter()
                .unzip()
        };
        let l_sub: Vec<f64> = {
            let (src, _) = units.next_unit()?;
            let cp = CodePredictor::load_parts(&src, cfg, numerics, false)?;
            let mut out = Vec::with_capacity(mine.len());
            for ((m, fh), e) in mine.iter().zip(&frame_hidden).zip(&embedded) {
                // In the chunks of the backward pass below: the forward's temporaries are one
                // chunk's too.
                let mut sum = 0.0;
                for (start, n, share) in predictor_chunks(fh.dim(0)?, self.predictor_chunk) {
                    let part = |t: &Tensor| t.narrow(0, start, n);
                    let l = sub_loss(
                        &cp,
                        &part(fh)?,
                        &part(&e.c0_embed)?,
                        &part(&e.sub_embeds)?,
                        &part(&m.batch.frame_codes)?,
                    )?;
                    sum += share * scalar(&l)?;
                }
                out.push(sum);
            }
            out
        };
        let mut local = Vec::with_capacity(mine.len());
        for ((m, lt), &ls) in mine.iter().zip(&l_talker).zip(&l_sub) {
            let lt = scalar(lt)?;
            local.push(RankLosses {
                index: m.index,
                total: lt + SUB_LOSS_WEIGHT * ls,
                talker: lt,
                sub: ls,
                frames: m.frames,
            });
        }
        Ok(Forward {
            embedded,
            inputs,
            head_in,
            frame_hidden,
            local,
        })
    }

    /// FULL_SHARD: the forward pass unit by unit, then the backward pass unit by unit in reverse,
    /// recomputing each unit from its saved inputs.
    pub(super) fn full_pass(
        &self,
        mine: &[Micro],
        rows: Option<&Tensor>,
        micro: &[Vec<usize>],
        epoch: usize,
    ) -> Result<Pass> {
        let numerics = self.backend().numerics();
        let in_place = self.backend().in_place();
        let grad_dtype = crate::reduce_dtype(self.run.opts.config.reduce_dtype);
        let cfg = &self.run.cfg;
        let tcfg = DecoderStackConfig::talker(&cfg.talker_config)?;
        let (emb_u, layer_u, head_u, cp_u) = self.unit_indices()?;
        let layer_name = |l: usize| format!("talker.model.layers.{l}");
        let table = self.text_table(rows)?;
        let Forward {
            embedded,
            inputs,
            head_in,
            frame_hidden,
            local,
        } = self.forward(mine, rows)?;
        // Nothing to learn below the layers when the embedding unit trains nothing and the text
        // table is frozen (a LoRA run, docs/training.md §13).
        let embeddings_learn = !self.units[emb_u].members.is_empty() || rows.is_some();
        let mut order = vec![cp_u, head_u];
        order.extend(layer_u.iter().rev());
        if embeddings_learn {
            order.push(emb_u);
        }
        let mut units = Prefetch::new(self, order, true);
        // The first units gather while the losses are agreed on.
        units.prime()?;
        let sums = self.agree_losses(&local, micro, epoch)?;
        let mut reducer = Reducer::new(self);

        // Backward, in reverse, recomputing each unit with `Var`s; gradients of the step's
        // micro-batches are summed, then reduced once per unit.
        let scale = 1.0 / micro.len() as f64;
        let mut grads: Vec<Option<Tensor>> = vec![None; self.params.len()];
        let grad_or_zero = |g: &candle_core::backprop::GradStore, v: &Var| -> Result<Tensor> {
            Ok(match g.get(v.as_tensor()) {
                Some(t) => t.clone(),
                None => v.as_tensor().zeros_like()?,
            })
        };
        let (mut d_fh, mut d_c0, mut d_sub) = (Vec::new(), Vec::new(), Vec::new());
        {
            let (src, vars) = units.next_unit()?;
            let cp = CodePredictor::load_parts(&src, cfg, numerics, false)?;
            let mut acc = vec![None; vars.len()];
            for ((m, fh), e) in mine.iter().zip(&frame_hidden).zip(&embedded) {
                // Frames are independent sequences for the predictor: recomputed a chunk at a
                // time, each chunk's mean loss weighted by its share of the frames, so the
                // graph alive is one chunk's (docs/training.md §6.7).
                let (mut dfh, mut dc0, mut dsb) = (Vec::new(), Vec::new(), Vec::new());
                for (start, n, share) in predictor_chunks(fh.dim(0)?, self.predictor_chunk) {
                    let part = |t: &Tensor| -> Result<Var> {
                        Ok(Var::from_tensor(&t.narrow(0, start, n)?.contiguous()?)?)
                    };
                    let (fh, c0, sb) = (part(fh)?, part(&e.c0_embed)?, part(&e.sub_embeds)?);
                    let l = sub_loss(
                        &cp,
                        fh.as_tensor(),
                        c0.as_tensor(),
                        sb.as_tensor(),
                        &m.batch.frame_codes.narrow(0, start, n)?,
                    )?;
                    let g = (l * (SUB_LOSS_WEIGHT * scale * share))?.backward()?;
                    accumulate_vars(&g, &vars, &mut acc, grad_dtype, in_place)?;
                    dfh.push(grad_or_zero(&g, &fh)?);
                    dc0.push(grad_or_zero(&g, &c0)?);
                    dsb.push(grad_or_zero(&g, &sb)?);
                }
                d_fh.push(Tensor::cat(&dfh, 0)?);
                d_c0.push(Tensor::cat(&dc0, 0)?);
                d_sub.push(Tensor::cat(&dsb, 0)?);
            }
            reducer.push(cp_u, acc, &mut grads)?;
        }
        let mut d_x: Vec<Tensor> = Vec::with_capacity(mine.len());
        {
            let (src, vars) = units.next_unit()?;
            let head = HeadUnit::load(&src, cfg, numerics)?;
            let mut acc = vec![None; vars.len()];
            for ((m, x), dfh) in mine.iter().zip(&head_in).zip(&d_fh) {
                let xv = Var::from_tensor(x)?;
                let (lt, fh) = head.forward(xv.as_tensor(), &m.batch)?;
                // `lt` is f32 (the cross-entropy computes in f32), `fh` in the arithmetic dtype
                // (bf16 on CUDA): candle adds only equal dtypes.
                let upstream = (fh * dfh)?.sum_all()?.to_dtype(DType::F32)?;
                let g = ((lt * scale)? + upstream)?.backward()?;
                accumulate_vars(&g, &vars, &mut acc, grad_dtype, in_place)?;
                d_x.push(grad_or_zero(&g, &xv)?);
            }
            reducer.push(head_u, acc, &mut grads)?;
        }
        for (l, &u) in layer_u.iter().enumerate().rev() {
            let (src, vars) = units.next_unit()?;
            let layer = DecoderLayer::load(&src, &layer_name(l), tcfg, numerics)?;
            let mut acc = vec![None; vars.len()];
            let mut next = Vec::with_capacity(mine.len());
            for ((m, x), dout) in mine.iter().zip(&inputs[l]).zip(&d_x) {
                let xv = Var::from_tensor(x)?;
                let out = layer.forward(xv.as_tensor(), &m.ctx, None)?;
                let g = (out * dout)?.sum_all()?.backward()?;
                accumulate_vars(&g, &vars, &mut acc, grad_dtype, in_place)?;
                next.push(grad_or_zero(&g, &xv)?);
            }
            d_x = next;
            reducer.push(u, acc, &mut grads)?;
        }
        let mut text_grad: Option<Tensor> = None;
        if embeddings_learn {
            let (src, vars) = units.next_unit()?;
            let unit = EmbeddingUnit::load(&src, cfg, numerics)?;
            let mut acc = vec![None; vars.len()];
            let rows_var = rows.map(Var::from_tensor).transpose()?;
            for (k, m) in mine.iter().enumerate() {
                let t = match &rows_var {
                    Some(v) => v.as_tensor().clone(),
                    None => table.clone(),
                };
                let e = unit.forward(
                    &m.batch,
                    &self.run.speaker,
                    TextRows {
                        table: &t,
                        ids: &m.text_ids,
                    },
                )?;
                let obj = (((e.inputs * &d_x[k])?.sum_all()?
                    + (e.c0_embed * &d_c0[k])?.sum_all()?)?
                    + (e.sub_embeds * &d_sub[k])?.sum_all()?)?;
                let g = obj.backward()?;
                accumulate_vars(&g, &vars, &mut acc, grad_dtype, in_place)?;
                if let Some(v) = &rows_var {
                    if let Some(t) = g.get(v.as_tensor()) {
                        add_into(&mut text_grad, t, grad_dtype, in_place)?;
                    }
                }
            }
            reducer.push(emb_u, acc, &mut grads)?;
        }
        reducer.finish(&mut grads)?;
        Ok(Pass {
            sums,
            grads,
            text_grad,
        })
    }
}
