//! Samples spoken at each evaluation and measured (docs/training.md §14.4): the texts of
//! [`plan`] spoken with a checkpoint's weights as its export would speak them (the
//! custom-voice prompt, greedy, at most [`plan::CAP_FACTOR`] × the reference length), written
//! to `checkpoints/step-N/samples/`, and for each one the speaker similarity, the speaking rate
//! against the speaker's own, whether it reached end of speech, and the word error rate of its
//! transcript (by the Whisper model [`listener`] chooses). [`score`] turns them into one number
//! and names drift.
//!
//! Samples are spoken on the CPU from the saved checkpoint, whatever trains the run and on how
//! many ranks: they read what the export reads, and take no memory from the training device.

pub mod listener;
pub mod plan;
pub mod score;
pub mod wer;

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::Device;
use serde::{Deserialize, Serialize};

use self::plan::PlannedSample;
use crate::{checkpoint, export};
use vc_generate::sampling::Sampling;
use vc_generate::{DecodeOptions, Precision, Request, Synthesizer, Voice};
use vc_model::files::ModelFiles;
use vc_prep::transcribe::Transcriber;

/// The directory of a checkpoint's samples.
pub const DIR: &str = "samples";

/// One sample of an evaluation, as `checkpoints/metrics.jsonl` records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleMetrics {
    pub text: String,
    /// The speaker (its lower-cased name, as the export names it).
    pub voice: String,
    /// The WAV and its codes, relative to the workspace.
    pub wav: String,
    pub codes: String,
    /// Frames generated, and the most it could take.
    pub frames: usize,
    pub cap: usize,
    /// Whether it stopped with end of speech (not at `cap`).
    pub eos: bool,
    /// Cosine of its x-vector and the speaker's (both by the model's speaker encoder).
    pub similarity: Option<f64>,
    /// Frames per text token, and the speaker's own pace over this one: 1 = the speaker's
    /// pace, above 1 faster (docs/training.md §14.4).
    pub frames_per_token: f64,
    pub rate_ratio: f64,
    /// The held-out recording of the same text the rate is measured against (its audio as
    /// the manifest names it); null for a text of `train.sample_texts`, measured against the
    /// speaker's mean pace.
    pub recording: Option<String>,
    /// Word error rate of its transcript against `text` (null without a Whisper model).
    pub wer: Option<f64>,
    pub transcript: Option<String>,
}

/// What transcribes the samples for their word error rate.
#[derive(Clone)]
pub enum Listener {
    Whisper(std::sync::Arc<dyn Transcriber>),
    /// None, and why (said at the start).
    Missing(String),
}

/// The samples of one checkpoint, and what went wrong measuring them.
pub struct Spoken {
    pub samples: Vec<SampleMetrics>,
    /// Measures that could not be taken (a transcription that failed): their fields are null.
    pub warnings: Vec<String>,
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
    Ok(Spoken {
        samples: out,
        warnings,
    })
}

/// Talker parameters above which `train.samples = "auto"` leaves samples off on a CPU-only
/// run: the 1.7B (their cost: docs/performance.md §12).
const AUTO_CPU_LIMIT: usize = 1_000_000_000;
/// Bytes of weights per second the samples of the 0.6B-shaped model went through on the
/// 2-core machine of docs/performance.md §12 (its frames' [`frame_bytes`] over the time its
/// samples took): what the start's estimate of another model's samples scales by.
const MEASURED_BYTES_PER_SECOND: f64 = 18.0e9;

/// The samples of a run, decided at its start the same way on every rank.
pub struct SampleSetup {
    /// What every evaluation speaks; empty: no samples.
    pub plan: Vec<PlannedSample>,
    /// What the start should say about them.
    pub notes: Vec<String>,
}

