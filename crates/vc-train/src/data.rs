//! The training manifest (`data/train.jsonl`, docs/model.md §10.1) as training samples: every
//! line's transcript tokenized the way the official `TTSDataset` does it and its `audio_codes`
//! checked. Bad lines are errors that name the file and the line.
//!
//! A manifest whose lines name their `speaker` (docs/training.md §3.3) gives every sample the
//! index of its speaker in [`Dataset::speakers`] (sorted by lower-cased name, the order of the
//! export's rows); the speaker table `(S, H)` of their x-vectors is [`speaker_table`]'s.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};

use vc_core::artifacts::codes::CodeFrame;
use vc_core::artifacts::manifest::{Manifest, ManifestRow};
use vc_model::text::TextTokenizer;

/// One utterance, ready for the batch layout (docs/model.md §10.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// 1-based line number in the manifest.
    pub line: usize,
    /// `tokenize(_build_assistant_text(text))[:-5]`: the 3 role ids then the text ids (L = 3 + Lt).
    pub text_ids: Vec<u32>,
    /// `(T, 16)` codes, frame-major.
    pub codes: Vec<CodeFrame>,
    /// Index of the sample's speaker in [`Dataset::speakers`] (0 with one unnamed speaker): the
    /// row of the speaker table whose x-vector goes to the sample's position 6.
    pub speaker: usize,
}

impl Sample {
    /// Number of text tokens `Lt`.
    pub fn text_len(&self) -> usize {
        self.text_ids.len() - 3
    }

    pub fn frames(&self) -> usize {
        self.codes.len()
    }

    /// Sequence length of the sample in the batch layout, `8 + L + T` (docs/model.md §10.2).
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
    /// The named speakers, sorted by lower-cased name; empty when the manifest names none
    /// (one unnamed speaker, whose x-vector is `data/speaker.safetensors`).
    pub speakers: Vec<String>,
}

impl Dataset {
    pub fn frames(&self) -> usize {
        self.samples.iter().map(Sample::frames).sum()
    }

    /// Every sample's sequence length in the batch layout (what the sampler buckets by).
    pub fn lengths(&self) -> Vec<usize> {
        self.samples.iter().map(Sample::seq_len).collect()
    }

    /// Number of speakers (1 for an unnamed speaker).
    pub fn speaker_count(&self) -> usize {
        self.speakers.len().max(1)
    }

    /// The samples whose index `keep` accepts, in order, with their digest; the speaker list
    /// (and so every sample's speaker index) is kept.
    pub fn subset(&self, keep: impl Fn(usize) -> bool) -> Dataset {
        let samples: Vec<Sample> = self
            .samples
            .iter()
            .enumerate()
            .filter(|(i, _)| keep(*i))
            .map(|(_, s)| s.clone())
            .collect();
        Dataset {
            manifest: self.manifest.clone(),
            digest: digest(&samples, &self.speakers),
            samples,
            speakers: self.speakers.clone(),
        }
    }

    /// The per-sample speaker indices the sampler balances over (`train.speaker_balance`,
    /// docs/training.md §4), or `None` when there is nothing to balance (off, or one speaker).
    pub fn balance_groups(&self, speaker_balance: bool) -> Option<Vec<usize>> {
        (speaker_balance && self.speakers.len() > 1)
            .then(|| self.samples.iter().map(|s| s.speaker).collect())
    }
}

/// The speaker table `(S, H)` (f32, on `device`) whose row `s` is the x-vector of
/// `dataset.speakers[s]`: with one unnamed speaker the file `speaker` (`data/speaker.safetensors`)
/// as one row; with named speakers `speaker` is the directory of their files
/// (`data/speakers/`, one `NAME.safetensors` each).
pub fn speaker_table(
    speaker: &Path,
    dataset: &Dataset,
    hidden: usize,
    device: &Device,
) -> Result<Tensor> {
    if dataset.speakers.is_empty() {
        return Ok(crate::load_speaker(speaker, hidden, device)?.unsqueeze(0)?);
    }
    let rows = vc_core::artifacts::speaker::read_set(speaker, &dataset.speakers, hidden)?;
    let flat: Vec<f32> = rows.concat();
    Ok(Tensor::from_vec(flat, (rows.len(), hidden), device)?)
}

/// A manifest row that cannot be trained on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    pub line: usize,
    pub why: String,
}

/// Line numbers (1-based) of rows without an `audio_codes` field: what `voiceclone codes`
/// would fill in.
pub fn lines_without_codes(manifest: &Path) -> Result<Vec<usize>> {
    Ok(Manifest::read(manifest)?
        .rows()
        .filter(|(_, r)| r.audio_codes.is_none())
        .map(|(line, _)| line)
        .collect())
}

/// The first row's `ref_audio` (resolved against `base`), for computing the speaker embedding
/// the way the official recipe does (the x-vector of the first sample's reference clip).
pub fn first_ref_audio(manifest: &Path, base: &Path) -> Result<Option<(usize, PathBuf)>> {
    Ok(Manifest::read(manifest)?
        .rows()
        .find_map(|(line, r)| r.ref_audio.as_ref().map(|a| (line, base.join(a)))))
}

