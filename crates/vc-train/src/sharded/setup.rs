//! Setting up one rank (docs/distributed.md §4, §6): this rank's rows of every trained tensor
//! (its shard within its group, docs/distributed.md §4.7) from the base model or from the newest checkpoint
//! (written at any world size and grouping), the frozen tensors, the units, and the repair of
//! what an interrupted checkpoint write left — by rank 0 alone, before the others look.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

use super::units::group_units;
use super::{ShardedTrainer, PREDICTOR_CHUNK_FRAMES};
use crate::checkpoint::RowReader;
use crate::optim::saved_state;
use crate::optim::AdamState;
use crate::run_setup::RunSetup;
use crate::run_state::RunState;
use crate::step::lora::Lora;
use crate::step::params::Param;
use crate::step::trainable;
use crate::step::units::{unit_of, Unit};
use crate::{Backend, TrainOptions, TEXT_EMBEDDING};
use vc_core::config::Shard as ShardMode;
use vc_dist::shard::RowSplit;
use vc_dist::Mesh;
use vc_model::ops::Rope;
use vc_model::weights::Weights;

impl ShardedTrainer {
    /// Loads this rank's shards (from the base model, or from the newest checkpoint of the run,
    /// written at any world size) and the frozen tensors. `mesh`: the run's communicators;
    /// this rank's shard is its place in its group.
    pub fn new(
        opts: TrainOptions,
        mesh: Mesh,
        mode: ShardMode,
        tag: String,
        fresh: bool,
    ) -> Result<Self> {
        // Tensors split over the ranks of the group; `rank` here is this rank's place in it.
        let (rank, world) = (mesh.shard.rank(), mesh.shard.world());
        let backend = opts.backend;
        let (storage, arith) = (backend.storage_dtype(), backend.arith_dtype(&opts.device));
        let setup = RunSetup::new(&opts)?;
        let cfg = setup.cfg.clone();
        let shapes = setup.shapes.clone();
        let splits: Vec<RowSplit> = shapes
            .iter()
            .map(|s| RowSplit::new(s.first().copied().unwrap_or(1), world))
            .collect();
        let owned: HashMap<&str, Range<usize>> = setup
            .trained
            .iter()
            .zip(&splits)
            .map(|(n, s)| (n.as_str(), s.owned(rank)))
            .collect();
        let mut params = load_owned_rows(
            &opts,
            &setup.trained,
            &shapes,
            &owned,
            storage,
            backend,
            setup.lora.as_ref(),
        )?;
        let frozen = load_frozen(&opts, &setup.trained, storage)?;
        let text = params.iter().position(|p| p.name == TEXT_EMBEDDING);
        let units = group_units(
            &Unit::all(cfg.talker_config.num_hidden_layers),
            params.iter().enumerate().map(|(i, p)| (i, p.unit)),
            text,
            &shapes,
            world,
            rank,
        )?;
        let state_mode = opts.config.optimizer_state;
        let full_shape: HashMap<&str, &[usize]> = setup
            .trained
            .iter()
            .zip(&shapes)
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        let mut adam = AdamState::zeros(&params, |p| {
            saved_state::eight_bit(state_mode, full_shape[p.name.as_str()])
        })?;
        drop(full_shape);
        let adapters = setup.lora.as_ref().map(Lora::spec);
        let reporter = mesh.world.rank() == 0;
        let (run, resume) = RunState::start(opts, setup, reporter, || mesh.world.barrier(), fresh)?;
        if let Some(r) = &resume {
            let mut reader = RowReader::open(&r.dir)?;
            for (i, p) in params.iter_mut().enumerate() {
                anyhow::ensure!(
                    reader.index.params.get(&p.name).map(|x| &x.shape) == Some(&shapes[i]),
                    "checkpoint {}: {} has another shape than this run's {:?}",
                    r.dir.display(),
                    p.name,
                    shapes[i]
                );
                let rows = splits[i].owned(rank);
                if rows.is_empty() {
                    continue;
                }
                let dev = p.state_device();
                let (m, v) = saved_state::restore(
                    &mut reader,
                    r.index.optimizer.state,
                    state_mode,
                    p,
                    &shapes[i],
                    rows,
                    &dev,
                )?;
                adam.m[i] = m;
                adam.v[i] = v;
            }
            adam.step = r.index.optimizer.step;
        }
        let t = &run.cfg.talker_config;
        let rope = Rope::new(t.head_dim, t.rope_theta, &run.opts.device)?;
        let prefetch = if world > 1 {
            run.opts.config.prefetch
        } else {
            0
        };
        let overlap = run.opts.config.prefetch > 0 && (world > 1 || mesh.replicas.is_some());
        let mut trainer = Self {
            mesh,
            prefetch,
            overlap,
            mode,
            storage,
            arith,
            run,
            adam,
            params,
            shapes,
            splits,
            units,
            text,
            frozen,
            adapters,
            rope,
            replica: None,
            tag,
            predictor_chunk: PREDICTOR_CHUNK_FRAMES,
        };
        if mode == ShardMode::GradOp {
            trainer.replica = Some(trainer.build_replica()?);
        }
        Ok(trainer)
    }
}

