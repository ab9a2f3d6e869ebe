//! `voiceclone codes`: the `codes` step (`vc_prep::codes`) on the workspace's manifest or
//! `--input`, with the configured speech tokenizer.

use std::path::PathBuf;

use anyhow::Result;

use crate::cli::CodesArgs;
use vc_core::config::Config;
use vc_core::workspace::Workspace;
use vc_prep::codes::{self, CodecOptions};

pub fn run(ws: &Workspace, config: &Config, args: &CodesArgs) -> Result<()> {
    let input = args.input.clone().unwrap_or_else(|| ws.manifest());
    if !input.is_file() {
        anyhow::bail!(
            "manifest {} does not exist; run `voiceclone prep` first (or pass --input)",
            input.display()
        );
    }
    let output: PathBuf = args.output.clone().unwrap_or_else(|| input.clone());
    let codec = CodecOptions::new(
        &config.codes.tokenizer,
        &config.model.base,
        config.codes.batch_size,
    );
    let summary = codes::code_manifest(ws, &codec, &input, &output, args.force)?;
    for line in summary.report(&input, &output) {
        println!("{line}");
    }
    Ok(())
}
