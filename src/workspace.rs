//! The workspace: one directory shared by the chained subcommands (DESIGN §1).
//!
//! ```text
//! voiceclone.toml        optional configuration
//! data/segments/*.wav    24 kHz utterances written by `prep`
//! data/train.jsonl       the training manifest
//! data/ref.wav           the reference clip
//! data/prep/             prep's per-source records (what makes re-runs free)
//! ```

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
}

impl Workspace {
    /// Opens (without creating anything) the workspace at `root`, which must be a directory.
    pub fn open(root: &Path) -> Result<Self> {
        let root = root
            .canonicalize()
            .with_context(|| format!("workspace directory {} does not exist", root.display()))?;
        anyhow::ensure!(
            root.is_dir(),
            "workspace {} is not a directory",
            root.display()
        );
        Ok(Workspace { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    pub fn segments_dir(&self) -> PathBuf {
        self.data_dir().join("segments")
    }

    pub fn manifest(&self) -> PathBuf {
        self.data_dir().join("train.jsonl")
    }

    pub fn ref_wav(&self) -> PathBuf {
        self.data_dir().join("ref.wav")
    }

    pub fn prep_records_dir(&self) -> PathBuf {
        self.data_dir().join("prep").join("sources")
    }

    /// A workspace path as written into manifests: relative to the root, `/`-separated.
    pub fn relative(&self, path: &Path) -> String {
        crate::fsutil::display_relative(path, &self.root)
    }

    /// Resolves a manifest path (relative to the root, or absolute).
    pub fn resolve(&self, manifest_path: &str) -> PathBuf {
        self.root.join(manifest_path)
    }
}
