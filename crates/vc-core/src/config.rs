//! The one TOML configuration shared by every subcommand, and its layering:
//! built-in `configs/default.toml` <- workspace `voiceclone.toml` <- `--config FILE` <- flags.
//!
//! Every layer is checked against the built-in defaults before merging, so an unknown key or a
//! value of the wrong type is reported with the key and the file (or flag) it came from.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use toml::{Table, Value};

/// The built-in defaults, with a comment on every key.
pub const DEFAULT_TOML: &str = include_str!("../../../configs/default.toml");

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
    /// [`resolve_layers`]); `train.memory = "auto"` chooses only the others.
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
/// `DIR` even with an `=` in it.
pub fn adapter_entry(entry: &str, exists: impl Fn(&str) -> bool) -> (Option<&str>, &str) {
    match entry.split_once('=') {
        Some((name, dir)) if is_voice_name(name) && !exists(entry) => (Some(name), dir),
        _ => (None, entry),
    }
}

/// A name a speech request can give as its `"voice"`: letters, digits, `-`, `_` and `.`.
pub fn is_voice_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// `speak.precision`: the number format of inference as asked for (`auto` or a format), which
/// `speak` and `serve` resolve into a [`vc_generate::Precision`].
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
}

impl PrecisionSetting {
    pub const NAMES: &'static [&'static str] = &["auto", "f32", "bf16-weights", "bf16", "q8"];
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

/// Keys whose string values name one of a fixed set (checked in every layer, so a typo is an
/// error naming the key, where it was set and the allowed values).
const CHOICES: &[(&str, &[&str])] = &[
    ("speak.precision", PrecisionSetting::NAMES),
    ("speak.non_streaming", NonStreaming::NAMES),
    ("train.shard", Shard::NAMES),
    ("train.select", Select::NAMES),
    ("train.backend", TrainBackend::NAMES),
    ("train.optimizer_state", OptimizerState::NAMES),
    ("train.offload", Offload::NAMES),
    ("train.recompute", Recompute::NAMES),
    ("train.reduce_dtype", ReduceDtype::NAMES),
    ("train.memory", MemoryPolicy::NAMES),
    ("embed.mode", EmbedMode::NAMES),
];

/// Keys that take "auto" (their default), true or false.
const AUTO_OR_BOOL: &[&str] = &["train.samples"];

/// Where a configuration value came from, for error messages and `voiceclone config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => write!(f, "built-in defaults"),
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Flag(flag) => write!(f, "command-line flag {flag}"),
        }
    }
}

/// The merged configuration together with the origin of every key.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub config: Config,
    pub sources: BTreeMap<String, Source>,
    merged: Table,
}

/// One command-line override: a dotted key, its value, and the flag that set it.
#[derive(Debug, Clone)]
pub struct Override {
    pub key: &'static str,
    pub value: Value,
    pub flag: &'static str,
}

impl Override {
    pub fn new(key: &'static str, flag: &'static str, value: impl Into<Value>) -> Self {
        Override {
            key,
            value: value.into(),
            flag,
        }
    }
}

/// Builds the configuration from the defaults, the workspace's config file (if present), an
/// explicit `--config` file (which must exist), and flag overrides, in that order.
pub fn resolve(
    workspace_file: PathBuf,
    explicit: Option<&Path>,
    overrides: &[Override],
) -> Result<Resolved> {
    let mut layers: Vec<(Table, Source)> = Vec::new();
    if workspace_file.is_file() {
        layers.push((read_table(&workspace_file)?, Source::File(workspace_file)));
    }
    if let Some(path) = explicit {
        if !path.is_file() {
            bail!("config file {} does not exist", path.display());
        }
        layers.push((read_table(path)?, Source::File(path.to_path_buf())));
    }
    for o in overrides {
        layers.push((
            dotted_table(o.key, o.value.clone()),
            Source::Flag(o.flag.to_string()),
        ));
    }
    resolve_layers(layers)
}

