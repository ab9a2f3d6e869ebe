//! The configuration's schema: one serde type per section of `configs/default.toml`, unknown
//! keys refused, enums for the keys that name one of a fixed set.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub prep: PrepConfig,
    pub codes: CodesConfig,
    pub embed: EmbedConfig,
    pub train: TrainConfig,
    pub speak: SpeakConfig,
    pub serve: ServeConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub base: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrepConfig {
    pub whisper_model: String,
    pub language: String,
    pub min_seconds: f64,
    pub max_seconds: f64,
    pub max_merge_gap: f64,
    pub max_no_speech_prob: f64,
    pub pad_seconds: f64,
    pub silence_db: f64,
    pub jobs: usize,
    pub ref_audio: String,
    /// Whether a config file or flag named `whisper_model` (not a key: filled in by
    /// [`super::resolve_layers`]); without one, training's samples use the model `prep` used
    /// (docs/training.md §14.4).
    #[serde(skip)]
    pub whisper_model_set: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CodesConfig {
    pub tokenizer: String,
    pub batch_size: usize,
}

/// `[embed]`: how a speaker's x-vector is computed (docs/training.md §3.3).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EmbedConfig {
    pub mode: EmbedMode,
    pub mean_clips: usize,
}

/// `embed.mode`: the x-vector of the reference clip (the official recipe), or the f32 mean of
/// the x-vectors of up to `embed.mean_clips` of the speaker's utterances.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EmbedMode {
    Ref,
    Mean,
}

impl EmbedMode {
    pub const NAMES: &'static [&'static str] = &["ref", "mean"];

    pub fn name(self) -> &'static str {
        match self {
            EmbedMode::Ref => "ref",
            EmbedMode::Mean => "mean",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub warmup_steps: usize,
    pub epochs: usize,
    pub max_steps: usize,
    pub clip_norm: f64,
    pub seed: u64,
    pub shuffle: bool,
    pub save_every: usize,
    pub keep: usize,
    /// Share of the utterances held out for validation (docs/training.md §14), 0 = none.
    pub val_fraction: f64,
    /// A manifest of the held-out set instead of `val_fraction`; empty = none.
    pub val_manifest: String,
    /// Steps between validations, 0 = at every checkpoint.
    pub eval_every: usize,
    /// Which checkpoint the run exports and `checkpoints/best` names (docs/training.md §14.3).
    pub select: Select,
    /// Stop after this many validations without a lower validation loss, 0 = never.
    pub early_stop: usize,
    /// Whether each evaluation speaks samples and measures them (docs/training.md §14.4).
    pub samples: Samples,
    /// The texts the samples speak; empty = texts of held-out utterances.
    pub sample_texts: Vec<String>,
    /// Whether the run writes TensorBoard event files to `checkpoints/tensorboard/`
    /// (docs/training.md §9.1).
    pub tensorboard: bool,
    pub freeze: Vec<String>,
    /// Rank of the low-rank adapters, 0 = a full fine-tune (docs/training.md §13).
    pub lora_rank: usize,
    /// The adapters' α (their product is added scaled by α / rank); 0 = twice the rank.
    pub lora_alpha: f64,
    /// Globs over the matrices that get adapters (decoder-layer projections only).
    pub lora_targets: Vec<String>,
    /// Globs over talker tensors trained fully beside the adapters.
    pub lora_full: Vec<String>,
    pub speaker_name: String,
    pub gpus: usize,
    pub cpu_ranks: usize,
    pub shard: Shard,
    /// Ranks that shard the state together; the groups replicate it (docs/distributed.md §4.7).
    pub shard_group: ShardGroup,
    /// Units gathered ahead of the one computing, 0 = communication not overlapped
    /// (docs/distributed.md §4.6).
    pub prefetch: usize,
    pub dist_timeout: u64,
    pub speaker_balance: bool,
    pub backend: TrainBackend,
    pub max_restarts: usize,
    pub optimizer_state: OptimizerState,
    pub offload: Offload,
    pub recompute: Recompute,
    pub reduce_dtype: ReduceDtype,
    pub memory: MemoryPolicy,
    /// Device memory in GiB the plan may use, 0 = what the device reports.
    pub gpu_memory: f64,
    /// Which memory settings were set above the defaults (not a key: filled in by
    /// [`super::resolve_layers`]); `train.memory = "auto"` chooses only the others.
    #[serde(skip)]
    pub set_by_user: MemoryKeys,
}

