//! Command-line definitions. Each flag that mirrors a config key says so in its help and is
//! turned into a [`config::Override`], so flags and config files share one validation path.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use toml::Value;
use vc_core::config::Override;

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
        /// Output JSON file.
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
        /// Output WAV file.
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

/// The config overrides of one subcommand's flags: each call adds an [`Override`] when its flag
/// was given.
#[derive(Default)]
struct Overrides(Vec<Override>);

impl Overrides {
    fn set(mut self, key: &'static str, flag: &'static str, v: Option<impl Into<Value>>) -> Self {
        if let Some(v) = v {
            self.0.push(Override::new(key, flag, v));
        }
        self
    }

    /// A model or file given as a path or hub id: an existing path is made absolute.
    fn path(self, key: &'static str, flag: &'static str, v: &Option<String>) -> Self {
        self.set(key, flag, v.as_deref().map(absolutize_if_exists))
    }

    fn count(self, key: &'static str, flag: &'static str, v: Option<usize>) -> Self {
        self.set(key, flag, v.map(|v| v as i64))
    }

    /// A seed (u64) as the TOML integer it is written as.
    fn seed(self, key: &'static str, flag: &'static str, v: Option<u64>) -> Self {
        self.set(key, flag, v.map(|v| v.min(i64::MAX as u64) as i64))
    }

    /// A switch that sets `key` to `value` when given.
    fn flag(
        self,
        key: &'static str,
        flag: &'static str,
        on: bool,
        value: impl Into<Value>,
    ) -> Self {
        self.set(key, flag, on.then_some(value))
    }
}

impl From<Overrides> for Vec<Override> {
    fn from(o: Overrides) -> Self {
        o.0
    }
}

#[derive(Debug, Args)]
#[command(
    after_long_help = "Endpoints: POST /v1/audio/speech (OpenAI's body: model, input, voice, \
    response_format wav|pcm, speed 1.0, stream_format audio|sse, plus language, seed and the \
    sampling keys of speak), POST /v1/voices (multipart: file, optional transcript and name), \
    GET /v1/voices, DELETE /v1/voices/ID, GET /v1/models, GET /health. Synthesis defaults come \
    from [speak]; see docs/serving.md."
)]
pub struct ServeArgs {
    /// Address to listen on [serve.host; default 127.0.0.1, this machine only].
    #[arg(long, value_name = "ADDR")]
    pub host: Option<String>,

    /// TCP port [serve.port].
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,

    /// Model: hub repo id or local directory [serve.model; default model/ or model.base].
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,

    /// Require "Authorization: Bearer KEY" on every request but GET /health [serve.api_key].
    #[arg(
        long,
        value_name = "KEY",
        env = "VOICECLONE_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,

    /// Requests generated together [serve.max_batch].
    #[arg(long, value_name = "N")]
    pub max_batch: Option<usize>,

    /// Requests waiting for the batch before 429 [serve.max_queue].
    #[arg(long, value_name = "N")]
    pub max_queue: Option<usize>,

    /// Seconds in-flight requests get after SIGTERM [serve.shutdown_seconds].
    #[arg(long, value_name = "S")]
    pub shutdown_seconds: Option<f64>,

    /// Number format, as for speak [speak.precision].
    #[arg(long, value_name = "P")]
    pub precision: Option<String>,

    /// After a stream's first frame, its audio goes out in chunks growing up to N frames,
    /// which decode cheaper; 1 = every frame at once [speak.stream_chunk_frames].
    #[arg(long, value_name = "N")]
    pub stream_chunk_frames: Option<usize>,

    /// An adapter directory (`voiceclone export --adapter-only`) served beside the model:
    /// its speakers become voices, or NAME=DIR serves its one speaker as voice NAME;
    /// repeatable, replaces the list [serve.adapters]. Without --model the base model is the
    /// one the adapters were trained on.
    #[arg(long = "adapter", value_name = "[NAME=]DIR")]
    pub adapters: Vec<String>,
}

