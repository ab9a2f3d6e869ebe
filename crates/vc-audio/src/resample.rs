//! Sample-rate conversion with rubato's band-limited sinc interpolator (512-tap
//! Blackman-Harris² windowed sinc). rubato's `SincFixedIn` starts its window centred on the
//! first input sample, but depending on the ratio its output instants sit up to about one
//! output sample early or late; the whole-sample part of that offset is measured once per
//! conversion (where the resampled impulse peaks) and removed, so the output is time-aligned
//! with the input to within half an output sample. The tail is flushed and the output cut to
//! exactly `ceil(len · to / from)` samples.
//!
//! Every pair of common rates has a rational ratio: output instants fall on at most
//! `to / gcd(from, to)` distinct phases between input samples (3 for 16 -> 24 kHz, 80 for
//! 44.1 -> 24 kHz). When that number is small, the sinc table is built with exactly those phases
//! and each output sample is one 512-tap dot product with the right phase (rubato's `Nearest`
//! mode; a synchronous polyphase filter). Other ratios use a 256× oversampled table with cubic
//! interpolation between its entries, four dot products per output sample.

use anyhow::{Context, Result};
use rubato::{
    calculate_cutoff, Resampler, SincFixedIn, SincInterpolationParameters, SincInterpolationType,
    WindowFunction,
};

const SINC_LEN: usize = 512;
const CHUNK: usize = 4096;
/// Most filter phases built into an exact table (512 × 1024 f32 = 2 MiB).
const MAX_EXACT_PHASES: u32 = 1024;
/// Table oversampling for ratios with more phases than that.
const INTERPOLATED_OVERSAMPLING: usize = 256;

/// Distinct fractional positions of the output instants on the input grid.
pub fn phases(from: u32, to: u32) -> u32 {
    let (mut a, mut b) = (from, to);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    to / a
}

/// Number of output samples for `len` input samples.
pub fn output_len(len: usize, from: u32, to: u32) -> usize {
    (len as u64 * to as u64).div_ceil(from as u64) as usize
}

/// Resamples mono `samples` from `from` Hz to `to` Hz.
pub fn resample(samples: &[f32], from: u32, to: u32) -> Result<Vec<f32>> {
    resample_with(samples, from, to, phases(from, to) <= MAX_EXACT_PHASES)
}

fn resample_with(samples: &[f32], from: u32, to: u32, exact_phases: bool) -> Result<Vec<f32>> {
    anyhow::ensure!(from > 0 && to > 0, "invalid sample rates {from} -> {to}");
    if from == to || samples.is_empty() {
        return Ok(samples.to_vec());
    }
    let lag = whole_sample_lag(from, to, exact_phases)?;
    let wanted = output_len(samples.len(), from, to);
    let mut out = convert(
        samples,
        from,
        to,
        exact_phases,
        wanted + lag.max(0) as usize,
    )?;
    if lag > 0 {
        // Output instants lag behind: drop the first samples.
        out.drain(..lag as usize);
    } else if lag < 0 {
        // They lead: the first samples lie before the input's start, which is silence.
        out.splice(0..0, std::iter::repeat_n(0.0, lag.unsigned_abs()));
    }
    out.truncate(wanted);
    Ok(out)
}

/// By how many whole output samples rubato's output lags the ideal instants `i / to`: the
/// rounded offset of the resampled impulse's peak (refined between samples by a parabola).
fn whole_sample_lag(from: u32, to: u32, exact_phases: bool) -> Result<isize> {
    let at = 2 * SINC_LEN;
    let mut impulse = vec![0f32; 4 * SINC_LEN];
    impulse[at] = 1.0;
    let wanted = output_len(impulse.len(), from, to);
    let y = convert(&impulse, from, to, exact_phases, wanted)?;
    let peak = (1..y.len() - 1)
        .max_by(|&a, &b| y[a].abs().total_cmp(&y[b].abs()))
        .expect("the probe has samples");
    let (l, c, r) = (y[peak - 1] as f64, y[peak] as f64, y[peak + 1] as f64);
    let curvature = l - 2.0 * c + r;
    let refine = if curvature != 0.0 {
        0.5 * (l - r) / curvature
    } else {
        0.0
    };
    let ideal = at as f64 * to as f64 / from as f64;
    Ok((peak as f64 + refine - ideal).round() as isize)
}

