//! The arguments of `train` and `export` (docs/training.md), the largest flag sets of the
//! command line, with the config overrides their flags give (docs/architecture.md §5).

use std::path::PathBuf;

use clap::Args;

use toml::Value;
use vc_core::config::Override;

use super::overrides::Overrides;

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
    full or grad-op), with the same results as one device; --shard-group shards within groups \
    of ranks and replicates across them (hybrid sharding, for several nodes); --prefetch N \
    overlaps communication with computation (default 1); --max-restarts K starts every rank \
    again from the last checkpoint when one fails. A process started by torchrun (with \
    --no-python; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), by scripts/launchers/ray_train.py \
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

    /// Shard the state within groups of N consecutive ranks and replicate it across groups:
    /// 0 = one group of every rank, node = the ranks of one node (for runs over several nodes)
    /// [train.shard_group, default 0].
    #[arg(long, value_name = "N|node")]
    pub shard_group: Option<String>,

    /// Units gathered ahead of the one computing, so that communication overlaps computation;
    /// 0 = none [train.prefetch, default 1].
    #[arg(long, value_name = "N")]
    pub prefetch: Option<usize>,

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
            .set(
                "train.shard_group",
                "--shard-group",
                self.shard_group
                    .as_deref()
                    .map(|v| match v.trim().parse::<i64>() {
                        Ok(n) => Value::Integer(n),
                        Err(_) => Value::String(v.to_string()),
                    }),
            )
            .count("train.prefetch", "--prefetch", self.prefetch)
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
