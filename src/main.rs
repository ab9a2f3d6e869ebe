use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

/// `test-hooks` builds count their allocations, so tests can hold the memory plan to what a
/// run allocates (docs/training.md §6.9).
#[cfg(feature = "test-hooks")]
#[global_allocator]
static ALLOCATOR: vc_kernels::alloc::Counting = vc_kernels::alloc::Counting;

fn main() -> ExitCode {
    // The memory-reuse policy of every command (see `vc_kernels::alloc`).
    vc_kernels::alloc::keep_freed_memory();
    // A cap on the kernels' paths that names no level is refused before anything runs (the
    // kernels themselves would ignore it, docs/performance.md §2.6).
    let cap = match vc_kernels::isa::IsaCap::from_env() {
        Ok(cap) => cap,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cli = parse_cli(cap);
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
    if let Some(to) = std::env::var_os("VOICECLONE_TEST_REPORT_PEAK") {
        // To a directory: a file per process, which the processes of a sharded run cannot
        // interleave as they do on a shared standard error.
        let (_, peak) = vc_kernels::alloc::Counting::live_and_peak();
        let dir = std::path::Path::new(&to);
        if dir.is_dir() {
            let file = dir.join(format!("peak-{}.txt", std::process::id()));
            let _ = std::fs::write(file, peak.to_string());
        } else {
            eprintln!("peak allocated bytes: {peak}");
        }
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The command line, with `--version` telling what this binary is (`voiceclone::build_info`).
fn parse_cli(cap: Option<vc_kernels::isa::IsaCap>) -> voiceclone::cli::Cli {
    use clap::{CommandFactory, FromArgMatches};
    let build = voiceclone::build_info::Build {
        commit: env!("VOICECLONE_COMMIT"),
        ggml_isa: env!("VOICECLONE_GGML_ISA"),
    };
    let isa = vc_kernels::isa::Isa::detected();
    // clap keeps the text for the life of the process; made once per process.
    let text: &'static str =
        Box::leak(voiceclone::build_info::describe(build, isa, cap).into_boxed_str());
    let matches = voiceclone::cli::Cli::command()
        .long_version(text)
        .get_matches();
    voiceclone::cli::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}
