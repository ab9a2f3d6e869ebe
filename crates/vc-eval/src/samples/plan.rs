//! What the samples of a run speak (docs/training.md §14.4): which texts, by which speakers,
//! and against which reference pace — chosen once when the run starts, the same at every
//! evaluation.

use std::collections::BTreeMap;

use anyhow::{Context, Result};

use vc_core::artifacts::manifest::Manifest;
use vc_model::text::TextTokenizer;
use vc_train::data::{Dataset, Sample};

/// The frame limit of a sample, as a multiple of its reference length.
pub const CAP_FACTOR: f64 = 1.5;
/// No sample is cut shorter than this many frames (the frame loop forbids end-of-speech
/// before its second frame).
const MIN_CAP: usize = 4;

/// One text one speaker says at every evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedSample {
    pub text: String,
    /// The voice the export speaks it with: the speaker's lower-cased name.
    pub voice: String,
    /// The speaker's row in the run's speaker table (and in the checkpoint's).
    pub speaker: usize,
    /// Text tokens of `text` (`Lt`, as the training samples count them).
    pub text_tokens: usize,
    /// The held-out recording of the same text, when the text is one: its audio as the manifest
    /// names it.
    pub recording: Option<String>,
    /// The speaker's own pace in frames per text token: the recording's, or for a text of
    /// `train.sample_texts` the mean of the speaker's held-out utterances (of its training
    /// utterances when it has none held out).
    pub reference_rate: f64,
    /// The most frames the sample may take: [`CAP_FACTOR`] × its reference length.
    pub cap: usize,
    /// The speaker's pace over the manifest in frames per text token, as the export records it
    /// for `voiceclone speak`: what its loop guard waits for (docs/model.md §7.2).
    pub pace: Option<f64>,
}

/// The samples of a run: `texts` (`train.sample_texts`) by every speaker, or when there are
/// none the texts of held-out utterances (two for one speaker, the first of each speaker with
/// several). `speaker_name` names the one unnamed speaker (`train.speaker_name`); `max_frames`
/// bounds every cap (the model's frame limit).
pub fn plan(
    texts: &[String],
    heldout: &Dataset,
    train: &Dataset,
    tokenizer: &TextTokenizer,
    speaker_name: &str,
    max_frames: usize,
) -> Result<Vec<PlannedSample>> {
    let names: Vec<String> = if train.speakers.is_empty() {
        vec![vc_core::artifacts::speaker::name_key(speaker_name.trim())]
    } else {
        train
            .speakers
            .iter()
            .map(|n| vc_core::artifacts::speaker::name_key(n))
            .collect()
    };
    let cap = |frames: f64| {
        ((CAP_FACTOR * frames).ceil() as usize)
            .max(MIN_CAP)
            .min(max_frames.max(1))
    };
    // Measured as the export measures it; without it the sample takes the default pace.
    let paces = vc_train::export::pace::measure(&train.manifest, tokenizer)
        .map(|m| vc_train::export::pace::of_speakers(&m, &names))
        .unwrap_or_default();
    let pace = |voice: &str| paces.get(voice).map(|p| p.frames_per_token);
    let mut out = Vec::new();
    if texts.is_empty() {
        let rows = transcripts(heldout)?;
        let per_speaker = if names.len() == 1 { 2 } else { 1 };
        for (speaker, voice) in names.iter().enumerate() {
            let chosen = heldout
                .samples
                .iter()
                .filter(|s| s.speaker == speaker)
                .take(per_speaker);
            for s in chosen {
                let (text, audio) = rows.get(&s.line).cloned().with_context(|| {
                    format!(
                        "{}:{} has no text to speak as a sample",
                        heldout.manifest.display(),
                        s.line
                    )
                })?;
                out.push(PlannedSample {
                    text,
                    voice: voice.clone(),
                    speaker,
                    text_tokens: s.text_len(),
                    recording: audio,
                    reference_rate: rate(std::slice::from_ref(s)),
                    cap: cap(s.frames() as f64),
                    pace: pace(voice),
                });
            }
        }
        return Ok(out);
    }
    for text in texts {
        let tokens = tokenizer
            .assistant_prompt(text)
            .with_context(|| format!("cannot tokenize the sample text {text:?}"))?
            .text()
            .len();
        for (speaker, voice) in names.iter().enumerate() {
            let held = heldout.samples.iter().any(|s| s.speaker == speaker);
            let own: Vec<Sample> = if held { heldout } else { train }
                .samples
                .iter()
                .filter(|s| s.speaker == speaker)
                .cloned()
                .collect();
            let reference_rate = rate(&own);
            out.push(PlannedSample {
                text: text.clone(),
                voice: voice.clone(),
                speaker,
                text_tokens: tokens,
                recording: None,
                reference_rate,
                cap: cap(reference_rate * tokens.max(1) as f64),
                pace: pace(voice),
            });
        }
    }
    Ok(out)
}

/// Frames per text token over `samples` (their total frames over their total tokens).
fn rate(samples: &[Sample]) -> f64 {
    let frames: usize = samples.iter().map(Sample::frames).sum();
    let tokens: usize = samples.iter().map(Sample::text_len).sum();
    frames as f64 / tokens.max(1) as f64
}

/// The transcript and audio of every line of the held-out set's manifest.
fn transcripts(heldout: &Dataset) -> Result<BTreeMap<usize, (String, Option<String>)>> {
    Ok(Manifest::read(&heldout.manifest)?
        .rows()
        .filter_map(|(line, row)| {
            let text = row.text.as_deref()?.trim().to_string();
            Some((line, (text, row.audio.clone())))
        })
        .collect())
}
