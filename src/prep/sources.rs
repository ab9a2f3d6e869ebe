//! Finding the recordings to prepare and naming them stably.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use crate::audio::decode::has_audio_extension;

/// A recording to prepare.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SourceFile {
    /// Absolute path.
    pub path: PathBuf,
}

/// The outcome of scanning the inputs: files to prepare, and warnings for inputs that gave none.
#[derive(Debug, Default)]
pub struct Discovery {
    pub files: Vec<SourceFile>,
    pub warnings: Vec<String>,
}

/// Expands `inputs` (files or folders, searched recursively) into audio files, sorted and
/// de-duplicated. Folders contribute files with an audio extension; a file named explicitly is
/// taken whatever its extension. Anything under `exclude` (the workspace's own data) is skipped.
pub fn discover(inputs: &[PathBuf], exclude: &Path) -> Discovery {
    let mut d = Discovery::default();
    for input in inputs {
        let abs = absolute(input);
        match std::fs::metadata(&abs) {
            Err(e) => d
                .warnings
                .push(format!("{}: cannot read input: {e}", input.display())),
            Ok(m) if m.is_dir() => {
                let before = d.files.len();
                walk(&abs, exclude, &mut d);
                if d.files.len() == before {
                    d.warnings.push(format!(
                        "{}: folder contains no audio files (looked for .{})",
                        input.display(),
                        crate::audio::decode::AUDIO_EXTENSIONS.join(", .")
                    ));
                }
            }
            Ok(_) => d.files.push(SourceFile { path: abs }),
        }
    }
    d.files.sort();
    d.files.dedup();
    d
}

fn walk(dir: &Path, exclude: &Path, d: &mut Discovery) {
    if dir.starts_with(exclude) {
        return;
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            d.warnings
                .push(format!("{}: cannot list folder: {e}", dir.display()));
            return;
        }
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        // Follow symlinks for the type check, but keep a dangling link as a file so that the
        // user hears about it.
        let is_dir = std::fs::metadata(&path)
            .map(|m| m.is_dir())
            .unwrap_or(false);
        if is_dir {
            walk(&path, exclude, d);
        } else if has_audio_extension(&path) && !path.starts_with(exclude) {
            d.files.push(SourceFile { path });
        }
    }
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

impl SourceFile {
    /// A key that changes whenever the file (path, size, modification time) or the settings
    /// that shaped its output (`settings_digest`) change.
    pub fn key(&self, settings_digest: &str) -> String {
        let mut h = Sha256::new();
        h.update(settings_digest.as_bytes());
        h.update([0]);
        h.update(self.path.to_string_lossy().as_bytes());
        if let Ok(m) = std::fs::metadata(&self.path) {
            h.update(m.len().to_le_bytes());
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            h.update(mtime.to_le_bytes());
        }
        hex(&h.finalize()[..16])
    }

    /// A file-name-safe stem for the utterances cut from this source.
    pub fn safe_stem(&self) -> String {
        let stem = self
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "audio".into());
        let safe: String = stem
            .chars()
            .map(|c| {
                if c.is_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .take(48)
            .collect();
        if safe.is_empty() {
            "audio".into()
        } else {
            safe
        }
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Digest of any serialisable settings value.
pub fn digest_of(value: &impl serde::Serialize) -> String {
    let json = serde_json::to_vec(value).unwrap_or_default();
    hex(&Sha256::digest(&json)[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovers_recursively_sorted_and_excludes_workspace_data() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::create_dir_all(root.join("data/segments")).unwrap();
        std::fs::create_dir_all(root.join("empty")).unwrap();
        for f in [
            "a/b/z.wav",
            "a/x.FLAC",
            "a/notes.txt",
            "data/segments/s.wav",
            "y.mp3",
        ] {
            std::fs::write(root.join(f), b"x").unwrap();
        }
        let d = discover(
            &[root.to_path_buf(), root.join("empty")],
            &root.join("data"),
        );
        let names: Vec<String> = d
            .files
            .iter()
            .map(|f| {
                f.path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        assert_eq!(names, ["a/b/z.wav", "a/x.FLAC", "y.mp3"]);
        assert_eq!(d.warnings.len(), 1);
        assert!(d.warnings[0].contains("empty") && d.warnings[0].contains("no audio"));
    }

    #[test]
    fn key_tracks_content_changes_and_settings() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.wav");
        std::fs::write(&p, b"one").unwrap();
        let f = SourceFile { path: p.clone() };
        let k1 = f.key("s1");
        assert_eq!(k1, f.key("s1"));
        assert_ne!(k1, f.key("s2"));
        std::fs::write(&p, b"longer").unwrap();
        assert_ne!(k1, f.key("s1"));
    }
}
