//! The `Event` records of a run's metrics (docs/training.md §9.1): which tag holds which
//! number of `metrics.jsonl`, and each sample's WAV as an `Audio` summary.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::proto::Message;
use crate::metrics::{EvalMetrics, SampleMetrics, StepMetrics};

/// The first record of every event file: TensorBoard reads the format's version from it.
pub const FILE_VERSION: &str = "brain.Event:2";

/// Field numbers of tensorboard/compat/proto/event.proto and summary.proto (checked against
/// the descriptors of the `tensorboard` package the tests read the files with).
mod field {
    pub const EVENT_WALL_TIME: u32 = 1;
    pub const EVENT_STEP: u32 = 2;
    pub const EVENT_FILE_VERSION: u32 = 3;
    pub const EVENT_SUMMARY: u32 = 5;
    pub const SUMMARY_VALUE: u32 = 1;
    pub const VALUE_TAG: u32 = 1;
    pub const VALUE_SIMPLE_VALUE: u32 = 2;
    pub const VALUE_AUDIO: u32 = 6;
    pub const AUDIO_SAMPLE_RATE: u32 = 1;
    pub const AUDIO_NUM_CHANNELS: u32 = 2;
    pub const AUDIO_LENGTH_FRAMES: u32 = 3;
    pub const AUDIO_ENCODED: u32 = 4;
    pub const AUDIO_CONTENT_TYPE: u32 = 5;
}
pub(super) use field::*;

/// A `Summary.Value` holding a scalar; TensorBoard stores it as a float32.
fn scalar(tag: &str, v: f64) -> Vec<u8> {
    Message::new()
        .string(VALUE_TAG, tag)
        .float(VALUE_SIMPLE_VALUE, v as f32)
        .into_bytes()
}

/// A `Summary.Value` holding a WAV file as TensorBoard's audio summary: its bytes as they are,
/// its rate, channels and length from its header.
fn audio(tag: &str, wav: &[u8], path: &Path) -> Result<Vec<u8>> {
    let h = wav_header(wav).with_context(|| format!("{} is not a PCM WAV", path.display()))?;
    let audio = Message::new()
        .float(AUDIO_SAMPLE_RATE, h.sample_rate as f32)
        .int64(AUDIO_NUM_CHANNELS, i64::from(h.channels))
        .int64(AUDIO_LENGTH_FRAMES, h.frames as i64)
        .bytes(AUDIO_ENCODED, wav)
        .string(AUDIO_CONTENT_TYPE, "audio/wav");
    Ok(Message::new()
        .string(VALUE_TAG, tag)
        .message(VALUE_AUDIO, &audio)
        .into_bytes())
}

/// An `Event` of `step` at `wall_time` (seconds since the epoch) holding `values` (encoded
/// `Summary.Value`s).
pub fn event<'a>(
    wall_time: f64,
    step: usize,
    values: impl IntoIterator<Item = &'a [u8]>,
) -> Vec<u8> {
    let summary = values
        .into_iter()
        .fold(Message::new(), |m, v| m.bytes(SUMMARY_VALUE, v));
    Message::new()
        .double(EVENT_WALL_TIME, wall_time)
        .int64(EVENT_STEP, step as i64)
        .message(EVENT_SUMMARY, &summary)
        .into_bytes()
}

/// The `Event` that opens a file.
pub fn version_event(wall_time: f64) -> Vec<u8> {
    Message::new()
        .double(EVENT_WALL_TIME, wall_time)
        .string(EVENT_FILE_VERSION, FILE_VERSION)
        .into_bytes()
}

/// The scalars of an optimizer step: `train/…`, with the step's frames per second and, in a
/// sharded run, the bytes sent (docs/training.md §9.1).
pub fn step_values(m: &StepMetrics) -> Vec<Vec<u8>> {
    let mut out = vec![
        scalar("train/loss", m.loss),
        scalar("train/loss_talker", m.loss_talker),
        scalar("train/loss_sub", m.loss_sub),
        scalar("train/lr", m.lr),
        scalar("train/grad_norm", m.grad_norm),
        scalar("train/frames_per_second", m.frames as f64 / m.seconds),
        scalar("train/epoch", m.epoch as f64),
    ];
    if let Some(b) = m.sent_within_node {
        out.push(scalar("train/sent_bytes_within_node", b as f64));
    }
    if let Some(b) = m.sent_across_nodes {
        out.push(scalar("train/sent_bytes_across_nodes", b as f64));
    }
    out
}

