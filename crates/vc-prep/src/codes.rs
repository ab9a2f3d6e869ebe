//! `voiceclone codes`: adds `"audio_codes"` (T frames × 16 codes, the official
//! `prepare_data.py` format) to every line of a training manifest.
//!
//! Lines are handled as JSON objects, so fields this step does not know survive unchanged and
//! in order. Lines that already carry valid codes are skipped (the step is resumable: the
//! manifest is rewritten atomically after every few batches, so an interrupted run keeps what it
//! finished). Codes that training would refuse — not frames of 16 codes, none, or a code outside
//! the codebook ([`AudioCodes::checked`], the check `train` makes) — are recomputed from the
//! audio and reported with their line numbers and what was wrong: they are derived from the
//! audio, which stays the source of truth, and nothing can use them as they are. Broken lines
//! (not JSON, no `audio`, missing or undecodable audio) are reported with their line numbers and
//! kept exactly as they were.
//!
//! The step works on any [`AudioEncoder`] (tests use a fake); the speech tokenizer of the
//! workspace's configuration is one ([`load_codec`]), for the command and the trainer alike.
//! Commands resolve the configuration into [`CodecOptions`]; this crate never reads it whole.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use vc_audio::{self as audio, OUTPUT_RATE};
use vc_core::artifacts::codes::frames_from_rows;
use vc_core::artifacts::codes::CodeFrame;
use vc_core::artifacts::manifest::{AudioCodes, Manifest, ManifestLine, ManifestRow};
use vc_core::progress::Progress;
use vc_core::workspace::Workspace;
use vc_model::codec::Codec;

/// What `codes` needs from the speech tokenizer: batched 24 kHz waveforms in, codes out.
pub trait AudioEncoder {
    /// One code sequence per clip, `ceil(len / 1920)` frames each.
    fn encode_batch(&self, clips: &[&[f32]]) -> Result<Vec<Vec<CodeFrame>>>;
    /// Codes are below this (2048): stored codes at or above it are malformed.
    fn codebook_size(&self) -> u32;
}

/// The configured speech tokenizer and how it is fed: what [`load_codec`] and
/// [`code_manifest`] read of the `[codes]` keys and `model.base` (docs/usage.md §1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecOptions {
    /// The model spec (hub id or directory, as `Workspace::model_source` takes it) whose speech
    /// tokenizer is loaded: a standalone tokenizer, or a base model with `speech_tokenizer/`.
    pub tokenizer: String,
    /// Clips per encoder call (`codes.batch_size`).
    pub batch_size: usize,
}

impl CodecOptions {
    /// The options of `codes.tokenizer` (`tokenizer`), `model.base` (`base`) and
    /// `codes.batch_size`: the tokenizer named by `codes.tokenizer`, or, when that is empty or
    /// blank, the one inside `model.base`.
    pub fn new(tokenizer: &str, base: &str, batch_size: usize) -> Self {
        let tokenizer = if tokenizer.trim().is_empty() {
            base
        } else {
            tokenizer
        };
        Self {
            tokenizer: tokenizer.to_string(),
            batch_size,
        }
    }
}

/// The speech tokenizer of `codec.tokenizer`, resolved against the workspace.
pub fn load_codec(ws: &Workspace, codec: &CodecOptions) -> Result<Codec> {
    let source = ws.model_source(&codec.tokenizer)?;
    Codec::load(&source)
        .with_context(|| format!("cannot load the speech tokenizer of {}", source.describe()))
}

/// Codes the manifest `input` into `output` with the speech tokenizer of `codec`, audio paths
/// relative to the workspace: what `voiceclone codes` runs, and `train` when lines lack codes.
pub fn code_manifest(
    ws: &Workspace,
    codec: &CodecOptions,
    input: &Path,
    output: &Path,
    force: bool,
) -> Result<CodesSummary> {
    let encoder = load_codec(ws, codec)?;
    let opts = CodesOptions {
        input: input.to_path_buf(),
        output: output.to_path_buf(),
        base_dir: ws.root().to_path_buf(),
        batch_size: codec.batch_size,
        force,
    };
    run(&opts, &encoder)
}

/// The codec as this step sees it: frames of exactly 16 codes.
impl AudioEncoder for Codec {
    fn encode_batch(&self, clips: &[&[f32]]) -> Result<Vec<Vec<CodeFrame>>> {
        Codec::encode_batch(self, clips)?
            .iter()
            .map(|codes| frames_from_rows(codes))
            .collect()
    }

    fn codebook_size(&self) -> u32 {
        self.config().decoder_config.codebook_size as u32
    }
}

