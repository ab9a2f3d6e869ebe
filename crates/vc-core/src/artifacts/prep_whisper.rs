//! The Whisper model `prep` transcribed the manifest with (`data/prep/whisper.json`): written by
//! `prep` after every successful run, read when `train` evaluates (the `vc-eval` crate) so that the samples' WER is measured by
//! the same model when the configuration names none (docs/training.md §14.4).

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::fsutil::write_atomic;

/// What `prep` used, as it resolved it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrepWhisper {
    /// An absolute path to a ggml file, or a hub reference `owner/repo/file`.
    pub model: String,
}

/// The record at `path`; `None` when there is none (a workspace `prep` never ran in, or one
/// from before the record existed). A file that cannot be read or parsed is an error naming it.
pub fn read(path: &Path) -> Result<Option<PrepWhisper>> {
    if !path.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).map(Some).with_context(|| {
        format!(
            "{} is not a valid record of prep's Whisper model",
            path.display()
        )
    })
}

/// Writes the record atomically; an identical record is left untouched, so that a re-run of
/// `prep` that changes nothing writes nothing.
pub fn write(path: &Path, record: &PrepWhisper) -> Result<()> {
    if read(path).ok().flatten().as_ref() == Some(record) {
        return Ok(());
    }
    let text = serde_json::to_string_pretty(record)? + "\n";
    write_atomic(path, text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_an_unchanged_record_is_not_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data/prep/whisper.json");
        assert_eq!(read(&path).unwrap(), None);
        let record = PrepWhisper {
            model: "/models/ggml-tiny.en.bin".into(),
        };
        write(&path, &record).unwrap();
        assert_eq!(read(&path).unwrap(), Some(record.clone()));
        let before = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        write(&path, &record).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().modified().unwrap(),
            before
        );
        std::fs::write(&path, "{oops").unwrap();
        let e = format!("{:#}", read(&path).unwrap_err());
        assert!(e.contains("whisper.json"), "{e}");
    }
}