impl ServeArgs {
    pub fn overrides(&self) -> Vec<Override> {
        Overrides::default()
            .set("serve.host", "--host", self.host.clone())
            .set("serve.port", "--port", self.port.map(i64::from))
            .path("serve.model", "--model", &self.model)
            .set("serve.api_key", "--api-key", self.api_key.clone())
            .count("serve.max_batch", "--max-batch", self.max_batch)
            .count("serve.max_queue", "--max-queue", self.max_queue)
            .set(
                "serve.shutdown_seconds",
                "--shutdown-seconds",
                self.shutdown_seconds,
            )
            .set("speak.precision", "--precision", self.precision.clone())
            .count(
                "speak.stream_chunk_frames",
                "--stream-chunk-frames",
                self.stream_chunk_frames,
            )
            .set(
                "serve.adapters",
                "--adapter",
                (!self.adapters.is_empty()).then(|| {
                    self.adapters
                        .iter()
                        .map(|e| {
                            let exists = |p: &str| std::path::Path::new(p).exists();
                            toml::Value::String(match vc_core::config::adapter_entry(e, exists) {
                                (Some(name), dir) => {
                                    format!("{name}={}", absolutize_if_exists(dir))
                                }
                                (None, dir) => absolutize_if_exists(dir),
                            })
                        })
                        .collect::<Vec<_>>()
                }),
            )
            .into()
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

    /// Output WAV file (a directory with --input); `-` streams the WAV to standard output as it
    /// is generated (its header gives the sizes of a stream of unknown length).
    #[arg(short, long, value_name = "PATH")]
    pub output: PathBuf,

    /// Replace output files that already exist.
    #[arg(long)]
    pub overwrite: bool,

    /// An adapter directory (`voiceclone export --adapter-only`) to speak with, put on its base
    /// model as the merged export would be (the base it records, unless --model names one).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,

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

    /// With -o -: after the first frame, audio goes out in chunks growing up to N frames,
    /// which decode cheaper; 1 = every frame at once [speak.stream_chunk_frames].
    #[arg(long, value_name = "N")]
    pub stream_chunk_frames: Option<usize>,

    /// Number format: auto (the checkpoint's own), f32, bf16-weights (CPU), q8 (8-bit, fastest on a
    /// CPU), bf16 (GPU) [speak.precision].
    #[arg(long, value_name = "P")]
    pub precision: Option<String>,

    /// Also write the generated codes as JSON {"codes": [[16 ints], ...]} (a directory with --input).
    #[arg(long, value_name = "PATH")]
    pub save_codes: Option<PathBuf>,
}

impl SpeakArgs {
    pub fn overrides(&self) -> Vec<Override> {
        Overrides::default()
            .path("speak.model", "--model", &self.model)
            .set("speak.language", "--language", self.language.clone())
            .flag(
                "speak.non_streaming",
                "--non-streaming",
                self.non_streaming,
                "true",
            )
            .flag(
                "speak.non_streaming",
                "--streaming",
                self.streaming,
                "false",
            )
            .flag("speak.greedy", "--greedy", self.greedy, true)
            .set("speak.temperature", "--temperature", self.temperature)
            .set("speak.top_p", "--top-p", self.top_p)
            .set(
                "speak.repetition_penalty",
                "--repetition-penalty",
                self.repetition_penalty,
            )
            .set(
                "speak.sub_temperature",
                "--sub-temperature",
                self.sub_temperature,
            )
            .set("speak.sub_top_p", "--sub-top-p", self.sub_top_p)
            .count("speak.top_k", "--top-k", self.top_k)
            .count("speak.sub_top_k", "--sub-top-k", self.sub_top_k)
            .count("speak.max_frames", "--max-frames", self.max_frames)
            .count("speak.batch_size", "--batch-size", self.batch_size)
            .count(
                "speak.max_chunk_chars",
                "--max-chunk-chars",
                self.max_chunk_chars,
            )
            .count(
                "speak.stream_chunk_frames",
                "--stream-chunk-frames",
                self.stream_chunk_frames,
            )
            .seed("speak.seed", "--seed", self.seed)
            .set("speak.precision", "--precision", self.precision.clone())
            .into()
    }
}

#[derive(Debug, Args)]
#[command(
    after_long_help = "Reads data/train.jsonl; lines without \"audio_codes\" are coded first \
    (voiceclone codes), and data/speaker.safetensors is computed first when missing (voiceclone \
    embed, from data/ref.wav or the first line's ref_audio). With named speakers (prep --speaker) \
    every sample carries its own speaker's x-vector (data/speakers/NAME.safetensors, computed \
    when missing) and the export holds every speaker.\n\n\
    Checkpoints go to checkpoints/step-NNNNNNN/ (every train.save_every steps, at the end, and on \
    Ctrl-C or SIGTERM, after the current step); running train again continues from the newest \
    one exactly where it stopped. A checkpoint of another base model or of another trained set, \
    batch size, seed, speaker set or speaker embedding is refused with the reason. --fresh starts over: the \
    existing checkpoints/ is renamed to checkpoints.N/ (never deleted).\n\n\
    At the end the model is exported to model/ (see voiceclone export).\n\n\
    --gpus N trains on N GPUs and --cpu-ranks N on N CPU processes, sharded (FSDP; train.shard \
    full or grad-op), with the same results as one device; --max-restarts K starts every rank \
    again from the last checkpoint when one fails. A process started by torchrun (with \
    --no-python; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), by scripts/ray_train.py \
    or as one of several Slurm tasks (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, MASTER_ADDR) is \
    one rank of such a run and starts nothing itself: that is how runs span several nodes (the \
    workspace must be on a shared filesystem). Checkpoints of a sharded run continue at any \
    number of ranks, or on one device.\n\n\
    --backend autograd runs the code path of a GPU (autograd over plain ops, weights stored in \
    bf16) on the CPU, to check what a GPU run computes; auto, the default, is the CPU kernels on \
    the CPU and autograd on a GPU."
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