#[derive(Debug, Clone)]
pub struct CodesOptions {
    pub input: PathBuf,
    pub output: PathBuf,
    /// Directory that relative `audio` paths are relative to (the workspace).
    pub base_dir: PathBuf,
    /// Clips per encoder call.
    pub batch_size: usize,
    /// Redo lines that already have valid codes.
    pub force: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct CodesSummary {
    pub lines: usize,
    /// Lines with valid codes, skipped.
    pub already_coded: usize,
    /// Lines coded, `recomputed` among them.
    pub coded: usize,
    /// `(line number, what was wrong)` for lines whose malformed codes were recomputed.
    pub recomputed: Vec<(usize, String)>,
    /// `(line number, reason)` for lines left unchanged because they are broken.
    pub bad_lines: Vec<(usize, String)>,
    pub audio_seconds: f64,
}

impl CodesSummary {
    /// What a run did, as lines for the user: counts, each broken line with its reason, and the
    /// file written (`input` read, `output` written).
    pub fn report(&self, input: &Path, output: &Path) -> Vec<String> {
        let replaced = if self.recomputed.is_empty() {
            String::new()
        } else {
            format!(
                ", {} of them replacing malformed codes",
                self.recomputed.len()
            )
        };
        let mut lines = vec![format!(
            "codes: {} line(s): {} coded ({:.1} s of audio{replaced}), {} already had valid \
             codes, {} left unchanged (bad)",
            self.lines,
            self.coded,
            self.audio_seconds,
            self.already_coded,
            self.bad_lines.len()
        )];
        let mut listed: Vec<(usize, String)> = self
            .recomputed
            .iter()
            .map(|(line, why)| (*line, recomputed_note(why)))
            .chain(self.bad_lines.iter().cloned())
            .collect();
        listed.sort();
        for (line, why) in listed {
            lines.push(format!("  {}:{line}: {why}", input.display()));
        }
        if self.coded > 0 || output != input {
            lines.push(format!("  wrote {}", output.display()));
        }
        lines
    }
}

/// How often the partially coded manifest is saved during a long run.
const SAVE_EVERY: Duration = Duration::from_secs(60);

/// How a recomputed line's old codes are reported.
fn recomputed_note(why: &str) -> String {
    format!("\"audio_codes\" {why}; recomputed from its audio")
}

pub fn run(opts: &CodesOptions, encoder: &dyn AudioEncoder) -> Result<CodesSummary> {
    let mut manifest = Manifest::read(&opts.input)?;
    let mut summary = CodesSummary::default();
    let codebook_size = encoder.codebook_size();
    // Lines whose codes are malformed, by index, with what is wrong.
    let mut malformed: std::collections::HashMap<usize, String> = Default::default();
    let progress_warn = |p: &Progress, n: usize, why: &str| {
        p.warn(format!(
            "{}:{n}: {why}; line left unchanged",
            opts.input.display()
        ))
    };

    let mut pending: Vec<usize> = Vec::new();
    for (i, line) in manifest.lines.iter().enumerate() {
        match line {
            ManifestLine::Blank(_) => {}
            ManifestLine::Broken { why, .. } => {
                summary.lines += 1;
                summary.bad_lines.push((i + 1, why.clone()));
            }
            ManifestLine::Row(row) => {
                summary.lines += 1;
                match row.audio_codes.as_ref().map(|c| c.checked(codebook_size)) {
                    Some(Ok(_)) if !opts.force => summary.already_coded += 1,
                    Some(Err(why)) => {
                        malformed.insert(i, why);
                        pending.push(i);
                    }
                    _ => pending.push(i),
                }
            }
        }
    }
    // Similar lengths in one batch waste the least padding.
    let duration = |i: usize| match &manifest.lines[i] {
        ManifestLine::Row(row) => row.duration.unwrap_or(0.0),
        _ => 0.0,
    };
    pending.sort_by(|&a, &b| duration(a).total_cmp(&duration(b)));
    let progress = Progress::new(pending.len() as u64, "lines", "codes");
    for (n, why) in &summary.bad_lines {
        progress_warn(&progress, *n, why);
    }
    let mut last_save = Instant::now();
    for chunk in pending.chunks(opts.batch_size.max(1)) {
        // Load the batch; lines whose audio cannot be used are reported and skipped.
        let mut clips: Vec<(usize, Vec<f32>)> = Vec::with_capacity(chunk.len());
        for &i in chunk {
            let ManifestLine::Row(row) = &manifest.lines[i] else {
                continue;
            };
            match load_clip(row, &opts.base_dir) {
                Ok(samples) => clips.push((i, samples)),
                Err(why) => {
                    let why = match malformed.get(&i) {
                        Some(old) => {
                            format!("{why} (its \"audio_codes\" {old}, and cannot be recomputed)")
                        }
                        None => why,
                    };
                    progress_warn(&progress, i + 1, &why);
                    summary.bad_lines.push((i + 1, why));
                    progress.inc(1);
                }
            }
        }
        if clips.is_empty() {
            continue;
        }
        let refs: Vec<&[f32]> = clips.iter().map(|(_, s)| s.as_slice()).collect();
        let codes = encoder
            .encode_batch(&refs)
            .context("the speech tokenizer failed")?;
        anyhow::ensure!(
            codes.len() == clips.len(),
            "the speech tokenizer returned {} results for {} clips",
            codes.len(),
            clips.len()
        );
        for ((i, samples), frames) in clips.iter().zip(codes) {
            if let ManifestLine::Row(row) = &mut manifest.lines[*i] {
                row.audio_codes = Some(AudioCodes::Frames(frames));
            }
            if let Some(why) = malformed.remove(i) {
                progress.warn(format!(
                    "{}:{}: {}",
                    opts.input.display(),
                    i + 1,
                    recomputed_note(&why)
                ));
                summary.recomputed.push((i + 1, why));
            }
            summary.coded += 1;
            summary.audio_seconds += samples.len() as f64 / OUTPUT_RATE as f64;
            progress.inc(1);
        }
        progress.set_message(format!("{:.0} s of audio coded", summary.audio_seconds));
        if last_save.elapsed() >= SAVE_EVERY {
            manifest.write(&opts.output)?;
            last_save = Instant::now();
        }
    }
    progress.finish();
    summary.bad_lines.sort();
    summary.recomputed.sort();
    if summary.coded > 0 || opts.output != opts.input {
        manifest.write(&opts.output)?;
    }
    Ok(summary)
}

fn load_clip(row: &ManifestRow, base: &Path) -> std::result::Result<Vec<f32>, String> {
    let audio = row.audio.as_deref().ok_or("no \"audio\" field")?;
    let path = base.join(audio);
    if !path.exists() {
        return Err(format!("audio file {} does not exist", path.display()));
    }
    let samples = audio::load_mono(&path, OUTPUT_RATE).map_err(|e| format!("{e:#}"))?;
    if samples.is_empty() {
        return Err(format!("audio file {} has no samples", path.display()));
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Deterministic stand-in for the codec: frame k of a clip is [len % 2048, k, 0, ...].
    struct Fake {
        batches: RefCell<Vec<usize>>,
    }

    impl AudioEncoder for Fake {
        fn encode_batch(&self, clips: &[&[f32]]) -> Result<Vec<Vec<CodeFrame>>> {
            self.batches.borrow_mut().push(clips.len());
            Ok(clips
                .iter()
                .map(|c| {
                    (0..c.len().div_ceil(1920))
                        .map(|k| {
                            let mut f = [0u32; 16];
                            f[0] = (c.len() % 2048) as u32;
                            f[1] = k as u32;
                            CodeFrame(f)
                        })
                        .collect()
                })
                .collect())
        }

        fn codebook_size(&self) -> u32 {
            2048
        }
    }

    fn wav(dir: &Path, name: &str, samples: usize) {
        audio::wav::write_pcm16(&dir.join(name), &vec![0.1; samples], OUTPUT_RATE).unwrap();
    }

    #[test]
    fn an_empty_tokenizer_key_means_the_one_inside_the_base_model() {
        let base = "Qwen/Qwen3-TTS-12Hz-1.7B-Base";
        for unset in ["", "  "] {
            assert_eq!(
                CodecOptions::new(unset, base, 8),
                CodecOptions {
                    tokenizer: base.to_string(),
                    batch_size: 8
                }
            );
        }
        let own = CodecOptions::new("tokenizers/mine", base, 3);
        assert_eq!(
            (own.tokenizer.as_str(), own.batch_size),
            ("tokenizers/mine", 3)
        );
    }

    #[test]
    fn codes_every_good_line_keeps_bad_ones_and_unknown_fields() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        wav(d, "a.wav", 4000);
        wav(d, "b.wav", 1920);
        std::fs::write(d.join("junk.wav"), b"not audio").unwrap();
        let manifest = d.join("train.jsonl");
        let original = [
            r#"{"audio":"a.wav","text":"A","zeta":1,"alpha":[1,2]}"#,
            r#"{"audio":"b.wav","text":"B"}"#,
            r#"{"audio": broken"#,
            r#"{"audio":"missing.wav","text":"C"}"#,
            "",
            r#"{"audio":"junk.wav","text":"D"}"#,
            r#"{"text":"no audio"}"#,
        ];
        std::fs::write(&manifest, original.join("\n") + "\n").unwrap();
        let opts = CodesOptions {
            input: manifest.clone(),
            output: manifest.clone(),
            base_dir: d.to_path_buf(),
            batch_size: 8,
            force: false,
        };
        let fake = Fake {
            batches: RefCell::new(vec![]),
        };
        let s = run(&opts, &fake).unwrap();
        assert_eq!((s.lines, s.coded, s.already_coded), (6, 2, 0));
        let bad: Vec<usize> = s.bad_lines.iter().map(|b| b.0).collect();
        assert_eq!(bad, [3, 4, 6, 7]);
        let out = std::fs::read_to_string(&manifest).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[0],
            r#"{"audio":"a.wav","text":"A","zeta":1,"alpha":[1,2],"audio_codes":[[1952,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],[1952,1,0,0,0,0,0,0,0,0,0,0,0,0,0,0],[1952,2,0,0,0,0,0,0,0,0,0,0,0,0,0,0]]}"#
        );
        for i in 2..7 {
            assert_eq!(lines[i], original[i], "line {} changed", i + 1);
        }
        // Re-running does no work and changes nothing.
        let before = out.clone();
        let again = run(&opts, &fake).unwrap();
        assert_eq!((again.coded, again.already_coded), (0, 2));
        assert_eq!(fake.batches.borrow().len(), 1);
        assert_eq!(std::fs::read_to_string(&manifest).unwrap(), before);
    }

