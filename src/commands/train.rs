//! `voiceclone train`: plans the run, then trains on one device — or starts or joins a sharded
//! run ([`super::train_ranks`]) — from inputs made ready first ([`super::train_setup`]: codes,
//! speaker embeddings, the base model's files), and exports the result to `model/`.

use std::sync::Arc;

use anyhow::Result;

use super::train_setup::{
    finish, fresh_start, move_aside_if_fresh, placement, prepare, print_resumed, print_start,
    require_manifest, train_device,
};
use crate::cli::TrainArgs;
use vc_core::config::Config;
use vc_core::workspace::Workspace;
use vc_train::{self as train, Trainer};

pub fn run(ws: &Workspace, config: &Config, args: &TrainArgs) -> Result<()> {
    if args.plan {
        return super::train_plan::print(ws, config, args);
    }
    if let Some(env) = vc_dist::env::RankEnv::from_env()? {
        return super::train_ranks::run_rank(ws, config, args, env);
    }
    let c = &config.train;
    if c.gpus > 0 || c.cpu_ranks > 0 {
        return super::train_ranks::launch(ws, config, args);
    }
    require_manifest(ws)?;
    let _lock = train::lock::RunLock::acquire(&ws.train_lock())?;
    // Planned before anything is loaded (docs/training.md §6.9).
    let (config, chosen) =
        super::train_plan::choose(ws, config, super::train_plan::PlanTarget::of(config))?;
    let config = &config;
    let c = &config.train;
    if let Some(line) = chosen {
        println!("{line}");
    }
    if c.max_restarts > 0 {
        eprintln!(
            "note: train.max_restarts ({}) applies to sharded runs (--gpus, --cpu-ranks, which our \
             launcher restarts); a run on one device is not restarted: run `voiceclone train` \
             again and it resumes from the last checkpoint",
            c.max_restarts
        );
    }
    if c.shard_group != vc_core::config::ShardGroup::World {
        eprintln!(
            "note: train.shard_group ({}) applies to sharded runs (--gpus, --cpu-ranks, torchrun, \
             Slurm); this run trains on one device",
            c.shard_group
        );
    }
    let run = prepare(ws, config, args)?;
    let device = train_device()?;
    let backend = train::Backend::resolve(c.backend, &device)?;
    let mut opts = run.options(ws, config, device.clone(), backend)?;
    let where_ = placement(backend, &device, c);
    if c.recompute == vc_core::config::Recompute::Layers {
        // Recomputing on one device is the `full` pass of a world of one rank: each unit's
        // input is kept, the unit recomputed for the backward pass (docs/training.md §6.7).
        // Nothing is communicated, so nothing to overlap.
        opts.config.prefetch = 0;
        let coll: Arc<dyn vc_dist::Collective> =
            Arc::new(vc_dist::local::Local::world(1).remove(0));
        let tag = format!("{:x}", std::process::id());
        let mut trainer = train::sharded::ShardedTrainer::new(
            opts,
            vc_dist::Mesh::flat(coll),
            vc_core::config::Shard::Full,
            tag,
            fresh_start(args),
        )?;
        let sizes = (trainer.params.len(), trainer.full_parameters());
        let state = trainer.state_bytes();
        let outcome = announce_and_run(ws, args, config, &mut trainer, sizes, state, &where_)?;
        return finish(ws, config, args, &outcome, &trainer.run.opts);
    }
    let mut trainer = Trainer::new(opts, fresh_start(args))?;
    let sizes = (trainer.params.params.len(), trainer.params.elem_count());
    let state = trainer.state_bytes();
    let outcome = announce_and_run(ws, args, config, &mut trainer, sizes, state, &where_)?;
    finish(ws, config, args, &outcome, &trainer.run.opts)
}

/// Says what a one-device run starts from (its warnings, then a fresh start or the checkpoint
/// it resumes, then what its optimizer state takes) and runs it to the end; `--fresh` moves the
/// previous checkpoints aside once the run's checks have passed. `sizes`: trained tensors and
/// values.
fn announce_and_run(
    ws: &Workspace,
    args: &TrainArgs,
    config: &Config,
    trainer: &mut dyn train::driver::Engine,
    (tensors, values): (usize, usize),
    state: train::optim::StateBytes,
    where_: &str,
) -> Result<train::Outcome> {
    announce(ws, config, trainer.run(), (tensors, values), where_);
    println!("optimizer state: {state}");
    train::driver::run_with(trainer, || move_aside_if_fresh(ws, args))
}

/// Says what a run starts from (on the reporting rank): what setting up found, and the
/// checkpoint it continues or the data and trained set it starts on (`tensors` tensors of
/// `values` values, trained `where_`).
pub(super) fn announce(
    ws: &Workspace,
    config: &Config,
    run: &train::run_state::RunState,
    (tensors, values): (usize, usize),
    where_: &str,
) {
    for w in &run.warnings {
        eprintln!("warning: {w}");
    }
    match &run.resumed_from {
        Some(dir) => print_resumed(
            ws,
            dir,
            run.step,
            run.total_steps(),
            run.data_changed,
            run.sampler.cursor().epoch,
        ),
        None => print_start(
            config,
            tensors,
            values,
            &run.dataset,
            run.heldout.as_ref(),
            run.sampler.steps_per_epoch(config.train.grad_accum),
            where_,
        ),
    }
}