impl SampleSetup {
    /// Plans the samples of a run with `opts` on `train` (held out: `heldout`) over `world`
    /// ranks, or none when `train.samples` (or `auto` on the CPU for a large model) turns them
    /// off, nothing is held out (there are no evaluations) or there is nothing to speak.
    /// `train.select = "score"` without samples is refused.
    pub fn new(
        opts: &crate::TrainOptions,
        heldout: Option<&crate::data::Dataset>,
        train: &crate::data::Dataset,
        world: usize,
    ) -> Result<Self> {
        use vc_core::config::Select;
        let c = &opts.config;
        let off = off_reason(
            c.samples,
            opts.device.is_cpu(),
            talker_parameters(&opts.files),
        );
        let plan = match heldout {
            Some(heldout) => {
                let tokenizer = opts.files.text_tokenizer()?;
                let generation = DecodeOptions::from_generation_config(&opts.files.generation);
                plan::plan(
                    &c.sample_texts,
                    heldout,
                    train,
                    &tokenizer,
                    &c.speaker_name,
                    generation.max_frames,
                )?
            }
            None => Vec::new(),
        };
        let frames: usize = plan.iter().map(|p| p.cap).sum();
        let seconds = frames as f64 * frame_bytes(&opts.files) / MEASURED_BYTES_PER_SECOND;
        let why_not = match (off, heldout.is_some(), plan.is_empty()) {
            (Some(why), _, true) => Some(why),
            (Some(why), _, false) => Some(format!(
                "{why}; they would speak {} sample(s) of up to {frames} frames at each \
                 evaluation, about {seconds:.0} s at the pace measured on 2 cores \
                 (docs/performance.md §12)",
                plan.len(),
            )),
            (None, false, _) => Some(
                "nothing is held out (train.val_fraction = 0, or too few utterances), so there \
                 are no evaluations to speak them at"
                    .to_string(),
            ),
            (None, true, true) => Some("no speaker has a held-out utterance to speak".to_string()),
            (None, true, false) => None,
        };
        if let Some(why) = why_not {
            if c.select == Select::Score {
                anyhow::bail!(
                    "train.select = \"score\" chooses by the samples' score, but there are no \
                     samples: {why}"
                );
            }
            return Ok(Self {
                plan: Vec::new(),
                notes: vec![format!("no samples at evaluations: {why}")],
            });
        }
        let wer = match &opts.whisper {
            Listener::Whisper(_) => "and their WER".to_string(),
            Listener::Missing(why) => format!("but no WER ({why})"),
        };
        let mut notes = vec![format!(
            "samples: {} at each evaluation (up to {frames} frames in all), spoken on the CPU \
             from the checkpoint as its export would speak them; similarity, speaking rate, end \
             of speech {wer} in checkpoints/metrics.jsonl and report.html",
            plan.len()
        )];
        // The other ranks wait for the samples in their next collective.
        if world > 1 && seconds > c.dist_timeout as f64 / 2.0 {
            notes.push(format!(
                "warning: the samples may take about {seconds:.0} s at each evaluation while the \
                 other ranks wait at most train.dist_timeout = {} s for them: raise \
                 train.dist_timeout, or speak fewer samples (train.sample_texts, train.samples)",
                c.dist_timeout
            ));
        }
        Ok(Self { plan, notes })
    }
}

/// Why `setting` leaves the samples of a run (on the CPU only, or not) of a talker of `params`
/// parameters off; `None`: they are on.
fn off_reason(setting: vc_core::config::Samples, cpu: bool, params: usize) -> Option<String> {
    use vc_core::config::Samples;
    match setting {
        Samples::Off => Some("train.samples is false".to_string()),
        Samples::Auto if cpu && params > AUTO_CPU_LIMIT => Some(format!(
            "a CPU-only run of a model with {:.1} B talker parameters leaves them off \
             (train.samples = \"auto\"); train.samples = true turns them on",
            params as f64 / 1e9
        )),
        Samples::Auto | Samples::On => None,
    }
}

/// Bytes of bf16 weights one generated frame reads: the talker's decoder layers, text
/// projection and head once, the code predictor's decoder layers once for every code after the
/// first (docs/model.md §7) and each of its heads once.
fn frame_bytes(files: &ModelFiles) -> f64 {
    let codes = files.config.talker_config.num_code_groups.saturating_sub(1) as f64;
    let elements = |n: &str| -> f64 {
        files
            .checkpoint
            .tensor(n)
            .map_or(0.0, |t| t.shape.iter().product::<usize>() as f64)
    };
    files
        .checkpoint
        .tensor_names()
        .map(|n| {
            if n.starts_with("talker.code_predictor.model.layers.") {
                codes * elements(n)
            } else if n.starts_with("talker.model.layers.")
                || n.starts_with("talker.text_projection.")
                || n.starts_with("talker.code_predictor.lm_head.")
                || n == "talker.codec_head.weight"
            {
                elements(n)
            } else {
                0.0
            }
        })
        .sum::<f64>()
        * 2.0
}

/// Parameters of the talker (with its code predictor), from the checkpoint's headers.
fn talker_parameters(files: &ModelFiles) -> usize {
    files
        .checkpoint
        .tensor_names()
        .filter(|n| n.starts_with("talker."))
        .filter_map(|n| files.checkpoint.tensor(n))
        .map(|t| t.shape.iter().product::<usize>())
        .sum()
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
    use vc_core::config::Samples;

    #[test]
    fn auto_leaves_samples_off_only_for_a_large_model_on_the_cpu() {
        let large = 1_900_000_000;
        let small = 600_000_000;
        assert_eq!(
            off_reason(Samples::Off, false, small).as_deref(),
            Some("train.samples is false")
        );
        let why = off_reason(Samples::Auto, true, large).unwrap();
        assert!(
            why.contains("1.9 B") && why.contains("train.samples = true"),
            "{why}"
        );
        assert_eq!(off_reason(Samples::Auto, true, small), None);
        assert_eq!(off_reason(Samples::Auto, false, large), None, "a GPU run");
        assert_eq!(off_reason(Samples::On, true, large), None);
    }

    #[test]
    fn cosine_is_the_angle_in_f64() {
        assert_eq!(cosine(&[1.0, 0.0], &[2.0, 0.0]), 1.0);
        assert_eq!(cosine(&[1.0, 0.0], &[0.0, 3.0]), 0.0);
        assert!((cosine(&[1.0, 1.0], &[-1.0, -1.0]) + 1.0).abs() < 1e-15);
    }
}
