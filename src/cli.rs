//! Command-line definitions. Each flag that mirrors a config key says so in its help and is
//! turned into a [`config::Override`], so flags and config files share one validation path.
//!
//! The argument types of each command family live in modules of their own, re-exported here:
//! the data steps (`data_args`), the commands that speak (`voice_args`), training and export
//! (`train_args`), and the builder from flags to overrides they all use (`overrides`).

mod data_args;
mod overrides;
mod train_args;
mod voice_args;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

pub use data_args::{CodecCommand, CodesArgs, EmbedArgs, PrepArgs, SpeakersArgs, TokenizerArgs};
pub use train_args::{ExportArgs, TrainArgs};
pub use voice_args::{ServeArgs, SpeakArgs};

#[derive(Debug, Parser)]
#[command(
    name = "voiceclone",
    version,
    about = "Turn a folder of recordings into a fine-tuned Qwen3-TTS voice.",
    long_about = "Turn a folder of recordings into a fine-tuned Qwen3-TTS voice.\n\n\
        Subcommands share one workspace (the current directory, or --workdir) and one TOML \
        configuration: built-in defaults <- voiceclone.toml in the workspace <- --config FILE <- flags."
)]
pub struct Cli {
    /// Workspace directory (holds voiceclone.toml, data/, checkpoints/, model/).
    #[arg(long, global = true, value_name = "DIR", default_value = ".")]
    pub workdir: PathBuf,

    /// Extra configuration file, applied over the workspace's voiceclone.toml.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// More log output (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the resolved configuration (defaults <- voiceclone.toml <- --config <- flags).
    Config,
    /// Decode, resample and transcribe recordings into 24 kHz utterances and data/train.jsonl.
    Prep(PrepArgs),
    /// Speaker x-vector of the reference clip (default data/ref.wav) into data/speaker.safetensors.
    Embed(EmbedArgs),
    /// Add 12 Hz speech-tokenizer codes ("audio_codes", T x 16) to every manifest line.
    Codes(CodesArgs),
    /// Encode or decode single files with the 12 Hz speech tokenizer.
    #[command(subcommand)]
    Codec(CodecCommand),
    /// Fine-tune the talker on data/train.jsonl (resumable); exports model/ at the end.
    Train(Box<TrainArgs>),
    /// Write a training checkpoint as a model directory in the official layout (model/).
    Export(ExportArgs),
    /// Speak text in a cloned or fine-tuned voice (24 kHz mono WAV).
    Speak(Box<SpeakArgs>),
    /// Serve the voice over an OpenAI-compatible, streaming speech API (POST /v1/audio/speech).
    Serve(ServeArgs),
    /// What the workspace holds per speaker: utterances, hours, reference clip, x-vector, model.
    Speakers(SpeakersArgs),
}
