//! voiceclone: fine-tune Qwen3-TTS on a folder of recordings and speak with the cloned voice.
//!
//! The map of the code base, the data flow and where every artifact lives are in
//! `docs/architecture.md`; the model port in `docs/model.md`, the trainer in `docs/training.md`.
//!
//! Modules, one job each:
//! - [`artifacts`]: one type and reader/writer per file the steps exchange: manifest rows, audio
//!   code frames, the speaker file.
//! - [`audio`]: decoding (symphonia), resampling (rubato), 16-bit WAV output, signal measurements.
//! - [`build_info`]: what this binary is (version, commit, features, CPU paths), for
//!   `--version`.
//! - [`cli`]: the command-line definitions; flags that mirror config keys become overrides.
//! - [`codes`]: the `codes` step: adds `audio_codes` to every line of a manifest, resumably.
//! - [`commands`]: one thin module per subcommand (resolve config, call the library, print);
//!   the library never imports it.
//! - [`config`]: the TOML configuration schema and its layering (defaults, workspace file,
//!   `--config`, flags).
//! - [`dist`]: distributed training: collectives (TCP, NCCL), rendezvous, the rank launcher,
//!   row sharding; it knows tensors and ranks, not the model.
//! - [`fsutil`]: crash-safe output (temporary name, then rename).
//! - [`generate`]: speech synthesis: prompt layouts, sampling, the frame loop, text splitting, the
//!   voice-clone / custom-voice pipelines.
//! - [`hub`]: model resolution: a local directory or file, or a Hugging Face hub repository.
//! - [`kernels`]: every CPU kernel, on slices (matrix views and GEMM, codec convolutions, 8-bit
//!   and bf16 matrix-vector products, training kernels' inner loops, optimizer and loss loops).
//! - [`model`]: the Qwen3-TTS port: config, model files, weights, tokenizer, talker, code
//!   predictor, speaker encoder, 12 Hz codec; tensors and weights, the numbers go to `kernels`.
//! - [`prep`]: the `prep` pipeline: sources, transcription (Whisper), segmentation, records.
//! - [`progress`]: progress bars and warnings that do not garble each other.
//! - [`rng`]: the one random generator (SplitMix64: data order, `speak --seed`).
//! - [`serve`]: the OpenAI-compatible speech API: HTTP, continuous batching, streaming decode,
//!   registered voices.
//! - [`stop_signal`]: Ctrl-C / SIGTERM as a stop request that long work polls.
//! - [`train`]: fine-tuning: data, batches, the objective's units, optimizer, checkpoints, the
//!   single-device and the sharded trainer, export.
//! - [`workspace`]: the directory shared by the chained subcommands; the one owner of its paths.
//!
//! `kernels` holds every CPU kernel (on slices) and nearly all of the crate's `unsafe`, each
//! block with its `// SAFETY:` argument (the lints below).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod artifacts;
pub mod audio;
pub mod build_info;
pub mod cli;
pub mod codes;
pub mod commands;
pub mod config;
pub mod dist;
pub mod fsutil;
pub mod generate;
pub mod hub;
pub mod kernels;
pub mod model;
pub mod prep;
pub mod progress;
pub mod rng;
pub mod serve;
pub mod stop_signal;
pub mod train;
pub mod workspace;
