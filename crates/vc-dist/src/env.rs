//! Is this process one rank of a distributed run, and which? (docs/distributed.md §5)
//!
//! - started by `voiceclone train --gpus N | --cpu-ranks N`: `VOICECLONE_LAUNCHED=1` plus
//!   `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and `VOICECLONE_RENDEZVOUS` (`host:port`);
//! - started by torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`;
//! - started by Slurm (`srun`, more than one task): `SLURM_PROCID`, `SLURM_NTASKS`,
//!   `SLURM_LOCALID`, and `MASTER_ADDR` (+ `MASTER_PORT`, default 29500) set by the job script.
//!
//! Under torchrun and Slurm the rendezvous uses `MASTER_PORT + 1` (torchrun's own agent already
//! listens on `MASTER_PORT`), or `VOICECLONE_RENDEZVOUS_PORT` when set.

use anyhow::{bail, Context, Result};

/// Set in the rank processes our own launcher starts.
pub const LAUNCHED: &str = "VOICECLONE_LAUNCHED";
/// `host:port` of rank 0's rendezvous, set by our launcher.
pub const RENDEZVOUS: &str = "VOICECLONE_RENDEZVOUS";
/// The descriptor of the rendezvous socket our launcher binds and hands to rank 0, open.
pub const RENDEZVOUS_FD: &str = "VOICECLONE_RENDEZVOUS_FD";
/// Overrides the rendezvous port under torchrun or Slurm.
pub const RENDEZVOUS_PORT: &str = "VOICECLONE_RENDEZVOUS_PORT";
/// Directory where each rank leaves its error message for our launcher.
pub const REPORT_DIR: &str = "VOICECLONE_REPORT_DIR";

/// Set by voiceclone's launcher (and `scripts/launchers/ray_train.py`) in the ranks of a restarted run:
/// how many times the run was restarted before this attempt.
pub const RESTART_COUNT: &str = "VOICECLONE_RESTART_COUNT";

/// How many times this run was restarted before this process started (0 for a first attempt):
/// voiceclone's launcher and the Ray launcher say so in [`RESTART_COUNT`], torchrun in
/// `TORCHELASTIC_RESTART_COUNT`.
pub fn restart_count() -> usize {
    [RESTART_COUNT, "TORCHELASTIC_RESTART_COUNT"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .filter_map(|v| v.trim().parse::<usize>().ok())
        .max()
        .unwrap_or(0)
}

/// The rendezvous socket our launcher handed to this process ([`RENDEZVOUS_FD`]), already
/// bound and listening on `port`; `None` when it handed none. Taken at most once per process:
/// the socket then belongs to the caller.
pub fn take_inherited_rendezvous(port: u16) -> Result<Option<std::net::TcpListener>> {
    use std::os::fd::{FromRawFd, IntoRawFd};
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    let Some(v) = std::env::var(RENDEZVOUS_FD)
        .ok()
        .filter(|v| !v.trim().is_empty())
    else {
        return Ok(None);
    };
    let fd: libc::c_int = v
        .trim()
        .parse()
        .with_context(|| format!("environment variable {RENDEZVOUS_FD}={v:?} is not a number"))?;
    if TAKEN.swap(true, Ordering::SeqCst) {
        bail!("the inherited rendezvous socket was already taken");
    }
    // Only a listening socket is adopted: a descriptor that is anything else (a stale variable)
    // is refused rather than closed or used.
    let mut listening: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `listening`, an int we own; on a
    // descriptor that is not an open socket it fails without side effects.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&mut listening as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 || listening == 0 {
        bail!("{RENDEZVOUS_FD}={fd} is not a listening socket of this process");
    }
    // SAFETY: the descriptor is an open listening socket (checked above) inherited from the
    // launcher for this purpose, and TAKEN makes this the one owner in the process. Should it
    // not be the launcher's TCP socket on `port`, it is given back below without being closed.
    let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
    match listener.local_addr() {
        Ok(addr) if addr.port() == port => {}
        found => {
            let _ = listener.into_raw_fd();
            bail!(
                "{RENDEZVOUS_FD}={fd} is not the rendezvous socket on port {port} ({})",
                match found {
                    Ok(a) => format!("it listens on {a}"),
                    Err(e) => e.to_string(),
                }
            );
        }
    }
    // Not passed on to anything this process starts.
    // SAFETY: fcntl on the descriptor the listener now owns.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } == -1 {
        bail!(
            "cannot keep the rendezvous socket from child processes: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(Some(listener))
}

/// Who started the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    Voiceclone,
    Torchrun,
    Slurm,
}

