//! `voiceclone codes` and the speech-tokenizer loading it shares with `voiceclone codec`.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::artifacts::codes::{frames_from_rows, CodeFrame};
use crate::cli::CodesArgs;
use crate::codes::{self, AudioEncoder, CodesOptions};
use crate::config::Config;
use crate::model::codec::Codec;
use crate::workspace::Workspace;

/// The speech tokenizer named by `codes.tokenizer`, or else the one inside `model.base`.
pub fn load_codec(ws: &Workspace, config: &Config) -> Result<Codec> {
    let spec = if config.codes.tokenizer.trim().is_empty() {
        &config.model.base
    } else {
        &config.codes.tokenizer
    };
    let source = ws.model_source(spec)?;
    Codec::load(&source)
        .with_context(|| format!("cannot load the speech tokenizer of {}", source.describe()))
}

/// The codec as `codes` sees it: frames of exactly 16 codes.
struct CodecEncoder<'a>(&'a Codec);

impl AudioEncoder for CodecEncoder<'_> {
    fn encode_batch(&self, clips: &[&[f32]]) -> Result<Vec<Vec<CodeFrame>>> {
        self.0
            .encode_batch(clips)?
            .iter()
            .map(|codes| frames_from_rows(codes))
            .collect()
    }
}

pub fn run(ws: &Workspace, config: &Config, args: &CodesArgs) -> Result<()> {
    let input = args.input.clone().unwrap_or_else(|| ws.manifest());
    if !input.is_file() {
        anyhow::bail!(
            "manifest {} does not exist; run `voiceclone prep` first (or pass --input)",
            input.display()
        );
    }
    let output: PathBuf = args.output.clone().unwrap_or_else(|| input.clone());
    let codec = load_codec(ws, config)?;
    let opts = CodesOptions {
        input: input.clone(),
        output: output.clone(),
        base_dir: ws.root().to_path_buf(),
        batch_size: config.codes.batch_size,
        force: args.force,
    };
    let summary = codes::run(&opts, &CodecEncoder(&codec))?;
    println!(
        "codes: {} line(s): {} coded ({:.1} s of audio), {} already had codes, {} left unchanged (bad)",
        summary.lines,
        summary.coded,
        summary.audio_seconds,
        summary.already_coded,
        summary.bad_lines.len()
    );
    for (line, why) in &summary.bad_lines {
        println!("  {}:{line}: {why}", input.display());
    }
    if summary.coded > 0 || output != input {
        println!("  wrote {}", output.display());
    }
    Ok(())
}
