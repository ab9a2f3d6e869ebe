//! The `voiceclone` binary's library half: the command line and one thin module per subcommand
//! that resolves the configuration, calls the crates below and prints (docs/architecture.md §1).
//! Nothing below imports it.
//!
//! - [`build_info`]: what this binary is (version, commit, features, CPU paths), for
//!   `--version`.
//! - [`cli`]: the command-line definitions; flags that mirror config keys become overrides.
//! - [`commands`]: one module per subcommand.
//! - [`voice_setup`]: the model, device and voice that `speak` and `serve` both resolve.
//!
//! The crates, bottom to top: `vc-kernels` (CPU kernels on slices), `vc-core` (config, workspace,
//! artifacts), `vc-audio`, `vc-model` (the Qwen3-TTS port), `vc-generate` (synthesis), `vc-prep`
//! (recordings to training inputs), `vc-dist` (collectives), `vc-train`, `vc-serve`.

pub mod build_info;
pub mod cli;
pub mod commands;
pub mod voice_setup;
