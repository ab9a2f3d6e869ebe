//! Glue between the CLI and the library: each subcommand resolves its configuration, opens the
//! workspace and calls into the pipeline modules, which know nothing of flags or files.

pub mod codec;
pub mod codes;
pub mod embed;
pub mod export;
pub mod output;
pub mod prep;
pub mod serve;
pub mod speak;
pub mod speakers;
pub mod train;
pub mod train_plan;
pub mod train_ranks;
pub mod train_setup;

use anyhow::Result;

use crate::cli::{Cli, Command};
use vc_core::config::{self, Override};
use vc_core::workspace::Workspace;

pub fn run(cli: Cli) -> Result<()> {
    let ws = Workspace::open(&cli.workdir)?;
    match &cli.command {
        Command::Config => {
            let resolved = config::resolve(ws.config_file(), cli.config.as_deref(), &[])?;
            print!("{}", resolved.to_annotated_toml());
            Ok(())
        }
        Command::Prep(args) => {
            let resolved = resolve(&ws, &cli, &args.overrides())?;
            prep::run(&ws, &resolved.config, args)
        }
        Command::Embed(args) => {
            output::refuse_stdout(args.output.as_deref(), "a safetensors file")?;
            let resolved = resolve(&ws, &cli, &args.overrides())?;
            embed::run(&ws, &resolved.config, args)
        }
        Command::Codes(args) => {
            let resolved = resolve(&ws, &cli, &args.overrides())?;
            codes::run(&ws, &resolved.config, args)
        }
        Command::Codec(cmd) => {
            let resolved = resolve(&ws, &cli, &cmd.tokenizer().overrides())?;
            codec::run(&ws, &resolved.config, cmd)
        }
        Command::Train(args) => {
            output::refuse_stdout(args.output.as_deref(), "a model directory")?;
            let resolved = resolve(&ws, &cli, &args.overrides())?;
            train::run(&ws, &resolved.config, args)
        }
        Command::Export(args) => {
            output::refuse_stdout(args.output.as_deref(), "a model or adapter directory")?;
            let resolved = resolve(&ws, &cli, &args.overrides())?;
            export::run(&ws, &resolved.config, args)
        }
        Command::Speak(args) => {
            let resolved = resolve(&ws, &cli, &args.overrides())?;
            speak::run(&ws, &resolved.config, args)
        }
        Command::Serve(args) => {
            let resolved = resolve(&ws, &cli, &args.overrides())?;
            serve::run(&ws, &resolved)
        }
        Command::Speakers(args) => {
            let resolved = resolve(&ws, &cli, &[])?;
            speakers::run(&ws, &resolved.config, args)
        }
    }
}

fn resolve(ws: &Workspace, cli: &Cli, overrides: &[Override]) -> Result<config::Resolved> {
    config::resolve(ws.config_file(), cli.config.as_deref(), overrides)
}
