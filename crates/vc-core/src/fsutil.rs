//! Crash-safe file output: everything is written under a temporary name in the destination
//! directory and renamed into place, so a reader never sees a half-written file.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A temporary sibling of `dest` (same directory, so the final rename is atomic).
pub fn temp_path_for(dest: &Path) -> PathBuf {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dest.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Writes `bytes` to `dest` atomically, creating parent directories.
pub fn write_atomic(dest: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(dest, |f| f.write_all(bytes).map_err(Into::into))
}

/// Calls `fill` on a temporary file next to `dest`, syncs it and renames it to `dest`.
/// On error the temporary file is removed and `dest` is untouched.
pub fn write_atomic_with(
    dest: &Path,
    fill: impl FnOnce(&mut fs::File) -> Result<()>,
) -> Result<()> {
    if let Some(parent) = dest.parent() {
        fs::create_dir_all(parent)
            .with_context(|| format!("cannot create directory {}", parent.display()))?;
    }
    let tmp = temp_path_for(dest);
    let result = (|| -> Result<()> {
        let mut file =
            fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        // A full disk fails here: name the file, not only the OS's reason.
        fill(&mut file).with_context(|| format!("cannot write {}", tmp.display()))?;
        file.sync_all()
            .with_context(|| format!("cannot flush {}", tmp.display()))?;
        fs::rename(&tmp, dest)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), dest.display()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    } else {
        remove_stale_temps(dest);
    }
    result
}

/// Removes what writes of `dest` by processes that no longer run left behind (killed between
/// creating their temporary file and renaming it); a live process's temporary file is kept.
fn remove_stale_temps(dest: &Path) {
    let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) else {
        return;
    };
    let prefix = format!(".{}.tmp-", name.to_string_lossy());
    let Ok(entries) = fs::read_dir(if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    }) else {
        return;
    };
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = n.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// `path` relative to `base` when it lies inside it, else unchanged; always with `/` separators.
pub fn display_relative(path: &Path, base: &Path) -> String {
    let rel = path.strip_prefix(base).unwrap_or(path);
    rel.to_string_lossy().replace('\\', "/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_removes_what_killed_writes_of_the_same_file_left() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("train.jsonl");
        // A process id that cannot be running (above the kernel's limit), and a live one.
        let dead = dir.path().join(".train.jsonl.tmp-4294967294");
        let live = dir.path().join(format!(
            ".train.jsonl.tmp-{}",
            std::os::unix::process::parent_id()
        ));
        let other = dir.path().join(".other.jsonl.tmp-4294967294");
        for p in [&dead, &live, &other] {
            fs::write(p, b"half").unwrap();
        }
        write_atomic(&dest, b"whole").unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"whole");
        assert!(!dead.exists() && live.exists() && other.exists());
    }

    /// A full disk fails the write itself, after the temporary file was created: the error
    /// names the file, not only the OS's reason.
    #[test]
    fn a_failed_write_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("records/abc.json");
        let e = write_atomic_with(&dest, |_| {
            Err(
                std::io::Error::new(std::io::ErrorKind::StorageFull, "No space left on device")
                    .into(),
            )
        })
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains(&dir.path().join("records").display().to_string())
                && msg.contains("abc.json")
                && msg.contains("No space left on device"),
            "{msg}"
        );
    }

    #[test]
    fn atomic_write_replaces_whole_file_and_cleans_up_on_error() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("sub/out.txt");
        write_atomic(&dest, b"first").unwrap();
        write_atomic(&dest, b"second").unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"second");
        let err = write_atomic_with(&dest, |f| {
            f.write_all(b"partial")?;
            anyhow::bail!("boom")
        });
        assert!(err.is_err());
        assert_eq!(fs::read(&dest).unwrap(), b"second");
        let leftovers: Vec<_> = fs::read_dir(dest.parent().unwrap()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "temporary file left behind");
    }
}
