//! Samples spoken at each evaluation and measured (docs/training.md §14.4): the texts of
//! [`plan`] spoken with a checkpoint's weights as its export would speak them (the
//! custom-voice prompt, greedy, at most [`plan::CAP_FACTOR`] × the reference length), written
//! to `checkpoints/step-N/samples/`, and for each one the speaker similarity, the speaking rate
//! against the speaker's own, whether it reached end of speech, and the word error rate of its
//! transcript (by the Whisper model [`listener`] chooses). [`score`] turns them into one number
//! and names drift; [`setup`] decides at the start of a run whether it speaks any.
//!
//! Samples are spoken on the CPU from the saved checkpoint, whatever trains the run and on how
//! many ranks: they read what the export reads, and take no memory from the training device.

pub mod listener;
pub mod plan;
pub mod score;
pub mod setup;
pub mod wer;

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::Device;

use self::plan::PlannedSample;
use vc_generate::sampling::Sampling;
use vc_generate::{DecodeOptions, Precision, Request, Synthesizer, Voice};
use vc_model::files::ModelFiles;
use vc_prep::transcribe::Transcriber;
use vc_train::evaluation::Spoken;
use vc_train::metrics::SampleMetrics;
use vc_train::{checkpoint, export};

/// The directory of a checkpoint's samples.
pub const DIR: &str = "samples";

/// What transcribes the samples for their word error rate.
#[derive(Clone)]
pub enum Listener {
    Whisper(std::sync::Arc<dyn Transcriber>),
    /// None, and why (said at the start).
    Missing(String),
}

/// What speaking the samples of one checkpoint needs.
pub struct SampleJob<'a> {
    /// The base model the run trains.
    pub files: &'a ModelFiles,
    /// The checkpoint (`checkpoints/step-N`).
    pub checkpoint: &'a Path,
    /// The workspace, which the recorded paths are relative to.
    pub workspace: &'a Path,
    /// `train.speaker_name` (one unnamed speaker).
    pub speaker_name: &'a str,
    pub plan: &'a [PlannedSample],
    /// Transcribes 16 kHz audio for the WER; `None`: no WER.
    pub whisper: Option<&'a dyn Transcriber>,
}

