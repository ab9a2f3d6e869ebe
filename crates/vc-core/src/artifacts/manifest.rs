//! The training manifest, `data/train.jsonl`: one JSON object per utterance
//! (docs/model.md §10.1). `prep` writes the rows, `codes` adds `audio_codes`, `train` reads them;
//! the official recipe's own files (`audio`, `text`, `ref_audio`, `audio_codes` only) are valid
//! manifests too.
//!
//! A row is typed: the known fields, then every other field in [`ManifestRow::extra`], kept in
//! its order, so a step that rewrites the file never drops what another tool added. Lines that
//! are not JSON objects are kept verbatim by [`Manifest`] and reported with their line number.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use super::codes::{check_range, frames_from_json, CodeFrame};
use super::speaker;
use crate::fsutil::write_atomic;

/// One utterance. Field order is the order written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ManifestRow {
    /// Utterance audio, relative to the workspace (or absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<String>,
    /// The transcript.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Reference clip of the speaker, relative to the workspace (or absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ref_audio: Option<String>,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<f64>,
    /// The recording the utterance was cut from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Span within the source, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<f64>,
    /// Whisper's language name, e.g. "english".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    /// The utterance's speaker in a multi-speaker workspace (`voiceclone prep --speaker NAME`,
    /// docs/training.md §3.3); absent when the workspace holds one unnamed speaker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speaker: Option<String>,
    /// Every other field, in file order (written before `audio_codes`, so that the step that
    /// adds codes appends them after everything a row already had).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    /// The speech tokenizer's codes of `audio`, T frames × 16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio_codes: Option<AudioCodes>,
}

/// The `audio_codes` value of a row: frames, or a value that is not `[[16 ints], ...]`, which
/// is kept verbatim (and rewritten unchanged) together with what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub enum AudioCodes {
    Frames(Vec<CodeFrame>),
    Invalid { value: Value, why: String },
}

impl AudioCodes {
    /// The frames when the value is valid and not empty.
    pub fn frames(&self) -> Option<&[CodeFrame]> {
        match self {
            AudioCodes::Frames(f) if !f.is_empty() => Some(f),
            _ => None,
        }
    }

    /// The frames when they can be trained on — at least one, each of 16 codes, every code in
    /// `0..codebook_size` — or what is wrong with them. The one check of stored codes: `codes`
    /// recomputes what fails it, `train` refuses it (docs/training.md §3.1).
    pub fn checked(&self, codebook_size: u32) -> std::result::Result<&[CodeFrame], String> {
        match self {
            AudioCodes::Invalid { why, .. } => Err(why.clone()),
            AudioCodes::Frames(f) if f.is_empty() => Err("has no frames".into()),
            AudioCodes::Frames(f) => check_range(f, codebook_size).map(|()| f.as_slice()),
        }
    }
}

impl Serialize for AudioCodes {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            AudioCodes::Frames(f) => f.serialize(s),
            AudioCodes::Invalid { value, .. } => value.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for AudioCodes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        Ok(match frames_from_json(&value) {
            Ok(frames) => AudioCodes::Frames(frames),
            Err(why) => AudioCodes::Invalid { value, why },
        })
    }
}

impl ManifestRow {
    /// The valid, non-empty codes of the row.
    pub fn frames(&self) -> Option<&[CodeFrame]> {
        self.audio_codes.as_ref().and_then(AudioCodes::frames)
    }
}

/// One line of a manifest file as read.
#[derive(Debug, Clone, PartialEq)]
pub enum ManifestLine {
    /// An empty or whitespace-only line (kept as it was).
    Blank(String),
    /// A line that is not a JSON object with fields of the known types (kept as it was).
    Broken {
        text: String,
        why: String,
    },
    Row(Box<ManifestRow>),
}

/// A whole manifest file, line by line, so that rewriting it keeps every line it cannot parse.
#[derive(Debug, Clone)]
pub struct Manifest {
    pub path: PathBuf,
    pub lines: Vec<ManifestLine>,
}

impl ManifestLine {
    pub fn parse(text: &str) -> Self {
        if text.trim().is_empty() {
            return ManifestLine::Blank(text.to_string());
        }
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(_)) => match serde_json::from_str::<ManifestRow>(text) {
                Ok(row) => ManifestLine::Row(Box::new(row)),
                Err(e) => ManifestLine::Broken {
                    text: text.to_string(),
                    why: format!("a field has the wrong type ({e})"),
                },
            },
            Ok(_) => ManifestLine::Broken {
                text: text.to_string(),
                why: "not a valid JSON object".into(),
            },
            Err(e) => ManifestLine::Broken {
                text: text.to_string(),
                why: format!("not a valid JSON object ({e})"),
            },
        }
    }
}

