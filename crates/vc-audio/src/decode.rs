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
use symphonia::core::io::{MediaSource, MediaSourceStream, ReadOnlySource};
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

/// Mono audio at its native sample rate.
#[derive(Debug, Clone)]
pub struct Audio {
    pub samples: Vec<f32>,
    pub sample_rate: u32,
    /// Set when the file is damaged and only part of it could be decoded: what was wrong and
    /// how much is missing, for a warning (e.g. "truncated: the header announces 34.2 s").
    pub damage: Option<String>,
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

/// Packets that fail to decode are replaced by silence of their length; after this many in a
/// row the rest of the stream is given up as unreadable.
const MAX_CONSECUTIVE_BAD_PACKETS: usize = 100;
/// A damaged packet claiming to be longer than this (frames) ends the stream instead.
const MAX_SILENCED_PACKET_FRAMES: u64 = 1 << 16;

/// Decodes the first audio track of `path` to mono.
///
/// Damaged files keep what can be read, like a recorder that died mid-take: a stream that
/// ends before the frame count its header announces, or that ends in an error, gives the
/// audio up to that point; a packet that fails to decode becomes silence of its length, so
/// everything after it keeps its time. [`Audio::damage`] says what happened. Files that are
/// not audio at all, and damaged files of which nothing decodes, are errors.
pub fn decode_file(path: &Path) -> Result<Audio, DecodeError> {
    let file = File::open(path).map_err(DecodeError::Open)?;
    let len = file.metadata().map_err(DecodeError::Open)?.len();
    if len == 0 {
        return Err(DecodeError::Empty);
    }
    decode_source(
        Box::new(file),
        || {
            let file = File::open(path).map_err(DecodeError::Open)?;
            Ok(Box::new(ReadOnlySource::new(file)))
        },
        path.extension().and_then(|e| e.to_str()),
    )
}

/// [`decode_file`] for audio held in memory (an uploaded file); `extension` is a format hint.
pub fn decode_bytes(bytes: Vec<u8>, extension: Option<&str>) -> Result<Audio, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    let bytes: std::sync::Arc<[u8]> = bytes.into();
    decode_source(
        Box::new(std::io::Cursor::new(bytes.clone())),
        || {
            Ok(Box::new(ReadOnlySource::new(std::io::Cursor::new(
                bytes.clone(),
            ))))
        },
        extension,
    )
}

