//! The memory plan at the command line (docs/training.md §6.9): `voiceclone train --plan`, and
//! `train.memory = "auto"` choosing the memory settings before a run loads anything.

use std::io::BufRead;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::cli::TrainArgs;
use vc_core::config::{Config, MemoryPolicy, ShardGroup, TrainBackend};
use vc_core::workspace::Workspace;
use vc_model::config::Qwen3TtsConfig;
use vc_train::plan::activations::Longest;
use vc_train::plan::choice::{self, Pinned};
use vc_train::plan::shapes::TensorShape;
use vc_train::plan::{self, shapes, Estimate, Modes, Setup};
use vc_train::step::lora::Lora;
use vc_train::step::trainable;
use vc_train::step::units::unit_of;
use vc_train::{Backend, Storage};

/// Audio frames per second (the 12 Hz tokenizer's 12.5).
const FRAMES_PER_SECOND: f64 = 12.5;
/// Text tokens assumed per second of speech when the manifest has no transcripts yet (fast
/// English speech is about 4).
const TOKENS_PER_SECOND: f64 = 5.0;

/// Where a run trains, as the plan sees it.
#[derive(Debug, Clone, Copy)]
pub struct PlanTarget {
    pub cuda: bool,
    pub world: usize,
    /// Ranks that shard the state among them (docs/distributed.md §4.7).
    pub group: usize,
}

impl PlanTarget {
    /// `train.gpus` (or `--gpus`) GPUs; else CPU ranks; else one device: the first GPU when
    /// this build has CUDA and sees one, otherwise the CPU. The ranks our launcher starts are
    /// on this machine: a group of a node is every rank, unless an emulated network says
    /// otherwise.
    pub fn of(config: &Config) -> Self {
        let c = &config.train;
        let (cuda, world) = if c.gpus > 0 {
            (true, c.gpus)
        } else if c.cpu_ranks > 0 {
            (false, c.cpu_ranks)
        } else {
            let cuda = super::train_setup::train_device().is_ok_and(|d| d.is_cuda());
            return PlanTarget {
                cuda,
                world: 1,
                group: 1,
            };
        };
        let per_node = vc_dist::topology::Emulation::from_env()
            .ok()
            .flatten()
            .map_or(world, |e| e.ranks_per_node);
        PlanTarget {
            cuda,
            world,
            group: group_size(c.shard_group, world, Some(per_node)).unwrap_or(world),
        }
    }

    fn device_word(&self) -> &'static str {
        if self.cuda {
            "GPU"
        } else {
            "CPU process"
        }
    }
}

/// The ranks of a shard group (docs/distributed.md §4.7) of a run of `world` ranks, nodes of
/// `per_node` ranks where that is known.
pub fn group_size(group: ShardGroup, world: usize, per_node: Option<usize>) -> Result<usize> {
    Ok(match group {
        ShardGroup::World => world,
        ShardGroup::Ranks(n) => n,
        ShardGroup::Node => per_node.context(
            "train.shard_group = \"node\" needs the number of ranks per node, and this launcher \
             does not say it: set LOCAL_WORLD_SIZE (torchrun sets it; under Slurm use srun \
             --ntasks-per-node), or give the group size as a number",
        )?,
    })
}

/// The plan's view of the run: the model's shapes from its `config.json` (nothing else of the
/// model is read; a hub model fetches just that file), the trained set, and the longest
/// utterance of the manifest (or of `prep.max_seconds` when there is none yet).
pub fn setup(ws: &Workspace, config: &Config, target: PlanTarget) -> Result<Setup> {
    let source = ws.model_source(&config.model.base)?;
    let path = source
        .file("config.json")
        .with_context(|| format!("the plan needs the config.json of {}", source.describe()))?;
    let cfg = Qwen3TtsConfig::from_file(&path)?;
    let tensors = shapes::talker_tensors(&cfg)?;
    let named: Vec<(&str, &[usize])> = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    // With adapters the trained set is their factors and train.lora_full (docs/training.md §13).
    let (trained, adapters) = match Lora::from_config(&config.train, &named)? {
        Some(l) => {
            let adapters = l
                .trained()
                .into_iter()
                .filter_map(|n| {
                    let shape = l.factor_shape(&n)?;
                    Some(unit_of(&n).map(|unit| TensorShape {
                        name: n,
                        shape,
                        unit,
                    }))
                })
                .collect::<Result<Vec<_>>>()?;
            (l.full, adapters)
        }
        None => (
            trainable::select_trainable(named.iter().map(|(n, _)| *n), &config.train.freeze)?.0,
            Vec::new(),
        ),
    };
    let trained: std::collections::BTreeSet<&str> = trained.iter().map(String::as_str).collect();
    let tensors = tensors
        .iter()
        .map(|t| (t.clone(), trained.contains(t.name.as_str())))
        .chain(adapters.into_iter().map(|t| (t, true)))
        .collect();
    let c = &config.train;
    let backend = match (c.backend, target.cuda) {
        (TrainBackend::AutogradF32, _) => Backend::Autograd(Storage::F32),
        (TrainBackend::Autograd, _) | (TrainBackend::Auto, true) => {
            Backend::Autograd(Storage::Bf16)
        }
        (TrainBackend::Kernels | TrainBackend::Auto, false) => Backend::Kernels,
        (TrainBackend::Kernels, true) => bail!("train.backend = \"kernels\" runs on the CPU only"),
    };
    Ok(Setup {
        cfg,
        tensors,
        backend,
        cuda: target.cuda,
        world: target.world,
        group: target.group,
        prefetch: c.prefetch,
        shard: c.shard,
        batch_size: c.batch_size,
        grad_accum: c.grad_accum,
        reduce: c.reduce_dtype,
        longest: longest(&ws.manifest(), config)?,
    })
}