/// Reads and checks every line of `manifest`. `base` resolves relative audio paths (only used
/// to explain a missing `audio_codes`); `codebook_size` bounds the codes (2048).
pub fn load(
    manifest: &Path,
    base: &Path,
    tokenizer: &TextTokenizer,
    codebook_size: u32,
) -> Result<Dataset> {
    let file = Manifest::read(manifest)?;
    let mut samples = Vec::new();
    let mut bad: Vec<BadLine> = file
        .broken()
        .map(|(line, why)| BadLine {
            line,
            why: why.to_string(),
        })
        .chain(
            file.speaker_problems()
                .into_iter()
                .map(|(line, why)| BadLine { line, why }),
        )
        .collect();
    let speakers = file.speakers();
    for (line, row) in file.rows() {
        match parse_row(line, row, base, tokenizer, codebook_size) {
            Ok(mut s) => {
                s.speaker = row
                    .speaker
                    .as_ref()
                    .and_then(|n| speakers.iter().position(|x| x == n))
                    .unwrap_or(0);
                samples.push(s)
            }
            Err(why) => bad.push(BadLine { line, why }),
        }
    }
    bad.sort_by_key(|b| b.line);
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
    let digest = digest(&samples, &speakers);
    Ok(Dataset {
        manifest: manifest.to_path_buf(),
        samples,
        digest,
        speakers,
    })
}

fn parse_row(
    line: usize,
    row: &ManifestRow,
    base: &Path,
    tokenizer: &TextTokenizer,
    codebook_size: u32,
) -> std::result::Result<Sample, String> {
    let transcript = row
        .text
        .as_deref()
        .ok_or("no \"text\" field (the transcript)")?;
    if transcript.trim().is_empty() {
        return Err("the transcript (\"text\") is empty".into());
    }
    let codes = row_codes(row, base, codebook_size)?;
    let prompt = tokenizer
        .assistant_prompt(transcript)
        .map_err(|e| format!("cannot tokenize the transcript: {e:#}"))?;
    // `[:, :-5]` of the assistant prompt: role (3 ids) + text ids (docs/model.md §10.1).
    let text_ids = prompt.ids[..prompt.ids.len() - 5].to_vec();
    Ok(Sample {
        line,
        text_ids,
        codes: codes.to_vec(),
        speaker: 0,
    })
}

/// The row's codes, every code below `codebook_size`; errors say what is missing or which
/// frame is wrong.
fn row_codes<'a>(
    row: &'a ManifestRow,
    base: &Path,
    codebook_size: u32,
) -> std::result::Result<&'a [CodeFrame], String> {
    let codes = match &row.audio_codes {
        None => {
            return Err(match row.audio.as_deref() {
                None => "no \"audio_codes\" and no \"audio\" field to compute them from".into(),
                Some(a) if !base.join(a).is_file() => format!(
                    "no \"audio_codes\": its audio file {} does not exist",
                    base.join(a).display()
                ),
                Some(_) => "no \"audio_codes\" (`voiceclone codes` could not encode its audio; \
                            see its report)"
                    .into(),
            })
        }
        // The check `codes` makes too (it recomputes what fails it).
        Some(codes) => codes.checked(codebook_size),
    };
    codes.map_err(|why| format!("\"audio_codes\" {why}"))
}

/// SHA-256 over every sample's text ids and codes, and with named speakers also its speaker's
/// name (one unnamed speaker adds nothing, so such a digest is what it always was).
fn digest(samples: &[Sample], speakers: &[String]) -> String {
    let mut h = Sha256::new();
    for s in samples {
        hash_sample(&mut h, s, speakers);
    }
    format!("{:x}", h.finalize())
}

fn hash_sample(h: &mut Sha256, s: &Sample, speakers: &[String]) {
    if let Some(name) = speakers.get(s.speaker) {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
    }
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

/// The SHA-256 of one sample's content (speaker name, text ids, codes), as for the digest:
/// what makes two manifest lines the same utterance.
pub fn sample_sha256(s: &Sample, speakers: &[String]) -> [u8; 32] {
    let mut h = Sha256::new();
    hash_sample(&mut h, s, speakers);
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use vc_core::artifacts::manifest::ManifestLine;

    fn row(json: &str) -> ManifestRow {
        match ManifestLine::parse(json) {
            ManifestLine::Row(r) => *r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn code_errors_name_the_frame_or_what_is_missing() {
        let base = Path::new("/nonexistent");
        let e = row_codes(&row(r#"{"audio_codes":[[1,2,3]]}"#), base, 2048).unwrap_err();
        assert!(e.contains("frame 0 has 3 codes"), "{e}");
        let mut f = vec![0u32; 16];
        f[5] = 2048;
        let r = row(&serde_json::json!({ "audio_codes": [vec![0u32; 16], f] }).to_string());
        let e = row_codes(&r, base, 2048).unwrap_err();
        assert!(e.contains("frame 1") && e.contains("2048"), "{e}");
        let e = row_codes(&row(r#"{"audio_codes":[]}"#), base, 2048).unwrap_err();
        assert!(e.contains("no frames"), "{e}");
        let e = row_codes(&row(r#"{"audio":"x.wav"}"#), base, 2048).unwrap_err();
        assert!(
            e.contains("its audio file /nonexistent/x.wav does not exist"),
            "{e}"
        );
        let e = row_codes(&row(r#"{"text":"t"}"#), base, 2048).unwrap_err();
        assert!(e.contains("no \"audio\" field"), "{e}");
        let r = row(&serde_json::json!({ "audio_codes": [vec![7u32; 16]] }).to_string());
        assert_eq!(row_codes(&r, base, 2048).unwrap(), &[CodeFrame([7; 16])]);
    }
}