/// This rank's rows of every trained tensor as parameters with fp32 masters, adapter factors
/// from their first values (docs/training.md §13). A tensor of which the rank owns no rows
/// becomes an empty parameter on the CPU: no device ever sees it.
fn load_owned_rows(
    opts: &TrainOptions,
    trained: &[String],
    shapes: &[Vec<usize>],
    owned: &HashMap<&str, Range<usize>>,
    storage: DType,
    backend: Backend,
    lora: Option<&Lora>,
) -> Result<Vec<Param>> {
    let place = backend.placement(opts);
    let mut weights = Weights::load_rows(
        &opts.files.checkpoint.shards,
        DType::F32,
        &place.state_device(),
        |name, _| owned.get(name).filter(|r| !r.is_empty()).cloned(),
    )
    .context("cannot load this rank's shards of the base model")?;
    let mut params = Vec::with_capacity(trained.len());
    for (name, shape) in trained.iter().zip(shapes) {
        let empty = owned[name.as_str()].is_empty();
        let master = if empty {
            let mut empty = shape.clone();
            empty[0] = 0;
            Tensor::zeros(empty, DType::F32, &Device::Cpu)?
        } else if let Some(first) = lora
            .map(|l| l.initial(name, &place.state_device()))
            .transpose()?
            .flatten()
        {
            let rows = &owned[name.as_str()];
            first.narrow(0, rows.start, rows.len())?.contiguous()?
        } else {
            // Taken out one at a time: loading peaks near one copy of this rank's rows.
            weights.take(name)?
        };
        params.push(Param::new(
            name.clone(),
            unit_of(name)?,
            master,
            storage,
            backend.masters(opts.config.optimizer_state, shape),
            // A rank's empty shard stays on the CPU: no device ever sees it.
            if empty { &Device::Cpu } else { &place.device },
            place.offload,
        )?);
    }
    Ok(params)
}

/// The talker tensors nobody trains, whole on every rank, in the storage dtype.
fn load_frozen(
    opts: &TrainOptions,
    trained: &[String],
    storage: DType,
) -> Result<BTreeMap<String, Tensor>> {
    let trained: BTreeSet<&str> = trained.iter().map(String::as_str).collect();
    let weights = Weights::load_rows(
        &opts.files.checkpoint.shards,
        storage,
        &opts.device,
        |name, shape| {
            (name.starts_with(trainable::TRAINABLE_PREFIX) && !trained.contains(name))
                .then(|| 0..shape.first().copied().unwrap_or(1))
        },
    )
    .context("cannot load the frozen tensors of the base model")?;
    weights
        .names_with_prefix(trainable::TRAINABLE_PREFIX)
        .into_iter()
        .map(|n| {
            let t = weights.get_any(&n)?;
            Ok((n, t))
        })
        .collect()
}
