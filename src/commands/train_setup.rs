//! What every way of training needs, whatever runs it — one device ([`super::train`]) or one
//! rank of a sharded run ([`super::train_ranks`]): the manifest with its codes and the speaker
//! embeddings made ready (the library steps of `codes` and `embed`, run when they are missing), the
//! base model's files, the training device and test seams, a fresh start's move aside, and what
//! is printed before and after a run, with the export at its end.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use crate::cli::TrainArgs;
use vc_core::config::{Config, EmbedMode};
use vc_core::workspace::Workspace;
use vc_model::files::ModelFiles;
use vc_prep::codes::{self, CodecOptions};
use vc_prep::xvectors::{self, XVectorJob};
use vc_train::hooks::TrainHooks;
use vc_train::{self as train, checkpoint, data, export, TrainOptions};

/// The device training runs on: the first CUDA GPU when built with `cuda`, else the CPU.
pub fn train_device() -> Result<Device> {
    Ok(Device::cuda_if_available(0)?)
}

/// The training loop's test seams: environment-driven in a `test-hooks` build, none otherwise.
pub fn hooks() -> Arc<dyn TrainHooks> {
    #[cfg(feature = "test-hooks")]
    {
        Arc::new(train::hooks::EnvHooks::from_env())
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        Arc::new(train::hooks::NoHooks)
    }
}

/// What every way of training needs ready first: the manifest with codes, the speaker
/// embedding, the base model's files.
pub struct Prepared {
    pub manifest: PathBuf,
    pub speaker: PathBuf,
    pub files: ModelFiles,
    pub model_spec: String,
}

impl Prepared {
    pub fn options(
        self,
        ws: &Workspace,
        config: &Config,
        device: Device,
        backend: train::Backend,
    ) -> Result<TrainOptions> {
        Ok(TrainOptions {
            evaluator: Some(Arc::new(vc_eval::Evaluation {
                listener: vc_eval::samples::listener::for_workspace(ws, &config.prep),
                references: references(ws, config)?,
            })),
            files: self.files,
            model_spec: self.model_spec,
            manifest: self.manifest,
            base_dir: ws.root().to_path_buf(),
            speaker: self.speaker,
            checkpoints: ws.checkpoints_dir(),
            config: config.train.clone(),
            device,
            backend,
            hooks: hooks(),
        })
    }
}

/// Each speaker's reference clip, by the name the export gives the voice.
fn references(ws: &Workspace, config: &Config) -> Result<Vec<(String, PathBuf)>> {
    let named = xvectors::workspace_speakers(ws)?;
    let clips: Vec<(String, PathBuf)> = if named.is_empty() {
        let voice = vc_core::artifacts::speaker::name_key(config.train.speaker_name.trim());
        vec![(voice, ws.ref_wav())]
    } else {
        named
            .iter()
            .map(|n| (vc_core::artifacts::speaker::name_key(n), ws.ref_clip(n)))
            .collect()
    };
    Ok(clips.into_iter().filter(|(_, p)| p.is_file()).collect())
}

/// The manifest must exist before anything else happens.
pub fn require_manifest(ws: &Workspace) -> Result<()> {
    let manifest = ws.manifest();
    if !manifest.is_file() {
        bail!(
            "no training data: {} does not exist in workspace {}; run `voiceclone prep` on your \
             recordings first",
            ws.relative(&manifest),
            ws.root().display()
        );
    }
    Ok(())
}

/// Fills in missing codes and the speaker embeddings, and resolves the model.
pub fn prepare(ws: &Workspace, config: &Config, args: &TrainArgs) -> Result<Prepared> {
    require_manifest(ws)?;
    let manifest = ws.manifest();
    vc_kernels::alloc::keep_freed_memory();
    let named = xvectors::workspace_speakers(ws)?;
    if args.speaker_name.is_some() && !named.is_empty() {
        bail!(
            "--speaker-name names the one speaker of a single-speaker workspace; {} names its \
             speakers ({}), which keep their names in the exported model",
            ws.relative(&manifest),
            named.join(", ")
        );
    }
    ensure_codes(ws, config, &manifest)?;
    let speaker = if named.is_empty() {
        ensure_speaker(ws, config, &manifest)?
    } else {
        ensure_speakers(ws, config, &named)?
    };
    Ok(Prepared {
        files: model_files(ws, config)?,
        model_spec: ws.model_source(&config.model.base)?.stable_spec(),
        manifest,
        speaker,
    })
}

