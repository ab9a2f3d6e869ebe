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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::env::{LAUNCHED, RENDEZVOUS, REPORT_DIR};

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
}

/// The report file of `rank` under `dir`.
pub fn report_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.txt"))
}

/// Leaves this rank's error message where the launcher looks for it (no-op outside a launch).
pub fn write_report(rank: usize, message: &str) {
    if let Some(dir) = std::env::var_os(REPORT_DIR) {
        let _ = std::fs::write(report_file(Path::new(&dir), rank), message);
    }
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

/// A free loopback port for the rendezvous.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn spawn_rank(spec: &LaunchSpec, rank: usize, port: u16, reports: &Path) -> Result<Child> {
    let exe = std::env::current_exe().context("cannot find this program's executable")?;
    let mut cmd = Command::new(exe);
    cmd.args(&spec.args)
        .env(LAUNCHED, "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", spec.world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env(RENDEZVOUS, format!("127.0.0.1:{port}"))
        .env(REPORT_DIR, reports)
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
        // SAFETY: the closure runs in the forked child before exec and only makes two
        // async-signal-safe system calls (setpgid, prctl), touching no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                // Its own process group: the terminal's Ctrl-C reaches the launcher only, which
                // passes it on, so every rank sees each signal exactly once.
                libc::setpgid(0, 0);
                // Killed when the launcher dies, however it dies: no orphaned ranks.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
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

/// Starts the ranks, waits for them and returns `Ok` when every rank succeeded; otherwise the
/// error of the rank that failed first (or was killed), then a line per other failed rank.
pub fn launch(spec: &LaunchSpec) -> Result<()> {
    anyhow::ensure!(spec.world >= 1, "a run needs at least one rank");
    let reports = ReportDir::create()?;
    let port = free_port()?;
    crate::train::signal::install();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(spec.world);
    for rank in 0..spec.world {
        match spawn_rank(spec, rank, port, reports.path()) {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; spec.world];
    let mut first_failure: Option<(usize, Instant)> = None;
    let mut forwarded = false;
    while statuses.iter().any(Option::is_none) {
        if crate::train::signal::stop_requested() && !forwarded {
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
            if at.elapsed() >= GRACE {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    crate::train::signal::restore();
    let Some((first, _)) = first_failure else {
        return Ok(());
    };
    let report = |rank: usize| {
        std::fs::read_to_string(report_file(reports.path(), rank))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    // The cause: a rank that died without a report (killed), else a rank whose error is its
    // own rather than an abort passed on from another rank, else the first to fail.
    let killed =
        (0..spec.world).find(|&r| statuses[r].is_some_and(|s| !s.success()) && report(r).is_none());
    let own =
        (0..spec.world).find(|&r| report(r).is_some_and(|m| !m.contains("the run was aborted")));
    let cause = killed.or(own).unwrap_or(first);
    if forwarded && killed.is_none() {
        // Stopped on request: rank 0 says where the run stands (e.g. which checkpoint it saved).
        bail!(report(0).unwrap_or_else(|| "training was stopped".into()));
    }
    let mut msg = match report(cause) {
        Some(m) => format!("rank {cause} failed: {m}"),
        None => format!(
            "rank {cause} {}",
            statuses[cause].as_ref().map(describe).unwrap_or_default()
        ),
    };
    for r in (0..spec.world).filter(|&r| r != cause) {
        if let Some(s) = statuses[r].filter(|s| !s.success()) {
            msg.push_str(&format!("\n  rank {r} {}", describe(&s)));
        }
    }
    bail!(msg)
}