/// The scalars and audio of an evaluation: `eval/…`, and per sample `samples/<voice>/<NN>/…`
/// (`NN` counting that voice's samples from 01, in the order of `metrics.jsonl`), its WAV read
/// relative to `workspace`.
pub fn eval_values(e: &EvalMetrics, workspace: &Path) -> Result<Vec<Vec<u8>>> {
    let mut out = vec![
        scalar("eval/val_loss", e.val_loss),
        scalar("eval/val_loss_talker", e.val_loss_talker),
        scalar("eval/val_loss_sub", e.val_loss_sub),
    ];
    if let Some(score) = e.score {
        out.push(scalar("eval/score", score));
    }
    let mut per_voice: HashMap<&str, usize> = HashMap::new();
    for s in e.samples.iter().flatten() {
        let n = per_voice.entry(&s.voice).or_default();
        *n += 1;
        out.extend(sample_values(
            s,
            &format!("samples/{}/{:02}", s.voice, n),
            workspace,
        )?);
    }
    Ok(out)
}

fn sample_values(s: &SampleMetrics, prefix: &str, workspace: &Path) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    if let Some(v) = s.similarity {
        out.push(scalar(&format!("{prefix}/similarity"), v));
    }
    out.push(scalar(&format!("{prefix}/rate_ratio"), s.rate_ratio));
    if let Some(v) = s.wer {
        out.push(scalar(&format!("{prefix}/wer"), v));
    }
    let path = workspace.join(&s.wav);
    let wav = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    out.push(audio(&format!("{prefix}/audio"), &wav, &path)?);
    Ok(out)
}

/// What an audio summary says of its WAV.
#[derive(Debug, PartialEq)]
struct WavHeader {
    sample_rate: u32,
    channels: u16,
    frames: u64,
}

/// The `fmt ` and `data` chunks of a RIFF WAVE file of integer PCM.
fn wav_header(b: &[u8]) -> Result<WavHeader> {
    if b.len() < 12 || &b[..4] != b"RIFF" || &b[8..12] != b"WAVE" {
        bail!("no RIFF WAVE header");
    }
    let (mut at, mut fmt) = (12usize, None);
    while at + 8 <= b.len() {
        let id = &b[at..at + 4];
        let size = u32::from_le_bytes(b[at + 4..at + 8].try_into()?) as usize;
        let body = &b[at + 8..(at + 8).saturating_add(size).min(b.len())];
        match id {
            b"fmt " if body.len() >= 16 => {
                let u16_at = |i: usize| u16::from_le_bytes([body[i], body[i + 1]]);
                let rate = u32::from_le_bytes(body[4..8].try_into()?);
                fmt = Some((u16_at(2), rate, u16_at(14)));
            }
            b"data" => {
                let Some((channels, sample_rate, bits)) = fmt else {
                    bail!("data before the fmt chunk");
                };
                let frame_bytes = u64::from(channels) * u64::from(bits).div_ceil(8);
                if frame_bytes == 0 {
                    bail!("{channels} channels of {bits} bits");
                }
                return Ok(WavHeader {
                    sample_rate,
                    channels,
                    frames: body.len() as u64 / frame_bytes,
                });
            }
            _ => {}
        }
        // Chunks are padded to an even size.
        at = at.saturating_add(8).saturating_add(size + (size & 1));
    }
    bail!("no data chunk")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wav_header_gives_rate_channels_and_frames() {
        // 44-byte canonical header of 16-bit mono at 24 kHz, then a LIST chunk, then 5 frames.
        let mut b = Vec::new();
        b.extend_from_slice(b"RIFF\0\0\0\0WAVE");
        b.extend_from_slice(b"fmt \x10\0\0\0");
        b.extend_from_slice(&1u16.to_le_bytes()); // PCM
        b.extend_from_slice(&1u16.to_le_bytes()); // channels
        b.extend_from_slice(&24_000u32.to_le_bytes());
        b.extend_from_slice(&48_000u32.to_le_bytes());
        b.extend_from_slice(&2u16.to_le_bytes());
        b.extend_from_slice(&16u16.to_le_bytes());
        b.extend_from_slice(b"LIST\x03\0\0\0abc\0");
        b.extend_from_slice(b"data\x0a\0\0\0");
        b.extend_from_slice(&[0u8; 10]);
        assert_eq!(
            wav_header(&b).unwrap(),
            WavHeader {
                sample_rate: 24_000,
                channels: 1,
                frames: 5
            }
        );
        assert!(wav_header(b"RIFF\0\0\0\0WAVE").is_err());
        assert!(wav_header(b"not a wav at all").is_err());
    }
}
