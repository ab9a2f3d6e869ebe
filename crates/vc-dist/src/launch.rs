//! `voiceclone train --gpus N` / `--cpu-ranks N`: start one process per rank and watch them
//! (docs/distributed.md §5).
//!
//! The ranks run this same program with the same arguments, told who they are by the
//! environment ([`super::env`]). Rank 0 keeps the terminal (progress bar, final messages); the
//! other ranks' error output is passed on, each line prefixed with its rank. Each rank leaves its
//! error message in a report file, so that when a run fails the launcher names the rank that
//! caused it first. When one rank fails, the others stop on their own (the control plane aborts
//! them); a rank still running 30 s later is killed. Ctrl-C or SIGTERM to the launcher is passed
//! to every rank (they finish the step, save and stop); a rank outlives its launcher by nothing:
//! it is killed when the launcher dies (Linux).

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::env::{LAUNCHED, RENDEZVOUS, RENDEZVOUS_FD, REPORT_DIR, RESTART_COUNT};

/// How long the other ranks may take to stop after one failed.
pub const GRACE: Duration = Duration::from_secs(30);

/// What to launch.
pub struct LaunchSpec {
    pub world: usize,
    /// This program's arguments (without the program name): every rank runs the same command.
    pub args: Vec<OsString>,
    /// Extra environment of every rank.
    pub env: Vec<(String, String)>,
    /// CPU ranks share this machine's cores: each gets its part of them as compute threads
    /// (`RAYON_NUM_THREADS`), unless the user set that variable.
    pub cpu: bool,
    /// How many times a failed run is started again (every rank), continuing from what the
    /// failed attempt saved.
    pub max_restarts: usize,
    /// A file whose content changes when the run makes lasting progress (the checkpoint
    /// pointer): an attempt that fails exactly as the one before it, without progress, is not
    /// restarted again — it would only fail once more.
    pub progress_file: Option<PathBuf>,
}

/// The report file of `rank` under `dir`.
pub fn report_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.txt"))
}

/// What a rank leaves for the launcher when it fails (docs/distributed.md §5.1): the message the
/// user reads, and what the launcher compares between attempts — which failure (`kind`) and where
/// (`step`), never the message's wording, which may name a temporary file of its attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankReport {
    pub message: String,
    /// What failed, in words stable across attempts: the kind of an I/O error in the chain
    /// (`"I/O: StorageFull"`), or a class the rank names (`"non-finite"`, `"panic"`).
    pub kind: String,
    /// The last optimizer step this rank had completed ([`note_step`]).
    pub step: Option<usize>,
    /// Whether starting the run again could succeed (not a non-finite loss: the same data and
    /// weights give it again).
    pub restartable: bool,
}

/// The last optimizer step this process completed, `usize::MAX` before the first.
static LAST_STEP: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Records that this process completed optimizer step `step` (or resumed at it), for the
/// failure report ([`RankReport::step`]).
pub fn note_step(step: usize) {
    LAST_STEP.store(step, Ordering::Relaxed);
}

/// The step [`note_step`] last recorded.
pub fn last_step() -> Option<usize> {
    Some(LAST_STEP.load(Ordering::Relaxed)).filter(|&s| s != usize::MAX)
}

/// The kind of `e` for [`RankReport::kind`]: the kind of the first I/O error in its chain
/// (a full disk is a full disk whatever file it met), else `otherwise`.
pub fn failure_kind(e: &anyhow::Error, otherwise: &str) -> String {
    e.chain()
        .find_map(|c| c.downcast_ref::<std::io::Error>())
        .map_or_else(
            || otherwise.to_string(),
            |io| format!("I/O: {:?}", io.kind()),
        )
}

/// Leaves this rank's report where the launcher looks for it (no-op outside a launch).
pub fn write_report(rank: usize, report: &RankReport) {
    if let Some(dir) = std::env::var_os(REPORT_DIR) {
        if let Ok(json) = serde_json::to_string(report) {
            let _ = std::fs::write(report_file(Path::new(&dir), rank), json);
        }
    }
}

/// The report `rank` left under `dir`, if it left one.
fn read_report(dir: &Path, rank: usize) -> Option<RankReport> {
    let text = std::fs::read_to_string(report_file(dir, rank)).ok()?;
    serde_json::from_str::<RankReport>(&text)
        .ok()
        .filter(|r| !r.message.trim().is_empty())
}

/// A private directory for the ranks' reports, removed when the launch ends.
struct ReportDir(PathBuf);

