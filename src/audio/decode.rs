//! Decoding any supported audio file to mono `f32` samples with symphonia.
//!
//! Supported: WAV (8/16/24/32-bit integer, 32/64-bit float, ADPCM), FLAC, MP3, Ogg Vorbis,
//! M4A/MP4 with AAC or ALAC, AIFF, CAF. Multi-channel audio is averaged to mono.

use std::fs::File;
use std::path::Path;

use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{DecoderOptions, CODEC_TYPE_NULL};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

/// Mono audio at its native sample rate.
#[derive(Debug, Clone)]
pub struct Audio {
    pub samples: Vec<f32>,
    pub sample_rate: u32,
}

impl Audio {
    pub fn duration_seconds(&self) -> f64 {
        self.samples.len() as f64 / self.sample_rate as f64
    }
}

/// Why a file could not be decoded; the message is meant for the user.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("cannot open: {0}")]
    Open(#[source] std::io::Error),
    #[error("empty file")]
    Empty,
    #[error("not a recognised audio format ({0})")]
    UnknownFormat(String),
    #[error("no audio track")]
    NoTrack,
    #[error("unsupported codec ({0})")]
    UnsupportedCodec(String),
    #[error("corrupt or truncated audio: {0}")]
    Corrupt(String),
    #[error("contains no audio samples")]
    NoSamples,
}

/// File extensions treated as audio when scanning folders.
pub const AUDIO_EXTENSIONS: &[&str] = &[
    "wav", "wave", "flac", "mp3", "ogg", "oga", "m4a", "mp4", "aac", "alac", "aif", "aiff", "caf",
];

/// True when `path` has one of [`AUDIO_EXTENSIONS`] (case-insensitive).
pub fn has_audio_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| AUDIO_EXTENSIONS.iter().any(|a| a.eq_ignore_ascii_case(e)))
}

/// Decodes the first audio track of `path` to mono.
///
/// A decode error anywhere is fatal (the file is corrupt), and so is a stream that ends before
/// the frame count its header announces (the file was cut off): keeping half a recording
/// silently would hide the damage from the user.
pub fn decode_file(path: &Path) -> Result<Audio, DecodeError> {
    let file = File::open(path).map_err(DecodeError::Open)?;
    let len = file.metadata().map_err(DecodeError::Open)?.len();
    if len == 0 {
        return Err(DecodeError::Empty);
    }
    decode_source(Box::new(file), path.extension().and_then(|e| e.to_str()))
}

/// [`decode_file`] for audio held in memory (an uploaded file); `extension` is a format hint.
pub fn decode_bytes(bytes: Vec<u8>, extension: Option<&str>) -> Result<Audio, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    decode_source(Box::new(std::io::Cursor::new(bytes)), extension)
}

fn decode_source(
    source: Box<dyn symphonia::core::io::MediaSource>,
    extension: Option<&str>,
) -> Result<Audio, DecodeError> {
    let mss = MediaSourceStream::new(source, Default::default());
    let mut hint = Hint::new();
    if let Some(ext) = extension {
        hint.with_extension(ext);
    }
    let probed = symphonia::default::get_probe()
        .format(
            &hint,
            mss,
            &FormatOptions::default(),
            &MetadataOptions::default(),
        )
        .map_err(|e| DecodeError::UnknownFormat(short(&e)))?;
    let mut format = probed.format;
    let track = format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or(DecodeError::NoTrack)?;
    let track_id = track.id;
    let params = track.codec_params.clone();
    let mut decoder = symphonia::default::get_codecs()
        .make(&params, &DecoderOptions::default())
        .map_err(|e| DecodeError::UnsupportedCodec(short(&e)))?;

    let mut sample_rate = params.sample_rate.unwrap_or(0);
    let mut samples: Vec<f32> = Vec::new();
    if let Some(frames) = params.n_frames {
        samples.reserve(frames.min(1 << 28) as usize);
    }
    let mut buf: Option<SampleBuffer<f32>> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(p) => p,
            Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(SymError::ResetRequired) => break,
            Err(e) => return Err(DecodeError::Corrupt(short(&e))),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let decoded = match decoder.decode(&packet) {
            Ok(d) => d,
            Err(e) => return Err(DecodeError::Corrupt(short(&e))),
        };
        let spec = *decoded.spec();
        sample_rate = spec.rate;
        let channels = spec.channels.count().max(1);
        let needed = decoded.capacity() * channels;
        if buf.as_ref().is_none_or(|b| b.capacity() < needed) {
            buf = Some(SampleBuffer::new(decoded.capacity() as u64, spec));
        }
        let b = buf.as_mut().expect("sample buffer allocated above");
        b.copy_interleaved_ref(decoded);
        downmix_into(b.samples(), channels, &mut samples);
    }
    if let Some(expected) = params.n_frames {
        // A container that announces more frames than it delivers was cut off.
        let got = samples.len() as u64;
        let delay = params.delay.unwrap_or(0) as u64 + params.padding.unwrap_or(0) as u64;
        if got + delay + 4096 < expected {
            return Err(DecodeError::Corrupt(format!(
                "truncated: header announces {expected} frames, only {got} decoded"
            )));
        }
    }
    if samples.is_empty() || sample_rate == 0 {
        return Err(DecodeError::NoSamples);
    }
    Ok(Audio {
        samples,
        sample_rate,
    })
}

fn downmix_into(interleaved: &[f32], channels: usize, out: &mut Vec<f32>) {
    if channels == 1 {
        out.extend_from_slice(interleaved);
        return;
    }
    let scale = 1.0 / channels as f32;
    out.extend(
        interleaved
            .chunks_exact(channels)
            .map(|frame| frame.iter().sum::<f32>() * scale),
    );
}

fn short(e: &SymError) -> String {
    match e {
        SymError::IoError(io) => format!("I/O error: {io}"),
        SymError::DecodeError(m) => format!("decode error: {m}"),
        SymError::Unsupported(m) => format!("unsupported: {m}"),
        SymError::LimitError(m) => format!("limit exceeded: {m}"),
        SymError::SeekError(_) => "seek error".to_string(),
        SymError::ResetRequired => "stream reset required".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downmix_averages_channels() {
        let mut out = Vec::new();
        downmix_into(&[1.0, 0.0, 0.5, 0.5, -1.0, 1.0], 2, &mut out);
        assert_eq!(out, vec![0.5, 0.5, 0.0]);
    }

    #[test]
    fn extension_check_is_case_insensitive() {
        assert!(has_audio_extension(Path::new("a/B.WAV")));
        assert!(has_audio_extension(Path::new("x.m4a")));
        assert!(!has_audio_extension(Path::new("notes.txt")));
        assert!(!has_audio_extension(Path::new("noext")));
    }
}
