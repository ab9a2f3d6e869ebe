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
        fill(&mut file)?;
        file.sync_all()
            .with_context(|| format!("cannot flush {}", tmp.display()))?;
        fs::rename(&tmp, dest)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), dest.display()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
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
