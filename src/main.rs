use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

/// `test-hooks` builds count their allocations, so tests can hold the memory plan to what a
/// run allocates (docs/training.md §6.9).
#[cfg(feature = "test-hooks")]
#[global_allocator]
static ALLOCATOR: voiceclone::kernels::alloc::Counting = voiceclone::kernels::alloc::Counting;

fn main() -> ExitCode {
    // The memory-reuse policy of every command (see `voiceclone::kernels::alloc`).
    voiceclone::kernels::alloc::keep_freed_memory();
    let cli = voiceclone::cli::Cli::parse();
    let default_level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .without_time()
        .init();
    let result = voiceclone::commands::run(cli);
    #[cfg(feature = "test-hooks")]
    if std::env::var_os("VOICECLONE_TEST_REPORT_PEAK").is_some() {
        let (_, peak) = voiceclone::kernels::alloc::Counting::live_and_peak();
        eprintln!("peak allocated bytes: {peak}");
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
