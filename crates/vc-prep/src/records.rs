//! Prep's per-source records (`data/prep/sources/*.json`): what a re-run needs to skip a
//! recording, and the utterances it produced, from which the manifest rows are rebuilt.

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use vc_core::artifacts::manifest::ManifestRow;
use vc_core::fsutil::write_atomic;

/// What prep remembers about one source recording, so a re-run can skip it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SourceRecord {
    /// Digest of the source's identity and of the prep settings that shaped its output.
    pub key: String,
    pub source: String,
    /// Length of the recording, seconds.
    pub duration: f64,
    /// Digest of the decoded audio (`super::duplicates`): the same digest, the same recording.
    #[serde(default)]
    pub audio_sha256: String,
    pub utterances: Vec<UtteranceRecord>,
    /// Seconds of the recording not kept, by reason (display names, `super::accounting`): with
    /// the utterances' durations they add up to `duration`.
    pub dropped: Vec<(String, f64)>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct UtteranceRecord {
    pub audio: String,
    pub text: String,
    pub duration: f64,
    pub start: f64,
    pub end: f64,
    pub language: String,
    pub no_speech_prob: f64,
}

impl UtteranceRecord {
    pub fn to_row(&self, source: &str, ref_audio: &str) -> ManifestRow {
        ManifestRow {
            audio: Some(self.audio.clone()),
            text: Some(self.text.clone()),
            ref_audio: Some(ref_audio.to_string()),
            duration: Some(self.duration),
            source: Some(source.to_string()),
            start: Some(self.start),
            end: Some(self.end),
            language: Some(self.language.clone()),
            ..ManifestRow::default()
        }
    }
}

/// Rounds seconds to the millisecond, so manifests are stable and readable.
pub fn round_ms(seconds: f64) -> f64 {
    (seconds * 1000.0).round() / 1000.0
}

pub fn read_record(path: &Path) -> Result<SourceRecord> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid prep record", path.display()))
}

pub fn write_record(path: &Path, record: &SourceRecord) -> Result<()> {
    write_atomic(path, serde_json::to_string_pretty(record)?.as_bytes())
        .with_context(|| format!("cannot write the prep record {}", path.display()))
}
