//! What every step of voiceclone shares, below the model and the commands (docs/architecture.md §1):
//! the configuration, the workspace and the artifacts the steps exchange through it, model
//! resolution, crash-safe output, the random generator, progress bars and stop signals.
//!
//! - [`artifacts`]: one type and reader/writer per file the steps exchange: manifest rows, audio
//!   code frames, the speaker file, voice names.
//! - [`config`]: the TOML configuration schema and its layering (defaults, workspace file,
//!   `--config`, flags).
//! - [`fsutil`]: crash-safe output (temporary name, then rename).
//! - [`hub`]: model resolution: a local directory or file, or a Hugging Face hub repository.
//! - [`progress`]: progress bars and warnings that do not garble each other.
//! - [`rng`]: the one random generator (SplitMix64: data order, `speak --seed`).
//! - [`shell`]: POSIX shell quoting of the commands printed for the user to run.
//! - [`stop_signal`]: Ctrl-C / SIGTERM as a stop request that long work polls.
//! - [`workspace`]: the directory shared by the chained subcommands; the one owner of its paths.

pub mod artifacts;
pub mod config;
pub mod fsutil;
pub mod hub;
pub mod progress;
pub mod rng;
pub mod shell;
pub mod stop_signal;
pub mod workspace;