/// Speaks and measures every planned sample of `job` on the CPU; `progress(done, total)` after
/// each. The WAVs and codes go to `checkpoint/samples/NN.wav` and `NN.codes.json`.
pub fn speak(job: &SampleJob, mut progress: impl FnMut(usize, usize)) -> Result<Spoken> {
    let model = export::checkpoint_as_model(job.files, job.checkpoint, job.speaker_name)?;
    let index = checkpoint::read_index(job.checkpoint)?;
    let references = checkpoint::read_speakers(job.checkpoint, &index)?;
    // What `voiceclone speak` picks on the CPU for the bf16 export.
    let mut synth = Synthesizer::from_files(model, Precision::Bf16Weights, &Device::Cpu)
        .context("cannot load the checkpoint's weights to speak samples")?;
    let dir = job.checkpoint.join(DIR);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let rate = synth.codec.output_sample_rate();
    let mut out = Vec::with_capacity(job.plan.len());
    let mut warnings = Vec::new();
    for (i, p) in job.plan.iter().enumerate() {
        let speech = synth
            .synthesize(
                &[Request {
                    text: p.text.clone(),
                    language: "auto".into(),
                    voice: Voice::Speaker(p.voice.clone()),
                    non_streaming: true,
                    // The pace `speak` reads from the export (docs/model.md §7.2).
                    pace: p.pace,
                }],
                &decode_options(&synth, p.cap),
                |_, _, _| {},
            )?
            .remove(0);
        let stem = format!("{:02}", i + 1);
        let wav = dir.join(format!("{stem}.wav"));
        let codes = dir.join(format!("{stem}.codes.json"));
        vc_audio::wav::write_pcm16(&wav, &speech.wav, rate)?;
        vc_core::artifacts::codes::write_codes_file(&codes, &speech.frames)?;
        // Measured as written: the 16-bit samples of the file, as anything reading it gets them.
        let written: Vec<f32> = speech
            .wav
            .iter()
            .map(|&v| f32::from(vc_audio::wav::to_i16(v)) / 32768.0)
            .collect();
        let reference = &references
            .get(p.speaker)
            .with_context(|| format!("the checkpoint has no x-vector of speaker {}", p.voice))?
            .1;
        let similarity = if written.is_empty() {
            None
        } else {
            Some(cosine(&synth.xvector(&written)?, reference))
        };
        let frames = speech.frames.len();
        let frames_per_token = frames as f64 / p.text_tokens.max(1) as f64;
        let heard = job
            .whisper
            .map(|w| intelligibility(w, &written, rate, &p.text));
        let (wer, transcript) = match heard {
            Some(Ok((wer, heard))) => (wer, Some(heard)),
            Some(Err(e)) => {
                warnings.push(format!("sample {} could not be transcribed: {e:#}", i + 1));
                (None, None)
            }
            None => (None, None),
        };
        out.push(SampleMetrics {
            text: p.text.clone(),
            voice: p.voice.clone(),
            wav: vc_core::fsutil::display_relative(&wav, job.workspace),
            codes: vc_core::fsutil::display_relative(&codes, job.workspace),
            frames,
            cap: p.cap,
            eos: speech.eos_steps.first().is_some_and(Option::is_some),
            similarity,
            frames_per_token,
            // (A sample has at least one frame: the frame loop ends no earlier.)
            rate_ratio: if frames == 0 {
                0.0
            } else {
                p.reference_rate / frames_per_token
            },
            recording: p.recording.clone(),
            wer,
            transcript,
        });
        progress(i + 1, job.plan.len());
    }
    warnings.extend(score::drift(&out));
    Ok(Spoken {
        score: score::score(&out),
        samples: out,
        warnings,
    })
}

/// What `whisper` hears in `wav` (mono at `rate` Hz) and its word error rate against `text`
/// ([`wer::wer`]; `None` when `text` has no words). Silence is heard as nothing.
pub fn intelligibility(
    whisper: &dyn Transcriber,
    wav: &[f32],
    rate: u32,
    text: &str,
) -> Result<(Option<f64>, String)> {
    let heard = if wav.is_empty() {
        String::new()
    } else {
        let audio16 = vc_audio::resample::resample(wav, rate, 16_000)?;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let t = whisper.transcribe(&audio16, threads)?;
        let parts: Vec<&str> = t
            .segments
            .iter()
            .map(|s| s.text.trim())
            .filter(|s| !s.is_empty())
            .collect();
        parts.join(" ")
    };
    Ok((wer::wer(text, &heard), heard))
}

/// Greedy decoding with the model's other generation settings, the whole text in one piece,
/// at most `cap` frames: `voiceclone speak --greedy --max-frames CAP --max-chunk-chars 0` —
/// the cap instead of a frame budget, the loop guard on (docs/model.md §7.2).
pub fn decode_options(synth: &Synthesizer, cap: usize) -> DecodeOptions {
    let mut o = DecodeOptions::from_generation_config(&synth.files.generation);
    o.code0 = Sampling::GREEDY;
    o.sub_codes = Sampling::GREEDY;
    o.max_frames = cap;
    o.runaway.budget = false;
    o.batch_size = 1;
    o.max_chunk_chars = 0;
    o
}

/// Cosine similarity in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_is_the_angle_in_f64() {
        assert_eq!(cosine(&[1.0, 0.0], &[2.0, 0.0]), 1.0);
        assert_eq!(cosine(&[1.0, 0.0], &[0.0, 3.0]), 0.0);
        assert!((cosine(&[1.0, 1.0], &[-1.0, -1.0]) + 1.0).abs() < 1e-15);
    }
}
