//! Command-line definitions. Each flag that mirrors a config key says so in its help and is
//! turned into a [`config::Override`], so flags and config files share one validation path.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::Override;

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
}

#[derive(Debug, Args)]
pub struct PrepArgs {
    /// Audio files or folders (searched recursively). Never written to.
    #[arg(required = true, value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,

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
        let mut o = Vec::new();
        if let Some(v) = &self.whisper_model {
            let v = absolutize_if_exists(v);
            o.push(Override::new("prep.whisper_model", "--whisper-model", v));
        }
        if let Some(v) = &self.language {
            o.push(Override::new("prep.language", "--language", v.clone()));
        }
        if let Some(v) = self.min_seconds {
            o.push(Override::new("prep.min_seconds", "--min-seconds", v));
        }
        if let Some(v) = self.max_seconds {
            o.push(Override::new("prep.max_seconds", "--max-seconds", v));
        }
        if let Some(v) = self.jobs {
            o.push(Override::new("prep.jobs", "--jobs", v as i64));
        }
        if let Some(v) = &self.ref_audio {
            let v = std::path::absolute(v).unwrap_or_else(|_| v.clone());
            o.push(Override::new(
                "prep.ref_audio",
                "--ref-audio",
                v.to_string_lossy().into_owned(),
            ));
        }
        o
    }
}

#[derive(Debug, Args)]
pub struct EmbedArgs {
    /// Reference clip in any supported audio format [default: the workspace's data/ref.wav,
    /// written by `voiceclone prep`].
    #[arg(value_name = "REF_AUDIO")]
    pub ref_audio: Option<PathBuf>,

    /// Qwen3-TTS Base model: hub repo id or local directory [model.base].
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,

    /// Output file [default: data/speaker.safetensors in the workspace].
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,
}

impl EmbedArgs {
    pub fn overrides(&self) -> Vec<Override> {
        let mut o = Vec::new();
        if let Some(v) = &self.model {
            o.push(Override::new(
                "model.base",
                "--model",
                absolutize_if_exists(v),
            ));
        }
        o
    }
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
        /// Output JSON file.
        #[arg(short, long, value_name = "JSON")]
        output: PathBuf,
        #[command(flatten)]
        tokenizer: TokenizerArgs,
    },
    /// Codes JSON -> 24 kHz mono 16-bit WAV.
    Decode {
        #[arg(value_name = "CODES_JSON")]
        codes: PathBuf,
        /// Output WAV file.
        #[arg(short, long, value_name = "WAV")]
        output: PathBuf,
        #[command(flatten)]
        tokenizer: TokenizerArgs,
    },
}

impl TokenizerArgs {
    pub fn overrides(&self) -> Vec<Override> {
        let mut o = Vec::new();
        if let Some(v) = &self.model {
            o.push(Override::new(
                "model.base",
                "--model",
                absolutize_if_exists(v),
            ));
        }
        if let Some(v) = &self.tokenizer {
            o.push(Override::new(
                "codes.tokenizer",
                "--tokenizer",
                absolutize_if_exists(v),
            ));
        }
        o
    }
}

