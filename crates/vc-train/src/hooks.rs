//! A seam for tests: points in a training run where a test can step in (pause for a signal,
//! poison a loss, stop inside a checkpoint write). Production runs use [`NoHooks`]; the
//! `test-hooks` cargo feature adds [`EnvHooks`], which the binary installs so that integration
//! tests can drive a real `voiceclone train` process through `VOICECLONE_TEST_*` variables. A
//! default build reads no such variable.

/// Where in writing a checkpoint a hook runs (in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointPhase {
    /// The rank files and extras are in the temporary directory; no index yet.
    RankFilesWritten,
    /// The temporary directory is complete (index written and synced).
    IndexWritten,
    /// Re-saving an existing step: the old directory has been moved aside, the new one is not
    /// in place yet.
    OldMovedAside,
    /// The new checkpoint directory is in place; `latest` still names the previous one.
    InPlace,
    /// `latest` names the new checkpoint; old ones are not pruned yet.
    LatestWritten,
}

impl CheckpointPhase {
    pub const ALL: [CheckpointPhase; 5] = [
        CheckpointPhase::RankFilesWritten,
        CheckpointPhase::IndexWritten,
        CheckpointPhase::OldMovedAside,
        CheckpointPhase::InPlace,
        CheckpointPhase::LatestWritten,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CheckpointPhase::RankFilesWritten => "rank-files",
            CheckpointPhase::IndexWritten => "index",
            CheckpointPhase::OldMovedAside => "old-aside",
            CheckpointPhase::InPlace => "in-place",
            CheckpointPhase::LatestWritten => "latest",
        }
    }
}

/// Test seams of the training loop; every method defaults to doing nothing.
pub trait TrainHooks: Send + Sync {
    /// After optimizer step `step` (1-based) was applied, before the checkpoint decision.
    fn after_step(&self, _step: usize) {}
    /// The loss value of a micro-batch of optimizer step `step` on `rank`, before it is checked.
    fn loss(&self, _step: usize, _rank: usize, value: f64) -> f64 {
        value
    }
    /// At the start of optimizer step `step` on `rank`.
    fn step_start(&self, _step: usize, _rank: usize) {}
    /// While writing the checkpoint of `step` (on the rank that commits it: rank 0).
    fn checkpoint(&self, _step: usize, _phase: CheckpointPhase) {}
    /// Sharded runs: `rank`'s own file of checkpoint `step` is written and synced; the ranks
    /// have not yet agreed that every file is.
    fn rank_file_written(&self, _step: usize, _rank: usize) {}
    /// Sharded runs: before `rank` writes its own file of checkpoint `step`; an error fails
    /// that write as the filesystem would.
    fn rank_file_write(&self, _step: usize, _rank: usize) -> std::io::Result<()> {
        Ok(())
    }
}