impl Manifest {
    /// Reads every line of `path`; only I/O fails here (bad lines are [`ManifestLine::Broken`]).
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read manifest {}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            lines: text.lines().map(ManifestLine::parse).collect(),
        })
    }

    /// The rows with their 1-based line numbers.
    pub fn rows(&self) -> impl Iterator<Item = (usize, &ManifestRow)> {
        self.lines.iter().enumerate().filter_map(|(i, l)| match l {
            ManifestLine::Row(r) => Some((i + 1, r.as_ref())),
            _ => None,
        })
    }

    /// The broken lines with their 1-based line numbers and what is wrong.
    pub fn broken(&self) -> impl Iterator<Item = (usize, &str)> {
        self.lines.iter().enumerate().filter_map(|(i, l)| match l {
            ManifestLine::Broken { why, .. } => Some((i + 1, why.as_str())),
            _ => None,
        })
    }

    /// The speakers the rows name, in the order of the exported model's rows: sorted by their
    /// lower-cased name (docs/training.md §3.3). Empty for a single-speaker manifest.
    pub fn speakers(&self) -> Vec<String> {
        let mut names: Vec<String> = self.rows().filter_map(|(_, r)| r.speaker.clone()).collect();
        names.sort_by(|a, b| {
            speaker::name_key(a)
                .cmp(&speaker::name_key(b))
                .then_with(|| a.cmp(b))
        });
        names.dedup();
        names
    }

    /// Every row that breaks the rules of a multi-speaker manifest (docs/training.md §3.3), with
    /// its line number: a row without `speaker` when other rows name one, an invalid name, a name
    /// that differs from an earlier line's only in case. Empty for a single-speaker manifest.
    pub fn speaker_problems(&self) -> Vec<(usize, String)> {
        let named: Vec<String> = self.speakers();
        if named.is_empty() {
            return Vec::new();
        }
        let mut first: std::collections::HashMap<String, (usize, &str)> = Default::default();
        let mut problems = Vec::new();
        for (line, row) in self.rows() {
            let Some(name) = row.speaker.as_deref() else {
                problems.push((
                    line,
                    format!(
                        "no \"speaker\" field, but other lines name speakers ({}): every line \
                         of a multi-speaker manifest names its speaker",
                        named.join(", ")
                    ),
                ));
                continue;
            };
            if let Err(why) = speaker::check_name(name) {
                problems.push((line, why));
                continue;
            }
            match first.get(&speaker::name_key(name)) {
                Some((l, other)) if *other != name => problems.push((
                    line,
                    format!(
                        "the speaker {name:?} differs from {other:?} (line {l}) only in case; \
                         speaker names are compared case-insensitively"
                    ),
                )),
                Some(_) => {}
                None => {
                    first.insert(speaker::name_key(name), (line, name));
                }
            }
        }
        problems
    }

    /// The file content: rows serialised, other lines as they were read.
    pub fn to_jsonl(&self) -> Result<String> {
        let mut out = String::new();
        for line in &self.lines {
            match line {
                ManifestLine::Blank(t) | ManifestLine::Broken { text: t, .. } => out.push_str(t),
                ManifestLine::Row(row) => out.push_str(&serde_json::to_string(row)?),
            }
            out.push('\n');
        }
        Ok(out)
    }

    /// Writes the manifest atomically to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        write_atomic(path, self.to_jsonl()?.as_bytes())
            .with_context(|| format!("cannot write manifest {}", path.display()))
    }
}

/// Writes `rows` as a manifest, atomically.
pub fn write_rows(path: &Path, rows: &[ManifestRow]) -> Result<()> {
    Manifest {
        path: path.to_path_buf(),
        lines: rows
            .iter()
            .map(|r| ManifestLine::Row(Box::new(r.clone())))
            .collect(),
    }
    .write(path)
}

