//! `voiceclone export`: a training checkpoint as a model directory in the official layout.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::cli::ExportArgs;
use vc_core::config::Config;
use vc_core::workspace::Workspace;
use vc_model::files::ModelFiles;
use vc_train::{checkpoint, export, selection};

pub fn run(ws: &Workspace, config: &Config, args: &ExportArgs) -> Result<()> {
    let mut choice = export::card::Choice::Newest;
    let dir = match &args.checkpoint {
        Some(d) if args.best && d.join(checkpoint::INDEX).is_file() => bail!(
            "--best chooses from a directory of checkpoints, and {} is one checkpoint: pass \
             its parent, or leave out --best",
            d.display()
        ),
        // The checkpoint the run chose (docs/training.md §14.3).
        d if args.best => {
            choice = export::card::Choice::Best;
            let root = d.clone().unwrap_or_else(|| ws.checkpoints_dir());
            selection::find_best(&root)?.with_context(|| {
                format!(
                    "{} names no complete checkpoint: `voiceclone train` writes it at each \
                     checkpoint (export without --best for the newest)",
                    ws.relative(&root.join(selection::BEST))
                )
            })?
        }
        Some(d) if d.join(checkpoint::INDEX).is_file() => {
            choice = export::card::Choice::Given;
            d.clone()
        }
        // A checkpoints/ directory: its newest checkpoint.
        Some(d) => checkpoint::find_latest(d)?.with_context(|| {
            format!(
                "{} is neither a checkpoint nor a directory of checkpoints",
                d.display()
            )
        })?,
        None => {
            let root = ws.checkpoints_dir();
            checkpoint::find_latest(&root)?.with_context(|| {
                format!(
                    "no checkpoint in {}; run `voiceclone train` first (or pass --checkpoint DIR)",
                    ws.relative(&root)
                )
            })?
        }
    };
    let index = checkpoint::read_index(&dir)?;
    if args.speaker_name.is_some() && !index.identity.speakers.is_empty() {
        bail!(
            "--speaker-name names the one speaker of a single-speaker checkpoint, but {} holds \
             the named speakers {}, which keep their names",
            dir.display(),
            index
                .identity
                .speakers
                .iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    // The model the checkpoint was trained from, unless --model names one.
    let spec = if args.model.is_some() {
        config.model.base.clone()
    } else {
        index.identity.model.base.clone()
    };
    let source = ws.model_source(&spec).with_context(|| {
        format!(
            "checkpoint {} was trained from {spec}, which cannot be found; pass it with --model",
            dir.display()
        )
    })?;
    let files = ModelFiles::resolve(&source)?;
    let output: PathBuf = args
        .output
        .as_ref()
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
        .unwrap_or_else(|| {
            if args.adapter_only {
                ws.adapter_dir()
            } else {
                ws.model_dir()
            }
        });
    if output.starts_with(&dir) {
        bail!("the output must not be inside the checkpoint");
    }
    let summary = export::export(&export::ExportOptions {
        files: &files,
        model_spec: &source.stable_spec(),
        checkpoint: dir,
        output,
        speaker_name: config.train.speaker_name.clone(),
        lora_scale: args.lora_scale,
        adapter_only: args.adapter_only,
        manifest: Some(ws.manifest()),
        choice,
        // The checkpoint records no session settings; the card says so.
        session: None,
    })?;
    summary.print(ws);
    Ok(())
}
