//! The arguments of the data steps — `prep`, `embed`, `codes`, `codec` and the `speakers`
//! report — with the speech-tokenizer choice `codes` and `codec` share, and the config overrides
//! each one's flags give (docs/architecture.md §5).

use std::path::PathBuf;

use clap::{Args, Subcommand};

use vc_core::config::Override;

use super::overrides::Overrides;

#[derive(Debug, Args)]
#[command(
    after_long_help = "Several voices in one workspace: `prep --speaker NAME INPUT...` tags every \
    utterance of the run with the speaker NAME and adds it to data/train.jsonl, keeping the other \
    speakers' lines; running it again for the same NAME replaces only that speaker's lines. \
    `--speakers-from-dirs PARENT` takes each subfolder of PARENT as one speaker named after it. \
    Each named speaker gets its reference clip data/ref/NAME.wav. Without --speaker the \
    workspace holds one unnamed speaker (data/ref.wav) and each run replaces the manifest."
)]
pub struct PrepArgs {
    /// Audio files or folders (searched recursively). Never written to.
    #[arg(required_unless_present = "speakers_from_dirs", value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,

    /// Speaker of every utterance of this run; adds to (or updates) that speaker's lines of a
    /// multi-speaker manifest.
    #[arg(long, value_name = "NAME")]
    pub speaker: Option<String>,

    /// Every subfolder of PARENT is one speaker, named after the folder.
    #[arg(
        long,
        value_name = "PARENT",
        conflicts_with_all = ["inputs", "speaker", "ref_audio"]
    )]
    pub speakers_from_dirs: Option<PathBuf>,

    /// Whisper ggml model: local file or owner/repo/file on the hub [prep.whisper_model].
    #[arg(long, value_name = "MODEL")]
    pub whisper_model: Option<String>,

    /// Spoken language: auto or a Whisper language code such as en [prep.language].
    #[arg(long, value_name = "LANG")]
    pub language: Option<String>,

    /// Shortest utterance in seconds [prep.min_seconds].
    #[arg(long, value_name = "SECONDS")]
    pub min_seconds: Option<f64>,

    /// Longest utterance in seconds [prep.max_seconds].
    #[arg(long, value_name = "SECONDS")]
    pub max_seconds: Option<f64>,

    /// Files processed at once, 0 = one per core [prep.jobs].
    #[arg(long, value_name = "N")]
    pub jobs: Option<usize>,

    /// Use this clip as the reference voice instead of choosing one [prep.ref_audio].
    #[arg(long, value_name = "AUDIO")]
    pub ref_audio: Option<PathBuf>,

    /// Redo every file, ignoring the results of earlier runs.
    #[arg(long)]
    pub force: bool,
}

impl PrepArgs {
    pub fn overrides(&self) -> Vec<Override> {
        let ref_audio = self
            .ref_audio
            .as_ref()
            .map(|v| std::path::absolute(v).unwrap_or_else(|_| v.clone()));
        Overrides::default()
            .path("prep.whisper_model", "--whisper-model", &self.whisper_model)
            .set("prep.language", "--language", self.language.clone())
            .set("prep.min_seconds", "--min-seconds", self.min_seconds)
            .set("prep.max_seconds", "--max-seconds", self.max_seconds)
            .count("prep.jobs", "--jobs", self.jobs)
            .set(
                "prep.ref_audio",
                "--ref-audio",
                ref_audio.map(|v| v.to_string_lossy().into_owned()),
            )
            .into()
    }
}

#[derive(Debug, Args)]
#[command(
    after_long_help = "With named speakers (`prep --speaker NAME`) embed computes every speaker's \
    x-vector into data/speakers/NAME.safetensors (or only --speaker NAME's): from data/ref/NAME.wav \
    with --mode ref, or the mean of up to --mean-clips of the speaker's utterances with --mode mean."
)]
pub struct EmbedArgs {
    /// Reference clip in any supported audio format [default: the workspace's data/ref.wav,
    /// written by `voiceclone prep`, or data/ref/NAME.wav of each named speaker].
    #[arg(value_name = "REF_AUDIO")]
    pub ref_audio: Option<PathBuf>,

