//! One training run per workspace: an exclusive OS file lock (`flock`) on the workspace's lock
//! file, held for the life of the run. The kernel releases it when the process ends, however it
//! ends, so the lock of a killed run never has to be detected or taken over, and two runs that
//! start together cannot both get it. The file itself stays (it only records the last owner's
//! process id, for the message a second run prints).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The held lock; dropping it (or the process ending) releases it.
pub struct RunLock {
    _file: File,
    pub path: PathBuf,
}

impl RunLock {
    pub fn acquire(path: &Path) -> Result<Self> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("cannot open the lock file {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut owner = String::new();
                let _ = file.read_to_string(&mut owner);
                let who = match owner.trim().parse::<u32>() {
                    Ok(pid) => format!(" (process {pid})"),
                    Err(_) => String::new(),
                };
                bail!(
                    "another `voiceclone train`{who} is running in this workspace (it holds the \
                     lock {}); wait for it or stop it first",
                    path.display()
                );
            }
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()))
            }
        }
        file.set_len(0)?;
        file.rewind()?;
        writeln!(file, "{}", std::process::id())?;
        Ok(Self {
            _file: file,
            path: path.to_path_buf(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    #[test]
    fn a_second_run_is_refused_until_the_first_ends() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("lock");
        let a = RunLock::acquire(&p).unwrap();
        let e = RunLock::acquire(&p).err().unwrap().to_string();
        assert!(
            e.contains(&format!(
                "another `voiceclone train` (process {})",
                std::process::id()
            )),
            "{e}"
        );
        drop(a);
        let _b = RunLock::acquire(&p).unwrap();
    }

    #[test]
    fn a_lock_file_naming_this_very_process_is_not_mistaken_for_a_live_run() {
        // In a container the trainer is often process 1, and a run killed there leaves a file
        // naming process 1 — which is the new run itself. The file's content must not matter.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("lock");
        std::fs::write(&p, format!("{}\n", std::process::id())).unwrap();
        let _l = RunLock::acquire(&p).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap().trim(),
            std::process::id().to_string()
        );
    }

    #[test]
    fn runs_starting_together_get_the_lock_exactly_once() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..50 {
            // A file of its own each round: a process another test forks while the last round's
            // winner still has the file open would hold that round's lock until it execs (the
            // lock belongs to the shared open file), and nobody could win this round.
            let p = Arc::new(dir.path().join(format!("lock-{round}")));
            // A stale file from a killed run is there, as in the take-over case.
            std::fs::write(&*p, "4194305\n").unwrap();
            let barrier = Arc::new(Barrier::new(4));
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let (p, barrier) = (p.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        let got = RunLock::acquire(&p).ok();
                        // Hold it until everyone has tried.
                        barrier.wait();
                        got.is_some()
                    })
                })
                .collect();
            let winners = handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&w| w)
                .count();
            assert_eq!(winners, 1, "round {round}");
        }
    }

    #[test]
    fn the_lock_of_a_killed_process_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("lock");
        std::fs::write(&p, "").unwrap();
        // A shell opens the file, takes the same flock(2) lock with util-linux flock(1) on its
        // descriptor, and becomes `sleep`: one process holds the lock until it is killed.
        let Ok(mut child) = std::process::Command::new("sh")
            .args(["-c", "exec 9<>\"$0\" && flock -x 9 && exec sleep 30"])
            .arg(&p)
            .spawn()
        else {
            eprintln!("skipped: no sh");
            return;
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while RunLock::acquire(&p).is_ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "flock never took the lock"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let _l = RunLock::acquire(&p).expect("the killed holder's lock is released");
    }
}