impl CodesArgs {
    pub fn overrides(&self) -> Vec<Override> {
        let mut o = self.tokenizer.overrides();
        if let Some(v) = self.batch_size {
            o.push(Override::new("codes.batch_size", "--batch-size", v as i64));
        }
        o
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

/// Flags name paths relative to the current directory, config files relative to the workspace:
/// make a flag's existing path absolute so both resolve the same way.
fn absolutize_if_exists(v: &str) -> String {
    let p = std::path::Path::new(v);
    if p.exists() {
        std::path::absolute(p)
            .map(|a| a.to_string_lossy().into_owned())
            .unwrap_or_else(|_| v.to_string())
    } else {
        v.to_string()
    }
}

#[derive(Debug, Args)]
#[command(
    after_long_help = "Voice, when none is given: the fine-tuned model in the workspace's model/ \
    (its only speaker), else the base model cloning data/speaker.safetensors or data/ref.wav.\n\n\
    --input takes one text per line, or JSON lines with \"text\" and optional \"output\", \
    \"language\", \"speaker\", \"ref_audio\", \"ref_text\", \"x_vector_only\", \"non_streaming\"; \
    -o is then a directory receiving one WAV per line (0001.wav, ... unless \"output\" names it)."
)]
pub struct SpeakArgs {
    /// Text to speak (or use --input).
    #[arg(
        value_name = "TEXT",
        required_unless_present = "input",
        conflicts_with = "input"
    )]
    pub text: Option<String>,

    /// Many texts: one per line, or JSON lines (see below).
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,

    /// Output WAV file (a directory with --input).
    #[arg(short, long, value_name = "PATH")]
    pub output: PathBuf,

    /// Replace output files that already exist.
    #[arg(long)]
    pub overwrite: bool,

    /// Model: hub repo id or local directory [speak.model; default model/ or model.base].
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,

    /// Named speaker of a fine-tuned / CustomVoice model [default: its only speaker].
    #[arg(long, value_name = "NAME")]
    pub speaker: Option<String>,

    /// Clone the voice of this clip (any supported audio format).
    #[arg(long, value_name = "AUDIO")]
    pub ref_audio: Option<PathBuf>,

    /// Transcript of --ref-audio: enables in-context cloning (reference codes in the prompt).
    #[arg(long, value_name = "TEXT")]
    pub ref_text: Option<String>,

    /// Clone from the speaker embedding only, even when --ref-text is given.
    #[arg(long)]
    pub x_vector_only: bool,

    /// Language: auto or a name from the model's codec_language_id [speak.language].
    #[arg(long, value_name = "LANG")]
    pub language: Option<String>,

    /// Whole text before the first frame (official non_streaming_mode) [speak.non_streaming;
    /// default: on for named speakers, off for cloning, as officially].
    #[arg(long, conflicts_with = "streaming")]
    pub non_streaming: bool,

    /// Feed the text along with the frames (the opposite of --non-streaming).
    #[arg(long)]
    pub streaming: bool,

    /// No sampling: most likely code at every step, talker and code predictor [speak.greedy].
    #[arg(long)]
    pub greedy: bool,

    /// Code-0 sampling temperature [speak.temperature].
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,

    /// Code-0 top-k [speak.top_k].
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,

    /// Code-0 top-p (nucleus) [speak.top_p].
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,

    /// Penalty on repeated code-0 ids, 1 = none [speak.repetition_penalty].
    #[arg(long, value_name = "R")]
    pub repetition_penalty: Option<f64>,

    /// Code-predictor (codebooks 1-15) temperature [speak.sub_temperature].
    #[arg(long, value_name = "T")]
    pub sub_temperature: Option<f64>,

    /// Code-predictor top-k [speak.sub_top_k].
    #[arg(long, value_name = "K")]
    pub sub_top_k: Option<usize>,

    /// Code-predictor top-p [speak.sub_top_p].
    #[arg(long, value_name = "P")]
    pub sub_top_p: Option<f64>,

    /// At most N frames (80 ms each) per text chunk [speak.max_frames].
    #[arg(long, value_name = "N")]
    pub max_frames: Option<usize>,

    /// Random seed; the same seed gives the same audio [speak.seed].
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,

    /// Texts generated together [speak.batch_size].
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,

    /// Split texts longer than this at sentence boundaries, 0 = never [speak.max_chunk_chars].
    #[arg(long, value_name = "N")]
    pub max_chunk_chars: Option<usize>,

    /// Number format: auto, f32, bf16-weights (fast CPU), bf16 (GPU) [speak.precision].
    #[arg(long, value_name = "P")]
    pub precision: Option<String>,

    /// Also write the generated codes as JSON {"codes": [[16 ints], ...]} (a directory with --input).
    #[arg(long, value_name = "PATH")]
    pub save_codes: Option<PathBuf>,
}