/// Merges already-parsed layers over the defaults; exposed for tests.
pub fn resolve_layers(layers: Vec<(Table, Source)>) -> Result<Resolved> {
    let defaults: Table = DEFAULT_TOML
        .parse()
        .context("the built-in configs/default.toml is not valid TOML")?;
    let mut merged = defaults.clone();
    let mut sources = BTreeMap::new();
    collect_keys(&defaults, "", &mut |key| {
        sources.insert(key, Source::Default);
    });
    for (layer, source) in layers {
        check_against_schema(&layer, &defaults, "", &source)?;
        // A value of the right kind may still not fit its setting (a port above 65535): try the
        // layer alone over the defaults, so the error names the file or flag that set it.
        let mut alone = defaults.clone();
        merge_into(&mut alone, layer.clone(), "", &source, &mut BTreeMap::new());
        Value::Table(alone).try_into::<Config>().map_err(|e| {
            anyhow::anyhow!(
                "invalid value in {source}: {}",
                e.to_string().trim().replace('\n', " ")
            )
        })?;
        merge_into(&mut merged, layer, "", &source, &mut sources);
    }
    let mut config: Config = Value::Table(merged.clone())
        .try_into()
        .context("internal error: the merged configuration does not match the schema")?;
    let set = |key: &str| sources.get(key).is_some_and(|s| *s != Source::Default);
    config.train.set_by_user = MemoryKeys {
        optimizer_state: set("train.optimizer_state"),
        offload: set("train.offload"),
        recompute: set("train.recompute"),
    };
    let resolved = Resolved {
        config,
        sources,
        merged,
    };
    resolved.validate()?;
    Ok(resolved)
}

impl Resolved {
    /// The resolved configuration as TOML, one comment per key naming its origin when it is not
    /// the built-in default.
    pub fn to_annotated_toml(&self) -> String {
        let mut out = String::new();
        for (section, value) in &self.merged {
            let Value::Table(table) = value else { continue };
            out.push_str(&format!("[{section}]\n"));
            for (key, v) in table {
                let full = format!("{section}.{key}");
                let line = format!("{key} = {v}");
                match self.sources.get(&full) {
                    Some(Source::Default) | None => out.push_str(&format!("{line}\n")),
                    Some(src) => out.push_str(&format!("{line}  # from {src}\n")),
                }
            }
            out.push('\n');
        }
        out
    }

    fn source_of(&self, key: &str) -> String {
        self.sources
            .get(key)
            .map(|s| s.to_string())
            .unwrap_or_else(|| Source::Default.to_string())
    }

    /// Semantic checks that the type system cannot express; each error names key and origin.
    fn validate(&self) -> Result<()> {
        let p = &self.config.prep;
        let bad = |key: &str, why: String| -> anyhow::Error {
            anyhow::anyhow!(
                "invalid value for `{key}` (set in {}): {why}",
                self.source_of(key)
            )
        };
        if self.config.model.base.trim().is_empty() {
            return Err(bad(
                "model.base",
                "must name a hub repo id or a local directory".into(),
            ));
        }
        if p.whisper_model.trim().is_empty() {
            return Err(bad("prep.whisper_model", "must name a model file".into()));
        }
        if !(p.min_seconds > 0.0 && p.min_seconds.is_finite()) {
            return Err(bad(
                "prep.min_seconds",
                format!("{} is not a positive number", p.min_seconds),
            ));
        }
        if !(p.max_seconds > p.min_seconds && p.max_seconds.is_finite()) {
            return Err(bad(
                "prep.max_seconds",
                format!(
                    "{} must be larger than `prep.min_seconds` = {} (set in {})",
                    p.max_seconds,
                    p.min_seconds,
                    self.source_of("prep.min_seconds")
                ),
            ));
        }
        for (key, v) in [
            ("prep.max_merge_gap", p.max_merge_gap),
            ("prep.pad_seconds", p.pad_seconds),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(
                    key,
                    format!("{v} is not a non-negative number of seconds"),
                ));
            }
        }
        if !(0.0..=1.0).contains(&p.max_no_speech_prob) {
            return Err(bad(
                "prep.max_no_speech_prob",
                format!(
                    "{} is not a probability between 0 and 1",
                    p.max_no_speech_prob
                ),
            ));
        }
        if !(p.silence_db < 0.0 && p.silence_db.is_finite()) {
            return Err(bad(
                "prep.silence_db",
                format!("{} must be negative (dB below the peak)", p.silence_db),
            ));
        }
        if self.config.codes.batch_size == 0 {
            return Err(bad("codes.batch_size", "must be at least 1".into()));
        }
        if self.config.embed.mean_clips == 0 {
            return Err(bad("embed.mean_clips", "must be at least 1".into()));
        }
        self.validate_train()?;
        self.validate_speak()?;
        self.validate_serve()?;
        let lang = p.language.trim();
        if lang != "auto" && (lang.is_empty() || !lang.chars().all(|c| c.is_ascii_lowercase())) {
            return Err(bad(
                "prep.language",
                format!(
                    "{:?} is neither \"auto\" nor a Whisper language code such as \"en\"",
                    p.language
                ),
            ));
        }
        Ok(())
    }
}