/// The memory settings a config file or flag set (docs/training.md §6.9).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryKeys {
    pub optimizer_state: bool,
    pub offload: bool,
    pub recompute: bool,
}

/// `train.shard`: what a sharded run shards (docs/distributed.md §4).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Shard {
    /// ZeRO-3 / FSDP FULL_SHARD.
    Full,
    /// ZeRO-2 / FSDP SHARD_GRAD_OP.
    GradOp,
}

impl Shard {
    pub const NAMES: &'static [&'static str] = &["full", "grad-op"];
}

/// `train.shard_group`: how many consecutive ranks shard the state together
/// (docs/distributed.md §4.7). Written as `0` (every rank: flat sharding), a number of ranks,
/// or `"node"` (the ranks of one node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardGroup {
    /// One group of every rank.
    World,
    /// Groups of this many ranks.
    Ranks(usize),
    /// The ranks of each node.
    Node,
}

impl std::fmt::Display for ShardGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShardGroup::World => f.write_str("0"),
            ShardGroup::Ranks(n) => write!(f, "{n}"),
            ShardGroup::Node => f.write_str("node"),
        }
    }
}

impl Serialize for ShardGroup {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            ShardGroup::World => s.serialize_i64(0),
            ShardGroup::Ranks(n) => s.serialize_i64(*n as i64),
            ShardGroup::Node => s.serialize_str("node"),
        }
    }
}

impl<'de> Deserialize<'de> for ShardGroup {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(i64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Count(0) => Ok(ShardGroup::World),
            Raw::Count(n) if n > 0 => Ok(ShardGroup::Ranks(n as usize)),
            Raw::Text(t) if t == "node" => Ok(ShardGroup::Node),
            Raw::Text(t) if t.trim().parse::<usize>().is_ok() => {
                match t.trim().parse::<usize>().unwrap_or(0) {
                    0 => Ok(ShardGroup::World),
                    n => Ok(ShardGroup::Ranks(n)),
                }
            }
            Raw::Count(n) => Err(serde::de::Error::custom(format!(
                "{n} is not 0 (every rank), a number of ranks or \"node\""
            ))),
            Raw::Text(t) => Err(serde::de::Error::custom(format!(
                "{t:?} is not 0 (every rank), a number of ranks or \"node\""
            ))),
        }
    }
}

/// `train.select`: the checkpoint a run exports and `checkpoints/best` names
/// (docs/training.md §14.3).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Select {
    /// The newest checkpoint.
    Last,
    /// The checkpoint with the lowest validation loss.
    ValLoss,
    /// The checkpoint whose samples score highest (docs/training.md §14.5).
    Score,
}

impl Select {
    pub const NAMES: &'static [&'static str] = &["last", "val_loss", "score"];

    pub fn name(self) -> &'static str {
        match self {
            Select::Last => "last",
            Select::ValLoss => "val_loss",
            Select::Score => "score",
        }
    }
}

/// `train.samples`: whether evaluations speak samples (docs/training.md §14.4). `auto`: yes,
/// except on a CPU-only run of a model whose samples would cost more than the run can spare
/// (the start says so).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Samples {
    Auto,
    On,
    Off,
}

