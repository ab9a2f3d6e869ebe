//! `voiceclone train --gpus N | --cpu-ranks N`, and the rank processes of such a run (ours, or
//! started by torchrun or Slurm): docs/distributed.md §5.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::Device;

use super::train_setup::{finish, move_aside_if_fresh, prepare};
use crate::cli::TrainArgs;
use vc_core::config::Config;
use vc_core::workspace::Workspace;
use vc_dist::env::Launcher;
use vc_dist::launch::{self, LaunchSpec, RankReport};
use vc_dist::tcp::{Endpoint, TcpCollective};
use vc_dist::topology::{Emulation, Groups, Nodes, EMULATE_NETWORK};
use vc_dist::{env::RankEnv, Collective, Mesh, ReduceOp};
use vc_train::driver::NonFinite;
use vc_train::sharded::ShardedTrainer;
use vc_train::{self as train, Backend};

/// Starts the rank processes of a run on this machine and waits for them. The data steps
/// (codes, speaker embedding) happen here, once, before any rank starts (`--fresh` in rank 0,
/// once the run is set up); the workspace stays locked until the last rank has exited.
pub fn launch(ws: &Workspace, config: &Config, args: &TrainArgs) -> Result<()> {
    let c = &config.train;
    let world = c.gpus.max(c.cpu_ranks);
    if c.gpus > 0 && !cfg!(feature = "nccl") {
        bail!(
            "--gpus needs a build with GPU support: cargo build --release --features cuda,nccl \
             (or train on CPU ranks with --cpu-ranks {world})"
        );
    }
    super::train_setup::require_manifest(ws)?;
    let _lock = train::lock::RunLock::acquire(&ws.train_lock())?;
    // One plan for every rank, made here before anything is loaded; the ranks get its choice
    // as flags (docs/training.md §6.9).
    let (config, chosen) =
        super::train_plan::choose(ws, config, super::train_plan::PlanTarget::of(config))?;
    let config = &config;
    if let Some(line) = chosen {
        println!("{line}");
    }
    prepare(ws, config, args)?;
    let env = match config.train.memory {
        vc_core::config::MemoryPolicy::Auto => vec![super::train_plan::chosen_env(config)],
        vc_core::config::MemoryPolicy::Manual => Vec::new(),
    };
    let spec = LaunchSpec {
        world,
        args: std::env::args_os().skip(1).collect(),
        env,
        cpu: c.gpus == 0,
        max_restarts: c.max_restarts,
        progress_file: Some(ws.checkpoints_dir().join(train::checkpoint::LATEST)),
    };
    launch::launch(&spec)
}

/// The device of this rank: its GPU (`LOCAL_RANK`) on a GPU run, else the CPU.
fn rank_device(config: &Config, env: &RankEnv) -> Result<Device> {
    let c = &config.train;
    let gpu = match env.launcher {
        Launcher::Voiceclone => c.gpus > 0,
        // Under torchrun or Slurm: a GPU when this build has them, unless --cpu-ranks says CPU.
        Launcher::Torchrun | Launcher::Slurm => c.cpu_ranks == 0 && cfg!(feature = "cuda"),
    };
    if gpu {
        Device::new_cuda(env.local_rank).with_context(|| {
            format!(
                "rank {} cannot open GPU {} (LOCAL_RANK)",
                env.rank, env.local_rank
            )
        })
    } else {
        Ok(Device::Cpu)
    }
}

/// Where this run's ranks are and how they group (docs/distributed.md §4.7, §8.3): the nodes
/// (from the emulated network, else the launcher's ranks per node), the emulated network, and
/// the shard groups of `train.shard_group`.
fn topology(config: &Config, env: &RankEnv) -> Result<(Nodes, Option<Emulation>, Groups)> {
    let emulation = Emulation::from_env()?;
    let per_node = emulation.map(|e| e.ranks_per_node).or(env.local_world);
    let nodes = per_node.map_or(Nodes::single(env.world), |n| Nodes { ranks_per_node: n });
    let size = super::train_plan::group_size(config.train.shard_group, env.world, per_node)?;
    let groups = Groups::new(env.world, size)?;
    Ok((nodes, emulation, groups))
}

