//! 16-bit PCM WAV output (the format of every utterance and of synthesized speech).

use std::io::BufWriter;
use std::path::Path;

use anyhow::{Context, Result};

use vc_core::fsutil::write_atomic_with;

/// Writes mono `samples` (clamped to [-1, 1]) as 16-bit PCM at `rate` Hz, atomically.
pub fn write_pcm16(path: &Path, samples: &[f32], rate: u32) -> Result<()> {
    write_atomic_with(path, |file| write_to(BufWriter::new(file), samples, rate))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The bytes [`write_pcm16`] writes, in memory (for standard output).
pub fn pcm16_bytes(samples: &[f32], rate: u32) -> Result<Vec<u8>> {
    let mut bytes = std::io::Cursor::new(Vec::with_capacity(44 + 2 * samples.len()));
    write_to(&mut bytes, samples, rate)?;
    Ok(bytes.into_inner())
}

fn write_to<W: std::io::Write + std::io::Seek>(out: W, samples: &[f32], rate: u32) -> Result<()> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut writer = hound::WavWriter::new(out, spec)?;
    for &s in samples {
        writer.write_sample(to_i16(s))?;
    }
    writer.finalize()?;
    Ok(())
}

/// Float sample to 16-bit PCM with rounding and clipping.
pub fn to_i16(s: f32) -> i16 {
    (s.clamp(-1.0, 1.0) * 32767.0).round() as i16
}