    /// Train low-rank adapters of rank R instead of every weight, 0 = a full fine-tune
    /// [train.lora_rank, default 0].
    #[arg(long, value_name = "R")]
    pub lora_rank: Option<usize>,

    /// The adapters' alpha (their product is scaled by alpha / R), 0 = 2·R [train.lora_alpha].
    #[arg(long, value_name = "ALPHA")]
    pub lora_alpha: Option<f64>,

    /// Matrices that get adapters (glob over decoder-layer projections); repeatable, replaces
    /// the list [train.lora_targets, default: every projection of both decoders].
    #[arg(long, value_name = "GLOB")]
    pub lora_target: Vec<String>,

    /// Talker tensors trained fully beside the adapters (glob); repeatable, replaces the list
    /// [train.lora_full, default none].
    #[arg(long, value_name = "GLOB")]
    pub lora_full: Vec<String>,

    /// Speaker name of the exported model, for a workspace with one unnamed speaker
    /// [train.speaker_name].
    #[arg(long, value_name = "NAME")]
    pub speaker_name: Option<String>,

    /// Train sharded on N GPUs, one process each (builds with --features cuda,nccl) [train.gpus].
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,

    /// Train sharded on N CPU processes [train.cpu_ranks].
    #[arg(long, value_name = "N")]
    pub cpu_ranks: Option<usize>,

    /// What a sharded run shards: full or grad-op [train.shard].
    #[arg(long, value_name = "MODE")]
    pub shard: Option<String>,

    /// How the trainer computes: auto, kernels, autograd (the GPU code path, bf16 weights) or
    /// autograd-f32; a verification setting [train.backend].
    #[arg(long, value_name = "BACKEND")]
    pub backend: Option<String>,

    /// How the optimizer keeps its state: fp32 (masters and moments), int8 (fp32 masters,
    /// 8-bit moments) or bf16-compensated (bf16 weights with a bf16 compensation, fp32
    /// moments) [train.optimizer_state, default fp32].
    #[arg(long, value_name = "MODE")]
    pub optimizer_state: Option<String>,

    /// What lives in host memory: none, or optimizer (masters and moments, updated there by the
    /// CPU kernels) [train.offload, default none].
    #[arg(long, value_name = "WHAT")]
    pub offload: Option<String>,

    /// Activation checkpointing: none, or layers (keep each unit's input, recompute it for the
    /// backward pass) [train.recompute, default none].
    #[arg(long, value_name = "WHAT")]
    pub recompute: Option<String>,