impl Resolved {
    fn validate_train(&self) -> Result<()> {
        let t = &self.config.train;
        let bad = |key: &str, why: String| -> anyhow::Error {
            anyhow::anyhow!(
                "invalid value for `{key}` (set in {}): {why}",
                self.source_of(key)
            )
        };
        for (key, v) in [
            ("train.batch_size", t.batch_size),
            ("train.grad_accum", t.grad_accum),
            ("train.epochs", t.epochs),
            ("train.keep", t.keep),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1".into()));
            }
        }
        if t.gpus > 0 && t.cpu_ranks > 0 {
            return Err(bad(
                "train.cpu_ranks",
                format!(
                    "a run uses GPUs or CPU ranks, not both (train.gpus is {}, set in {})",
                    t.gpus,
                    self.source_of("train.gpus")
                ),
            ));
        }
        if t.gpus > 0 && t.backend == TrainBackend::Kernels {
            return Err(bad(
                "train.backend",
                format!(
                    "\"kernels\" runs on the CPU only, and train.gpus is {} (set in {}); use \
                     \"auto\" or \"autograd\"",
                    t.gpus,
                    self.source_of("train.gpus")
                ),
            ));
        }
        if t.dist_timeout == 0 {
            return Err(bad(
                "train.dist_timeout",
                "must be at least 1 second".into(),
            ));
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            return Err(bad(
                "train.lr",
                format!("{} is not a positive number", t.lr),
            ));
        }
        for (key, v) in [
            ("train.weight_decay", t.weight_decay),
            ("train.clip_norm", t.clip_norm),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(key, format!("{v} is not a non-negative number")));
            }
        }
        if !(0.0..=0.5).contains(&t.val_fraction) {
            return Err(bad(
                "train.val_fraction",
                format!(
                    "{} is not a share between 0 (no held-out set) and 0.5",
                    t.val_fraction
                ),
            ));
        }
        if let Some(i) = t.sample_texts.iter().position(|x| x.trim().is_empty()) {
            return Err(bad(
                "train.sample_texts",
                format!("text {} is empty", i + 1),
            ));
        }
        if t.speaker_name.trim().is_empty() || t.speaker_name.trim() != t.speaker_name {
            return Err(bad(
                "train.speaker_name",
                format!(
                    "{:?} must be a non-empty name without surrounding spaces",
                    t.speaker_name
                ),
            ));
        }
        if !(t.gpu_memory >= 0.0 && t.gpu_memory.is_finite()) {
            return Err(bad(
                "train.gpu_memory",
                format!("{} is not a non-negative number of GiB", t.gpu_memory),
            ));
        }
        for (key, globs) in [
            ("train.freeze", &t.freeze),
            ("train.lora_targets", &t.lora_targets),
            ("train.lora_full", &t.lora_full),
        ] {
            if let Some(p) = globs.iter().find(|p| p.trim().is_empty()) {
                return Err(bad(key, format!("{p:?} is not a glob pattern")));
            }
        }
        if !(t.lora_alpha >= 0.0 && t.lora_alpha.is_finite()) {
            return Err(bad(
                "train.lora_alpha",
                format!("{} is not a non-negative number", t.lora_alpha),
            ));
        }
        if t.lora_rank == 0 {
            // Adapter settings without adapters would silently train everything.
            for key in ["train.lora_alpha", "train.lora_targets", "train.lora_full"] {
                if !matches!(self.sources.get(key), None | Some(Source::Default)) {
                    return Err(bad(
                        key,
                        "applies to low-rank adapters only, and train.lora_rank is 0 (a full \
                         fine-tune): set train.lora_rank (--lora-rank) too"
                            .into(),
                    ));
                }
            }
        }
        if t.lora_rank > 0 {
            if t.lora_targets.is_empty() {
                return Err(bad(
                    "train.lora_targets",
                    "names no matrix: with train.lora_rank > 0 at least one glob is needed".into(),
                ));
            }
            if !t.freeze.is_empty() {
                return Err(bad(
                    "train.freeze",
                    "has no meaning with adapters (train.lora_rank > 0): every tensor is \
                     frozen but the adapters and train.lora_full"
                        .into(),
                ));
            }
        }
        Ok(())
    }
}

