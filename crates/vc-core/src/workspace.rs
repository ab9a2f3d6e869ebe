//! The workspace: one directory shared by the chained subcommands (docs/architecture.md §1), and
//! the one place that knows where each artifact lives in it.
//!
//! ```text
//! voiceclone.toml            optional configuration
//! data/segments/*.wav        24 kHz utterances written by `prep`
//! data/train.jsonl           the training manifest
//! data/ref.wav               the reference clip
//! data/speaker.safetensors   its x-vector (`embed`)
//! data/ref/NAME.wav          with named speakers (`prep --speaker NAME`): each one's reference
//! data/speakers/NAME.safetensors   and its x-vector (docs/training.md §3.3)
//! data/prep/sources/*.json   prep's per-source records (what makes re-runs free)
//! data/prep/whisper.json     the Whisper model prep used (for the WER of training's samples)
//! checkpoints/               training state (`train`)
//! .voiceclone-train.lock     held while `train` runs
//! model/                     the exported fine-tuned model (`train`, `export`)
//! serve/voices/ID.safetensors   voices registered with `voiceclone serve` (docs/serving.md §5)
//! ```

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::artifacts::VoiceId;
use crate::hub::ModelSource;

/// File name of the per-workspace configuration.
pub const CONFIG_FILE: &str = "voiceclone.toml";

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

    /// `voiceclone.toml`.
    pub fn config_file(&self) -> PathBuf {
        self.root.join(CONFIG_FILE)
    }

    /// `data/`: everything the data steps write.
    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    pub fn segments_dir(&self) -> PathBuf {
        self.data_dir().join("segments")
    }

    /// One utterance file in `data/segments/`.
    pub fn segment(&self, file_name: &str) -> PathBuf {
        self.segments_dir().join(file_name)
    }

    pub fn manifest(&self) -> PathBuf {
        self.data_dir().join("train.jsonl")
    }

    pub fn ref_wav(&self) -> PathBuf {
        self.data_dir().join("ref.wav")
    }

    /// The x-vector of the reference clip (`voiceclone embed`).
    pub fn speaker_file(&self) -> PathBuf {
        self.data_dir().join("speaker.safetensors")
    }

    /// `data/ref/`: the reference clips of named speakers.
    pub fn ref_dir(&self) -> PathBuf {
        self.data_dir().join("ref")
    }

    /// The reference clip of the named speaker `name` (`data/ref/NAME.wav`). `name` must have
    /// passed [`crate::artifacts::speaker::check_name`].
    pub fn ref_clip(&self, name: &str) -> PathBuf {
        self.ref_dir().join(format!("{name}.wav"))
    }

    /// `data/speakers/`: the x-vectors of named speakers.
    pub fn speakers_dir(&self) -> PathBuf {
        self.data_dir().join("speakers")
    }

    /// The x-vector of the named speaker `name` (`data/speakers/NAME.safetensors`).
    pub fn speaker_file_of(&self, name: &str) -> PathBuf {
        self.speakers_dir()
            .join(crate::artifacts::speaker::file_name(name))
    }

    pub fn prep_records_dir(&self) -> PathBuf {
        self.data_dir().join("prep").join("sources")
    }

    /// The Whisper model `prep` last transcribed with ([`crate::artifacts::prep_whisper`]).
    pub fn prep_whisper(&self) -> PathBuf {
        self.data_dir().join("prep").join("whisper.json")
    }

    /// The prep record of the source with identity `key`.
    pub fn prep_record(&self, key: &str) -> PathBuf {
        self.prep_records_dir().join(format!("{key}.json"))
    }

    /// `checkpoints/`.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.root.join("checkpoints")
    }

    /// Held by the one `voiceclone train` running in this workspace.
    pub fn train_lock(&self) -> PathBuf {
        self.root.join(".voiceclone-train.lock")
    }

    /// `model/`: where the fine-tuned model is exported.
    pub fn model_dir(&self) -> PathBuf {
        self.root.join("model")
    }

    /// `adapter/`: the adapters of a LoRA run exported alone (`export --adapter-only`).
    pub fn adapter_dir(&self) -> PathBuf {
        self.root.join("adapter")
    }

    /// `serve/voices/`: the voices registered through `voiceclone serve`.
    pub fn serve_voices_dir(&self) -> PathBuf {
        self.root.join("serve").join("voices")
    }

    /// The file of registered voice `id` (its type guarantees a name safe in a path).
    pub fn serve_voice_file(&self, id: &VoiceId) -> PathBuf {
        self.serve_voices_dir().join(format!("{id}.safetensors"))
    }

    /// A workspace path as written into manifests: relative to the root, `/`-separated.
    pub fn relative(&self, path: &Path) -> String {
        crate::fsutil::display_relative(path, &self.root)
    }

    /// A path for messages: workspace-relative when it lies inside the workspace.
    pub fn display(&self, path: &Path) -> String {
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        if abs.starts_with(&self.root) {
            self.relative(&abs)
        } else {
            path.display().to_string()
        }
    }

    /// Resolves a manifest path (relative to the root, or absolute).
    pub fn resolve(&self, manifest_path: &str) -> PathBuf {
        self.root.join(manifest_path)
    }

    /// A path from a configuration file: relative paths are relative to the workspace.
    pub fn config_path(&self, value: &str) -> PathBuf {
        let p = Path::new(value);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.root.join(p)
        }
    }

    /// A model named by the configuration: a directory relative to the workspace when one
    /// exists there, otherwise an absolute path or a hub repository id.
    pub fn model_source(&self, spec: &str) -> Result<ModelSource> {
        let local = self.config_path(spec);
        if local.exists() {
            Ok(ModelSource::Local(local))
        } else {
            ModelSource::parse(spec)
                .with_context(|| format!("{spec:?} does not name a usable model"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_model_sources() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open(dir.path()).unwrap();
        let root = ws.root().to_path_buf();
        assert_eq!(ws.manifest(), root.join("data/train.jsonl"));
        assert_eq!(ws.speaker_file(), root.join("data/speaker.safetensors"));
        assert_eq!(ws.ref_clip("Bob"), root.join("data/ref/Bob.wav"));
        assert_eq!(
            ws.speaker_file_of("Bob"),
            root.join("data/speakers/Bob.safetensors")
        );
        assert_eq!(ws.prep_record("ab"), root.join("data/prep/sources/ab.json"));
        assert_eq!(ws.prep_whisper(), root.join("data/prep/whisper.json"));
        assert_eq!(
            ws.serve_voice_file(&VoiceId::parse("voice_0123456789abcdef0123").unwrap()),
            root.join("serve/voices/voice_0123456789abcdef0123.safetensors")
        );
        assert_eq!(ws.relative(&ws.segment("x.wav")), "data/segments/x.wav");
        assert_eq!(ws.display(&ws.model_dir()), "model");
        assert_eq!(ws.display(Path::new("/elsewhere/f")), "/elsewhere/f");
        assert_eq!(ws.config_path("/abs"), PathBuf::from("/abs"));
        std::fs::create_dir(root.join("local-model")).unwrap();
        assert!(matches!(
            ws.model_source("local-model").unwrap(),
            ModelSource::Local(_)
        ));
        assert!(matches!(
            ws.model_source("Qwen/Qwen3-TTS-12Hz-0.6B-Base").unwrap(),
            ModelSource::Hub { .. }
        ));
        assert!(Workspace::open(&root.join("missing")).is_err());
    }
}