impl SpeakArgs {
    pub fn overrides(&self) -> Vec<Override> {
        let mut o = Vec::new();
        if let Some(v) = &self.model {
            o.push(Override::new(
                "speak.model",
                "--model",
                absolutize_if_exists(v),
            ));
        }
        if let Some(v) = &self.language {
            o.push(Override::new("speak.language", "--language", v.clone()));
        }
        if self.non_streaming {
            o.push(Override::new(
                "speak.non_streaming",
                "--non-streaming",
                "true",
            ));
        }
        if self.streaming {
            o.push(Override::new("speak.non_streaming", "--streaming", "false"));
        }
        if self.greedy {
            o.push(Override::new("speak.greedy", "--greedy", true));
        }
        let floats = [
            ("speak.temperature", "--temperature", self.temperature),
            ("speak.top_p", "--top-p", self.top_p),
            (
                "speak.repetition_penalty",
                "--repetition-penalty",
                self.repetition_penalty,
            ),
            (
                "speak.sub_temperature",
                "--sub-temperature",
                self.sub_temperature,
            ),
            ("speak.sub_top_p", "--sub-top-p", self.sub_top_p),
        ];
        for (key, flag, v) in floats {
            if let Some(v) = v {
                o.push(Override::new(key, flag, v));
            }
        }
        let ints = [
            ("speak.top_k", "--top-k", self.top_k),
            ("speak.sub_top_k", "--sub-top-k", self.sub_top_k),
            ("speak.max_frames", "--max-frames", self.max_frames),
            ("speak.batch_size", "--batch-size", self.batch_size),
            (
                "speak.max_chunk_chars",
                "--max-chunk-chars",
                self.max_chunk_chars,
            ),
        ];
        for (key, flag, v) in ints {
            if let Some(v) = v {
                o.push(Override::new(key, flag, v as i64));
            }
        }
        if let Some(v) = self.seed {
            o.push(Override::new(
                "speak.seed",
                "--seed",
                v.min(i64::MAX as u64) as i64,
            ));
        }
        o
    }
}

#[derive(Debug, Args)]
#[command(
    after_long_help = "Reads data/train.jsonl; lines without \"audio_codes\" are coded first \
    (voiceclone codes), and data/speaker.safetensors is computed first when missing (voiceclone \
    embed, from data/ref.wav or the first line's ref_audio).\n\n\
    Checkpoints go to checkpoints/step-NNNNNNN/ (every train.save_every steps, at the end, and on \
    Ctrl-C or SIGTERM, after the current step); running train again continues from the newest \
    one exactly where it stopped. A checkpoint of another base model or of another trained set, \
    batch size, seed or speaker embedding is refused with the reason. --fresh starts over: the \
    existing checkpoints/ is renamed to checkpoints.N/ (never deleted).\n\n\
    At the end the model is exported to model/ (see voiceclone export)."
)]
pub struct TrainArgs {
    /// Qwen3-TTS Base model to fine-tune: hub repo id or local directory [model.base].
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,

    /// Utterances per micro-batch [train.batch_size].
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,

    /// Micro-batches per optimizer step [train.grad_accum].
    #[arg(long, value_name = "N")]
    pub grad_accum: Option<usize>,

    /// Peak learning rate [train.lr].
    #[arg(long, value_name = "LR")]
    pub lr: Option<f64>,

    /// AdamW weight decay [train.weight_decay].
    #[arg(long, value_name = "WD")]
    pub weight_decay: Option<f64>,

    /// Linear warm-up steps before the cosine decay [train.warmup_steps].
    #[arg(long, value_name = "N")]
    pub warmup_steps: Option<usize>,

    /// Passes over the data [train.epochs].
    #[arg(long, value_name = "N")]
    pub epochs: Option<usize>,

    /// Stop after this many optimizer steps in total, 0 = no limit [train.max_steps].
    #[arg(long, value_name = "N")]
    pub max_steps: Option<usize>,

    /// Clip the gradient's global L2 norm to this, 0 = off [train.clip_norm].
    #[arg(long, value_name = "NORM")]
    pub clip_norm: Option<f64>,

    /// Seed of the data order [train.seed].
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,

    /// Manifest order in fixed batches instead of shuffling (for benchmarks) [train.shuffle].
    #[arg(long)]
    pub no_shuffle: bool,

    /// Save a checkpoint every N optimizer steps, 0 = only at the end [train.save_every].
    #[arg(long, value_name = "N")]
    pub save_every: Option<usize>,

    /// Checkpoints kept [train.keep].
    #[arg(long, value_name = "N")]
    pub keep: Option<usize>,