impl Serialize for Samples {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Samples::Auto => s.serialize_str("auto"),
            Samples::On => s.serialize_bool(true),
            Samples::Off => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for Samples {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bool(bool),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bool(true) => Ok(Samples::On),
            Raw::Bool(false) => Ok(Samples::Off),
            Raw::Text(t) if t == "auto" => Ok(Samples::Auto),
            Raw::Text(t) => Err(serde::de::Error::custom(format!(
                "{t:?} is not true, false or \"auto\""
            ))),
        }
    }
}

/// `train.backend`: how the trainer computes (docs/training.md §5.5). A verification setting:
/// `auto` is what a user wants; the others run one device's code path on another.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum TrainBackend {
    /// The CPU kernels on the CPU, autograd with bf16 storage on CUDA.
    Auto,
    /// The CPU training kernels (CPU only).
    Kernels,
    /// The code path CUDA runs: autograd over plain ops, weights stored in bf16 (on the CPU the
    /// arithmetic is f32 on the bf16 values).
    Autograd,
    /// Autograd with weights stored in f32.
    AutogradF32,
}

impl TrainBackend {
    pub const NAMES: &'static [&'static str] = &["auto", "kernels", "autograd", "autograd-f32"];
}

/// `train.optimizer_state`: how the optimizer keeps its state (docs/training.md §6.5).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerState {
    /// fp32 masters and moments.
    #[default]
    Fp32,
    /// fp32 masters, AdamW's moments in 8-bit block codes.
    Int8,
    /// bf16 weights as the masters with a bf16 compensation (Kahan), fp32 moments.
    Bf16Compensated,
}

impl OptimizerState {
    pub const NAMES: &'static [&'static str] = &["fp32", "int8", "bf16-compensated"];

    pub fn name(self) -> &'static str {
        match self {
            OptimizerState::Fp32 => "fp32",
            OptimizerState::Int8 => "int8",
            OptimizerState::Bf16Compensated => "bf16-compensated",
        }
    }
}

/// `train.offload`: what lives in host memory (docs/training.md §6.6).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Offload {
    /// Everything on the training device.
    #[default]
    None,
    /// The optimizer's masters and moments on the host, updated there by the CPU kernels.
    Optimizer,
}

impl Offload {
    pub const NAMES: &'static [&'static str] = &["none", "optimizer"];

    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
        }
    }
}

/// `train.recompute`: activation checkpointing (docs/training.md §6.7).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Recompute {
    /// Keep every activation of the forward pass for the backward pass (sharded `full` runs
    /// recompute their units regardless).
    #[default]
    None,
    /// Keep each decoder layer's (each unit's) input only and recompute the unit in the
    /// backward pass.
    Layers,
}

impl Recompute {
    pub const NAMES: &'static [&'static str] = &["none", "layers"];

    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Layers => "layers",
        }
    }
}

/// `train.memory`: whether the run is planned before it loads (docs/training.md §6.9).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryPolicy {
    /// Choose the memory settings the user left open (the most exact that fits the device)
    /// and refuse a run that cannot fit, before any weight is read.
    #[default]
    Auto,
    /// Train with the settings as configured, without a plan.
    Manual,
}

impl MemoryPolicy {
    pub const NAMES: &'static [&'static str] = &["auto", "manual"];
}

/// `train.reduce_dtype`: the dtype gradients are summed in — over a step's micro-batches and,
/// in a sharded run, over the ranks by the reduce-scatter (docs/training.md §6.8).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ReduceDtype {
    #[default]
    Fp32,
    /// Half the bytes of the accumulators and on the wire; each sum rounded to bf16.
    Bf16,
}

impl ReduceDtype {
    pub const NAMES: &'static [&'static str] = &["fp32", "bf16"];
}