    /// The dtype gradients are summed in, over micro-batches and ranks: fp32 or bf16 (half the
    /// bytes, each sum rounded) [train.reduce_dtype, default fp32].
    #[arg(long, value_name = "DTYPE")]
    pub reduce_dtype: Option<String>,

    /// auto: plan memory before loading, take the most exact of the memory settings not given
    /// that fits, and refuse a run that cannot fit; or manual: the settings as configured
    /// [train.memory, default auto].
    #[arg(long, value_name = "POLICY")]
    pub memory: Option<String>,

    /// Memory per device the plan may use, in GiB; 0 = what the device reports (a GPU's
    /// total, on the CPU the machine's) [train.gpu_memory, default 0].
    #[arg(long, value_name = "GIB")]
    pub gpu_memory: Option<f64>,

    /// Print the memory plan (bytes per device and on the host, by category, for every memory
    /// setting that makes sense, and which fit) and exit; reads the model's config.json only.
    #[arg(long)]
    pub plan: bool,

    /// With --plan: print the plan as one JSON object.
    #[arg(long, requires = "plan")]
    pub json: bool,

    /// The checkpoint exported at the end and named by checkpoints/best: last, val_loss (the
    /// lowest validation loss) or score (the best-scoring samples) [train.select].
    #[arg(long, value_name = "WHICH")]
    pub select: Option<String>,

    /// Stop after N validations in a row without a lower validation loss (a higher score with
    /// --select score), 0 = never [train.early_stop].
    #[arg(long, value_name = "N")]
    pub early_stop: Option<usize>,

    /// Speak samples at every evaluation and measure similarity, speaking rate, end of speech
    /// and WER: true, false or auto (on, except on the CPU for models over 1B parameters)
    /// [train.samples].
    #[arg(long, value_name = "WHEN", value_parser = ["auto", "true", "false"])]
    pub samples: Option<String>,

    /// A text the samples speak (repeatable; each by every speaker) [train.sample_texts,
    /// default: texts of held-out utterances].
    #[arg(long = "sample-text", value_name = "TEXT")]
    pub sample_text: Vec<String>,

    /// Sharded runs: restart every rank from the last checkpoint when one fails, at most N
    /// times [train.max_restarts].
    #[arg(long, value_name = "N")]
    pub max_restarts: Option<usize>,

    /// Repeat the utterances of speakers with fewer clips each epoch, up to the largest
    /// speaker's count [train.speaker_balance].
    #[arg(long)]
    pub speaker_balance: bool,

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
        let globs = |v: &[String]| {
            (!v.is_empty()).then(|| {
                v.iter()
                    .map(|g| toml::Value::String(g.clone()))
                    .collect::<Vec<_>>()
            })
        };
        let freeze = globs(&self.freeze);
        Overrides::default()
            .path("model.base", "--model", &self.model)
            .count("train.batch_size", "--batch-size", self.batch_size)
            .count("train.grad_accum", "--grad-accum", self.grad_accum)
            .count("train.warmup_steps", "--warmup-steps", self.warmup_steps)
            .count("train.epochs", "--epochs", self.epochs)
            .count("train.max_steps", "--max-steps", self.max_steps)
            .count("train.save_every", "--save-every", self.save_every)
            .count("train.keep", "--keep", self.keep)
            .set("train.lr", "--lr", self.lr)
            .set("train.weight_decay", "--weight-decay", self.weight_decay)
            .set("train.clip_norm", "--clip-norm", self.clip_norm)
            .seed("train.seed", "--seed", self.seed)
            .flag("train.shuffle", "--no-shuffle", self.no_shuffle, false)
            .set("train.freeze", "--freeze", freeze)
            .count("train.lora_rank", "--lora-rank", self.lora_rank)
            .set("train.lora_alpha", "--lora-alpha", self.lora_alpha)
            .set(
                "train.lora_targets",
                "--lora-target",
                globs(&self.lora_target),
            )
            .set("train.lora_full", "--lora-full", globs(&self.lora_full))
            .set(
                "train.speaker_name",
                "--speaker-name",
                self.speaker_name.clone(),
            )
            .count("train.gpus", "--gpus", self.gpus)
            .count("train.cpu_ranks", "--cpu-ranks", self.cpu_ranks)
            .set("train.shard", "--shard", self.shard.clone())
            .set("train.backend", "--backend", self.backend.clone())
            .set("train.select", "--select", self.select.clone())
            .set(
                "train.samples",
                "--samples",
                self.samples.as_deref().map(|v| match v {
                    "true" => Value::Boolean(true),
                    "false" => Value::Boolean(false),
                    other => Value::String(other.to_string()),
                }),
            )
            .set(
                "train.sample_texts",
                "--sample-text",
                (!self.sample_text.is_empty()).then(|| {
                    self.sample_text
                        .iter()
                        .map(|t| Value::String(t.clone()))
                        .collect::<Vec<_>>()
                }),
            )
            .count("train.early_stop", "--early-stop", self.early_stop)
            .count("train.max_restarts", "--max-restarts", self.max_restarts)
            .set(
                "train.optimizer_state",
                "--optimizer-state",
                self.optimizer_state.clone(),
            )
            .set("train.offload", "--offload", self.offload.clone())
            .set("train.recompute", "--recompute", self.recompute.clone())
            .set(
                "train.reduce_dtype",
                "--reduce-dtype",
                self.reduce_dtype.clone(),
            )
            .set("train.memory", "--memory", self.memory.clone())
            .set("train.gpu_memory", "--gpu-memory", self.gpu_memory)
            .flag(
                "train.speaker_balance",
                "--speaker-balance",
                self.speaker_balance,
                true,
            )
            .into()
    }
}