impl Resolved {
    fn validate_serve(&self) -> Result<()> {
        let s = &self.config.serve;
        let bad = |key: &str, why: String| -> anyhow::Error {
            anyhow::anyhow!(
                "invalid value for `{key}` (set in {}): {why}",
                self.source_of(key)
            )
        };
        if s.host.trim().is_empty() {
            return Err(bad(
                "serve.host",
                "must name an address to listen on".into(),
            ));
        }
        for (key, v) in [
            ("serve.max_batch", s.max_batch),
            ("serve.max_input_chars", s.max_input_chars),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1".into()));
            }
        }
        for (key, v) in [
            ("serve.max_body_mb", s.max_body_mb),
            ("serve.max_voice_seconds", s.max_voice_seconds),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(bad(key, format!("{v} is not a positive number")));
            }
        }
        if !(s.shutdown_seconds >= 0.0 && s.shutdown_seconds.is_finite()) {
            return Err(bad(
                "serve.shutdown_seconds",
                format!("{} is not a non-negative number", s.shutdown_seconds),
            ));
        }
        if let Some(e) = s
            .adapters
            .iter()
            .find(|e| adapter_entry(e, |_| false).1.trim().is_empty())
        {
            return Err(bad(
                "serve.adapters",
                format!("{e:?} names no adapter directory (DIR or NAME=DIR)"),
            ));
        }
        Ok(())
    }

    fn validate_speak(&self) -> Result<()> {
        let s = &self.config.speak;
        let bad = |key: &str, why: String| -> anyhow::Error {
            anyhow::anyhow!(
                "invalid value for `{key}` (set in {}): {why}",
                self.source_of(key)
            )
        };
        for (key, v) in [
            ("speak.temperature", s.temperature),
            ("speak.sub_temperature", s.sub_temperature),
            ("speak.repetition_penalty", s.repetition_penalty),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(key, format!("{v} is not a non-negative number")));
            }
        }
        for (key, v) in [("speak.top_p", s.top_p), ("speak.sub_top_p", s.sub_top_p)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(bad(key, format!("{v} is not between 0 and 1")));
            }
        }
        for (key, v) in [
            ("speak.batch_size", s.batch_size),
            ("speak.stream_chunk_frames", s.stream_chunk_frames),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1".into()));
            }
        }
        if s.seed < -1 {
            return Err(bad(
                "speak.seed",
                format!("{} is not -1 (random) or a non-negative seed", s.seed),
            ));
        }
        if s.language.trim().is_empty() {
            return Err(bad(
                "speak.language",
                "must be \"auto\" or a language name".into(),
            ));
        }
        Ok(())
    }
}

