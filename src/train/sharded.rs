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
//! - `grad-op` (ZeRO-2, SHARD_GRAD_OP): the weights are replicated in the compute dtype, each
//!   micro-batch runs forward and backward in one graph (no recompute), the summed gradients are
//!   reduce-scattered once per step, and after the update every unit is all-gathered back into
//!   the replicas.
//!
//! The text embedding (151 936 rows) stays row-sparse in both: only the rows of the step's text
//! tokens are gathered and their gradients reduced to their owners. The global batch of a step
//! and its order do not depend on the number of ranks: rank r takes micro-batches r, r+N, … of
//! the step, and the result equals single-device training up to the order of floating-point
//! sums. Losses, non-finite values and stop requests are agreed on by every rank before any acts.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};

use super::batch::{Batch, BatchTensors, LayoutIds};
use super::checkpoint::{self, ParamInfo, PendingCheckpoint, RowReader, Shard};
use super::data::Dataset;
use super::metrics::{MetricsLog, StepMetrics};
use super::optim::{self, AdamState, AdamW, Grad, Schedule};
use super::params::{self, Param};
use super::run::{self, IndexParts, RunSetup};
use super::sampler::Sampler;
use super::sparse::RowGrad;
use super::stages::{sub_loss, Embedded, EmbeddingUnit, HeadUnit, TextRows, SUB_LOSS_WEIGHT};
use super::units::{unit_of, Unit};
use super::{compute_dtype, loss, signal, Backend, Outcome, TrainOptions, TEXT_EMBEDDING};
use crate::config::Shard as ShardMode;
use crate::dist::flat::{gather_rows, reduce_scatter_rows, FlatLayout};
use crate::dist::shard::RowSplit;
use crate::dist::{Collective, ReduceOp};
use crate::model::code_predictor::CodePredictor;
use crate::model::config::Qwen3TtsConfig;
use crate::model::layers::{
    trainable_or_frozen, DecoderConfig, DecoderLayer, StepContext, TensorSource,
};
use crate::model::ops::Rope;
use crate::model::talker::Talker;
use crate::progress::Progress;

/// A unit's trained tensors (the text table excepted) and their flat-shard layout.
struct UnitShards {
    unit: Unit,
    /// Indices into the parameters.
    members: Vec<usize>,
    layout: FlatLayout,
}

/// A unit's weights for one pass: gathered trained tensors and the frozen ones.
struct UnitSource<'a> {
    tensors: HashMap<String, Tensor>,
    frozen: &'a BTreeMap<String, Tensor>,
}

impl TensorSource for UnitSource<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> anyhow::Result<Tensor> {
        trainable_or_frozen(name, shape, self.tensors.get(name), self.frozen.get(name))
    }
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.frozen.contains_key(name)
    }
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

/// grad-op mode: the whole model, replicated in the compute dtype.
struct Replica {
    vars: BTreeMap<String, Var>,
    talker: Talker,
}

pub struct ShardedTrainer {
    coll: Arc<dyn Collective>,
    pub mode: ShardMode,
    backend: Backend,
    compute: DType,
    pub cfg: Qwen3TtsConfig,
    opts: TrainOptions,
    pub dataset: Dataset,
    pub sampler: Sampler,
    layout: LayoutIds,
    speaker: Tensor,
    pub identity: checkpoint::Identity,
    pub step: usize,
    pub schedule: Schedule,
    adamw: AdamW,
    pub adam: AdamState,
    /// This rank's rows of every trained tensor, in parameter order.
    pub params: Vec<Param>,
    shapes: Vec<Vec<usize>>,
    splits: Vec<RowSplit>,
    units: Vec<UnitShards>,
    /// The trained text table, when it is trained (row-sparse).
    text: Option<usize>,
    frozen: BTreeMap<String, Tensor>,
    rope: Rope,
    replica: Option<Replica>,
    /// Shared by the ranks (agreed at the rendezvous): names temporary checkpoint directories.
    tag: String,
    pub resumed_from: Option<PathBuf>,
    pub data_changed: bool,
    last_loss: Option<f64>,
}