/// `[speak]`: synthesis defaults. Sampling keys at 0 take the model's
/// `generation_config.json` value.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SpeakConfig {
    pub model: String,
    pub language: String,
    pub non_streaming: NonStreaming,
    pub greedy: bool,
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
    pub repetition_penalty: f64,
    pub sub_temperature: f64,
    pub sub_top_k: usize,
    pub sub_top_p: f64,
    pub max_frames: usize,
    /// Stop a chunk that misses its end of speech or loops (docs/model.md §7.2).
    pub runaway_guard: bool,
    pub seed: i64,
    pub batch_size: usize,
    pub max_chunk_chars: usize,
    pub stream_chunk_frames: usize,
    pub precision: PrecisionSetting,
}

/// `[serve]`: the HTTP speech API (docs/serving.md). Synthesis defaults come from `[speak]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    pub model: String,
    pub api_key: String,
    pub max_batch: usize,
    pub max_queue: usize,
    pub max_input_chars: usize,
    pub max_body_mb: f64,
    pub max_voice_seconds: f64,
    pub max_voices: usize,
    pub shutdown_seconds: f64,
    /// Adapter directories (`voiceclone export --adapter-only`) served beside the model, each
    /// `DIR` or `NAME=DIR` ([`adapter_entry`], docs/serving.md §7).
    pub adapters: Vec<String>,
}

/// A `serve.adapters` entry: `NAME=DIR` (the adapter's one speaker served as voice NAME) or
/// `DIR` (its speakers under their own names). An entry that `exists` (resolved as the caller
/// resolves paths: the current directory for flags, the workspace for the config file) is a
/// `DIR` even with an `=` in it; any other entry with an `=` is `NAME=DIR`, and a NAME that
/// [`check_voice_name`] refuses is an error saying why (not a directory named `=dir`).
pub fn adapter_entry(
    entry: &str,
    exists: impl Fn(&str) -> bool,
) -> std::result::Result<(Option<&str>, &str), String> {
    match entry.split_once('=') {
        Some(_) if exists(entry) => Ok((None, entry)),
        Some((name, dir)) => match check_voice_name(name) {
            Ok(()) => Ok((Some(name), dir)),
            Err(why) => Err(format!(
                "{entry:?} is not NAME=DIR: {why} (and no directory {entry:?} exists)"
            )),
        },
        None => Ok((None, entry)),
    }
}

/// Why `name` cannot be a voice name given as `NAME=DIR`, if it cannot. A voice name is a
/// speaker name ([`crate::artifacts::speaker::check_name`]: at most 64 characters, not
/// starting with `.`) made of letters, digits, `-`, `_` and `.` only, so that it reads the
/// same in a flag, a TOML list and a request's `"voice"` (docs/serving.md §7).
pub fn check_voice_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err("the voice name before \"=\" is empty".into());
    }
    crate::artifacts::speaker::check_name(name)
        .map_err(|why| why.replacen("the speaker name", "the voice name", 1))?;
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "the voice name {name:?} has {c:?}; a voice name holds letters, digits, '-', '_' \
             and '.' only"
        ));
    }
    Ok(())
}

/// `speak.precision`: the number format of inference as asked for (`auto` or a format), which
/// `speak` and `serve` resolve into a `vc_generate::Precision`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum PrecisionSetting {
    /// Never below what the checkpoint stores: on a CPU bf16-weights for a bf16 checkpoint,
    /// f32 for an f32 one; bf16 on a GPU.
    Auto,
    F32,
    Bf16Weights,
    Bf16,
    /// 8-bit block-quantized matrices (CPU).
    Q8,
    /// 4-bit block-quantized matrices (CPU).
    Q4,
}

impl PrecisionSetting {
    pub const NAMES: &'static [&'static str] = &["auto", "f32", "bf16-weights", "bf16", "q8", "q4"];
}

/// `speak.non_streaming`: the whole text before the first frame (the official
/// `non_streaming_mode`); `auto` follows the official default for the voice.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NonStreaming {
    Auto,
    True,
    False,
}

impl NonStreaming {
    pub const NAMES: &'static [&'static str] = &["auto", "true", "false"];
}
