//! The training manifest (`data/train.jsonl`, spec §10.1) as training samples: every line's
//! transcript tokenized the way the official `TTSDataset` does it and its `audio_codes` checked.
//! Bad lines are errors that name the file and the line.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::model::text::TextTokenizer;

/// Codebooks per frame in the manifest format.
pub const CODE_GROUPS: usize = 16;

/// One utterance, ready for the batch layout (spec §10.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// 1-based line number in the manifest.
    pub line: usize,
    /// `tokenize(_build_assistant_text(text))[:-5]`: the 3 role ids then the text ids (L = 3 + Lt).
    pub text_ids: Vec<u32>,
    /// `(T, 16)` codes, frame-major.
    pub codes: Vec<[u32; CODE_GROUPS]>,
}

impl Sample {
    /// Number of text tokens `Lt`.
    pub fn text_len(&self) -> usize {
        self.text_ids.len() - 3
    }

    pub fn frames(&self) -> usize {
        self.codes.len()
    }

    /// Sequence length of the sample in the batch layout, `8 + L + T` (spec §10.2).
    pub fn seq_len(&self) -> usize {
        8 + self.text_ids.len() + self.codes.len()
    }
}

/// Every sample of a manifest, and a digest of their content (to notice changed data on resume).
#[derive(Debug, Clone)]
pub struct Dataset {
    pub manifest: PathBuf,
    pub samples: Vec<Sample>,
    pub digest: String,
}

impl Dataset {
    pub fn frames(&self) -> usize {
        self.samples.iter().map(Sample::frames).sum()
    }
}

/// A manifest row that cannot be trained on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    pub line: usize,
    pub why: String,
}

/// Line numbers (1-based) of rows that are JSON objects without an `audio_codes` field: what
/// `voiceclone codes` would fill in.
pub fn lines_without_codes(manifest: &Path) -> Result<Vec<usize>> {
    let text = std::fs::read_to_string(manifest)
        .with_context(|| format!("cannot read manifest {}", manifest.display()))?;
    Ok(text
        .lines()
        .enumerate()
        .filter_map(|(i, l)| {
            let v: Value = serde_json::from_str(l).ok()?;
            let row = v.as_object()?;
            (!row.contains_key("audio_codes")).then_some(i + 1)
        })
        .collect())
}

/// The first row's `ref_audio` (resolved against `base`), for computing the speaker embedding
/// the way the official recipe does (the x-vector of the first sample's reference clip).
pub fn first_ref_audio(manifest: &Path, base: &Path) -> Result<Option<(usize, PathBuf)>> {
    let text = std::fs::read_to_string(manifest)
        .with_context(|| format!("cannot read manifest {}", manifest.display()))?;
    for (i, l) in text.lines().enumerate() {
        if let Ok(Value::Object(row)) = serde_json::from_str::<Value>(l) {
            if let Some(r) = row.get("ref_audio").and_then(Value::as_str) {
                return Ok(Some((i + 1, base.join(r))));
            }
        }
    }
    Ok(None)
}

/// Reads and checks every line of `manifest`. `base` resolves relative audio paths (only used
/// to explain a missing `audio_codes`); `codebook_size` bounds the codes (2048).
pub fn load(
    manifest: &Path,
    base: &Path,
    tokenizer: &TextTokenizer,
    codebook_size: u32,
) -> Result<Dataset> {
    let text = std::fs::read_to_string(manifest)
        .with_context(|| format!("cannot read manifest {}", manifest.display()))?;
    let mut samples = Vec::new();
    let mut bad = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse_row(i + 1, line, base, tokenizer, codebook_size) {
            Ok(s) => samples.push(s),
            Err(why) => bad.push(BadLine { line: i + 1, why }),
        }
    }
    if !bad.is_empty() {
        const SHOWN: usize = 10;
        let mut msg = format!(
            "{} line(s) of {} cannot be used for training:",
            bad.len(),
            manifest.display()
        );
        for b in bad.iter().take(SHOWN) {
            msg.push_str(&format!("\n  {}:{}: {}", manifest.display(), b.line, b.why));
        }
        if bad.len() > SHOWN {
            msg.push_str(&format!("\n  … and {} more", bad.len() - SHOWN));
        }
        msg.push_str(
            "\nFix or remove these lines (or re-run `voiceclone prep` / `voiceclone codes`).",
        );
        bail!(msg);
    }
    if samples.is_empty() {
        bail!(
            "manifest {} has no utterances; run `voiceclone prep` on your recordings first",
            manifest.display()
        );
    }
    let digest = digest(&samples);
    Ok(Dataset {
        manifest: manifest.to_path_buf(),
        samples,
        digest,
    })
}