/// Where the trainer finds the x-vectors: `data/speaker.safetensors`, or with named speakers
/// `data/speakers/` (docs/training.md §3.3).
pub fn speaker_source(ws: &Workspace) -> Result<PathBuf> {
    Ok(if xvectors::workspace_speakers(ws)?.is_empty() {
        ws.speaker_file()
    } else {
        ws.speakers_dir()
    })
}

/// The base model's files (`model.base`).
pub fn model_files(ws: &Workspace, config: &Config) -> Result<ModelFiles> {
    let source = ws.model_source(&config.model.base)?;
    ModelFiles::resolve(&source)
        .with_context(|| format!("cannot use the base model {}", source.describe()))
}

/// `--fresh`: the previous run's checkpoints move aside (never deleted).
pub fn move_aside_if_fresh(ws: &Workspace, args: &TrainArgs) -> Result<()> {
    let checkpoints = ws.checkpoints_dir();
    if fresh_start(args) {
        if let Some(moved) = move_aside(&checkpoints)? {
            println!(
                "--fresh: moved the previous run's {} to {} (delete it when no longer needed)",
                ws.relative(&checkpoints),
                ws.relative(&moved)
            );
        }
    }
    Ok(())
}

/// Where and how a run computes, for its first line when that is not the default.
pub fn placement(
    backend: train::Backend,
    device: &Device,
    c: &vc_core::config::TrainConfig,
) -> String {
    let mut out = String::new();
    if backend != train::Backend::auto(device) {
        out += &format!("; backend {} on {device:?}", backend.name());
    }
    if c.optimizer_state != vc_core::config::OptimizerState::Fp32 {
        out += &format!("; optimizer state {}", c.optimizer_state.name());
    }
    if c.offload == vc_core::config::Offload::Optimizer {
        out += "; masters and moments offloaded to the host";
    }
    if c.recompute == vc_core::config::Recompute::Layers {
        out += "; each unit recomputed for the backward pass";
    }
    out
}

/// `--fresh` applies to the first attempt of a run only: a restarted attempt (voiceclone's
/// launcher, torchrun, Ray) continues from the checkpoints the first one wrote.
pub fn fresh_start(args: &TrainArgs) -> bool {
    args.fresh && vc_dist::env::restart_count() == 0
}

pub fn print_resumed(
    ws: &Workspace,
    dir: &Path,
    step: usize,
    total: usize,
    data_changed: bool,
    epoch: usize,
) {
    println!(
        "resuming from {} (step {step} of {total})",
        ws.relative(dir)
    );
    if data_changed {
        eprintln!(
            "warning: {} changed since that checkpoint; epoch {} restarts from its first batch \
             with the new data",
            ws.relative(&ws.manifest()),
            epoch + 1
        );
    }
}

pub fn print_start(
    config: &Config,
    tensors: usize,
    parameters: usize,
    dataset: &data::Dataset,
    heldout: Option<&data::Dataset>,
    steps_per_epoch: usize,
    placement: &str,
) {
    let c = &config.train;
    let heldout = heldout.map_or(", none held out".to_string(), |h| {
        format!(", {} held out for validation", h.samples.len())
    });
    println!(
        "training {tensors} tensors ({:.1} M parameters) on {} utterances ({} frames{heldout}): \
         {} epochs × {steps_per_epoch} steps, effective batch {} × {}, lr {:e}{placement}",
        parameters as f64 / 1e6,
        dataset.samples.len(),
        dataset.frames(),
        c.epochs,
        c.batch_size,
        c.grad_accum,
        c.lr
    );
}