/// The longest utterance of `manifest` (frames from its codes, or from its duration before
/// `codes` ran; text tokens estimated as one per three bytes of the transcript, which is above
/// the tokenizer's count for English and about it for CJK scripts); without a manifest, one of
/// `prep.max_seconds`, the longest that `prep` writes.
pub fn longest(manifest: &Path, config: &Config) -> Result<Longest> {
    let of_seconds = |s: f64| Longest {
        text_tokens: (s * TOKENS_PER_SECOND).ceil() as usize,
        frames: (s * FRAMES_PER_SECOND).ceil() as usize,
    };
    if !manifest.is_file() {
        return Ok(of_seconds(config.prep.max_seconds));
    }
    let file = std::fs::File::open(manifest)
        .with_context(|| format!("cannot read {}", manifest.display()))?;
    let mut best: Option<Longest> = None;
    for line in std::io::BufReader::new(file).lines() {
        let line = line.with_context(|| format!("cannot read {}", manifest.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        // A line that is not JSON is one of the bad lines reading the data lists together
        // (docs/training.md §3.1); it holds no utterance to plan for.
        let Ok(row) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        let text_tokens = row["text"].as_str().map_or(0, |t| t.len().div_ceil(3));
        let frames = match (&row["audio_codes"], row["duration"].as_f64()) {
            (serde_json::Value::Array(codes), _) => codes.len(),
            (_, Some(d)) => (d * FRAMES_PER_SECOND).ceil() as usize,
            _ => of_seconds(config.prep.max_seconds).frames,
        };
        let this = Longest {
            text_tokens,
            frames,
        };
        if best.is_none_or(|b| this.talker_positions() > b.talker_positions()) {
            best = Some(this);
        }
    }
    Ok(best.unwrap_or_else(|| of_seconds(config.prep.max_seconds)))
}

/// The settings the user fixed, which `auto` leaves as they are.
pub fn pinned(config: &Config) -> Pinned {
    let (c, set) = (&config.train, &config.train.set_by_user);
    Pinned {
        optimizer_state: set.optimizer_state.then_some(c.optimizer_state),
        offload: set.offload.then_some(c.offload),
        recompute: set.recompute.then_some(c.recompute),
    }
}

/// Bytes per device the plan may fill: `train.gpu_memory`, else the device's own figure (a
/// GPU's total memory; the machine's memory for a CPU run).
pub fn capacity(config: &Config, target: PlanTarget) -> Result<usize> {
    let gib = config.train.gpu_memory;
    if gib > 0.0 {
        return Ok((gib * (1u64 << 30) as f64) as usize);
    }
    if target.cuda {
        return gpu_total_memory();
    }
    // CPU ranks share the machine.
    Ok(host_memory()? / target.world.max(1))
}

/// The machine's memory (`MemTotal`), shared by its CPU ranks.
fn host_memory() -> Result<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").context("cannot read /proc/meminfo")?;
    let kb = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
        .context("/proc/meminfo has no MemTotal")?;
    Ok(kb * 1024)
}

/// The total memory of GPU 0, from the driver without creating a context (the launcher must
/// not hold GPU memory its ranks need). GPU-only code (docs/architecture.md §9.2).
#[cfg(feature = "cuda")]
fn gpu_total_memory() -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::result;
    result::init().context("cannot initialise the CUDA driver")?;
    let dev = result::device::get(0).context("no CUDA device 0")?;
    // SAFETY: `dev` is a valid device handle from the initialised driver.
    let bytes = unsafe { result::device::total_mem(dev) }.context("cannot read GPU memory")?;
    Ok(bytes)
}