/// This process's place in a distributed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    /// The rank's index on its node (the GPU ordinal).
    pub local_rank: usize,
    /// Ranks per node when the launcher says (`LOCAL_WORLD_SIZE`, Slurm's
    /// `SLURM_NTASKS_PER_NODE`; every rank of our launcher is on this machine).
    pub local_world: Option<usize>,
    /// Rank 0's rendezvous address, `host:port`.
    pub rendezvous: String,
    pub launcher: Launcher,
}

impl RankEnv {
    /// The rank this process is, from its environment; `None` for an ordinary process.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
    }

    /// [`Self::from_env`] over any variable lookup (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let num = |k: &str| -> Result<Option<usize>> {
            var(k)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .with_context(|| format!("environment variable {k}={v:?} is not a number"))
                })
                .transpose()
        };
        let port_after = |master_port: usize| -> Result<usize> {
            Ok(match num(RENDEZVOUS_PORT)? {
                Some(p) => p,
                None => master_port + 1,
            })
        };
        let env = if var(LAUNCHED).as_deref() == Some("1") {
            let rendezvous =
                var(RENDEZVOUS).with_context(|| format!("{LAUNCHED} without {RENDEZVOUS}"))?;
            let rank = num("RANK")?.context("RANK is not set")?;
            let world = num("WORLD_SIZE")?.context("WORLD_SIZE is not set")?;
            RankEnv {
                rank,
                world,
                local_rank: num("LOCAL_RANK")?.unwrap_or(rank),
                local_world: Some(world),
                rendezvous,
                launcher: Launcher::Voiceclone,
            }
        } else if let (Some(rank), Some(world)) = (num("RANK")?, num("WORLD_SIZE")?) {
            let addr = var("MASTER_ADDR")
                .context("RANK and WORLD_SIZE are set (torchrun) but MASTER_ADDR is not")?;
            let port = num("MASTER_PORT")?
                .context("RANK and WORLD_SIZE are set (torchrun) but MASTER_PORT is not")?;
            RankEnv {
                rank,
                world,
                local_rank: num("LOCAL_RANK")?.unwrap_or(0),
                local_world: num("LOCAL_WORLD_SIZE")?,
                rendezvous: format!("{addr}:{}", port_after(port)?),
                launcher: Launcher::Torchrun,
            }
        } else if let (Some(rank), Some(world)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
            if world < 2 {
                // A single task inside an allocation is an ordinary run.
                return Ok(None);
            }
            let addr = var("MASTER_ADDR").context(
                "running as one of several Slurm tasks, but MASTER_ADDR is not set: export \
                 MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) in the \
                 job script",
            )?;
            let port = num("MASTER_PORT")?.unwrap_or(29500);
            RankEnv {
                rank,
                world,
                local_rank: num("SLURM_LOCALID")?.unwrap_or(0),
                // Set with --ntasks-per-node: a plain count (SLURM_TASKS_PER_NODE may be
                // "8(x2)").
                local_world: var("SLURM_NTASKS_PER_NODE").and_then(|v| v.trim().parse().ok()),
                rendezvous: format!("{addr}:{}", port_after(port)?),
                launcher: Launcher::Slurm,
            }
        } else {
            return Ok(None);
        };
        if env.world == 0 || env.rank >= env.world {
            bail!("rank {} is not in a world of {} ranks", env.rank, env.world);
        }
        Ok(Some(env))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<RankEnv>> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn launchers_are_recognised() {
        assert_eq!(env(&[]).unwrap(), None);
        let t = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((t.rank, t.world, t.local_rank), (3, 8, 1));
        assert_eq!(t.local_world, None);
        assert_eq!(t.rendezvous, "node0:29501");
        assert_eq!(t.launcher, Launcher::Torchrun);
        let s = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_NTASKS_PER_NODE", "8"),
            ("SLURM_LOCALID", "5"),
            ("MASTER_ADDR", "gpu01"),
            ("VOICECLONE_RENDEZVOUS_PORT", "40000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.rank, s.world, s.rendezvous.as_str(), s.local_world),
            (5, 16, "gpu01:40000", Some(8))
        );
        assert_eq!(
            env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]).unwrap(),
            None
        );
        let e = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let ours = env(&[
            ("VOICECLONE_LAUNCHED", "1"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("VOICECLONE_RENDEZVOUS", "127.0.0.1:5000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(ours.launcher, Launcher::Voiceclone);
        assert_eq!(ours.local_world, Some(2));
        let t = env(&[
            ("RANK", "9"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(t.local_world, Some(8));
        assert_eq!(ours.rendezvous, "127.0.0.1:5000");
        assert!(env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1")
        ])
        .is_err());
        assert!(env(&[("RANK", "x"), ("WORLD_SIZE", "2")]).is_err());
    }
}