/// At least `wanted` output samples of rubato's conversion of `samples` (zeros after the end).
fn convert(
    samples: &[f32],
    from: u32,
    to: u32,
    exact_phases: bool,
    wanted: usize,
) -> Result<Vec<f32>> {
    let window = WindowFunction::BlackmanHarris2;
    let phases = phases(from, to);
    let (oversampling_factor, interpolation) = if exact_phases {
        (phases as usize, SincInterpolationType::Nearest)
    } else {
        (INTERPOLATED_OVERSAMPLING, SincInterpolationType::Cubic)
    };
    let params = SincInterpolationParameters {
        sinc_len: SINC_LEN,
        f_cutoff: calculate_cutoff(SINC_LEN, window),
        oversampling_factor,
        interpolation,
        window,
    };
    let mut resampler = SincFixedIn::<f32>::new(to as f64 / from as f64, 1.0, params, CHUNK, 1)
        .with_context(|| format!("cannot build a {from} -> {to} Hz resampler"))?;
    let mut out: Vec<f32> = Vec::with_capacity(wanted + resampler.output_frames_max());
    let mut output_buf = vec![vec![0f32; resampler.output_frames_max()]];

    let mut pos = 0;
    while samples.len() - pos >= resampler.input_frames_next() {
        let n = resampler.input_frames_next();
        let (_, produced) = resampler
            .process_into_buffer(&[&samples[pos..pos + n]], &mut output_buf, None)
            .context("resampling failed")?;
        out.extend_from_slice(&output_buf[0][..produced]);
        pos += n;
    }
    if pos < samples.len() {
        let (_, produced) = resampler
            .process_partial_into_buffer(Some(&[&samples[pos..]]), &mut output_buf, None)
            .context("resampling failed")?;
        out.extend_from_slice(&output_buf[0][..produced]);
    }
    // Flush the filter's tail with silence until the output is complete.
    while out.len() < wanted {
        let (_, produced) = resampler
            .process_partial_into_buffer(None::<&[&[f32]]>, &mut output_buf, None)
            .context("resampling failed")?;
        out.extend_from_slice(&output_buf[0][..produced]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{goertzel_db, rms_db, sine};

    /// The shift (in output samples, to 1/100) that best aligns `y` with the ideal 1 kHz,
    /// 0.5-amplitude tone at `rate`, and the RMS error there.
    fn best_alignment(y: &[f32], rate: u32) -> (f64, f64) {
        let n = y.len();
        (-100..=100)
            .map(|k| {
                let d = k as f64 / 100.0;
                let sq = (n / 10..n * 9 / 10)
                    .map(|i| {
                        let t = (i as f64 + d) / rate as f64;
                        let ideal = 0.5 * (2.0 * std::f64::consts::PI * 1000.0 * t).sin();
                        (y[i] as f64 - ideal).powi(2)
                    })
                    .sum::<f64>();
                (d, (sq / (n as f64 * 0.8)).sqrt())
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap()
    }

    #[test]
    fn output_instants_are_within_half_a_sample_for_both_tables() {
        for (from, to) in [
            (48000u32, 16000u32),
            (48000, 24000),
            (16000, 24000),
            (8000, 24000),
            (44100, 24000),
            (44100, 16000),
            (22050, 16000),
        ] {
            let x = sine(1000.0, 0.5, from, from as usize / 2);
            for exact in [true, false] {
                let y = resample_with(&x, from, to, exact).unwrap();
                let (shift, rms) = best_alignment(&y, to);
                assert!(
                    shift.abs() <= 0.5 && rms < 5e-4,
                    "{from}->{to} (exact table: {exact}): best shift {shift}, rms error {rms:.1e}"
                );
            }
        }
    }

    #[test]
    fn phases_of_common_ratios() {
        assert_eq!(phases(16000, 24000), 3);
        assert_eq!(phases(48000, 24000), 1);
        assert_eq!(phases(44100, 24000), 80);
        assert_eq!(phases(44100, 16000), 160);
        assert_eq!(phases(22050, 16000), 320);
        // 44 056 Hz (NTSC-locked audio) -> 16 kHz has 2000 phases: interpolated table.
        assert!(phases(44056, 16000) > MAX_EXACT_PHASES);
    }

    #[test]
    fn exact_phases_reproduce_the_input_on_shared_instants() {
        // 16 -> 24 kHz: output 3k and input 2k are the same instant, where the sinc is 1 at
        // the centre and 0 at every other tap.
        let x = sine(1000.0, 0.5, 16000, 16000);
        let y = resample(&x, 16000, 24000).unwrap();
        let worst = (1000..7000)
            .map(|k| (y[3 * k] - x[2 * k]).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{worst}");
    }

    #[test]
    fn length_is_ceil_of_ratio() {
        let x = vec![0.0f32; 16001];
        let y = resample(&x, 16000, 24000).unwrap();
        assert_eq!(y.len(), 24002);
        assert_eq!(output_len(44100, 44100, 24000), 24000);
    }

    #[test]
    fn impulse_stays_in_place() {
        for (from, to) in [(48000u32, 24000u32), (16000, 24000), (44100, 16000)] {
            let mut x = vec![0f32; from as usize];
            x[from as usize / 2] = 1.0;
            let y = resample(&x, from, to).unwrap();
            let peak = y
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap()
                .0;
            assert!(
                peak.abs_diff(to as usize / 2) <= 1,
                "{from}->{to}: impulse moved to {peak}"
            );
        }
    }

    #[test]
    fn tone_keeps_frequency_level_and_phase_alignment() {
        // 1 kHz at -6 dBFS, 48 kHz -> 24 kHz: level within 0.1 dB, energy at the tone's bin.
        let x = sine(1000.0, 0.5, 48000, 48000);
        let y = resample(&x, 48000, 24000).unwrap();
        let core = &y[2400..y.len() - 2400];
        assert!((rms_db(core) - rms_db(&x)).abs() < 0.1);
        assert!((goertzel_db(core, 1000.0, 24000) - rms_db(core)).abs() < 0.1);
        // No group delay: the output matches the ideal 24 kHz tone once shifted by less than
        // one output sample (rubato places output instants at a fractional offset).
        let (err, shift) = (-100..=100)
            .map(|k| {
                let d = k as f64 / 100.0;
                let err = (2400..y.len() - 2400)
                    .map(|i| {
                        let t = (i as f64 + d) / 24000.0;
                        (y[i] as f64 - 0.5 * (2.0 * std::f64::consts::PI * 1000.0 * t).sin()).abs()
                    })
                    .fold(0f64, f64::max);
                (err, d)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap();
        assert!(
            err < 2e-3,
            "no alignment within one sample matches (best {shift}: {err})"
        );
    }
}