#[cfg(not(feature = "cuda"))]
fn gpu_total_memory() -> Result<usize> {
    bail!(
        "this build has no CUDA, so it cannot ask a GPU for its memory: give it with \
         --gpu-memory GIB (train.gpu_memory)"
    )
}

/// `voiceclone train --plan [--json]`.
pub fn print(ws: &Workspace, config: &Config, args: &TrainArgs) -> Result<()> {
    let target = PlanTarget::of(config);
    let setup = setup(ws, config, target)?;
    let pins = pinned(config);
    let capacity = match capacity(config, target) {
        Ok(c) => Some(c),
        // Without a device to ask (a CPU build planning for GPUs), the plan still prints.
        Err(_) if config.train.gpu_memory == 0.0 => None,
        Err(e) => return Err(e),
    };
    let (all, chosen) = choice::plan(&setup, pins, capacity.unwrap_or(usize::MAX));
    let chosen = capacity.and(chosen);
    if args.json {
        println!("{}", json(&setup, &all, chosen, capacity));
    } else {
        print_table(&setup, target, &all, chosen, capacity);
    }
    Ok(())
}

fn gb(b: usize) -> f64 {
    b as f64 / 1e9
}

fn json(setup: &Setup, all: &[Estimate], chosen: Option<usize>, capacity: Option<usize>) -> String {
    let bytes = |b: &plan::Bytes| {
        let mut m = serde_json::Map::new();
        for (k, v) in b.named() {
            m.insert(k.into(), v.into());
        }
        m.insert("total".into(), b.total().into());
        serde_json::Value::Object(m)
    };
    let modes: Vec<serde_json::Value> = all
        .iter()
        .map(|e| {
            serde_json::json!({
                "optimizer_state": e.modes.optimizer_state.name(),
                "offload": e.modes.offload.name(),
                "recompute": e.modes.recompute.name(),
                "gpu_bytes": e.device.map(|d| d.total()),
                "host_bytes": e.host.total(),
                "fits": capacity.map(|c| e.device_total() <= c),
                "gpu": e.device.as_ref().map(bytes),
                "host": bytes(&e.host),
            })
        })
        .collect();
    let chosen = chosen.map(|i| {
        let m = all[i].modes;
        serde_json::json!({
            "optimizer_state": m.optimizer_state.name(),
            "offload": m.offload.name(),
            "recompute": m.recompute.name(),
        })
    });
    serde_json::json!({
        "device": if setup.cuda { "cuda" } else { "cpu" },
        "world": setup.world,
        "shard_group": setup.group,
        "prefetch": setup.prefetch,
        "backend": setup.backend.name(),
        "batch_size": setup.batch_size,
        "grad_accum": setup.grad_accum,
        "longest": {"text_tokens": setup.longest.text_tokens, "frames": setup.longest.frames},
        "capacity_bytes": capacity,
        "modes": modes,
        "chosen": chosen,
    })
    .to_string()
}

fn print_table(
    setup: &Setup,
    target: PlanTarget,
    all: &[Estimate],
    chosen: Option<usize>,
    capacity: Option<usize>,
) {
    let trained: usize = setup
        .tensors
        .iter()
        .filter(|(_, t)| *t)
        .map(|(t, _)| t.elem_count())
        .sum();
    let per = if target.world > 1 {
        format!("per {} of {}", target.device_word(), target.world)
    } else {
        format!("on one {}", target.device_word())
    };
    println!(
        "memory plan: {:.1} M trained values, backend {}, batch {} × {} micro-batches, longest \
         utterance {} frames and ~{} text tokens; GB {per}{}",
        trained as f64 / 1e6,
        setup.backend.name(),
        setup.batch_size,
        setup.grad_accum,
        setup.longest.frames,
        setup.longest.text_tokens,
        match capacity {
            Some(c) => format!(", {:.1} GB available", gb(c)),
            None => String::new(),
        }
    );
    let names: Vec<&str> = plan::Bytes::default()
        .named()
        .iter()
        .map(|(k, _)| *k)
        .collect();
    println!(
        "{:<18} {:<8} {:<9} {:>8} {:>8} {:>5}  {}",
        "optimizer_state",
        "offload",
        "recompute",
        if target.cuda { "gpu" } else { "memory" },
        "host",
        "fits",
        names.join(" / ")
    );
    for (i, e) in all.iter().enumerate() {
        let split = e.device.as_ref().unwrap_or(&e.host);
        let cats: Vec<String> = split
            .named()
            .iter()
            .map(|(_, v)| format!("{:.2}", gb(*v)))
            .collect();
        let fits = match capacity {
            Some(c) if e.device_total() <= c => "yes",
            Some(_) => "no",
            None => "?",
        };
        println!(
            "{:<18} {:<8} {:<9} {:>8.2} {:>8} {:>5}  {}{}",
            e.modes.optimizer_state.name(),
            e.modes.offload.name(),
            e.modes.recompute.name(),
            gb(e.device_total()),
            match e.device {
                Some(_) => format!("{:.2}", gb(e.host.total())),
                None => "-".into(),
            },
            fits,
            cats.join(" / "),
            if Some(i) == chosen { "   <- auto" } else { "" }
        );
    }
    if capacity.is_none() {
        println!("(give --gpu-memory GIB to see which fit and what auto would choose)");
    }
}