    #[test]
    fn malformed_codes_are_recomputed_and_reported_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        wav(d, "a.wav", 4000);
        let frame = |c: i64| serde_json::json!(vec![c; 16]);
        let mut out_of_range = vec![7i64; 16];
        out_of_range[3] = 99999;
        let rows = [
            serde_json::json!({"audio": "a.wav", "audio_codes": [frame(1)]}),
            serde_json::json!({"audio": "a.wav", "audio_codes": [[1, 2, 3]]}),
            serde_json::json!({"audio": "a.wav", "audio_codes": [frame(-1)]}),
            serde_json::json!({"audio": "a.wav", "audio_codes": []}),
            serde_json::json!({"audio": "a.wav", "audio_codes": [frame(7), out_of_range]}),
            serde_json::json!({"audio": "gone.wav", "audio_codes": [[1, 2, 3]]}),
        ];
        let manifest = d.join("train.jsonl");
        let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
        std::fs::write(&manifest, &text).unwrap();
        let opts = CodesOptions {
            input: manifest.clone(),
            output: manifest.clone(),
            base_dir: d.to_path_buf(),
            batch_size: 8,
            force: false,
        };
        let fake = Fake {
            batches: RefCell::new(vec![]),
        };
        let s = run(&opts, &fake).unwrap();
        assert_eq!((s.lines, s.coded, s.already_coded), (6, 4, 1), "{s:?}");
        let out = std::fs::read_to_string(&manifest).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        let recomputed = serde_json::json!({"audio": "a.wav", "audio_codes": [
            [1952, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [1952, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [1952, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ]})
        .to_string();
        assert_eq!(lines[0], rows[0].to_string(), "a valid line was recoded");
        for line in &lines[1..5] {
            assert_eq!(*line, recomputed);
        }
        assert_eq!(
            lines[5],
            rows[5].to_string(),
            "a line without audio changed"
        );
        // Each malformed line is named with what was wrong with it.
        let report = s.report(&manifest, &manifest).join("\n");
        let path = manifest.display();
        for (line, why) in [
            (2, "frame 0 has 3 codes"),
            (3, "frame 0 has code -1"),
            (4, "no frames"),
            (5, "frame 1 has code 99999"),
        ] {
            let found = report
                .lines()
                .find(|l| l.contains(&format!("{path}:{line}:")))
                .unwrap_or_else(|| panic!("line {line} not reported:\n{report}"));
            assert!(
                found.contains(why) && found.contains("recomputed"),
                "{found}"
            );
        }
        let gone = report
            .lines()
            .find(|l| l.contains(&format!("{path}:6:")))
            .unwrap_or_else(|| panic!("line 6 not reported:\n{report}"));
        assert!(gone.contains("does not exist"), "{gone}");
    }
}
