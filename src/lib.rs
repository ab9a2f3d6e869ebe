//! voiceclone: fine-tune Qwen3-TTS on a folder of recordings and speak with the cloned voice.
//!
//! Layout: `audio` (decode, resample, WAV), `prep` (transcription and segmentation),
//! `hub` (model resolution), `config` and `workspace` (shared by the subcommands), and the
//! CLI glue in `cli` and `commands`. `kernels` holds every CPU kernel (on slices) and nearly
//! all of the crate's `unsafe`, each block with its `// SAFETY:` argument (the lints below).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod audio;
pub mod cli;
pub mod codes;
pub mod commands;
pub mod config;
pub mod fsutil;
pub mod generate;
pub mod hub;
pub mod kernels;
pub mod model;
pub mod prep;
pub mod progress;
pub mod train;
pub mod workspace;