impl ReportDir {
    fn create() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("voiceclone-launch-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir).with_context(|| {
            format!(
                "cannot create the launcher's report directory {}",
                dir.display()
            )
        })?;
        Ok(Self(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ReportDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Rank 0's rendezvous socket, bound by the launcher on a loopback port the system chooses and
/// handed to rank 0 open (docs/distributed.md §5): a port only named to rank 0 could be taken by
/// another process before rank 0 binds it.
fn rendezvous_listener() -> Result<TcpListener> {
    TcpListener::bind("127.0.0.1:0").context("cannot open a loopback port for the rendezvous")
}

fn spawn_rank(
    spec: &LaunchSpec,
    rank: usize,
    rendezvous: &TcpListener,
    reports: &Path,
    attempt: usize,
) -> Result<Child> {
    let exe = std::env::current_exe().context("cannot find this program's executable")?;
    let port = rendezvous.local_addr()?.port();
    let mut cmd = Command::new(exe);
    cmd.args(&spec.args)
        .env(LAUNCHED, "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", spec.world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env(RENDEZVOUS, format!("127.0.0.1:{port}"))
        .env(REPORT_DIR, reports)
        .env(RESTART_COUNT, attempt.to_string())
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null());
    if spec.cpu && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        cmd.env("RAYON_NUM_THREADS", (cores / spec.world).max(1).to_string());
    }
    if rank == 0 {
        cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
    } else {
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // Rank 0 inherits the rendezvous socket itself (its descriptor is kept open across the
        // exec below); the other ranks only learn its port.
        let inherited = (rank == 0).then(|| rendezvous.as_raw_fd());
        if let Some(fd) = inherited {
            cmd.env(RENDEZVOUS_FD, fd.to_string());
        }
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls (setpgid, prctl, fcntl) on its own process and on a
        // descriptor the child holds, touching no memory of the parent.
        unsafe {
            cmd.pre_exec(move || {
                // Its own process group: the terminal's Ctrl-C reaches the launcher only, which
                // passes it on, so every rank sees each signal exactly once.
                libc::setpgid(0, 0);
                // Killed when the launcher dies, however it dies: no orphaned ranks.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // The rendezvous socket survives the exec (the flag is the child's own copy).
                if let Some(fd) = inherited {
                    if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start rank {rank}"))?;
    if let Some(err) = child.stderr.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[rank {rank}] {line}");
            }
        });
    }
    Ok(child)
}

#[cfg(unix)]
fn signal_child(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on the pid of a child we started and have not reaped yet.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

#[cfg(not(unix))]
fn signal_child(_child: &Child, _sig: i32) {}

fn describe(status: &ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => "ended".into(),
    }
}

/// How one attempt of a run failed.
struct Failure {
    message: String,
    /// Whether starting again could help (not a stop request, not a final error).
    restartable: bool,
    /// Which failure it was and where: the rank that caused it, the kind, the step
    /// ([`RankReport`]). Two attempts with the same identity and no checkpoint between them
    /// failed the same way.
    identity: (usize, String, Option<usize>),
}

/// Starts the ranks, waits for them and returns `Ok` when every rank succeeded; otherwise,
/// after at most `spec.max_restarts` restarts, the error of the rank that failed first (or was
/// killed), then a line per other failed rank. An attempt that fails as the one before it did
/// (the same rank, kind of error and step) without a new checkpoint between them is not
/// restarted again: it would only fail once more (docs/distributed.md §5.1).
pub fn launch(spec: &LaunchSpec) -> Result<()> {
    anyhow::ensure!(spec.world >= 1, "a run needs at least one rank");
    let progress = || {
        spec.progress_file
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
    };
    // The previous attempt's failure and the progress it had reached.
    type Seen = ((usize, String, Option<usize>), Option<String>);
    let mut previous: Option<Seen> = None;
    for attempt in 0..=spec.max_restarts {
        let Some(failure) = launch_once(spec, attempt)? else {
            return Ok(());
        };
        let reached = progress();
        let repeated = previous
            .as_ref()
            .is_some_and(|(id, p)| *id == failure.identity && *p == reached);
        if !failure.restartable || attempt == spec.max_restarts || repeated {
            let mut msg = failure.message;
            if attempt > 0 {
                msg.push_str(&format!(
                    "\n(the run was restarted {attempt} time(s); {})",
                    if repeated {
                        "it failed the same way again (the same rank, kind of error and step) \
                         without a new checkpoint, so it was not restarted further"
                    } else if failure.restartable {
                        "no restart is left (train.max_restarts)"
                    } else {
                        "a restart cannot help with this failure"
                    }
                ));
            }
            bail!(msg)
        }
        eprintln!(
            "error: {}\nrestarting every rank from the last complete checkpoint (restart {} of {})",
            failure.message,
            attempt + 1,
            spec.max_restarts
        );
        previous = Some((failure.identity, reached));
    }
    unreachable!("the last attempt returns")
}

/// Whether the process `pid` is stopped (SIGSTOP, or traced): it cannot finish by itself.
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The state follows the command name, which is in parentheses.
            let after = s.rsplit_once(')')?.1;
            after
                .split_whitespace()
                .next()
                .map(|st| st == "T" || st == "t")
        })
        .unwrap_or(false)
}