/// After training: says how it went and exports `model/` (unless `--no-export`).
pub fn finish(
    ws: &Workspace,
    config: &Config,
    args: &TrainArgs,
    outcome: &train::Outcome,
    opts: &TrainOptions,
) -> Result<()> {
    let c = &config.train;
    let total = outcome.total_steps;
    let checkpoints = ws.checkpoints_dir();
    if outcome.interrupted {
        bail!(
            "training interrupted after step {} of {}; saved {}. Run `voiceclone train` again \
             to continue from there",
            outcome.step,
            outcome.total_steps,
            outcome
                .checkpoint
                .as_deref()
                .map(|d| ws.relative(d))
                .unwrap_or_default()
        );
    }
    if outcome.step == outcome.start_step && outcome.early_stopped {
        let better = if c.select == vc_core::config::Select::Score {
            "higher sample score"
        } else {
            "lower validation loss"
        };
        println!(
            "training stopped early at step {} of {total}: no {better} in the last \
             train.early_stop = {} evaluations (raise it, or set it to 0, to train on)",
            outcome.step, c.early_stop
        );
    } else if outcome.step == outcome.start_step {
        println!(
            "training already finished: step {} of {total} (raise --epochs or --max-steps to \
             train longer, or use --fresh to start over)",
            outcome.step
        );
    } else {
        let val = outcome
            .last_val_loss
            .map_or(String::new(), |v| format!(", validation loss {v:.4}"));
        println!(
            "trained steps {}..{} of {total}: loss {:.4} -> {:.4}{val}, {:.0} frames/s; metrics \
             in {}",
            outcome.start_step + 1,
            outcome.step,
            outcome.first_loss.unwrap_or(f64::NAN),
            outcome.last_loss.unwrap_or(f64::NAN),
            outcome.frames_per_second.unwrap_or(0.0),
            ws.relative(&checkpoints.join(train::metrics::METRICS_FILE))
        );
    }
    if args.no_export {
        return Ok(());
    }
    let newest = outcome
        .checkpoint
        .clone()
        .or(checkpoint::find_latest(&checkpoints)?);
    // The checkpoint `train.select` chose (docs/training.md §14.3), else the newest.
    let best = train::selection::find_best(&checkpoints)?;
    let choice = if best.is_some() {
        export::card::Choice::Best
    } else {
        export::card::Choice::Newest
    };
    let Some(ckpt) = best.or(newest.clone()) else {
        bail!("no checkpoint to export");
    };
    if newest.as_ref().is_some_and(|n| *n != ckpt) {
        println!(
            "exporting {}, {} (train.select = \"{}\"; the newest is {})",
            ws.relative(&ckpt),
            train::selection::Selection::describe(c.select),
            c.select.name(),
            newest.as_ref().map_or(String::new(), |n| ws.relative(n))
        );
    }
    let output = args
        .output
        .as_ref()
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
        .unwrap_or_else(|| ws.model_dir());
    for note in export::recover(&output)? {
        eprintln!("note: {note}");
    }
    if export::is_current(&output, &ckpt, &c.speaker_name) {
        println!(
            "{} is up to date (export of {})",
            ws.relative(&output),
            ws.relative(&ckpt)
        );
        return Ok(());
    }
    let summary = export::export(&export::ExportOptions {
        files: &opts.files,
        model_spec: &opts.model_spec,
        checkpoint: ckpt,
        output,
        speaker_name: c.speaker_name.clone(),
        lora_scale: 1.0,
        adapter_only: false,
        manifest: Some(ws.manifest()),
        choice,
        session: Some(export::card::Session {
            backend: opts.backend,
            device: if opts.device.is_cpu() {
                "CPU".into()
            } else if opts.device.is_cuda() {
                "CUDA device".into()
            } else {
                format!("{:?}", opts.device.location())
            },
            grad_accum: c.grad_accum,
            epochs: c.epochs,
            max_steps: c.max_steps,
            select: c.select.name().to_string(),
        }),
    })?;
    summary.print(ws);
    Ok(())
}

