//! Small signal measurements shared by the segmenter and the tests: levels, tone detection,
//! frame energies.

use std::f64::consts::PI;

/// A sine of `freq` Hz and peak `amplitude`, `len` samples at `rate` Hz.
pub fn sine(freq: f64, amplitude: f32, rate: u32, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| amplitude * (2.0 * PI * freq * i as f64 / rate as f64).sin() as f32)
        .collect()
}

/// RMS level in dB relative to full scale of a full-scale sine (a full-scale sine reads 0 dB).
pub fn rms_db(x: &[f32]) -> f64 {
    let mean_sq = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len().max(1) as f64;
    10.0 * (2.0 * mean_sq).max(1e-30).log10()
}

/// Level (same scale as [`rms_db`]) of the component at exactly `freq` Hz, by the Goertzel
/// algorithm over a Hann window (so leakage from other frequencies stays low).
pub fn goertzel_db(x: &[f32], freq: f64, rate: u32) -> f64 {
    let n = x.len();
    let w = 2.0 * PI * freq / rate as f64;
    let (mut re, mut im, mut wsum) = (0.0f64, 0.0f64, 0.0f64);
    for (i, &v) in x.iter().enumerate() {
        let win = 0.5 - 0.5 * (2.0 * PI * i as f64 / n as f64).cos();
        wsum += win;
        re += v as f64 * win * (w * i as f64).cos();
        im -= v as f64 * win * (w * i as f64).sin();
    }
    // Amplitude of the sinusoid = 2|X|/Σwin; its RMS level on the scale above is 20·log10(A).
    let amplitude = 2.0 * (re * re + im * im).sqrt() / wsum;
    20.0 * amplitude.max(1e-15).log10()
}

/// RMS energy in dB (re. full scale) of consecutive frames of `frame` samples.
pub fn frame_levels_db(x: &[f32], frame: usize) -> Vec<f64> {
    x.chunks(frame.max(1))
        .map(|c| {
            let mean_sq = c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / c.len() as f64;
            10.0 * mean_sq.max(1e-20).log10()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_measurements_agree_on_a_pure_tone() {
        let x = sine(440.0, 0.5, 16000, 16000);
        assert!((rms_db(&x) - (-6.0206)).abs() < 0.01);
        assert!((goertzel_db(&x, 440.0, 16000) - (-6.0206)).abs() < 0.05);
        assert!(goertzel_db(&x, 3000.0, 16000) < -80.0);
    }
}