#[derive(Debug, Args)]
#[command(
    after_long_help = "The output is the official layout (docs/model.md §10.5): config.json with \
    tts_model_type \"custom_voice\" and talker_config.spk_id {NAME: 3000}, a bf16 model.safetensors \
    (the base model without speaker_encoder.*, trained tensors replaced, the speaker x-vector in \
    codec_embedding row 3000), and the base model's other files (tokenizer, generation config, \
    speech_tokenizer/). A checkpoint of named speakers exports all of them: rows 3000, 3001, … \
    in the order of their lower-cased names. It is written to a temporary directory and renamed into place; an existing \
    directory is only replaced when it is an earlier export of the same kind (it has \
    voiceclone-export.json) or empty. A LoRA checkpoint is merged (W + S·alpha/R·B·A in f32, \
    --lora-scale S); with --adapter-only its adapters are written alone in PEFT's format \
    (adapter_config.json, adapter_model.safetensors, speakers.safetensors; default adapter/), \
    which PEFT loads onto the official model and `voiceclone speak --adapter DIR` speaks with \
    (docs/training.md §13)."
)]
pub struct ExportArgs {
    /// Checkpoint directory, or a directory of checkpoints for its newest [default: the newest
    /// in the workspace's checkpoints/].
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,

    /// The checkpoint training chose (the one checkpoints/best names: the lowest validation
    /// loss under train.select = "val_loss") instead of the newest.
    #[arg(long)]
    pub best: bool,

    /// Output directory [default: model/ in the workspace; adapter/ with --adapter-only].
    #[arg(short, long, value_name = "DIR")]
    pub output: Option<PathBuf>,

    /// Speaker name stored in config.json (lower-cased), for a checkpoint of one unnamed
    /// speaker [train.speaker_name].
    #[arg(long, value_name = "NAME")]
    pub speaker_name: Option<String>,

    /// The base model the checkpoint was trained from [model.base].
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,

    /// A LoRA checkpoint: merge the adapters at this fraction of their trained strength
    /// (the community merges at 0.3-0.35 for a subtler voice) [default: 1].
    #[arg(long, value_name = "S", default_value_t = 1.0)]
    pub lora_scale: f64,

    /// A LoRA checkpoint: write only its adapters (and fully trained modules), in PEFT's
    /// format (adapter_config.json, adapter_model.safetensors) with the speakers' x-vectors.
    #[arg(long)]
    pub adapter_only: bool,
}

impl ExportArgs {
    pub fn overrides(&self) -> Vec<Override> {
        Overrides::default()
            .path("model.base", "--model", &self.model)
            .set(
                "train.speaker_name",
                "--speaker-name",
                self.speaker_name.clone(),
            )
            .into()
    }
}