/// Every row of `path`; the first line that is not a row is an error naming file and line.
pub fn read_rows(path: &Path) -> Result<Vec<ManifestRow>> {
    let m = Manifest::read(path)?;
    if let Some((line, why)) = m.broken().next() {
        anyhow::bail!(
            "{}:{line}: not a valid manifest line: {why}",
            path.display()
        );
    }
    Ok(m.rows().map(|(_, r)| r.clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_keep_unknown_fields_in_order_and_bad_lines_verbatim() {
        let text = concat!(
            "{\"audio\":\"a.wav\",\"text\":\"hi\",\"zeta\":1,\"alpha\":[true]}\n",
            "\n",
            "not json\n",
            "[1,2]\n",
            "{\"audio\":\"b.wav\",\"duration\":\"long\"}\n",
            "{\"audio\":\"c.wav\",\"audio_codes\":[[1,2]]}\n",
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        std::fs::write(&path, text).unwrap();
        let m = Manifest::read(&path).unwrap();
        let rows: Vec<_> = m.rows().collect();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].0, 1);
        let keys: Vec<_> = rows[0].1.extra.keys().cloned().collect();
        assert_eq!(keys, ["zeta", "alpha"]);
        let broken: Vec<_> = m.broken().map(|(l, _)| l).collect();
        assert_eq!(broken, [3, 4, 5]);
        let (_, c) = rows[1];
        assert!(c.frames().is_none());
        match &c.audio_codes {
            Some(AudioCodes::Invalid { why, .. }) => assert!(why.contains("frame 0 has 2 codes")),
            other => panic!("{other:?}"),
        }
        // Nothing changed: the file is rewritten byte for byte.
        assert_eq!(m.to_jsonl().unwrap(), text);
    }

    #[test]
    fn codes_are_checked_for_shape_emptiness_and_range_in_one_place() {
        let codes = |json: &str| match ManifestLine::parse(&format!("{{\"audio_codes\":{json}}}")) {
            ManifestLine::Row(r) => r.audio_codes.unwrap(),
            other => panic!("{other:?}"),
        };
        let ok = codes(&serde_json::json!([vec![2047; 16]]).to_string());
        assert_eq!(ok.checked(2048).unwrap().len(), 1);
        for (json, why) in [
            ("[[1,2,3]]".to_string(), "frame 0 has 3 codes"),
            (
                serde_json::json!([vec![-1; 16]]).to_string(),
                "frame 0 has code -1",
            ),
            ("[]".to_string(), "has no frames"),
            (
                serde_json::json!([vec![0; 16], vec![99999; 16]]).to_string(),
                "frame 1 has code 99999, expected an integer in 0..2048",
            ),
        ] {
            let e = codes(&json).checked(2048).unwrap_err();
            assert!(e.contains(why), "{json}: {e}");
        }
    }

    #[test]
    fn known_fields_are_written_first_in_a_fixed_order() {
        let row = ManifestRow {
            audio: Some("segments/x.wav".into()),
            text: Some("Hello.".into()),
            ref_audio: Some("data/ref.wav".into()),
            duration: Some(1.5),
            source: Some("rec.flac".into()),
            start: Some(0.25),
            end: Some(1.75),
            language: Some("english".into()),
            speaker: Some("Alice".into()),
            extra: Map::from_iter([("note".to_string(), Value::from("kept"))]),
            audio_codes: Some(AudioCodes::Frames(vec![CodeFrame([0; 16])])),
        };
        let s = serde_json::to_string(&row).unwrap();
        assert!(s.starts_with(
            "{\"audio\":\"segments/x.wav\",\"text\":\"Hello.\",\"ref_audio\":\"data/ref.wav\",\
             \"duration\":1.5,\"source\":\"rec.flac\",\"start\":0.25,\"end\":1.75,\
             \"language\":\"english\",\"speaker\":\"Alice\",\"note\":\"kept\",\"audio_codes\":[[0,"
        ));
        assert_eq!(serde_json::from_str::<ManifestRow>(&s).unwrap(), row);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        write_rows(&path, std::slice::from_ref(&row)).unwrap();
        assert_eq!(read_rows(&path).unwrap(), vec![row]);
        std::fs::write(&path, "{}\n{oops\n").unwrap();
        let e = read_rows(&path).unwrap_err().to_string();
        assert!(e.contains("m.jsonl:2: not a valid manifest line"), "{e}");
    }

    #[test]
    fn speakers_are_sorted_case_insensitively_and_problems_named_by_line() {
        let m = |text: &str| Manifest {
            path: "m.jsonl".into(),
            lines: text.lines().map(ManifestLine::parse).collect(),
        };
        // Single speaker: no speakers, no problems; the row has no "speaker" key.
        let single = m("{\"audio\":\"a.wav\"}\n{\"audio\":\"b.wav\"}");
        assert!(single.speakers().is_empty() && single.speaker_problems().is_empty());
        assert_eq!(
            single.to_jsonl().unwrap(),
            "{\"audio\":\"a.wav\"}\n{\"audio\":\"b.wav\"}\n"
        );
        let multi = m(concat!(
            "{\"speaker\":\"bob\"}\n",
            "{\"speaker\":\"Alice\"}\n",
            "{\"speaker\":\"bob\"}\n",
            "{\"speaker\":\"carol\"}"
        ));
        assert_eq!(multi.speakers(), ["Alice", "bob", "carol"]);
        assert!(multi.speaker_problems().is_empty());
        let bad = m(concat!(
            "{\"speaker\":\"bob\"}\n",
            "{\"audio\":\"x.wav\"}\n",
            "{\"speaker\":\"a/b\"}\n",
            "{\"speaker\":\"Bob\"}"
        ));
        let p = bad.speaker_problems();
        assert_eq!(p.iter().map(|(l, _)| *l).collect::<Vec<_>>(), [2, 3, 4]);
        assert!(p[0].1.contains("no \"speaker\" field"), "{}", p[0].1);
        assert!(p[1].1.contains("path separator"), "{}", p[1].1);
        assert!(
            p[2].1
                .contains("\"Bob\" differs from \"bob\" (line 1) only in case"),
            "{}",
            p[2].1
        );
    }
}
