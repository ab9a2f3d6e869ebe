//! The arguments of the commands that speak a voice: `serve` (the speech API, docs/serving.md)
//! and `speak`, with the config overrides their flags give (docs/architecture.md §5); the two
//! share the `[speak]` synthesis keys.

use std::path::PathBuf;

use clap::Args;

use vc_core::config::Override;

use super::overrides::{absolutize_if_exists, Overrides};

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
                            // A bad NAME is kept as given, for `serve` to refuse by name.
                            toml::Value::String(match vc_core::config::adapter_entry(e, exists) {
                                Ok((Some(name), dir)) => {
                                    format!("{name}={}", absolutize_if_exists(dir))
                                }
                                Ok((None, dir)) => absolutize_if_exists(dir),
                                Err(_) => e.clone(),
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

    /// At most N frames (80 ms each) per text chunk, instead of the runaway guard's budget
    /// [speak.max_frames].
    #[arg(long, value_name = "N")]
    pub max_frames: Option<usize>,

    /// Turn the runaway guard off: a chunk that misses its end of speech or loops runs on to
    /// the frame limit [speak.runaway_guard = false].
    #[arg(long)]
    pub no_runaway_guard: bool,

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

    /// Number format: auto (the checkpoint's own), f32, bf16-weights (CPU), q8 (8-bit, fast on a
    /// CPU), q4 (4-bit: half q8's bytes, for CPUs q8 leaves short of real time), bf16 (GPU)
    /// [speak.precision].
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
            .flag(
                "speak.runaway_guard",
                "--no-runaway-guard",
                self.no_runaway_guard,
                false,
            )
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
