//! Audio in and out: decoding (symphonia), resampling (rubato), WAV output (hound), and the
//! few signal measurements the rest of the pipeline needs: [`decode`] (any supported file to
//! mono samples), [`resample`](mod@resample), [`wav`] (16-bit PCM output), [`analysis`] (levels, tones,
//! frame energies).

pub mod analysis;
pub mod decode;
pub mod resample;
pub mod wav;

/// Output rate of every utterance and of synthesis (the Qwen3-TTS codec's rate).
pub const OUTPUT_RATE: u32 = 24_000;
/// Whisper's input rate.
pub const WHISPER_RATE: u32 = 16_000;

/// Decodes `path` and resamples it to `rate` Hz mono. A damaged file gives its readable part,
/// with a warning in the log.
pub fn load_mono(path: &std::path::Path, rate: u32) -> anyhow::Result<Vec<f32>> {
    let audio =
        decode::decode_file(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if let Some(damage) = &audio.damage {
        tracing::warn!("{}: {damage}", path.display());
    }
    resample::resample(&audio.samples, audio.sample_rate, rate)
}
