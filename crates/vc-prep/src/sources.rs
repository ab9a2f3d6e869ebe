//! Finding the recordings to prepare and naming them stably.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use vc_audio::decode::has_audio_extension;

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

/// A file or folder by what it is, not by the path that reached it: device and inode.
type FileIdentity = (u64, u64);

fn identity(m: &std::fs::Metadata) -> FileIdentity {
    (m.dev(), m.ino())
}

/// What a walk has seen: the folders it searched (a folder reached again — through a link that
/// loops, or a second link to it — is not searched twice) and what it must not enter.
struct Walk<'a> {
    visited: HashSet<FileIdentity>,
    /// The workspace: never searched, however it is reached (docs/architecture.md §1).
    workspace: Option<FileIdentity>,
    exclude: &'a Path,
}

/// Expands `inputs` (files or folders, searched recursively, following links) into audio files,
/// sorted, each file once however many paths lead to it (docs/architecture.md §1). Folders
/// contribute files with an audio extension; a file named explicitly is taken whatever its
/// extension. The workspace `exclude_root` (by identity, so also through a link) and anything
/// under `exclude` (its data) are skipped.
pub fn discover(inputs: &[PathBuf], exclude_root: &Path, exclude: &Path) -> Discovery {
    let mut d = Discovery::default();
    let mut walk = Walk {
        visited: HashSet::new(),
        workspace: std::fs::metadata(exclude_root).ok().map(|m| identity(&m)),
        exclude,
    };
    for input in inputs {
        let abs = absolute(input);
        match std::fs::metadata(&abs) {
            Err(e) => d
                .warnings
                .push(format!("{}: cannot read input: {e}", input.display())),
            Ok(m) if m.is_dir() => {
                let before = d.files.len();
                walk.dir(&abs, &m, &mut d);
                if d.files.len() == before {
                    d.warnings.push(format!(
                        "{}: folder contains no audio files (looked for .{})",
                        input.display(),
                        vc_audio::decode::AUDIO_EXTENSIONS.join(", .")
                    ));
                }
            }
            Ok(_) => d.files.push(SourceFile { path: abs }),
        }
    }
    d.files = one_path_per_file(std::mem::take(&mut d.files));
    d
}

/// Sorted, with each file (by identity) once: under the path without links when there is one,
/// else the first in sorted order — so a folder with links to its own files gives exactly the
/// files of the same folder without the links.
fn one_path_per_file(mut files: Vec<SourceFile>) -> Vec<SourceFile> {
    files.sort();
    files.dedup();
    let mut chosen: HashMap<FileIdentity, usize> = HashMap::new();
    let mut keep = vec![true; files.len()];
    let direct = |p: &Path| std::fs::canonicalize(p).is_ok_and(|c| c == p);
    for (i, f) in files.iter().enumerate() {
        // A dangling link has no identity: it stays, and prep reports it.
        let Ok(m) = std::fs::metadata(&f.path) else {
            continue;
        };
        match chosen.get(&identity(&m)) {
            None => {
                chosen.insert(identity(&m), i);
            }
            Some(&j) => {
                if !direct(&files[j].path) && direct(&f.path) {
                    keep[j] = false;
                    chosen.insert(identity(&m), i);
                } else {
                    keep[i] = false;
                }
            }
        }
    }
    files
        .into_iter()
        .zip(keep)
        .filter_map(|(f, k)| k.then_some(f))
        .collect()
}

impl Walk<'_> {
    fn dir(&mut self, dir: &Path, meta: &std::fs::Metadata, d: &mut Discovery) {
        if dir.starts_with(self.exclude) {
            return;
        }
        let id = identity(meta);
        if Some(id) == self.workspace {
            d.warnings.push(format!(
                "{}: this is the workspace (reached through a link); skipped",
                dir.display()
            ));
            return;
        }
        if !self.visited.insert(id) {
            // A link back to a folder on the path (a loop) or a second way into one: its files
            // are already found once.
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
            // Follow symlinks for the type check, but keep a dangling link as a file so that
            // the user hears about it.
            match std::fs::metadata(&path) {
                Ok(m) if m.is_dir() => self.dir(&path, &m, d),
                _ => {
                    if has_audio_extension(&path) && !path.starts_with(self.exclude) {
                        d.files.push(SourceFile { path });
                    }
                }
            }
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
            &root.join("elsewhere"),
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

    fn names(d: &Discovery, root: &Path) -> Vec<String> {
        d.files
            .iter()
            .map(|f| {
                f.path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }

    #[test]
    fn links_that_loop_or_lead_into_the_workspace_add_nothing() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let (rec, ws) = (dir.path().join("rec"), dir.path().join("ws"));
        for d in ["rec/a", "rec/b", "ws/data/segments"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        for f in [
            "rec/a/1.wav",
            "rec/b/2.wav",
            "rec/3.wav",
            "ws/data/segments/s.wav",
            "ws/r.wav",
        ] {
            std::fs::write(dir.path().join(f), b"x").unwrap();
        }
        let plain = discover(std::slice::from_ref(&rec), &ws, &ws.join("data"));
        assert_eq!(names(&plain, &rec), ["3.wav", "a/1.wav", "b/2.wav"]);
        // Two loops (to the folder itself and to its parent), a second way into a folder, a
        // link to a file, and a link into the workspace.
        symlink(".", rec.join("a/self")).unwrap();
        symlink("..", rec.join("b/up")).unwrap();
        symlink("../a", rec.join("b/a-again")).unwrap();
        symlink("3.wav", rec.join("0-link.wav")).unwrap();
        symlink(&ws, rec.join("ws")).unwrap();
        let linked = discover(std::slice::from_ref(&rec), &ws, &ws.join("data"));
        assert_eq!(names(&linked, &rec), names(&plain, &rec));
        assert_eq!(linked.warnings.len(), 1, "{:?}", linked.warnings);
        assert!(linked.warnings[0].contains("this is the workspace"));
        // The same file named twice, once through a link: once, under its own name.
        let twice = discover(
            &[rec.join("0-link.wav"), rec.join("3.wav")],
            &ws,
            &ws.join("data"),
        );
        assert_eq!(names(&twice, &rec), ["3.wav"]);
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