fn parse_row(
    line: usize,
    text: &str,
    base: &Path,
    tokenizer: &TextTokenizer,
    codebook_size: u32,
) -> std::result::Result<Sample, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON ({e})"))?;
    let row = value.as_object().ok_or("not a JSON object")?;
    let transcript = row
        .get("text")
        .and_then(Value::as_str)
        .ok_or("no \"text\" field (the transcript)")?;
    if transcript.trim().is_empty() {
        return Err("the transcript (\"text\") is empty".into());
    }
    let Some(codes) = row.get("audio_codes") else {
        let audio = row.get("audio").and_then(Value::as_str);
        return Err(match audio {
            None => "no \"audio_codes\" and no \"audio\" field to compute them from".into(),
            Some(a) if !base.join(a).is_file() => format!(
                "no \"audio_codes\": its audio file {} does not exist",
                base.join(a).display()
            ),
            Some(_) => {
                "no \"audio_codes\" (`voiceclone codes` could not encode its audio; see its report)"
                    .into()
            }
        });
    };
    let codes = parse_codes(codes, codebook_size)?;
    let prompt = tokenizer
        .assistant_prompt(transcript)
        .map_err(|e| format!("cannot tokenize the transcript: {e:#}"))?;
    // `[:, :-5]` of the assistant prompt: role (3 ids) + text ids (spec §10.1).
    let text_ids = prompt.ids[..prompt.ids.len() - 5].to_vec();
    Ok(Sample {
        line,
        text_ids,
        codes,
    })
}

/// `[[16 ints], ...]` with every code below `codebook_size`; errors say which frame is wrong.
fn parse_codes(
    value: &Value,
    codebook_size: u32,
) -> std::result::Result<Vec<[u32; CODE_GROUPS]>, String> {
    let frames = value
        .as_array()
        .ok_or("\"audio_codes\" is not a list of frames")?;
    if frames.is_empty() {
        return Err("\"audio_codes\" has no frames".into());
    }
    frames
        .iter()
        .enumerate()
        .map(|(k, f)| {
            let items = f
                .as_array()
                .ok_or_else(|| format!("\"audio_codes\" frame {k} is not a list of codes"))?;
            if items.len() != CODE_GROUPS {
                return Err(format!(
                    "\"audio_codes\" frame {k} has {} codes, expected {CODE_GROUPS} (shape must be T x {CODE_GROUPS})",
                    items.len()
                ));
            }
            let mut out = [0u32; CODE_GROUPS];
            for (o, v) in out.iter_mut().zip(items) {
                *o = v
                    .as_u64()
                    .and_then(|c| u32::try_from(c).ok())
                    .filter(|&c| c < codebook_size)
                    .ok_or_else(|| {
                        format!(
                            "\"audio_codes\" frame {k} has code {v}, expected an integer in 0..{codebook_size}"
                        )
                    })?;
            }
            Ok(out)
        })
        .collect()
}

fn digest(samples: &[Sample]) -> String {
    let mut h = Sha256::new();
    for s in samples {
        h.update((s.text_ids.len() as u64).to_le_bytes());
        for id in &s.text_ids {
            h.update(id.to_le_bytes());
        }
        h.update((s.codes.len() as u64).to_le_bytes());
        for f in &s.codes {
            for c in f {
                h.update(c.to_le_bytes());
            }
        }
    }
    format!("{:x}", h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_shape_errors_name_the_frame() {
        let v: Value = serde_json::from_str("[[1,2,3]]").unwrap();
        assert!(parse_codes(&v, 2048)
            .unwrap_err()
            .contains("frame 0 has 3 codes"));
        let mut f = vec![0u32; 16];
        f[5] = 2048;
        let v: Value = serde_json::json!([vec![0u32; 16], f]);
        let e = parse_codes(&v, 2048).unwrap_err();
        assert!(e.contains("frame 1") && e.contains("2048"), "{e}");
        let v: Value = serde_json::json!([]);
        assert!(parse_codes(&v, 2048).unwrap_err().contains("no frames"));
        let v: Value = serde_json::json!([vec![7u32; 16]]);
        assert_eq!(parse_codes(&v, 2048).unwrap(), vec![[7u32; 16]]);
    }
}