/// The communicators of this rank: NCCL on a GPU, TCP rings on the CPU.
fn connect(ep: &Endpoint, device: &Device, groups: Groups) -> Result<Mesh> {
    if device.is_cuda() {
        if ep.emulation.is_some() {
            bail!("{EMULATE_NETWORK} emulates a network between CPU ranks only; unset it for GPUs");
        }
        #[cfg(feature = "nccl")]
        {
            return vc_dist::nccl::NcclCollective::connect_mesh(ep, device, groups);
        }
        #[cfg(not(feature = "nccl"))]
        bail!("a GPU rank needs a build with --features cuda,nccl");
    }
    let m = TcpCollective::connect_mesh(ep, Vec::new(), groups)?;
    let world: Arc<dyn Collective> = Arc::new(m.world);
    Ok(Mesh {
        shard: match m.shard {
            Some(s) => Arc::new(s),
            None => world.clone(),
        },
        replicas: m.replicas.map(|r| Arc::new(r) as Arc<dyn Collective>),
        world,
    })
}

/// One rank of a sharded run: joins the others, trains its shards, and (rank 0) reports and
/// exports. Any failure is passed to every rank before this one exits.
pub fn run_rank(ws: &Workspace, config: &Config, args: &TrainArgs, env: RankEnv) -> Result<()> {
    let rank = env.rank;
    let result = rank_main(ws, config, args, &env);
    if let Err(e) = &result {
        let non_finite = e.downcast_ref::<NonFinite>().is_some();
        launch::write_report(
            rank,
            &RankReport {
                message: format!("{e:#}"),
                kind: launch::failure_kind(e, if non_finite { "non-finite" } else { "error" }),
                step: launch::last_step(),
                restartable: !non_finite,
            },
        );
    }
    result.map_err(|e| e.context(format!("rank {rank}")))
}

fn rank_main(ws: &Workspace, config: &Config, args: &TrainArgs, env: &RankEnv) -> Result<()> {
    let ours = env.launcher == Launcher::Voiceclone;
    // Started by torchrun or Slurm, rank 0 does what our launcher does before the ranks start;
    // the other ranks wait for it in the rendezvous.
    let _lock = if !ours && env.rank == 0 {
        super::train_setup::require_manifest(ws)?;
        let lock = train::lock::RunLock::acquire(&ws.train_lock())?;
        prepare(ws, config, args)?;
        Some(lock)
    } else {
        None
    };
    let device = rank_device(config, env)?;
    let listener = match (env.rank, ours) {
        (0, true) => {
            let port = env
                .rendezvous
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse::<u16>().ok())
                .with_context(|| format!("{:?} is not a host:port address", env.rendezvous))?;
            vc_dist::env::take_inherited_rendezvous(port)?.map(std::sync::Arc::new)
        }
        _ => None,
    };
    let (nodes, emulation, groups) = topology(config, env)?;
    // The endpoint, and with it the rendezvous socket, is dropped once the ranks have met.
    let mesh = connect(
        &Endpoint {
            rank: env.rank,
            world: env.world,
            master: env.rendezvous.clone(),
            timeout: Duration::from_secs(config.train.dist_timeout),
            listener,
            nodes,
            emulation,
        },
        &device,
        groups,
    )?;
    let coll = mesh.world.clone();
    install_failure_handlers(coll.clone(), env.rank);
    // Ranks of our launcher come with its plan's choice (and `--memory manual`); under torchrun
    // or Slurm every rank makes the same plan, after rank 0 prepared the data.
    let target = super::train_plan::PlanTarget {
        cuda: device.is_cuda(),
        world: env.world,
        group: groups.size,
    };
    let (config, chosen) = super::train_plan::choose(ws, config, target)?;
    if let (0, Some(line)) = (env.rank, chosen) {
        println!("{line}");
    }
    let result = train_rank(ws, &config, args, env, &device, mesh, (nodes, emulation));
    match &result {
        Ok(()) => {}
        Err(e) => coll.abort(&format!("rank {}: {e:#}", env.rank)),
    }
    result
}