/// One attempt: starts every rank and waits for all of them; `None` when all succeeded.
fn launch_once(spec: &LaunchSpec, attempt: usize) -> Result<Option<Failure>> {
    let reports = ReportDir::create()?;
    let rendezvous = rendezvous_listener()?;
    vc_core::stop_signal::install();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(spec.world);
    for rank in 0..spec.world {
        match spawn_rank(spec, rank, &rendezvous, reports.path(), attempt) {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                vc_core::stop_signal::restore();
                return Err(e);
            }
        }
    }
    // Rank 0 holds the socket now; when it ends, the port is closed for good.
    drop(rendezvous);
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; spec.world];
    // Ranks this launcher killed because they did not stop after the failure.
    let mut killed_here: Vec<bool> = vec![false; spec.world];
    let mut first_failure: Option<(usize, Instant)> = None;
    let mut forwarded = false;
    while statuses.iter().any(Option::is_none) {
        if vc_core::stop_signal::stop_requested() && !forwarded {
            forwarded = true;
            #[cfg(unix)]
            for c in children.iter().flatten() {
                signal_child(c, libc::SIGTERM);
            }
        }
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Some(status) = child.try_wait()? {
                statuses[rank] = Some(status);
                *slot = None;
                if !status.success() && first_failure.is_none() {
                    first_failure = Some((rank, Instant::now()));
                }
            }
        }
        if let Some((_, at)) = first_failure {
            let late = at.elapsed() >= GRACE;
            for (rank, slot) in children.iter_mut().enumerate() {
                let Some(c) = slot else { continue };
                // A stopped rank cannot stop by itself: no need to wait for it.
                if late || is_stopped(c.id()) {
                    let _ = c.kill();
                    killed_here[rank] = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    vc_core::stop_signal::restore();
    let Some((first, _)) = first_failure else {
        return Ok(None);
    };
    let left: Vec<Option<RankReport>> = (0..spec.world)
        .map(|r| read_report(reports.path(), r))
        .collect();
    let message = |rank: usize| left[rank].as_ref().map(|r| r.message.trim().to_string());
    let failed = |r: usize| statuses[r].is_some_and(|s| !s.success());
    // The cause: a rank that died without a report (killed from outside), else a rank whose
    // error is its own rather than an abort passed on from another rank, else the reason the
    // run was aborted (a rank that stopped responding), else the first to fail.
    let killed = (0..spec.world).find(|&r| failed(r) && !killed_here[r] && left[r].is_none());
    let own =
        (0..spec.world).find(|&r| message(r).is_some_and(|m| !m.contains("the run was aborted")));
    if forwarded && killed.is_none() {
        // Stopped on request: rank 0 says where the run stands (e.g. which checkpoint it saved).
        return Ok(Some(Failure {
            message: message(0).unwrap_or_else(|| "training was stopped".into()),
            restartable: false,
            identity: (0, "stopped".into(), None),
        }));
    }
    let exit = |r: usize| statuses[r].as_ref().map(describe).unwrap_or_default();
    let (cause, mut msg) = match (killed, own) {
        (Some(r), _) => (r, format!("rank {r} {}", exit(r))),
        (None, Some(r)) => (
            r,
            format!("rank {r} failed: {}", message(r).unwrap_or_default()),
        ),
        (None, None) => match (0..spec.world).find_map(|r| message(r).map(|m| (r, m))) {
            Some((r, m)) => (r, m),
            None => (first, format!("rank {first} {}", exit(first))),
        },
    };
    for r in (0..spec.world).filter(|&r| r != cause) {
        if killed_here[r] {
            msg.push_str(&format!(
                "\n  rank {r} did not stop after the failure and was killed"
            ));
        } else if let Some(s) = statuses[r].filter(|s| !s.success()) {
            msg.push_str(&format!("\n  rank {r} {}", describe(&s)));
        }
    }
    // A rank without a report is known by how it ended.
    let identity = match &left[cause] {
        Some(r) => (cause, r.kind.clone(), r.step),
        None => (cause, exit(cause), None),
    };
    Ok(Some(Failure {
        message: msg,
        restartable: left[cause].as_ref().is_none_or(|r| r.restartable),
        identity,
    }))
}
