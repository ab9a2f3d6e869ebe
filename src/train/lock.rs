//! One training run per workspace: a lock file holding the owner's process id. A lock left by a
//! process that no longer exists (killed) is taken over.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

pub struct RunLock {
    path: PathBuf,
}

impl RunLock {
    pub fn acquire(path: &Path) -> Result<Self> {
        for _ in 0..2 {
            match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut f) => {
                    writeln!(f, "{}", std::process::id())?;
                    return Ok(Self {
                        path: path.to_path_buf(),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let owner = fs::read_to_string(path)
                        .ok()
                        .and_then(|t| t.trim().parse::<u32>().ok());
                    match owner {
                        Some(pid) if alive(pid) => bail!(
                            "another `voiceclone train` (process {pid}) is running in this \
                             workspace (lock file {}); wait for it or stop it first",
                            path.display()
                        ),
                        // Stale (the owner was killed) or unreadable: take it over.
                        _ => {
                            let _ = fs::remove_file(path);
                        }
                    }
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot create {}", path.display()))
                }
            }
        }
        bail!("cannot take the lock {}", path.display())
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

fn alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    #[cfg(unix)]
    {
        // SAFETY: signal 0 only checks whether the process exists.
        let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
        rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
    #[cfg(not(unix))]
    {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_fails_and_stale_locks_are_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("lock");
        let a = RunLock::acquire(&p).unwrap();
        let e = RunLock::acquire(&p).err().unwrap().to_string();
        assert!(e.contains("another `voiceclone train`"), "{e}");
        drop(a);
        assert!(!p.exists());
        // A pid that cannot exist (above the kernel's maximum).
        fs::write(&p, "4194305\n").unwrap();
        let _b = RunLock::acquire(&p).unwrap();
        assert_eq!(
            fs::read_to_string(&p).unwrap().trim(),
            std::process::id().to_string()
        );
    }
}