    /// Only this named speaker (writes data/speakers/NAME.safetensors).
    #[arg(long, value_name = "NAME")]
    pub speaker: Option<String>,

    /// ref (the reference clip) or mean (f32 mean over the speaker's utterances) [embed.mode].
    #[arg(long, value_name = "MODE")]
    pub mode: Option<String>,

    /// Utterances averaged per speaker with --mode mean [embed.mean_clips].
    #[arg(long, value_name = "N")]
    pub mean_clips: Option<usize>,

    /// Qwen3-TTS Base model: hub repo id or local directory [model.base].
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,

    /// Output file [default: data/speaker.safetensors in the workspace].
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,
}

impl EmbedArgs {
    pub fn overrides(&self) -> Vec<Override> {
        Overrides::default()
            .path("model.base", "--model", &self.model)
            .set("embed.mode", "--mode", self.mode.clone())
            .count("embed.mean_clips", "--mean-clips", self.mean_clips)
            .into()
    }
}

#[derive(Debug, Args)]
pub struct SpeakersArgs {
    /// One JSON object per speaker instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CodesArgs {
    /// Manifest to read [default: data/train.jsonl in the workspace].
    #[arg(long, value_name = "JSONL")]
    pub input: Option<PathBuf>,

    /// Manifest to write [default: the input, rewritten atomically].
    #[arg(long, value_name = "JSONL")]
    pub output: Option<PathBuf>,

    #[command(flatten)]
    pub tokenizer: TokenizerArgs,

    /// Clips encoded per batch [codes.batch_size].
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,

    /// Recompute codes for lines that already have them.
    #[arg(long)]
    pub force: bool,
}

/// Which speech tokenizer to use; shared by `codes` and `codec`.
#[derive(Debug, Args)]
pub struct TokenizerArgs {
    /// Qwen3-TTS model whose speech_tokenizer/ is used: hub repo id or local directory [model.base].
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,

    /// A standalone speech tokenizer (hub repo id or directory) instead of the model's [codes.tokenizer].
    #[arg(long, value_name = "TOKENIZER")]
    pub tokenizer: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum CodecCommand {
    /// Audio file (any supported format and rate) -> codes JSON {"codes": [[16 ints], ...]}.
    Encode {
        #[arg(value_name = "AUDIO")]
        audio: PathBuf,
        /// Output JSON file; `-` writes it to standard output.
        #[arg(short, long, value_name = "JSON")]
        output: PathBuf,
        /// Replace the output file if it exists.
        #[arg(long)]
        overwrite: bool,
        #[command(flatten)]
        tokenizer: TokenizerArgs,
    },
    /// Codes JSON -> 24 kHz mono 16-bit WAV.
    Decode {
        #[arg(value_name = "CODES_JSON")]
        codes: PathBuf,
        /// Output WAV file; `-` writes it to standard output.
        #[arg(short, long, value_name = "WAV")]
        output: PathBuf,
        /// Replace the output file if it exists.
        #[arg(long)]
        overwrite: bool,
        #[command(flatten)]
        tokenizer: TokenizerArgs,
    },
}

impl TokenizerArgs {
    pub fn overrides(&self) -> Vec<Override> {
        Overrides::default()
            .path("model.base", "--model", &self.model)
            .path("codes.tokenizer", "--tokenizer", &self.tokenizer)
            .into()
    }
}

impl CodesArgs {
    pub fn overrides(&self) -> Vec<Override> {
        Overrides(self.tokenizer.overrides())
            .count("codes.batch_size", "--batch-size", self.batch_size)
            .into()
    }
}

impl CodecCommand {
    pub fn tokenizer(&self) -> &TokenizerArgs {
        match self {
            CodecCommand::Encode { tokenizer, .. } | CodecCommand::Decode { tokenizer, .. } => {
                tokenizer
            }
        }
    }
}