    /// Leave tensors matching this glob untrained; repeatable, replaces the list [train.freeze].
    #[arg(long, value_name = "GLOB")]
    pub freeze: Vec<String>,

    /// Speaker name of the exported model [train.speaker_name].
    #[arg(long, value_name = "NAME")]
    pub speaker_name: Option<String>,

    /// Start a new run: move the existing checkpoints/ aside (to checkpoints.N/) first.
    #[arg(long)]
    pub fresh: bool,

    /// Do not export model/ at the end.
    #[arg(long)]
    pub no_export: bool,

    /// Where the finished model is exported [default: model/ in the workspace].
    #[arg(short, long, value_name = "DIR")]
    pub output: Option<PathBuf>,
}

impl TrainArgs {
    pub fn overrides(&self) -> Vec<Override> {
        let mut o = Vec::new();
        if let Some(v) = &self.model {
            o.push(Override::new(
                "model.base",
                "--model",
                absolutize_if_exists(v),
            ));
        }
        let ints = [
            ("train.batch_size", "--batch-size", self.batch_size),
            ("train.grad_accum", "--grad-accum", self.grad_accum),
            ("train.warmup_steps", "--warmup-steps", self.warmup_steps),
            ("train.epochs", "--epochs", self.epochs),
            ("train.max_steps", "--max-steps", self.max_steps),
            ("train.save_every", "--save-every", self.save_every),
            ("train.keep", "--keep", self.keep),
        ];
        for (key, flag, v) in ints {
            if let Some(v) = v {
                o.push(Override::new(key, flag, v as i64));
            }
        }
        let floats = [
            ("train.lr", "--lr", self.lr),
            ("train.weight_decay", "--weight-decay", self.weight_decay),
            ("train.clip_norm", "--clip-norm", self.clip_norm),
        ];
        for (key, flag, v) in floats {
            if let Some(v) = v {
                o.push(Override::new(key, flag, v));
            }
        }
        if let Some(v) = self.seed {
            o.push(Override::new(
                "train.seed",
                "--seed",
                v.min(i64::MAX as u64) as i64,
            ));
        }
        if self.no_shuffle {
            o.push(Override::new("train.shuffle", "--no-shuffle", false));
        }
        if !self.freeze.is_empty() {
            let list: Vec<toml::Value> = self
                .freeze
                .iter()
                .map(|g| toml::Value::String(g.clone()))
                .collect();
            o.push(Override::new("train.freeze", "--freeze", list));
        }
        if let Some(v) = &self.speaker_name {
            o.push(Override::new(
                "train.speaker_name",
                "--speaker-name",
                v.clone(),
            ));
        }
        o
    }
}

#[derive(Debug, Args)]
#[command(
    after_long_help = "The output is the official layout (spec §10.5): config.json with \
    tts_model_type \"custom_voice\" and talker_config.spk_id {NAME: 3000}, a bf16 model.safetensors \
    (the base model without speaker_encoder.*, trained tensors replaced, the speaker x-vector in \
    codec_embedding row 3000), and the base model's other files (tokenizer, generation config, \
    speech_tokenizer/). It is written to a temporary directory and renamed into place; an existing \
    directory is only replaced when it is an earlier export (it has voiceclone-export.json) or \
    empty."
)]
pub struct ExportArgs {
    /// Checkpoint directory [default: the newest in the workspace's checkpoints/].
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,

    /// Output directory [default: model/ in the workspace].
    #[arg(short, long, value_name = "DIR")]
    pub output: Option<PathBuf>,

    /// Speaker name stored in config.json (lower-cased) [train.speaker_name].
    #[arg(long, value_name = "NAME")]
    pub speaker_name: Option<String>,

    /// The base model the checkpoint was trained from [model.base].
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
}

impl ExportArgs {
    pub fn overrides(&self) -> Vec<Override> {
        let mut o = Vec::new();
        if let Some(v) = &self.model {
            o.push(Override::new(
                "model.base",
                "--model",
                absolutize_if_exists(v),
            ));
        }
        if let Some(v) = &self.speaker_name {
            o.push(Override::new(
                "train.speaker_name",
                "--speaker-name",
                v.clone(),
            ));
        }
        o
    }
}