fn read_table(path: &Path) -> Result<Table> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    text.parse::<Table>()
        .with_context(|| format!("config file {} is not valid TOML", path.display()))
}

/// `prep.jobs` = 4 -> `{prep = {jobs = 4}}`.
fn dotted_table(key: &str, value: Value) -> Table {
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().unwrap_or(key);
    let mut table = Table::new();
    table.insert(last.to_string(), value);
    for part in parts.into_iter().rev() {
        let mut outer = Table::new();
        outer.insert(part.to_string(), Value::Table(table));
        table = outer;
    }
    table
}

fn join_key(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn collect_keys(table: &Table, prefix: &str, f: &mut dyn FnMut(String)) {
    for (k, v) in table {
        let key = join_key(prefix, k);
        match v {
            Value::Table(t) => collect_keys(t, &key, f),
            _ => f(key),
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a number",
        Value::Boolean(_) => "true or false",
        Value::Datetime(_) => "a date",
        Value::Array(_) => "a list",
        Value::Table(_) => "a table",
    }
}

fn check_against_schema(
    layer: &Table,
    schema: &Table,
    prefix: &str,
    source: &Source,
) -> Result<()> {
    for (k, v) in layer {
        let key = join_key(prefix, k);
        let Some(expected) = schema.get(k) else {
            let known: Vec<String> = schema.keys().map(|s| join_key(prefix, s)).collect();
            bail!(
                "unknown configuration key `{key}` in {source} (known keys here: {})",
                known.join(", ")
            );
        };
        // Keys whose default is "auto" and whose other values are true and false.
        let auto_or_bool = AUTO_OR_BOOL.contains(&key.as_str())
            && matches!((expected, v), (Value::String(_), Value::Boolean(_)));
        let compatible = auto_or_bool
            || matches!(
                (expected, v),
                (Value::Table(_), Value::Table(_))
                    | (Value::String(_), Value::String(_))
                    | (Value::Integer(_), Value::Integer(_))
                    | (Value::Float(_), Value::Float(_) | Value::Integer(_))
                    | (Value::Boolean(_), Value::Boolean(_))
                    | (Value::Array(_), Value::Array(_))
            );
        if !compatible {
            bail!(
                "configuration key `{key}` in {source} must be {}, found {} ({v})",
                type_name(expected),
                type_name(v)
            );
        }
        if let (true, Value::String(value)) = (AUTO_OR_BOOL.contains(&key.as_str()), v) {
            if value != "auto" {
                bail!(
                    "invalid value for `{key}` (set in {source}): {value:?}; it is true, false or \
                     \"auto\""
                );
            }
        }
        if let (Some((_, names)), Value::String(value)) =
            (CHOICES.iter().find(|(k, _)| *k == key), v)
        {
            if !names.contains(&value.as_str()) {
                bail!(
                    "invalid value for `{key}` (set in {source}): {value:?} is not one of {}",
                    names.join(", ")
                );
            }
        }
        if let (Value::Integer(i), Value::Integer(_)) = (expected, v) {
            // All integer settings are counts: reject negatives here, where the key is known.
            if *i >= 0 && v.as_integer().is_some_and(|n| n < 0) {
                bail!("configuration key `{key}` in {source} must not be negative, found {v}");
            }
        }
        if let (Value::Table(s), Value::Table(t)) = (expected, v) {
            check_against_schema(t, s, &key, source)?;
        }
    }
    Ok(())
}

fn merge_into(
    base: &mut Table,
    layer: Table,
    prefix: &str,
    source: &Source,
    sources: &mut BTreeMap<String, Source>,
) {
    for (k, v) in layer {
        let key = join_key(prefix, &k);
        match (base.get_mut(&k), v) {
            (Some(Value::Table(b)), Value::Table(t)) => merge_into(b, t, &key, source, sources),
            (Some(Value::Float(_)), Value::Integer(i)) => {
                base.insert(k, Value::Float(i as f64));
                sources.insert(key, source.clone());
            }
            (_, v) => {
                base.insert(k, v);
                sources.insert(key, source.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(text: &str, name: &str) -> (Table, Source) {
        (text.parse().unwrap(), Source::File(PathBuf::from(name)))
    }

    #[test]
    fn defaults_parse_and_validate() {
        let r = resolve_layers(vec![]).unwrap();
        assert_eq!(r.config.model.base, "Qwen/Qwen3-TTS-12Hz-1.7B-Base");
        assert_eq!(r.config.prep.min_seconds, 1.0);
        assert_eq!(r.config.prep.max_seconds, 15.0);
        assert_eq!(r.sources["prep.jobs"], Source::Default);
    }

    #[test]
    fn a_value_that_does_not_fit_its_setting_names_the_file_and_the_key() {
        let err = resolve_layers(vec![
            layer("[serve]\nport = 8080", "fine.toml"),
            layer("[serve]\nport = 99999", "ws.toml"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("ws.toml") && err.contains("serve.port") && err.contains("99999"),
            "{err}"
        );
        assert!(
            !err.contains("internal error") && !err.contains('\n'),
            "{err}"
        );
    }

    #[test]
    fn the_cpu_kernels_are_refused_for_gpus_up_front() {
        let err = resolve_layers(vec![layer(
            "[train]\ngpus = 2\nbackend = \"kernels\"",
            "ws.toml",
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("train.backend") && err.contains("CPU only"),
            "{err}"
        );
        let r = resolve_layers(vec![layer(
            "[train]\nbackend = \"autograd-f32\"",
            "ws.toml",
        )])
        .unwrap();
        assert_eq!(r.config.train.backend, TrainBackend::AutogradF32);
    }

    #[test]
    fn later_layers_win_and_integers_widen_to_floats() {
        let r = resolve_layers(vec![
            layer("[prep]\nmax_seconds = 12\njobs = 3", "a.toml"),
            layer("[prep]\njobs = 1", "b.toml"),
        ])
        .unwrap();
        assert_eq!(r.config.prep.max_seconds, 12.0);
        assert_eq!(r.config.prep.jobs, 1);
        assert_eq!(r.sources["prep.jobs"], Source::File("b.toml".into()));
        assert_eq!(r.sources["prep.max_seconds"], Source::File("a.toml".into()));
        assert!(r.to_annotated_toml().contains("jobs = 1  # from b.toml"));
    }

    #[test]
    fn enum_keys_are_typed_and_typos_name_the_key_and_the_choices() {
        let r = resolve_layers(vec![layer(
            "[speak]\nprecision = \"bf16-weights\"\nnon_streaming = \"false\"",
            "a.toml",
        )])
        .unwrap();
        assert_eq!(r.config.speak.precision, PrecisionSetting::Bf16Weights);
        assert_eq!(r.config.speak.non_streaming, NonStreaming::False);
        let err = resolve_layers(vec![layer("[speak]\nprecision = \"bf17\"", "a.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`speak.precision`")
                && err.contains("a.toml")
                && err.contains("\"bf17\" is not one of auto, f32, bf16-weights, bf16, q8"),
            "{err}"
        );
        let err = resolve_layers(vec![(
            dotted_table("speak.non_streaming", Value::from("yes")),
            Source::Flag("--x".into()),
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("flag --x") && err.contains("auto, true, false"),
            "{err}"
        );
        // Every listed name is a variant, and every variant is listed.
        for (key, names) in CHOICES {
            for name in *names {
                let t = dotted_table(key, Value::from(*name));
                assert!(
                    resolve_layers(vec![(t, Source::Default)]).is_ok(),
                    "{key} = {name}"
                );
            }
        }
        let all = [
            PrecisionSetting::Auto,
            PrecisionSetting::F32,
            PrecisionSetting::Bf16Weights,
            PrecisionSetting::Bf16,
            PrecisionSetting::Q8,
        ];
        assert_eq!(all.len(), PrecisionSetting::NAMES.len());
        for (p, name) in all.iter().zip(PrecisionSetting::NAMES) {
            assert_eq!(toml::Value::try_from(p).unwrap().as_str(), Some(*name));
        }
        let modes = [EmbedMode::Ref, EmbedMode::Mean];
        assert_eq!(modes.len(), EmbedMode::NAMES.len());
        for (m, name) in modes.iter().zip(EmbedMode::NAMES) {
            assert_eq!(toml::Value::try_from(m).unwrap().as_str(), Some(*name));
            assert_eq!(m.name(), *name);
        }
        let err = resolve_layers(vec![layer("[embed]\nmode = \"median\"", "e.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`embed.mode`") && err.contains("ref, mean"),
            "{err}"
        );
    }

    #[test]
    fn samples_take_auto_true_or_false_and_sample_texts_words() {
        let samples = |text: &str| {
            resolve_layers(vec![layer(text, "s.toml")]).map(|r| r.config.train.samples)
        };
        assert_eq!(samples("").unwrap(), Samples::Auto);
        assert_eq!(samples("[train]\nsamples = true").unwrap(), Samples::On);
        assert_eq!(samples("[train]\nsamples = false").unwrap(), Samples::Off);
        assert_eq!(
            samples("[train]\nsamples = \"auto\"").unwrap(),
            Samples::Auto
        );
        for wrong in ["\"yes\"", "\"true\"", "1"] {
            let err = samples(&format!("[train]\nsamples = {wrong}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("`train.samples`") && err.contains("s.toml"),
                "{wrong}: {err}"
            );
        }
        // As `voiceclone config` prints it, read back the same.
        for v in [Samples::Auto, Samples::On, Samples::Off] {
            let text = toml::Value::try_from(v).unwrap();
            let t = dotted_table("train.samples", text);
            let r = resolve_layers(vec![(t, Source::Default)]).unwrap();
            assert_eq!(r.config.train.samples, v);
        }
        let err = resolve_layers(vec![layer(
            "[train]\nsample_texts = [\"a\", \" \"]",
            "t.toml",
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("train.sample_texts") && err.contains("text 2 is empty"),
            "{err}"
        );
    }

    #[test]
    fn unknown_key_names_key_and_file() {
        let err = resolve_layers(vec![layer("[prep]\nmax_secs = 3", "ws/voiceclone.toml")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("prep.max_secs"), "{err}");
        assert!(err.contains("ws/voiceclone.toml"), "{err}");
        let err = resolve_layers(vec![layer("[nonsense]\nx = 1", "c.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`nonsense`") && err.contains("c.toml"),
            "{err}"
        );
    }

    #[test]
    fn wrong_type_and_bad_values_name_key_and_origin() {
        let err = resolve_layers(vec![layer("[prep]\nmin_seconds = \"one\"", "x.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prep.min_seconds") && err.contains("x.toml") && err.contains("number"),
            "{err}"
        );
        let err = resolve_layers(vec![(
            dotted_table("prep.max_seconds", Value::Float(0.5)),
            Source::Flag("--max-seconds".into()),
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("prep.max_seconds") && err.contains("--max-seconds"),
            "{err}"
        );
        let err = resolve_layers(vec![layer("[prep]\njobs = -2", "y.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prep.jobs") && err.contains("negative"),
            "{err}"
        );
        let err = resolve_layers(vec![layer("[prep]\nlanguage = \"English!\"", "z.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prep.language") && err.contains("z.toml"),
            "{err}"
        );
    }

    #[test]
    fn every_default_key_is_documented_by_a_comment() {
        // The defaults file is the reference documentation of every key: each assignment must
        // be preceded by a comment line.
        let lines: Vec<&str> = DEFAULT_TOML.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim();
            if t.is_empty() || t.starts_with('#') || t.starts_with('[') {
                continue;
            }
            let mut j = i;
            while j > 0 && !lines[j - 1].trim().starts_with('#') && !lines[j - 1].trim().is_empty()
            {
                j -= 1;
            }
            assert!(
                j > 0 && lines[j - 1].trim().starts_with('#'),
                "undocumented key: {t}"
            );
        }
    }
}