/// A named point outside the training loop where a `test-hooks` build can pause (for a test
/// to kill the process there): with `VOICECLONE_TEST_PAUSE_AT_POINT=NAME` it prints `test hook:
/// paused at NAME (pid P)` and sleeps 10 minutes. Does nothing in a default build.
pub fn pause_point(name: &str) {
    #[cfg(feature = "test-hooks")]
    if std::env::var("VOICECLONE_TEST_PAUSE_AT_POINT").is_ok_and(|v| v == name) {
        eprintln!("test hook: paused at {name} (pid {})", std::process::id());
        std::thread::sleep(std::time::Duration::from_secs(600));
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = name;
}

/// No intervention (every production run).
pub struct NoHooks;

impl TrainHooks for NoHooks {}

#[cfg(feature = "test-hooks")]
pub use env::EnvHooks;

#[cfg(feature = "test-hooks")]
mod env {
    use std::time::{Duration, Instant};

    use super::{CheckpointPhase, TrainHooks};

    /// Hooks configured by environment variables (read once, when created):
    /// - `VOICECLONE_TEST_PAUSE_AFTER_STEP=N`: after step N, wait (up to 10 minutes) for a stop
    ///   signal;
    /// - `VOICECLONE_TEST_NAN_AT_STEP=N[:RANK]`: the loss of step N (on RANK, default every
    ///   rank) is NaN;
    /// - `VOICECLONE_TEST_PANIC_AT_STEP=N:RANK`: RANK panics at the start of step N;
    /// - `VOICECLONE_TEST_PAUSE_AT_STEP=N:RANK`: RANK sleeps (10 minutes) at the start of step N,
    ///   so a test can kill it there;
    /// - `VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE=N[:PHASE]`: sleep (10 minutes) while writing
    ///   the checkpoint of step N, at PHASE (default `rank-files`; see [`CheckpointPhase::name`]);
    /// - `VOICECLONE_TEST_PAUSE_AFTER_RANK_FILE=N:RANK`: RANK sleeps (10 minutes) once its own
    ///   file of checkpoint N is written;
    /// - `VOICECLONE_TEST_DISK_FULL_AT_CHECKPOINT=N:RANK`: RANK's write of its file of
    ///   checkpoint N fails with "No space left on device", in every attempt;
    /// - `VOICECLONE_TEST_FIRST_ATTEMPT_ONLY=1`: every hook above acts only in the first attempt
    ///   of a run (not after a restart by voiceclone's launcher, torchrun or the Ray launcher).
    ///
    /// Every pause prints `test hook: … (pid P)` on standard error, so a test can kill it.
    #[derive(Debug, Default)]
    pub struct EnvHooks {
        pause_after: Option<usize>,
        nan_at: Option<(usize, Option<usize>)>,
        panic_at: Option<(usize, usize)>,
        pause_at: Option<(usize, usize)>,
        pause_in_checkpoint: Option<(usize, String)>,
        pause_after_rank_file: Option<(usize, usize)>,
        disk_full_at: Option<(usize, usize)>,
    }

    fn var(name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.trim().is_empty())
    }

    fn step_and(v: &str) -> Option<(usize, Option<&str>)> {
        let mut it = v.trim().splitn(2, ':');
        let step = it.next()?.parse().ok()?;
        Some((step, it.next()))
    }

    impl EnvHooks {
        pub fn from_env() -> Self {
            let rank_of = |v: Option<&str>| v.and_then(|r| r.parse::<usize>().ok());
            let disk_full_at = var("VOICECLONE_TEST_DISK_FULL_AT_CHECKPOINT")
                .as_deref()
                .and_then(step_and)
                .and_then(|(s, r)| Some((s, rank_of(r)?)));
            let restarted = vc_dist::env::restart_count() > 0;
            if restarted && var("VOICECLONE_TEST_FIRST_ATTEMPT_ONLY").as_deref() == Some("1") {
                return Self {
                    disk_full_at,
                    ..Self::default()
                };
            }
            Self {
                disk_full_at,
                pause_after: var("VOICECLONE_TEST_PAUSE_AFTER_STEP")
                    .and_then(|v| v.trim().parse().ok()),
                nan_at: var("VOICECLONE_TEST_NAN_AT_STEP")
                    .as_deref()
                    .and_then(step_and)
                    .map(|(s, r)| (s, rank_of(r))),
                panic_at: var("VOICECLONE_TEST_PANIC_AT_STEP")
                    .as_deref()
                    .and_then(step_and)
                    .and_then(|(s, r)| Some((s, rank_of(r)?))),
                pause_at: var("VOICECLONE_TEST_PAUSE_AT_STEP")
                    .as_deref()
                    .and_then(step_and)
                    .and_then(|(s, r)| Some((s, rank_of(r)?))),
                pause_in_checkpoint: var("VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE")
                    .as_deref()
                    .and_then(step_and)
                    .map(|(s, p)| (s, p.unwrap_or("rank-files").to_string())),
                pause_after_rank_file: var("VOICECLONE_TEST_PAUSE_AFTER_RANK_FILE")
                    .as_deref()
                    .and_then(step_and)
                    .and_then(|(s, r)| Some((s, rank_of(r)?))),
            }
        }
    }

    impl TrainHooks for EnvHooks {
        fn after_step(&self, step: usize) {
            if self.pause_after == Some(step) {
                eprintln!("test hook: paused after step {step}");
                let until = Instant::now() + Duration::from_secs(600);
                while !vc_core::stop_signal::stop_requested() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }

        fn loss(&self, step: usize, rank: usize, value: f64) -> f64 {
            match self.nan_at {
                Some((s, r)) if s == step && r.is_none_or(|r| r == rank) => f64::NAN,
                _ => value,
            }
        }

        fn step_start(&self, step: usize, rank: usize) {
            if self.panic_at == Some((step, rank)) {
                panic!("test hook: rank {rank} panics at step {step}");
            }
            if self.pause_at == Some((step, rank)) {
                eprintln!(
                    "test hook: rank {rank} paused at step {step} (pid {})",
                    std::process::id()
                );
                std::thread::sleep(Duration::from_secs(600));
            }
        }

        fn checkpoint(&self, step: usize, phase: CheckpointPhase) {
            if let Some((s, p)) = &self.pause_in_checkpoint {
                if *s == step && p == phase.name() {
                    eprintln!(
                        "test hook: paused in checkpoint write at step {step} ({}) (pid {})",
                        phase.name(),
                        std::process::id()
                    );
                    std::thread::sleep(Duration::from_secs(600));
                }
            }
        }

        fn rank_file_written(&self, step: usize, rank: usize) {
            if self.pause_after_rank_file == Some((step, rank)) {
                eprintln!(
                    "test hook: rank {rank} paused after writing its file of step {step} (pid {})",
                    std::process::id()
                );
                std::thread::sleep(Duration::from_secs(600));
            }
        }

        fn rank_file_write(&self, step: usize, rank: usize) -> std::io::Result<()> {
            if self.disk_full_at == Some((step, rank)) {
                // ENOSPC: what a full filesystem answers a write.
                return Err(std::io::Error::from_raw_os_error(28));
            }
            Ok(())
        }
    }
}