/// `train.memory = "auto"` before a run loads anything: the configuration with the memory
/// settings the user left open set to the plan's choice, and the line that says so; an error
/// naming what would fit when nothing does. `manual` returns the configuration unchanged.
pub fn choose(
    ws: &Workspace,
    config: &Config,
    target: PlanTarget,
) -> Result<(Config, Option<String>)> {
    if config.train.memory == MemoryPolicy::Manual {
        return Ok((config.clone(), None));
    }
    if let Some(chosen) = chosen_by_launcher(config)? {
        return Ok((chosen, None));
    }
    let setup = setup(ws, config, target)?;
    let pins = pinned(config);
    let capacity = capacity(config, target)?;
    let (all, chosen) = choice::plan(&setup, pins, capacity);
    let Some(i) = chosen else {
        // CPU ranks share the machine's memory (unless train.gpu_memory gives each its own).
        let shared = !target.cuda && config.train.gpu_memory == 0.0;
        let per_world = |world: usize| {
            if shared {
                capacity * target.world.max(1) / world.max(1)
            } else {
                capacity
            }
        };
        bail!(choice::refusal(
            &setup,
            pins,
            per_world,
            target.device_word()
        ));
    };
    let e = all[i];
    let mut out = config.clone();
    let Modes {
        optimizer_state,
        offload,
        recompute,
    } = e.modes;
    out.train.optimizer_state = optimizer_state;
    out.train.offload = offload;
    out.train.recompute = recompute;
    let skipped = i; // more exact combinations that did not fit
    let why = if skipped == 0 {
        "the most exact setting, fits".to_string()
    } else {
        format!(
            "the most exact that fits: {} needs {:.1} GB",
            choice::describe(all[0].modes),
            gb(all[0].device_total())
        )
    };
    let line = format!(
        "memory plan: {} — {:.1} GB of {:.1} GB per {} ({why}; train.memory = \"auto\", \
         `voiceclone train --plan` shows the categories)",
        choice::describe(e.modes),
        gb(e.device_total()),
        gb(capacity),
        target.device_word()
    );
    Ok((out, Some(line)))
}

/// The variable that gives the rank processes of our launcher its plan's choice.
const CHOSEN_ENV: &str = "VOICECLONE_MEMORY_CHOSEN";

/// `CHOSEN_ENV` and its value for `config`'s memory settings.
pub fn chosen_env(config: &Config) -> (String, String) {
    let c = &config.train;
    (
        CHOSEN_ENV.to_string(),
        format!(
            "{} {} {}",
            c.optimizer_state.name(),
            c.offload.name(),
            c.recompute.name()
        ),
    )
}

/// The launcher's choice, in a rank it started.
fn chosen_by_launcher(config: &Config) -> Result<Option<Config>> {
    let Ok(value) = std::env::var(CHOSEN_ENV) else {
        return Ok(None);
    };
    let parts: Vec<&str> = value.split_whitespace().collect();
    let mut out = config.clone();
    let c = &mut out.train;
    let find = |names: &[&str], v: &str| names.iter().position(|n| *n == v);
    let (Some(s), Some(o), Some(r), 3) = (
        parts
            .first()
            .and_then(|v| find(vc_core::config::OptimizerState::NAMES, v)),
        parts
            .get(1)
            .and_then(|v| find(vc_core::config::Offload::NAMES, v)),
        parts
            .get(2)
            .and_then(|v| find(vc_core::config::Recompute::NAMES, v)),
        parts.len(),
    ) else {
        bail!("{CHOSEN_ENV}={value:?} is not \"STATE OFFLOAD RECOMPUTE\"");
    };
    c.optimizer_state = [
        vc_core::config::OptimizerState::Fp32,
        vc_core::config::OptimizerState::Int8,
        vc_core::config::OptimizerState::Bf16Compensated,
    ][s];
    c.offload = [
        vc_core::config::Offload::None,
        vc_core::config::Offload::Optimizer,
    ][o];
    c.recompute = [
        vc_core::config::Recompute::None,
        vc_core::config::Recompute::Layers,
    ][r];
    Ok(Some(out))
}
