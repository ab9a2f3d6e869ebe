//! The bytes of a speech response (docs/serving.md §2): 16-bit 24 kHz mono PCM, optionally
//! behind a WAV header, sent as it is decoded — as a plain audio stream or as OpenAI's
//! server-sent events with base64 chunks.

use base64::Engine;
use bytes::Bytes;

use vc_audio::wav::to_i16;

/// `response_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A WAV header, then the samples. The header's sizes are 0xFFFFFFFF ("unknown length",
    /// as streamed WAV is written): readers take the samples up to the end of the stream.
    Wav,
    /// Raw 16-bit little-endian samples, 24 kHz, mono.
    Pcm,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Wav => "wav",
            Format::Pcm => "pcm",
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Wav => "audio/wav",
            Format::Pcm => "audio/pcm",
        }
    }
}

/// `stream_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// The audio bytes themselves.
    Audio,
    /// `data: {"type": "speech.audio.delta", "audio": BASE64}` events, then
    /// `speech.audio.done` with the usage (OpenAI's format).
    Sse,
}

/// The WAV header of a mono 16-bit stream of unknown length.
pub fn wav_header(rate: u32) -> [u8; 44] {
    let mut h = [0u8; 44];
    h[0..4].copy_from_slice(b"RIFF");
    h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    h[8..12].copy_from_slice(b"WAVE");
    h[12..16].copy_from_slice(b"fmt ");
    h[16..20].copy_from_slice(&16u32.to_le_bytes());
    h[20..22].copy_from_slice(&1u16.to_le_bytes()); // PCM
    h[22..24].copy_from_slice(&1u16.to_le_bytes()); // mono
    h[24..28].copy_from_slice(&rate.to_le_bytes());
    h[28..32].copy_from_slice(&(rate * 2).to_le_bytes());
    h[32..34].copy_from_slice(&2u16.to_le_bytes());
    h[34..36].copy_from_slice(&16u16.to_le_bytes());
    h[36..40].copy_from_slice(b"data");
    h[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
    h
}

/// Samples as 16-bit little-endian PCM, rounded exactly as `voiceclone speak` writes them.
pub fn pcm16(samples: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(samples.len() * 2);
    for &s in samples {
        out.extend_from_slice(&to_i16(s).to_le_bytes());
    }
    out
}

/// Turns decoded samples into the response's byte chunks.
pub struct ResponseEncoder {
    pub format: Format,
    pub framing: Framing,
    rate: u32,
}

impl ResponseEncoder {
    pub fn new(format: Format, framing: Framing, rate: u32) -> Self {
        ResponseEncoder {
            format,
            framing,
            rate,
        }
    }

    pub fn content_type(&self) -> &'static str {
        match self.framing {
            Framing::Audio => self.format.content_type(),
            Framing::Sse => "text/event-stream",
        }
    }

    /// What goes out before any sample (the WAV header).
    pub fn start(&self) -> Option<Bytes> {
        match self.format {
            Format::Wav => Some(self.frame(&wav_header(self.rate))),
            Format::Pcm => None,
        }
    }

    /// The chunk of some samples.
    pub fn samples(&self, samples: &[f32]) -> Bytes {
        self.frame(&pcm16(samples))
    }

    fn frame(&self, bytes: &[u8]) -> Bytes {
        match self.framing {
            Framing::Audio => Bytes::copy_from_slice(bytes),
            Framing::Sse => sse_event(&serde_json::json!({
                "type": "speech.audio.delta",
                "audio": base64::engine::general_purpose::STANDARD.encode(bytes),
            })),
        }
    }

    /// The end of a complete response (SSE: the `speech.audio.done` event with the usage:
    /// input tokens = text tokens, output tokens = generated frames).
    pub fn done(&self, input_tokens: usize, output_tokens: usize) -> Option<Bytes> {
        match self.framing {
            Framing::Audio => None,
            Framing::Sse => Some(sse_event(&serde_json::json!({
                "type": "speech.audio.done",
                "usage": {
                    "input_tokens": input_tokens,
                    "output_tokens": output_tokens,
                    "total_tokens": input_tokens + output_tokens,
                },
            }))),
        }
    }

    /// An error after the stream began (SSE only: an `error` event; an audio stream is
    /// aborted instead, so the client sees an incomplete body).
    pub fn error(&self, message: &str) -> Option<Bytes> {
        match self.framing {
            Framing::Audio => None,
            Framing::Sse => Some(sse_event(&serde_json::json!({
                "type": "error",
                "error": {"message": message, "type": "server_error", "param": null, "code": null},
            }))),
        }
    }
}

fn sse_event(v: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wav_header_describes_mono_16_bit_of_unknown_length() {
        let h = wav_header(24_000);
        assert_eq!(&h[0..4], b"RIFF");
        assert_eq!(&h[36..40], b"data");
        assert_eq!(u32::from_le_bytes(h[24..28].try_into().unwrap()), 24_000);
        assert_eq!(u32::from_le_bytes(h[28..32].try_into().unwrap()), 48_000);
        assert_eq!(u32::from_le_bytes(h[40..44].try_into().unwrap()), u32::MAX);
    }

    #[test]
    fn sse_chunks_carry_base64_of_the_audio_bytes() {
        let e = ResponseEncoder::new(Format::Pcm, Framing::Sse, 24_000);
        let b = e.samples(&[0.5, -1.0]);
        let text = std::str::from_utf8(&b).unwrap();
        assert!(text.starts_with("data: ") && text.ends_with("\n\n"));
        let v: serde_json::Value = serde_json::from_str(&text[6..]).unwrap();
        assert_eq!(v["type"], "speech.audio.delta");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(v["audio"].as_str().unwrap())
            .unwrap();
        assert_eq!(bytes, pcm16(&[0.5, -1.0]));
        assert_eq!(pcm16(&[0.5, -1.0]), [0x00, 0x40, 0x01, 0x80]);
        let done = e.done(3, 4).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(std::str::from_utf8(&done).unwrap()[6..].trim()).unwrap();
        assert_eq!(v["usage"]["total_tokens"], 7);
    }
}