/// Decodes `source`; `as_stream` opens the same bytes again as a plain (unseekable) stream,
/// for the readers that fail on a seekable source whose end was cut off.
fn decode_source(
    source: Box<dyn MediaSource>,
    as_stream: impl Fn() -> Result<Box<dyn MediaSource>, DecodeError>,
    extension: Option<&str>,
) -> Result<Audio, DecodeError> {
    let mut hint = Hint::new();
    if let Some(ext) = extension {
        hint.with_extension(ext);
    }
    let probe = |source: Box<dyn MediaSource>| {
        symphonia::default::get_probe().format(
            &hint,
            MediaSourceStream::new(source, Default::default()),
            &FormatOptions::default(),
            &MetadataOptions::default(),
        )
    };
    let mut read_as_stream = false;
    let probed = match probe(source) {
        Ok(probed) => probed,
        // Some readers look at the end of a seekable file while opening it (Ogg reads its
        // last page for the duration) and fail when the end was cut off; read as a plain
        // stream, they start from the beginning and never look there.
        Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            read_as_stream = true;
            probe(as_stream()?).map_err(|e| match e {
                SymError::IoError(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    DecodeError::Corrupt("truncated: the file ends before its first audio".into())
                }
                e => probe_error(&e),
            })?
        }
        Err(e) => return Err(probe_error(&e)),
    };
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
    // Problems met on the way: the stream's end, and packets replaced by silence.
    let mut stream_error: Option<String> = None;
    let (mut bad_packets, mut bad_frames, mut first_bad) = (0usize, 0u64, None::<String>);
    // The current run of bad packets: how many, their frames, the length before it.
    let (mut run_packets, mut run_frames, mut run_from) = (0usize, 0u64, 0usize);
    // Where the next packet should start, on a time base of frames: a reader that skips
    // damaged data (FLAC resynchronises on the next frame header) leaves a gap there.
    let frame_time_base = params
        .time_base
        .is_none_or(|tb| tb.numer == 1 && Some(tb.denom) == params.sample_rate);
    let mut next_ts: Option<u64> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(p) => p,
            Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(SymError::ResetRequired) => break,
            Err(e) => {
                stream_error = Some(short(&e));
                break;
            }
        };
        if packet.track_id() != track_id {
            continue;
        }
        if let Some(expected) = next_ts.filter(|_| frame_time_base) {
            let gap = packet.ts().saturating_sub(expected);
            if gap > 0 && gap <= MAX_SILENCED_PACKET_FRAMES {
                bad_packets += 1;
                bad_frames += gap;
                first_bad.get_or_insert_with(|| "data skipped by the reader".into());
                samples.resize(samples.len() + gap as usize, 0.0);
            }
        }
        next_ts = Some(packet.ts() + packet.dur);
        match decoder.decode(&packet) {
            Ok(decoded) => {
                run_packets = 0;
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
            Err(SymError::DecodeError(m)) if packet.dur <= MAX_SILENCED_PACKET_FRAMES => {
                first_bad.get_or_insert_with(|| format!("decode error: {m}"));
                if run_packets == 0 {
                    (run_frames, run_from) = (0, samples.len());
                }
                run_packets += 1;
                bad_packets += 1;
                if run_packets > MAX_CONSECUTIVE_BAD_PACKETS {
                    break;
                }
                // Keep the timing of what follows: the lost packet becomes silence.
                run_frames += packet.dur;
                bad_frames += packet.dur;
                samples.resize(samples.len() + packet.dur as usize, 0.0);
            }
            Err(e) => {
                stream_error = Some(short(&e));
                break;
            }
        }
    }
    if run_packets > 0 {
        // Nothing decodes after the last good packet: that is where the audio ends.
        samples.truncate(run_from);
        bad_packets -= run_packets;
        bad_frames -= run_frames;
        stream_error.get_or_insert_with(|| {
            format!(
                "the last {run_packets} packet(s) do not decode: {}",
                first_bad.clone().unwrap_or_default()
            )
        });
        if bad_packets == 0 {
            first_bad = None;
        }
    }
    if samples.is_empty() || sample_rate == 0 {
        return Err(match stream_error.or(first_bad) {
            Some(reason) => DecodeError::Corrupt(reason),
            None => DecodeError::NoSamples,
        });
    }

    let seconds = |frames: u64| frames as f64 / sample_rate as f64;
    let mut damage: Vec<String> = Vec::new();
    let got = samples.len() as u64;
    if let Some(expected) = params.n_frames {
        // A container that announces more frames than it delivers was cut off.
        let delay = params.delay.unwrap_or(0) as u64 + params.padding.unwrap_or(0) as u64;
        if got + delay + 4096 < expected {
            damage.push(format!(
                "truncated: the header announces {:.1} s, the stream ends after {:.1} s",
                seconds(expected),
                seconds(got)
            ));
        }
    }
    if let Some(reason) = stream_error {
        damage.push(format!(
            "the stream breaks off after {:.1} s ({reason})",
            seconds(got)
        ));
    }
    if bad_packets > 0 {
        damage.push(format!(
            "{bad_packets} damaged stretch(es), {:.2} s in all, replaced by silence ({})",
            seconds(bad_frames),
            first_bad.unwrap_or_default()
        ));
    }
    if read_as_stream && damage.is_empty() {
        damage.push("the end of the file is cut off or damaged".into());
    }
    Ok(Audio {
        samples,
        sample_rate,
        damage: (!damage.is_empty()).then(|| damage.join("; ")),
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

/// Why no format reader could open the file.
fn probe_error(e: &SymError) -> DecodeError {
    match e {
        // An MP4/M4A recorder writes the index last; without it the audio cannot be found.
        SymError::Unsupported(m) if m.contains("moov") => DecodeError::Corrupt(
            "truncated: the MP4 index (moov atom) is missing, as in a recording that was never \
             finished; nothing can be decoded without it"
                .into(),
        ),
        e => DecodeError::UnknownFormat(short(e)),
    }
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
