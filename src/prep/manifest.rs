//! The training manifest (`data/train.jsonl`) and prep's per-source records.
//!
//! A manifest line carries the official fine-tuning fields (`audio`, `text`, `ref_audio`) plus
//! where the utterance came from. Later steps add fields (e.g. `audio_codes`) and keep unknown
//! ones, so rows are read as JSON objects there; here prep writes its own rows.

use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::fsutil::write_atomic;

/// One line of `data/train.jsonl` as written by `prep`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ManifestRow {
    /// Utterance WAV, relative to the workspace.
    pub audio: String,
    pub text: String,
    /// Reference clip (the same for every line), relative to the workspace.
    pub ref_audio: String,
    /// Seconds.
    pub duration: f64,
    /// The recording the utterance was cut from.
    pub source: String,
    /// Span within the source, seconds.
    pub start: f64,
    pub end: f64,
    /// Whisper's language name, e.g. "english".
    pub language: String,
}

/// What prep remembers about one source recording, so a re-run can skip it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SourceRecord {
    /// Digest of the source's identity and of the prep settings that shaped its output.
    pub key: String,
    pub source: String,
    /// Length of the recording, seconds.
    pub duration: f64,
    pub utterances: Vec<UtteranceRecord>,
    /// Seconds of transcribed audio dropped, by reason (display names).
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
            audio: self.audio.clone(),
            text: self.text.clone(),
            ref_audio: ref_audio.to_string(),
            duration: self.duration,
            source: source.to_string(),
            start: self.start,
            end: self.end,
            language: self.language.clone(),
        }
    }
}

/// Rounds seconds to the millisecond, so manifests are stable and readable.
pub fn round_ms(seconds: f64) -> f64 {
    (seconds * 1000.0).round() / 1000.0
}

/// Serialises rows as JSON Lines.
pub fn to_jsonl(rows: &[ManifestRow]) -> Result<String> {
    let mut out = String::new();
    for row in rows {
        out.push_str(&serde_json::to_string(row)?);
        out.push('\n');
    }
    Ok(out)
}

/// Writes the manifest atomically.
pub fn write_manifest(path: &Path, rows: &[ManifestRow]) -> Result<()> {
    write_atomic(path, to_jsonl(rows)?.as_bytes())
}

/// Reads a prep manifest; errors name the file and line.
pub fn read_manifest(path: &Path) -> Result<Vec<ManifestRow>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("cannot read {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let row = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a valid manifest line", path.display(), i + 1))?;
        rows.push(row);
    }
    Ok(rows)
}

pub fn read_record(path: &Path) -> Result<SourceRecord> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid prep record", path.display()))
}

pub fn write_record(path: &Path, record: &SourceRecord) -> Result<()> {
    write_atomic(path, serde_json::to_string_pretty(record)?.as_bytes())
}