/// Codes the manifest (what `voiceclone codes` does) when some lines have no `audio_codes`.
fn ensure_codes(ws: &Workspace, config: &Config, manifest: &Path) -> Result<()> {
    let missing = data::lines_without_codes(manifest)?;
    if missing.is_empty() {
        return Ok(());
    }
    println!(
        "{} line(s) of {} have no audio codes yet: running `voiceclone codes` first",
        missing.len(),
        ws.relative(manifest)
    );
    let codec = CodecOptions::new(
        &config.codes.tokenizer,
        &config.model.base,
        config.codes.batch_size,
    );
    let summary = codes::code_manifest(ws, &codec, manifest, manifest, false)?;
    for line in summary.report(manifest, manifest) {
        println!("{line}");
    }
    Ok(())
}

/// `data/speaker.safetensors`, computed as `voiceclone embed` does when missing (from `data/ref.wav`,
/// else from the first line's `ref_audio`, which is what the official recipe uses).
fn ensure_speaker(ws: &Workspace, config: &Config, manifest: &Path) -> Result<PathBuf> {
    let path = ws.speaker_file();
    if path.is_file() {
        return Ok(path);
    }
    let report = |line: &str| println!("{line}");
    if config.embed.mode == EmbedMode::Mean {
        println!("no speaker embedding yet: running `voiceclone embed --mode mean` first");
        let job = xvectors::single_speaker_job(ws, &config.embed)?;
        xvectors::write_jobs(ws, &config.model.base, &[job], report)?;
        return Ok(path);
    }
    let ref_audio = if ws.ref_wav().is_file() {
        ws.ref_wav()
    } else {
        match data::first_ref_audio(manifest, ws.root())? {
            Some((line, p)) if !p.is_file() => bail!(
                "no speaker embedding ({}) and no reference clip to compute it: {}:{line}: \
                 ref_audio {} does not exist",
                ws.relative(&path),
                manifest.display(),
                p.display()
            ),
            Some((_, p)) => p,
            None => bail!(
                "no speaker embedding ({}) and no reference clip ({} or a ref_audio in {}); run \
                 `voiceclone embed REF_AUDIO` first",
                ws.relative(&path),
                ws.relative(&ws.ref_wav()),
                ws.relative(manifest)
            ),
        }
    };
    println!(
        "no speaker embedding yet: running `voiceclone embed {}` first",
        vc_core::shell::quote(&ws.relative(&ref_audio))
    );
    let job = XVectorJob {
        speaker: None,
        clips: vec![ref_audio],
        mode: EmbedMode::Ref,
        output: path.clone(),
    };
    xvectors::write_jobs(ws, &config.model.base, &[job], report)?;
    Ok(path)
}

/// `data/speakers/`, with the x-vector file of every named speaker computed (as `voiceclone
/// embed --speaker NAME` does, with `embed.mode`) where it is missing.
fn ensure_speakers(ws: &Workspace, config: &Config, names: &[String]) -> Result<PathBuf> {
    let missing: Vec<String> = names
        .iter()
        .filter(|n| !ws.speaker_file_of(n).is_file())
        .cloned()
        .collect();
    if !missing.is_empty() {
        println!(
            "no x-vector yet for speaker(s) {}: running `voiceclone embed` first",
            missing.join(", ")
        );
        let jobs = missing
            .iter()
            .map(|n| xvectors::speaker_job(ws, &config.embed, n))
            .collect::<Result<Vec<_>>>()?;
        xvectors::write_jobs(ws, &config.model.base, &jobs, |line| println!("{line}"))?;
    }
    Ok(ws.speakers_dir())
}

/// Renames `dir` to the first free `dir.N`; `None` when `dir` does not exist.
pub fn move_aside(dir: &Path) -> Result<Option<PathBuf>> {
    if !dir.exists() {
        return Ok(None);
    }
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    for n in 1.. {
        let to = dir.with_file_name(format!("{name}.{n}"));
        if !to.exists() {
            std::fs::rename(dir, &to)
                .with_context(|| format!("cannot move {} to {}", dir.display(), to.display()))?;
            return Ok(Some(to));
        }
    }
    unreachable!()
}