fn train_rank(
    ws: &Workspace,
    config: &Config,
    args: &TrainArgs,
    env: &RankEnv,
    device: &Device,
    mesh: Mesh,
    (nodes, emulation): (Nodes, Option<Emulation>),
) -> Result<()> {
    let rank = env.rank;
    let coll = mesh.world.clone();
    let groups_end = mesh.clone();
    // A tag every rank shares, for the names of temporary checkpoint directories.
    let mine = if rank == 0 {
        (std::process::id() as f64) * 1e6
            + (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() % 1_000_000) as f64)
    } else {
        0.0
    };
    let tag = format!(
        "{:x}",
        coll.all_reduce_host(&[mine], ReduceOp::Sum)?[0] as u64
    );
    check_shared_filesystem(ws, coll.as_ref(), &tag)?;
    let files = super::train_setup::model_files(ws, config)?;
    let prepared = super::train_setup::Prepared {
        manifest: ws.manifest(),
        speaker: super::train_setup::speaker_source(ws)?,
        model_spec: ws.model_source(&config.model.base)?.stable_spec(),
        files,
    };
    let backend = Backend::resolve(config.train.backend, device)?;
    let opts = prepared.options(ws, config, device.clone(), backend)?;
    let fresh = super::train_setup::fresh_start(args);
    let mut trainer = ShardedTrainer::new(opts, mesh, config.train.shard, tag, fresh)?;
    let state = trainer.state_bytes().total() as f64;
    let most = coll.all_reduce_host(&[state], ReduceOp::Max)?[0];
    let all = coll.all_reduce_host(&[state], ReduceOp::Sum)?[0];
    if rank == 0 {
        super::train::announce(
            ws,
            config,
            &trainer.run,
            (trainer.params.len(), trainer.full_parameters()),
            &super::train_setup::placement(backend, device, &config.train),
        );
        println!(
            "{} ranks ({}), shard {}: masters, moments and gradients take at most {} bytes on a \
             rank ({:.3} GB; {} bytes in all), the largest unit gathered {} bytes",
            trainer.world(),
            if device.is_cuda() {
                "GPUs, NCCL"
            } else {
                "CPU, TCP"
            },
            match config.train.shard {
                vc_core::config::Shard::Full => "full",
                vc_core::config::Shard::GradOp => "grad-op",
            },
            most as u64,
            most / 1e9,
            all as u64,
            trainer.largest_unit_bytes()
        );
        println!(
            "{}",
            topology_line(&trainer, config, nodes, emulation.as_ref())
        );
    }
    // `--fresh`: rank 0 moves the previous checkpoints aside once every rank is set up and the
    // run's checks have passed (the ranks skip them already: `fresh` above).
    let outcome = train::driver::run_with(&mut trainer, || move_aside_if_fresh(ws, args))?;
    report_peak_memory(coll.as_ref())?;
    // The groups' communicators finish their work (a GPU's streams), then the run ends.
    for c in std::iter::once(&groups_end.shard).chain(groups_end.replicas.iter()) {
        if !Arc::ptr_eq(c, &groups_end.world) {
            c.finish()?;
        }
    }
    coll.finish()?;
    if rank == 0 {
        finish(ws, config, args, &outcome, &trainer.run.opts)
    } else if outcome.interrupted {
        bail!("stopped on request after step {}", outcome.step)
    } else {
        Ok(())
    }
}