impl ShardedTrainer {
    /// Loads this rank's shards (from the base model, or from the newest checkpoint of the run,
    /// written at any world size) and the frozen tensors.
    pub fn new(
        opts: TrainOptions,
        coll: Arc<dyn Collective>,
        mode: ShardMode,
        tag: String,
        fresh: bool,
    ) -> Result<Self> {
        let (rank, world) = (coll.rank(), coll.world());
        let backend = opts.backend;
        if backend == Backend::CpuKernels && !opts.device.is_cpu() {
            bail!("the CPU training kernels cannot run on {:?}", opts.device);
        }
        let compute = compute_dtype(&opts.device);
        let setup = RunSetup::new(&opts)?;
        let cfg = setup.cfg.clone();
        let info = |name: &str| {
            opts.files
                .checkpoint
                .tensor(name)
                .map(|t| t.shape.clone())
                .with_context(|| format!("the base model has no tensor {name}"))
        };
        let shapes = setup
            .trained
            .iter()
            .map(|n| info(n))
            .collect::<Result<Vec<_>>>()?;
        let splits: Vec<RowSplit> = shapes
            .iter()
            .map(|s| RowSplit::new(s.first().copied().unwrap_or(1), world))
            .collect();
        let owned: HashMap<&str, std::ops::Range<usize>> = setup
            .trained
            .iter()
            .zip(&splits)
            .map(|(n, s)| (n.as_str(), s.owned(rank)))
            .collect();
        let mut weights = crate::model::weights::Weights::load_rows(
            &opts.files.checkpoint.shards,
            DType::F32,
            &opts.device,
            |name, _| owned.get(name).cloned(),
        )
        .context("cannot load this rank's shards of the base model")?;
        let mut params = Vec::with_capacity(setup.trained.len());
        for name in &setup.trained {
            // Taken out one at a time: loading peaks near one copy of this rank's rows.
            params.push(Param::new(
                name.clone(),
                unit_of(name)?,
                weights.take(name)?,
                compute,
                backend.masters(),
            )?);
        }
        drop(weights);
        let trained: std::collections::BTreeSet<&str> =
            setup.trained.iter().map(String::as_str).collect();
        let frozen_weights = crate::model::weights::Weights::load_rows(
            &opts.files.checkpoint.shards,
            compute,
            &opts.device,
            |name, shape| {
                (name.starts_with(params::TRAINABLE_PREFIX) && !trained.contains(name))
                    .then(|| 0..shape.first().copied().unwrap_or(1))
            },
        )
        .context("cannot load the frozen tensors of the base model")?;
        let frozen: BTreeMap<String, Tensor> = frozen_weights
            .names_with_prefix(params::TRAINABLE_PREFIX)
            .into_iter()
            .map(|n| {
                let t = frozen_weights.get_any(&n)?;
                Ok((n, t))
            })
            .collect::<Result<_>>()?;
        drop(frozen_weights);
        let text = params.iter().position(|p| p.name == TEXT_EMBEDDING);
        let mut units: Vec<UnitShards> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            if Some(i) == text {
                continue;
            }
            match units.last_mut() {
                Some(u) if u.unit == p.unit => u.members.push(i),
                _ => units.push(UnitShards {
                    unit: p.unit,
                    members: vec![i],
                    layout: FlatLayout::new(&[], world, rank),
                }),
            }
        }
        for u in &mut units {
            let s: Vec<Vec<usize>> = u.members.iter().map(|&i| shapes[i].clone()).collect();
            u.layout = FlatLayout::new(&s, world, rank);
        }
        let masters: Vec<Tensor> = params.iter().map(|p| p.master()).collect();
        let mut adam = AdamState::zeros(&masters)?;
        drop(masters);
        let RunSetup {
            dataset,
            speaker,
            identity,
            mut sampler,
            ..
        } = setup;
        let (mut step, mut last_loss) = (0, None);
        let resume = run::find_resume(&opts, &identity, &dataset, fresh)?;
        if let Some(r) = &resume {
            let mut reader = RowReader::open(&r.dir)?;
            for (i, p) in params.iter_mut().enumerate() {
                anyhow::ensure!(
                    reader.index.params.get(&p.name).map(|x| &x.shape) == Some(&shapes[i]),
                    "checkpoint {}: {} has another shape than the base model's {:?}",
                    r.dir.display(),
                    p.name,
                    shapes[i]
                );
                let rows = splits[i].owned(rank);
                p.set_master(reader.rows("master", &p.name, rows.clone(), &opts.device)?)?;
                adam.m[i] = reader.rows("exp_avg", &p.name, rows.clone(), &opts.device)?;
                adam.v[i] = reader.rows("exp_avg_sq", &p.name, rows, &opts.device)?;
            }
            adam.step = r.index.optimizer.step;
            step = r.index.step;
            sampler = run::resumed_sampler(&opts, &dataset, r.cursor);
            last_loss = r.index.loss;
        }
        let t = &cfg.talker_config;
        let rope = Rope::new(t.head_dim, t.rope_theta, &opts.device)?;
        let total = RunSetup::total_steps(&opts, &sampler);
        let mut trainer = Self {
            coll,
            mode,
            backend,
            compute,
            layout: LayoutIds::from_config(&cfg),
            schedule: RunSetup::schedule(&opts, total),
            adamw: AdamW::new(opts.config.weight_decay),
            cfg,
            dataset,
            sampler,
            speaker,
            identity,
            step,
            adam,
            params,
            shapes,
            splits,
            units,
            text,
            frozen,
            rope,
            replica: None,
            tag,
            resumed_from: resume.as_ref().map(|r| r.dir.clone()),
            data_changed: resume.as_ref().is_some_and(|r| r.data_changed),
            opts,
            last_loss,
        };
        if mode == ShardMode::GradOp {
            trainer.replica = Some(trainer.build_replica()?);
        }
        Ok(trainer)
    }

    pub fn rank(&self) -> usize {
        self.coll.rank()
    }

    pub fn world(&self) -> usize {
        self.coll.world()
    }

    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }

    pub fn total_steps(&self) -> usize {
        RunSetup::total_steps(&self.opts, &self.sampler)
    }

    /// Bytes of this rank's fp32 masters, both moments and gradient shards: what sharding
    /// divides by the number of ranks (docs/distributed.md §7).
    pub fn state_bytes(&self) -> usize {
        16 * self.params.iter().map(Param::elem_count).sum::<usize>()
    }

    /// Trained parameters of the whole run (every rank's rows).
    pub fn full_parameters(&self) -> usize {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    /// The largest unit once gathered, in bytes of the compute dtype.
    pub fn largest_unit_bytes(&self) -> usize {
        let size = self.compute.size_in_bytes();
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

    /// All-gathers unit `u`: its full tensors in the compute dtype, as `Var`s when `vars`.
    fn gather(&self, u: usize, vars: bool) -> Result<(UnitSource<'_>, Vec<Var>)> {
        let unit = &self.units[u];
        let shards: Vec<Tensor> = unit
            .members
            .iter()
            .map(|&i| self.params[i].var.as_tensor().clone())
            .collect();
        let fulls = unit.layout.gather(self.coll.as_ref(), &shards)?;
        let mut tensors = HashMap::new();
        let mut out = Vec::new();
        for (&i, full) in unit.members.iter().zip(fulls) {
            let t = if vars {
                let v = Var::from_tensor(&full)?;
                let t = v.as_tensor().clone();
                out.push(v);
                t
            } else {
                full
            };
            tensors.insert(self.params[i].name.clone(), t);
        }
        Ok((
            UnitSource {
                tensors,
                frozen: &self.frozen,
            },
            out,
        ))
    }

    /// Sums `acc` (unit `u`'s full f32 gradients from this rank's micro-batches; `None` = zero)
    /// over the ranks into this rank's rows, stored at the parameters' indices in `out`.
    fn reduce(&self, u: usize, acc: Vec<Option<Tensor>>, out: &mut [Option<Tensor>]) -> Result<()> {
        let unit = &self.units[u];
        let fulls = unit
            .members
            .iter()
            .zip(acc)
            .map(|(&i, g)| match g {
                Some(g) => Ok(g),
                None => Ok(Tensor::zeros(
                    self.shapes[i].as_slice(),
                    DType::F32,
                    &self.opts.device,
                )?),
            })
            .collect::<Result<Vec<_>>>()?;
        let shards = unit.layout.reduce_scatter(self.coll.as_ref(), &fulls)?;
        for (&i, g) in unit.members.iter().zip(shards) {
            out[i] = Some(g);
        }
        Ok(())
    }

    fn unit_index(&self, unit: Unit) -> Result<usize> {
        self.units
            .iter()
            .position(|u| u.unit == unit)
            .with_context(|| format!("unit {unit} has no trained tensor: sharded training trains every unit (freeze fewer tensors)"))
    }

    /// The step's distinct text ids, sorted (the same on every rank).
    fn step_text_ids(&self, micro: &[Vec<usize>]) -> Vec<u32> {
        let mut ids: Vec<u32> = micro
            .iter()
            .flatten()
            .flat_map(|&s| self.dataset.samples[s].text_ids.iter().copied())
            .chain(self.layout.text_specials())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    fn build_micro(&self, index: usize, samples: &[usize], text_ids: &[u32]) -> Result<Micro> {
        let s: Vec<&super::data::Sample> =
            samples.iter().map(|&i| &self.dataset.samples[i]).collect();
        let batch = Batch::build(&s, &self.layout);
        let dev = &self.opts.device;
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
            self.compute,
            self.backend.numerics(),
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
        let (rank, world) = (self.rank(), self.world());
        self.opts.hooks.step_start(self.step + 1, rank);
        let epoch = self.sampler.cursor().epoch;
        let text_ids = self.step_text_ids(micro);
        let mine: Vec<Micro> = (0..micro.len())
            .filter(|i| i % world == rank)
            .map(|i| self.build_micro(i, &micro[i], &text_ids))
            .collect::<Result<_>>()?;
        let rows = match self.text {
            Some(t) => Some(gather_rows(
                self.coll.as_ref(),
                &self.splits[t],
                self.params[t].var.as_tensor(),
                &text_ids,
            )?),
            None => None,
        };
        let pass = match self.mode {
            ShardMode::Full => self.full_pass(&mine, rows.as_ref(), micro, epoch)?,
            ShardMode::GradOp => self.grad_op_pass(&mine, rows.as_ref(), micro, epoch)?,
        };
        self.apply(pass, &text_ids, epoch, micro.len(), t0)
    }

    /// Agrees on the step's losses (sums over every rank's micro-batches); when any micro-batch's
    /// loss is not finite, every rank fails with the same message naming its manifest lines.
    fn agree_losses(
        &self,
        local: &[Local],
        micro: &[Vec<usize>],
        epoch: usize,
    ) -> Result<[f64; 4]> {
        let step = self.step + 1;
        let mut sums = [0.0f64; 4];
        let mut bad = f64::NEG_INFINITY;
        for l in local {
            let total = self.opts.hooks.loss(step, self.rank(), l.total);
            if !total.is_finite() {
                bad = bad.max(-(l.index as f64));
            } else {
                sums[0] += total;
            }
            sums[1] += l.talker;
            sums[2] += l.sub;
            sums[3] += l.frames as f64;
        }
        let all = self.coll.all_reduce_host(&sums, ReduceOp::Sum)?;
        let first_bad = self.coll.all_reduce_host(&[bad], ReduceOp::Max)?[0];
        if first_bad.is_finite() {
            let index = (-first_bad) as usize;
            let lines: Vec<String> = micro[index]
                .iter()
                .map(|&i| self.dataset.samples[i].line.to_string())
                .collect();
            bail!(
                "the loss became NaN at step {step} (epoch {}, manifest lines {} of {}); this \
                 step was not applied and nothing was saved for it",
                epoch + 1,
                lines.join(", "),
                self.dataset.manifest.display()
            );
        }
        Ok([all[0], all[1], all[2], all[3]])
    }

    /// FULL_SHARD: the forward pass unit by unit, then the backward pass unit by unit in reverse,
    /// recomputing each unit from its saved inputs.
    fn full_pass(
        &self,
        mine: &[Micro],
        rows: Option<&Tensor>,
        micro: &[Vec<usize>],
        epoch: usize,
    ) -> Result<Pass> {
        let numerics = self.backend.numerics();
        let in_place = self.backend.in_place();
        let cfg = &self.cfg;
        let tcfg = DecoderConfig::talker(&cfg.talker_config)?;
        let layers = cfg.talker_config.num_hidden_layers;
        let emb_u = self.unit_index(Unit::Embeddings)?;
        let head_u = self.unit_index(Unit::Head)?;
        let cp_u = self.unit_index(Unit::CodePredictor)?;
        let layer_u: Vec<usize> = (0..layers)
            .map(|l| self.unit_index(Unit::Layer(l)))
            .collect::<Result<_>>()?;
        let layer_name = |l: usize| format!("talker.model.layers.{l}");
        let table = self.text_table(rows)?;

        // Forward, keeping every unit's inputs.
        let embedded: Vec<Embedded> = {
            let (src, _) = self.gather(emb_u, false)?;
            let unit = EmbeddingUnit::load(&src, cfg, numerics)?;
            mine.iter()
                .map(|m| {
                    let text = TextRows {
                        table: &table,
                        ids: &m.text_ids,
                    };
                    unit.forward(&m.batch, &self.speaker, text)
                })
                .collect::<candle_core::Result<_>>()?
        };
        let mut inputs: Vec<Vec<Tensor>> = Vec::with_capacity(layers);
        let mut x: Vec<Tensor> = embedded.iter().map(|e| e.inputs.clone()).collect();
        for (l, &u) in layer_u.iter().enumerate() {
            let (src, _) = self.gather(u, false)?;
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
            let (src, _) = self.gather(head_u, false)?;
            let head = HeadUnit::load(&src, cfg, numerics)?;
            mine.iter()
                .zip(&head_in)
                .map(|(m, x)| head.forward(x, &m.batch))
                .collect::<candle_core::Result<Vec<_>>>()?
                .into_iter()
                .unzip()
        };
        let l_sub: Vec<Tensor> = {
            let (src, _) = self.gather(cp_u, false)?;
            let cp = CodePredictor::load_parts(&src, cfg, numerics, false)?;
            mine.iter()
                .zip(&frame_hidden)
                .zip(&embedded)
                .map(|((m, fh), e)| {
                    sub_loss(&cp, fh, &e.c0_embed, &e.sub_embeds, &m.batch.frame_codes)
                })
                .collect::<candle_core::Result<_>>()?
        };
        let mut local = Vec::with_capacity(mine.len());
        for ((m, lt), ls) in mine.iter().zip(&l_talker).zip(&l_sub) {
            let (lt, ls) = (scalar(lt)?, scalar(ls)?);
            local.push(Local {
                index: m.index,
                total: lt + SUB_LOSS_WEIGHT * ls,
                talker: lt,
                sub: ls,
                frames: m.frames,
            });
        }
        let sums = self.agree_losses(&local, micro, epoch)?;
        drop((l_talker, l_sub));

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
            let (src, vars) = self.gather(cp_u, true)?;
            let cp = CodePredictor::load_parts(&src, cfg, numerics, false)?;
            let mut acc = vec![None; vars.len()];
            for ((m, fh), e) in mine.iter().zip(&frame_hidden).zip(&embedded) {
                let fh = Var::from_tensor(fh)?;
                let c0 = Var::from_tensor(&e.c0_embed)?;
                let sb = Var::from_tensor(&e.sub_embeds)?;
                let l = sub_loss(
                    &cp,
                    fh.as_tensor(),
                    c0.as_tensor(),
                    sb.as_tensor(),
                    &m.batch.frame_codes,
                )?;
                let g = (l * (SUB_LOSS_WEIGHT * scale))?.backward()?;
                accumulate_vars(&g, &vars, &mut acc, in_place)?;
                d_fh.push(grad_or_zero(&g, &fh)?);
                d_c0.push(grad_or_zero(&g, &c0)?);
                d_sub.push(grad_or_zero(&g, &sb)?);
            }
            self.reduce(cp_u, acc, &mut grads)?;
        }
        let mut d_x: Vec<Tensor> = Vec::with_capacity(mine.len());
        {
            let (src, vars) = self.gather(head_u, true)?;
            let head = HeadUnit::load(&src, cfg, numerics)?;
            let mut acc = vec![None; vars.len()];
            for ((m, x), dfh) in mine.iter().zip(&head_in).zip(&d_fh) {
                let xv = Var::from_tensor(x)?;
                let (lt, fh) = head.forward(xv.as_tensor(), &m.batch)?;
                let g = ((lt * scale)? + (fh * dfh)?.sum_all()?)?.backward()?;
                accumulate_vars(&g, &vars, &mut acc, in_place)?;
                d_x.push(grad_or_zero(&g, &xv)?);
            }
            self.reduce(head_u, acc, &mut grads)?;
        }
        for (l, &u) in layer_u.iter().enumerate().rev() {
            let (src, vars) = self.gather(u, true)?;
            let layer = DecoderLayer::load(&src, &layer_name(l), tcfg, numerics)?;
            let mut acc = vec![None; vars.len()];
            let mut next = Vec::with_capacity(mine.len());
            for ((m, x), dout) in mine.iter().zip(&inputs[l]).zip(&d_x) {
                let xv = Var::from_tensor(x)?;
                let out = layer.forward(xv.as_tensor(), &m.ctx, None)?;
                let g = (out * dout)?.sum_all()?.backward()?;
                accumulate_vars(&g, &vars, &mut acc, in_place)?;
                next.push(grad_or_zero(&g, &xv)?);
            }
            d_x = next;
            self.reduce(u, acc, &mut grads)?;
        }
        let mut text_grad: Option<Tensor> = None;
        {
            let (src, vars) = self.gather(emb_u, true)?;
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
                    &self.speaker,
                    TextRows {
                        table: &t,
                        ids: &m.text_ids,
                    },
                )?;
                let obj = (((e.inputs * &d_x[k])?.sum_all()?
                    + (e.c0_embed * &d_c0[k])?.sum_all()?)?
                    + (e.sub_embeds * &d_sub[k])?.sum_all()?)?;
                let g = obj.backward()?;
                accumulate_vars(&g, &vars, &mut acc, in_place)?;
                if let Some(v) = &rows_var {
                    if let Some(t) = g.get(v.as_tensor()) {
                        add_into(&mut text_grad, t, in_place)?;
                    }
                }
            }
            self.reduce(emb_u, acc, &mut grads)?;
        }
        Ok(Pass {
            sums,
            grads,
            text_grad,
        })
    }

    /// SHARD_GRAD_OP: every local micro-batch forward and backward on the replicated model, the
    /// summed gradients reduced once per unit.
    fn grad_op_pass(
        &self,
        mine: &[Micro],
        rows: Option<&Tensor>,
        micro: &[Vec<usize>],
        epoch: usize,
    ) -> Result<Pass> {
        let replica = self
            .replica
            .as_ref()
            .context("grad-op mode without a replica")?;
        let in_place = self.backend.in_place();
        let table = self.text_table(rows)?;
        let rows_var = rows.map(Var::from_tensor).transpose()?;
        let scale = 1.0 / micro.len() as f64;
        let names: Vec<&str> = self.params.iter().map(|p| p.name.as_str()).collect();
        let mut full: Vec<Option<Tensor>> = vec![None; self.params.len()];
        let mut text_grad: Option<Tensor> = None;
        let mut local = Vec::with_capacity(mine.len());
        for m in mine {
            let t = match &rows_var {
                Some(v) => v.as_tensor().clone(),
                None => table.clone(),
            };
            let l = loss::sft_loss_with(
                &replica.talker,
                &m.batch,
                &self.speaker,
                Some(TextRows {
                    table: &t,
                    ids: &m.text_ids,
                }),
            )?;
            let (lt, ls) = (scalar(&l.talker)?, scalar(&l.sub)?);
            local.push(Local {
                index: m.index,
                total: scalar(&l.total)?,
                talker: lt,
                sub: ls,
                frames: m.frames,
            });
            let g = (l.total * scale)?.backward()?;
            for (i, name) in names.iter().enumerate() {
                if Some(i) == self.text {
                    continue;
                }
                if let Some(t) = replica.vars.get(*name).and_then(|v| g.get(v.as_tensor())) {
                    add_into(&mut full[i], t, in_place)?;
                }
            }
            if let Some(v) = &rows_var {
                if let Some(t) = g.get(v.as_tensor()) {
                    add_into(&mut text_grad, t, in_place)?;
                }
            }
        }
        let sums = self.agree_losses(&local, micro, epoch)?;
        let mut grads: Vec<Option<Tensor>> = vec![None; self.params.len()];
        for u in 0..self.units.len() {
            let acc = self.units[u]
                .members
                .iter()
                .map(|&i| full[i].take())
                .collect();
            self.reduce(u, acc, &mut grads)?;
        }
        Ok(Pass {
            sums,
            grads,
            text_grad,
        })
    }

    /// Reduces the text rows' gradient to their owners, clips on the global norm, takes the
    /// AdamW step on this rank's rows and (grad-op) refreshes the replicas.
    fn apply(
        &mut self,
        pass: Pass,
        text_ids: &[u32],
        epoch: usize,
        n: usize,
        t0: Instant,
    ) -> Result<StepMetrics> {
        let in_place = self.backend.in_place();
        let Pass {
            sums,
            mut grads,
            text_grad,
        } = pass;
        let mut rows_grad: Option<RowGrad> = None;
        if let Some(t) = self.text {
            let width = self.shapes[t][1];
            let g = match text_grad {
                Some(g) => g,
                None => Tensor::zeros((text_ids.len(), width), DType::F32, &self.opts.device)?,
            };
            let (local, summed) =
                reduce_scatter_rows(self.coll.as_ref(), &self.splits[t], &g, text_ids)?;
            let owned = self.splits[t].owned(self.rank()).len();
            if in_place {
                let mut rg = RowGrad::new(owned, width);
                rg.add(&local, &summed.flatten_all()?.to_vec1::<f32>()?)?;
                rows_grad = Some(rg);
            } else {
                let dense = Tensor::zeros((owned, width), DType::F32, &self.opts.device)?;
                let ids = Tensor::new(local.as_slice(), &self.opts.device)?;
                grads[t] = Some(if local.is_empty() {
                    dense
                } else {
                    dense.index_add(&ids, &summed, 0)?
                });
            }
        }
        let mut sum_sq = 0f64;
        for (i, g) in grads.iter().enumerate() {
            sum_sq += match (g, &rows_grad) {
                (Some(g), _) => optim::sum_squares(g, in_place)?,
                (None, Some(r)) if Some(i) == self.text => r.sum_squares(),
                (None, _) => 0.0,
            };
        }
        let grad_norm = self.coll.all_reduce_host(&[sum_sq], ReduceOp::Sum)?[0].sqrt();
        if !grad_norm.is_finite() {
            bail!(
                "the gradient norm became {grad_norm} at step {}; this step was not applied and \
                 nothing was saved for it",
                self.step + 1
            );
        }
        let clip = optim::clip_factor(grad_norm, self.opts.config.clip_norm);
        let lr = self.schedule.lr(self.step + 1);
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
        self.adamw
            .step(&mut self.adam, &mut self.params, &grads, lr, clip, in_place)?;
        if self.mode == ShardMode::GradOp {
            self.refresh_replica()?;
        }
        self.step += 1;
        let loss = sums[0] / n as f64;
        self.last_loss = Some(loss);
        Ok(StepMetrics {
            step: self.step,
            epoch,
            loss,
            loss_talker: sums[1] / n as f64,
            loss_sub: sums[2] / n as f64,
            grad_norm,
            lr,
            frames: sums[3] as usize,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// The text table as a one-tensor flat layout (grad-op gathers it whole).
    fn text_layout(&self, t: usize) -> FlatLayout {
        FlatLayout::new(
            std::slice::from_ref(&self.shapes[t]),
            self.world(),
            self.rank(),
        )
    }

    /// grad-op: every trained tensor gathered in full, as `Var`s, and the model built on them.
    fn build_replica(&self) -> Result<Replica> {
        let mut vars = BTreeMap::new();
        for u in 0..self.units.len() {
            let (src, gathered) = self.gather(u, true)?;
            drop(src);
            for (&i, v) in self.units[u].members.iter().zip(gathered) {
                vars.insert(self.params[i].name.clone(), v);
            }
        }
        if let Some(t) = self.text {
            let table = self
                .text_layout(t)
                .gather(
                    self.coll.as_ref(),
                    &[self.params[t].var.as_tensor().clone()],
                )?
                .remove(0);
            vars.insert(self.params[t].name.clone(), Var::from_tensor(&table)?);
        }
        let talker = {
            let tensors: HashMap<String, Tensor> = vars
                .iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
                .collect();
            let src = UnitSource {
                tensors,
                frozen: &self.frozen,
            };
            Talker::from_source(&src, &self.cfg, self.backend.numerics())?
        };
        Ok(Replica { vars, talker })
    }

    /// grad-op: after the update, every replica takes the new values of every tensor.
    fn refresh_replica(&self) -> Result<()> {
        let replica = self
            .replica
            .as_ref()
            .context("grad-op mode without a replica")?;
        for u in 0..self.units.len() {
            let (src, _) = self.gather(u, false)?;
            for &i in &self.units[u].members {
                let name = &self.params[i].name;
                replica.vars[name].set(&src.tensors[name])?;
            }
        }
        if let Some(t) = self.text {
            let table = self
                .text_layout(t)
                .gather(
                    self.coll.as_ref(),
                    &[self.params[t].var.as_tensor().clone()],
                )?
                .remove(0);
            replica.vars[&self.params[t].name].set(&table)?;
        }
        Ok(())
    }

    /// Every tensor's shards over the ranks, for the index.
    fn describe_params(&self) -> BTreeMap<String, ParamInfo> {
        let world = self.world();
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let shards = (0..world)
                    .filter_map(|q| {
                        let own = self.splits[i].owned(q);
                        (!own.is_empty()).then_some(Shard {
                            rank: q,
                            rows: [own.start, own.end],
                        })
                    })
                    .collect();
                (
                    p.name.clone(),
                    ParamInfo {
                        shape: self.shapes[i].clone(),
                        unit: p.unit.to_string(),
                        shards,
                    },
                )
            })
            .collect()
    }

    fn write_rank_file(&self, path: &std::path::Path) -> Result<()> {
        let mut entries = Vec::new();
        let mut sources = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            if p.shape().first() == Some(&0) {
                continue;
            }
            for (kind, t) in [
                ("master", p.master()),
                ("exp_avg", self.adam.m[i].clone()),
                ("exp_avg_sq", self.adam.v[i].clone()),
            ] {
                entries.push(super::stwrite::Entry {
                    name: format!("{kind}.{}", p.name),
                    dtype: safetensors::Dtype::F32,
                    shape: p.shape().to_vec(),
                });
                sources.push(t);
            }
        }
        checkpoint::write_tensors(path, &entries, |i| super::stwrite::f32_bytes(&sources[i]))
    }

    /// Saves a checkpoint: every rank writes its rows into the directory rank 0 created, and
    /// rank 0 commits it once every rank's file is complete. Returns the directory (on rank 0).
    pub fn save(&self) -> Result<Option<PathBuf>> {
        let (rank, root) = (self.rank(), &self.opts.checkpoints);
        let pending = if rank == 0 {
            Some(PendingCheckpoint::begin(root, self.step, &self.tag)?)
        } else {
            None
        };
        self.coll.barrier()?;
        let dir = PendingCheckpoint::join(root, self.step, &self.tag).dir;
        let written = self.write_rank_file(&dir.join(checkpoint::rank_file(rank)));
        let failed = self
            .coll
            .all_reduce_host(&[if written.is_ok() { 0.0 } else { 1.0 }], ReduceOp::Sum)?[0];
        if failed > 0.0 {
            if let Some(p) = pending {
                p.abandon();
            }
            written.with_context(|| format!("cannot write checkpoint {}", dir.display()))?;
            bail!(
                "another rank could not write its part of checkpoint step {}",
                self.step
            );
        }
        let out = match pending {
            Some(p) => {
                checkpoint::SpeakerSnapshot::new(&self.identity.speakers, &self.speaker)?
                    .write(&p.dir)?;
                let index = IndexParts {
                    identity: &self.identity,
                    dataset: &self.dataset,
                    cursor: self.sampler.cursor(),
                    step: self.step,
                    adamw: &self.adamw,
                    adam_step: self.adam.step,
                    loss: self.last_loss,
                    world_size: self.world(),
                }
                .index(self.describe_params());
                Some(p.commit(&index, self.opts.config.keep, self.opts.hooks.as_ref())?)
            }
            None => None,
        };
        self.coll.barrier()?;
        Ok(out)
    }

    /// Trains until the total step count or an agreed stop; checkpoints on the way and at the
    /// end. Progress, metrics and the loss plot are rank 0's.
    pub fn run(&mut self) -> Result<Outcome> {
        let total = self.total_steps();
        let rank0 = self.rank() == 0;
        let mut outcome = Outcome {
            start_step: self.step,
            step: self.step,
            total_steps: total,
            checkpoint: self.resumed_from.clone(),
            interrupted: false,
            first_loss: None,
            last_loss: None,
            frames_per_second: None,
        };
        if self.step >= total {
            return Ok(outcome);
        }
        let log = if rank0 {
            Some(MetricsLog::open(&self.opts.checkpoints, self.step)?)
        } else {
            None
        };
        signal::install();
        let progress = if rank0 {
            Progress::new(total as u64, "steps", "train")
        } else {
            Progress::hidden(total as u64)
        };
        progress.set_position(self.step as u64);
        let c = self.opts.config.clone();
        let (mut frames, mut seconds) = (0usize, 0f64);
        while self.step < total {
            let micro = self.sampler.next_step(c.grad_accum);
            let device = self.opts.device.clone();
            let m = match super::run_step(&device, || self.step(&micro)) {
                Ok(m) => m,
                Err(e) => {
                    progress.finish();
                    signal::restore();
                    return Err(e);
                }
            };
            if let Some(log) = &log {
                log.append(&m)?;
            }
            frames += m.frames;
            seconds += m.seconds;
            outcome.first_loss.get_or_insert(m.loss);
            outcome.last_loss = Some(m.loss);
            outcome.step = self.step;
            let fps = frames as f64 / seconds.max(1e-9);
            outcome.frames_per_second = Some(fps);
            progress.set_position(self.step as u64);
            progress.set_message(format!(
                "epoch {}/{} · loss {:.4} (talker {:.4}, sub {:.4}) · lr {:.2e} · {:.0} frames/s · {} ranks",
                m.epoch + 1,
                c.epochs,
                m.loss,
                m.loss_talker,
                m.loss_sub,
                m.lr,
                fps,
                self.world()
            ));
            self.opts.hooks.after_step(self.step);
            let stop = self.coll.all_reduce_host(
                &[if signal::stop_requested() { 1.0 } else { 0.0 }],
                ReduceOp::Max,
            )?[0]
                > 0.0;
            let due = c.save_every > 0 && self.step.is_multiple_of(c.save_every);
            if due || stop || self.step == total {
                let dir = self.save()?;
                if let (Some(log), Some(dir)) = (&log, &dir) {
                    log.plot()?;
                    let shown = match self.opts.checkpoints.parent() {
                        Some(base) => crate::fsutil::display_relative(dir, base),
                        None => dir.display().to_string(),
                    };
                    progress.println(format!(
                        "step {}/{total}: loss {:.4}; saved {shown}",
                        self.step, m.loss
                    ));
                    outcome.checkpoint = Some(dir.clone());
                }
            }
            if stop {
                outcome.interrupted = true;
                break;
            }
        }
        progress.finish();
        signal::restore();
        Ok(outcome)
    }
}

/// A rank's loss values of one micro-batch.
struct Local {
    index: usize,
    total: f64,
    talker: f64,
    sub: f64,
    frames: usize,
}

/// What a step's forward and backward passes leave for the update.
struct Pass {
    /// Σ loss, Σ L_talker, Σ L_sub, Σ frames over every rank's micro-batches.
    sums: [f64; 4],
    /// This rank's rows of every parameter's gradient (the text table's comes separately).
    grads: Vec<Option<Tensor>>,
    /// The step's text rows' gradient from this rank's micro-batches, `(ids, width)`.
    text_grad: Option<Tensor>,
}

fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64)
}

/// `acc += g` in f32 (in place with the CPU kernels).
fn add_into(acc: &mut Option<Tensor>, g: &Tensor, in_place: bool) -> Result<()> {
    let g = g.to_dtype(DType::F32)?;
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
    in_place: bool,
) -> Result<()> {
    for (v, a) in vars.iter().zip(acc.iter_mut()) {
        if let Some(g) = grads.get(v.as_tensor()) {
            add_into(a, g, in_place)?;
        }
    }
    Ok(())
}