/// How the run's ranks group and what a step sends (docs/distributed.md §4.6, §4.7, §8):
/// the shard groups, the nodes, the overlap, and the bytes a rank sends per step in its units'
/// collectives (the text table's rows come on top).
fn topology_line(
    trainer: &ShardedTrainer,
    config: &Config,
    nodes: Nodes,
    emulation: Option<&Emulation>,
) -> String {
    let (world, size) = (trainer.world(), trainer.group_size());
    let groups = if size == world {
        format!(
            "one shard group of {world} ranks (train.shard_group {})",
            config.train.shard_group
        )
    } else {
        format!(
            "{} shard groups of {size} ranks, the state sharded within a group and replicated \
             across groups (train.shard_group {})",
            world / size,
            config.train.shard_group
        )
    };
    let node_count = world.div_ceil(nodes.ranks_per_node);
    let nodes = match emulation {
        Some(e) => format!(
            "{node_count} emulated nodes of {} ranks ({:.3} Gbit/s and {} µs between nodes, \
             {EMULATE_NETWORK})",
            e.ranks_per_node,
            e.bytes_per_second * 8.0 / 1e9,
            e.latency.as_micros()
        ),
        None if node_count == 1 => "one node".to_string(),
        None => format!("{node_count} nodes of {} ranks", nodes.ranks_per_node),
    };
    let overlap = match config.train.prefetch {
        0 => "communication not overlapped (train.prefetch 0)".to_string(),
        n => format!("prefetch {n}: gathers run ahead of the computation, reductions behind it"),
    };
    let t = trainer.unit_traffic();
    format!(
        "{groups}; {nodes}; {overlap}; a step sends {:.1} MB per rank within its group and \
         {:.1} MB to its replicas (units; metrics.jsonl has what was sent)",
        t.group as f64 / 1e6,
        t.replicas as f64 / 1e6
    )
}

/// Rank 0 prints every rank's peak resident memory (what sharding saves is visible there).
fn report_peak_memory(coll: &dyn Collective) -> Result<()> {
    let mut mine = vec![0.0; coll.world()];
    mine[coll.rank()] = peak_rss_bytes().unwrap_or(0) as f64;
    let all = coll.all_reduce_host(&mine, ReduceOp::Sum)?;
    if coll.rank() == 0 && all.iter().any(|&b| b > 0.0) {
        let shown: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(r, b)| format!("rank {r} {:.3} GB", b / 1e9))
            .collect();
        println!("peak resident memory: {}", shown.join(", "));
    }
    Ok(())
}

/// This process's peak resident set size (Linux).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// A sharded run writes one checkpoint from every rank: the checkpoint directory must be the
/// same directory for all of them (one machine, or a filesystem every node shares).
fn check_shared_filesystem(ws: &Workspace, coll: &dyn Collective, tag: &str) -> Result<()> {
    let dir = ws.checkpoints_dir();
    let marker = dir.join(format!(".voiceclone-shared-fs-{tag}"));
    if coll.rank() == 0 {
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        vc_core::fsutil::write_atomic(&marker, tag.as_bytes())?;
    }
    coll.barrier()?;
    let sees = std::fs::read_to_string(&marker).is_ok_and(|t| t == tag);
    let missing = coll.all_reduce_host(
        &[if sees { 0.0 } else { 1.0 + coll.rank() as f64 }],
        ReduceOp::Max,
    )?[0];
    coll.barrier()?;
    if coll.rank() == 0 {
        let _ = std::fs::remove_file(&marker);
    }
    if missing > 0.0 {
        bail!(
            "rank {} cannot see {} written by rank 0: the workspace must be on a filesystem \
             shared by every node of the run (the same path everywhere)",
            missing as usize - 1,
            marker.display()
        );
    }
    Ok(())
}

/// A restartable report of a failure of `kind` at this rank's last step.
fn report(message: String, kind: &str) -> RankReport {
    RankReport {
        message,
        kind: kind.into(),
        step: launch::last_step(),
        restartable: true,
    }
}

/// A panic anywhere in this rank stops the whole run at once (the message reaches every rank),
/// and once the run is aborted this process ends within 20 s even if it is stuck in a
/// computation or a GPU collective.
fn install_failure_handlers(coll: Arc<dyn Collective>, rank: usize) {
    let for_panic = coll.clone();
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = format!("rank {rank} panicked: {info}");
        launch::write_report(rank, &report(msg.clone(), "panic"));
        for_panic.abort(&msg);
        default(info);
    }));
    std::thread::spawn(move || loop {
        if let Some(why) = coll.aborted() {
            let since = Instant::now();
            while since.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let msg = format!("the run was aborted: {why} (rank {rank} did not stop by itself)");
            launch::write_report(rank, &report(msg.clone(), "stuck after an abort"));
            eprintln!("error: rank {rank}: {msg}");
            std::process::exit(1);
        }
        std::thread::sleep(Duration::from_millis(200));
    });
}
