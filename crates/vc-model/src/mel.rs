//! The log-mel front end of the speaker encoder (docs/model.md §8.1, `mel_spectrogram` in the
//! official `modeling_qwen3_tts.py`, itself the BigVGAN/HiFi-GAN recipe):
//!
//! ```text
//! y    = reflect_pad(wav, (n_fft - hop) / 2 each side)
//! spec = |stft(y, n_fft, hop, periodic Hann(win), center=False, onesided)|   (sqrt(re² + im² + 1e-9))
//! mel  = librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax) @ spec          (Slaney scale + area norm)
//! out  = log(clamp(mel, 1e-5))                                              (frames, n_mels)
//! ```
//!
//! Everything is computed in f64 (our own radix-2 FFT) and rounded to f32 at the end, so the
//! result is closer to the exact value than the official f32 pipeline (whose own f32 error is
//! about 2e-4 abs, docs/model.md §14). The filterbank reproduces librosa bit for bit, including its
//! rounding of the weights to f32.

use anyhow::{bail, ensure, Result};
use candle_core::{Device, Tensor};

/// STFT / mel parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct MelConfig {
    pub sample_rate: u32,
    /// FFT size; a power of two.
    pub n_fft: usize,
    pub hop: usize,
    /// Hann window length (≤ n_fft; centred in the frame as `torch.stft` does).
    pub win: usize,
    pub n_mels: usize,
    pub fmin: f64,
    pub fmax: f64,
}

impl MelConfig {
    /// The features `extract_speaker_embedding` feeds the speaker encoder (docs/model.md §8.1).
    pub fn speaker_encoder() -> Self {
        MelConfig {
            sample_rate: 24_000,
            n_fft: 1024,
            hop: 256,
            win: 1024,
            n_mels: 128,
            fmin: 0.0,
            fmax: 12_000.0,
        }
    }

    /// Reflect padding added on each side: `(n_fft - hop) / 2` (384 for the speaker encoder).
    pub fn pad(&self) -> usize {
        (self.n_fft - self.hop) / 2
    }

    /// Number of frames for `samples` input samples: `1 + (N + 2·pad − n_fft) // hop`,
    /// or `None` when the input is too short to pad or to fill one frame.
    pub fn frames(&self, samples: usize) -> Option<usize> {
        let padded = samples + 2 * self.pad();
        (samples > self.pad() && padded >= self.n_fft).then(|| 1 + (padded - self.n_fft) / self.hop)
    }

    /// The shortest input [`LogMel::compute`] accepts.
    pub fn min_samples(&self) -> usize {
        self.samples_for_frames(1)
    }

    /// The fewest input samples that give at least `frames` frames.
    pub fn samples_for_frames(&self, frames: usize) -> usize {
        let need = frames.saturating_sub(1) * self.hop + self.n_fft.saturating_sub(2 * self.pad());
        need.max(self.pad() + 1)
    }
}

/// A log-mel spectrogram, row-major `(frames, n_mels)`.
#[derive(Debug, Clone, PartialEq)]
pub struct MelSpectrogram {
    pub frames: usize,
    pub n_mels: usize,
    pub data: Vec<f32>,
}

impl MelSpectrogram {
    /// The features as a `(1, frames, n_mels)` f32 tensor, the layout the speaker encoder takes.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(
            &self.data,
            (1, self.frames, self.n_mels),
            device,
        )?)
    }

    /// Row `frame`.
    pub fn frame(&self, frame: usize) -> &[f32] {
        &self.data[frame * self.n_mels..(frame + 1) * self.n_mels]
    }
}

/// One triangular mel filter: its non-zero weights, starting at FFT bin `start`.
#[derive(Debug, Clone)]
struct Filter {
    start: usize,
    weights: Vec<f64>,
}

/// A reusable log-mel extractor (window, FFT tables and filterbank computed once).
#[derive(Debug, Clone)]
pub struct LogMel {
    cfg: MelConfig,
    window: Vec<f64>,
    fft: Fft,
    filters: Vec<Filter>,
}

impl LogMel {
    pub fn new(cfg: MelConfig) -> Result<Self> {
        ensure!(
            cfg.n_fft.is_power_of_two() && cfg.n_fft >= 2,
            "n_fft must be a power of two, got {}",
            cfg.n_fft
        );
        ensure!(
            cfg.hop > 0 && cfg.hop <= cfg.n_fft,
            "hop {} must be in 1..=n_fft",
            cfg.hop
        );
        ensure!(
            cfg.win > 0 && cfg.win <= cfg.n_fft,
            "window {} must be in 1..=n_fft",
            cfg.win
        );
        ensure!(cfg.n_mels > 0, "n_mels must be positive");
        ensure!(
            cfg.fmin >= 0.0 && cfg.fmax > cfg.fmin && cfg.fmax <= cfg.sample_rate as f64 / 2.0,
            "mel band {}..{} Hz is not inside 0..{} Hz",
            cfg.fmin,
            cfg.fmax,
            cfg.sample_rate as f64 / 2.0
        );
        // torch.hann_window(win, periodic=True), zero-padded to n_fft and centred (torch.stft).
        let mut window = vec![0.0; cfg.n_fft];
        let offset = (cfg.n_fft - cfg.win) / 2;
        for i in 0..cfg.win {
            window[offset + i] =
                0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / cfg.win as f64).cos();
        }
        let basis =
            slaney_mel_filterbank(cfg.sample_rate, cfg.n_fft, cfg.n_mels, cfg.fmin, cfg.fmax);
        let filters = basis
            .iter()
            .map(|row| {
                let first = row.iter().position(|&w| w != 0.0);
                let last = row.iter().rposition(|&w| w != 0.0);
                match (first, last) {
                    (Some(a), Some(b)) => Filter {
                        start: a,
                        weights: row[a..=b].to_vec(),
                    },
                    // librosa warns about empty filters (too many mels for n_fft); keep them
                    // empty, which gives log(1e-5) as the official code does.
                    _ => Filter {
                        start: 0,
                        weights: Vec::new(),
                    },
                }
            })
            .collect();
        Ok(LogMel {
            fft: Fft::new(cfg.n_fft),
            cfg,
            window,
            filters,
        })
    }

    /// The extractor `extract_speaker_embedding` uses (docs/model.md §8.1).
    pub fn speaker_encoder() -> Self {
        Self::new(MelConfig::speaker_encoder()).expect("the built-in mel configuration is valid")
    }

    pub fn config(&self) -> &MelConfig {
        &self.cfg
    }

    /// Log-mel features of `wav` (mono, at `sample_rate`, values expected in [−1, 1]).
    pub fn compute(&self, wav: &[f32]) -> Result<MelSpectrogram> {
        let cfg = &self.cfg;
        let Some(frames) = cfg.frames(wav.len()) else {
            bail!(
                "audio too short for the mel spectrogram: {} samples, at least {} ({:.0} ms at {} Hz) are needed",
                wav.len(),
                cfg.min_samples(),
                cfg.min_samples() as f64 * 1000.0 / cfg.sample_rate as f64,
                cfg.sample_rate
            );
        };
        let padded = reflect_pad(wav, cfg.pad());
        let n_bins = cfg.n_fft / 2 + 1;
        let mut re = vec![0.0f64; cfg.n_fft];
        let mut im = vec![0.0f64; cfg.n_fft];
        let mut mag = vec![0.0f64; n_bins];
        let mut data = Vec::with_capacity(frames * cfg.n_mels);
        for f in 0..frames {
            let start = f * cfg.hop;
            for (i, (r, x)) in re
                .iter_mut()
                .zip(&padded[start..start + cfg.n_fft])
                .enumerate()
            {
                *r = *x * self.window[i];
            }
            im.fill(0.0);
            self.fft.forward(&mut re, &mut im);
            for (k, m) in mag.iter_mut().enumerate() {
                *m = (re[k] * re[k] + im[k] * im[k] + 1e-9).sqrt();
            }
            for filter in &self.filters {
                let bins = &mag[filter.start..filter.start + filter.weights.len()];
                let mel: f64 = filter.weights.iter().zip(bins).map(|(w, m)| w * m).sum();
                data.push(mel.max(1e-5).ln() as f32);
            }
        }
        Ok(MelSpectrogram {
            frames,
            n_mels: cfg.n_mels,
            data,
        })
    }
}

/// `F.pad(x, (pad, pad), mode="reflect")` (the edge sample is not repeated), in f64.
/// Requires `pad < x.len()`, as PyTorch does.
pub fn reflect_pad(x: &[f32], pad: usize) -> Vec<f64> {
    assert!(
        pad == 0 || pad < x.len(),
        "reflect padding {pad} needs more than {} samples",
        x.len()
    );
    let n = x.len();
    let mut out = Vec::with_capacity(n + 2 * pad);
    out.extend((1..=pad).rev().map(|i| x[i] as f64));
    out.extend(x.iter().map(|&v| v as f64));
    out.extend((1..=pad).map(|i| x[n - 1 - i] as f64));
    out
}

/// librosa's Slaney mel scale (`htk=False`): linear below 1 kHz, logarithmic above.
pub fn hz_to_mel(hz: f64) -> f64 {
    const F_SP: f64 = 200.0 / 3.0;
    const MIN_LOG_HZ: f64 = 1000.0;
    let min_log_mel = MIN_LOG_HZ / F_SP;
    let logstep = 6.4f64.ln() / 27.0;
    if hz >= MIN_LOG_HZ {
        min_log_mel + (hz / MIN_LOG_HZ).ln() / logstep
    } else {
        hz / F_SP
    }
}

/// Inverse of [`hz_to_mel`].
pub fn mel_to_hz(mel: f64) -> f64 {
    const F_SP: f64 = 200.0 / 3.0;
    const MIN_LOG_HZ: f64 = 1000.0;
    let min_log_mel = MIN_LOG_HZ / F_SP;
    let logstep = 6.4f64.ln() / 27.0;
    if mel >= min_log_mel {
        MIN_LOG_HZ * (logstep * (mel - min_log_mel)).exp()
    } else {
        F_SP * mel
    }
}

/// `np.linspace(start, stop, n)` (numpy's formula, last point exactly `stop`).
fn linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![start];
    }
    let step = (stop - start) / (n - 1) as f64;
    let mut v: Vec<f64> = (0..n).map(|i| i as f64 * step + start).collect();
    v[n - 1] = stop;
    v
}

/// `librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax)` with librosa's defaults (Slaney scale,
/// `norm="slaney"`, `dtype=float32`): `n_mels` rows of `n_fft/2 + 1` weights. Values are the
/// f32 numbers librosa returns, widened to f64.
pub fn slaney_mel_filterbank(
    sr: u32,
    n_fft: usize,
    n_mels: usize,
    fmin: f64,
    fmax: f64,
) -> Vec<Vec<f64>> {
    let n_bins = n_fft / 2 + 1;
    // fft_frequencies = np.fft.rfftfreq(n_fft, 1/sr) = linspace(0, sr/2, n_bins)
    let fftfreqs: Vec<f64> = (0..n_bins)
        .map(|k| k as f64 * sr as f64 / n_fft as f64)
        .collect();
    let mel_f: Vec<f64> = linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2)
        .into_iter()
        .map(mel_to_hz)
        .collect();
    let fdiff: Vec<f64> = mel_f.windows(2).map(|w| w[1] - w[0]).collect();
    (0..n_mels)
        .map(|i| {
            let enorm = 2.0 / (mel_f[i + 2] - mel_f[i]);
            fftfreqs
                .iter()
                .map(|&f| {
                    let lower = -(mel_f[i] - f) / fdiff[i];
                    let upper = (mel_f[i + 2] - f) / fdiff[i + 1];
                    // stored into a float32 array, then `weights *= enorm` (f64 product, f32 store)
                    let w = lower.min(upper).max(0.0) as f32;
                    (w as f64 * enorm) as f32 as f64
                })
                .collect()
        })
        .collect()
}

/// In-place iterative radix-2 complex FFT (decimation in time), f64.
#[derive(Debug, Clone)]
pub struct Fft {
    n: usize,
    /// `exp(-2πi k / n)` for k < n/2.
    twiddle_re: Vec<f64>,
    twiddle_im: Vec<f64>,
    bitrev: Vec<usize>,
}

impl Fft {
    pub fn new(n: usize) -> Self {
        assert!(n.is_power_of_two(), "FFT size {n} is not a power of two");
        let bits = n.trailing_zeros();
        let bitrev = (0..n)
            .map(|i| {
                if bits == 0 {
                    0
                } else {
                    i.reverse_bits() >> (usize::BITS - bits)
                }
            })
            .collect();
        let (twiddle_re, twiddle_im) = (0..n / 2)
            .map(|k| {
                let a = -2.0 * std::f64::consts::PI * k as f64 / n as f64;
                (a.cos(), a.sin())
            })
            .unzip();
        Fft {
            n,
            twiddle_re,
            twiddle_im,
            bitrev,
        }
    }

    /// `X[k] = Σ x[j] exp(-2πi jk/n)` in place.
    pub fn forward(&self, re: &mut [f64], im: &mut [f64]) {
        let n = self.n;
        assert!(
            re.len() == n && im.len() == n,
            "FFT buffers must hold {n} values"
        );
        for i in 0..n {
            let j = self.bitrev[i];
            if j > i {
                re.swap(i, j);
                im.swap(i, j);
            }
        }
        let mut len = 2;
        while len <= n {
            let half = len / 2;
            let stride = n / len;
            for start in (0..n).step_by(len) {
                for k in 0..half {
                    let (wr, wi) = (self.twiddle_re[k * stride], self.twiddle_im[k * stride]);
                    let (a, b) = (start + k, start + k + half);
                    let tr = re[b] * wr - im[b] * wi;
                    let ti = re[b] * wi + im[b] * wr;
                    re[b] = re[a] - tr;
                    im[b] = im[a] - ti;
                    re[a] += tr;
                    im[a] += ti;
                }
            }
            len *= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64) -> impl FnMut() -> f64 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        }
    }

    #[test]
    fn fft_matches_naive_dft() {
        for n in [1usize, 2, 8, 64, 1024] {
            let mut rnd = lcg(n as u64);
            let x_re: Vec<f64> = (0..n).map(|_| rnd()).collect();
            let x_im: Vec<f64> = (0..n).map(|_| rnd()).collect();
            let (mut re, mut im) = (x_re.clone(), x_im.clone());
            Fft::new(n).forward(&mut re, &mut im);
            let mut max_err = 0.0f64;
            for k in 0..n {
                let (mut sr, mut si) = (0.0, 0.0);
                for j in 0..n {
                    let a = -2.0 * std::f64::consts::PI * ((j * k) % n) as f64 / n as f64;
                    sr += x_re[j] * a.cos() - x_im[j] * a.sin();
                    si += x_re[j] * a.sin() + x_im[j] * a.cos();
                }
                max_err = max_err.max((sr - re[k]).abs()).max((si - im[k]).abs());
            }
            assert!(
                max_err < 1e-9,
                "n={n}: FFT differs from the DFT by {max_err}"
            );
        }
    }

    #[test]
    fn reflect_pad_mirrors_without_repeating_the_edge() {
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(
            reflect_pad(&x, 2),
            vec![3.0, 2.0, 1.0, 2.0, 3.0, 4.0, 5.0, 4.0, 3.0]
        );
        assert_eq!(reflect_pad(&x, 0), vec![1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(
            reflect_pad(&x, 4),
            vec![5.0, 4.0, 3.0, 2.0, 1.0, 2.0, 3.0, 4.0, 5.0, 4.0, 3.0, 2.0, 1.0]
        );
    }

    #[test]
    fn slaney_scale_matches_librosa_values() {
        // librosa.hz_to_mel(1000) == 15, (440) == 6.6, (12000) == 15 + ln(12)/(ln(6.4)/27)
        assert!((hz_to_mel(1000.0) - 15.0).abs() < 1e-12);
        assert!((hz_to_mel(440.0) - 6.6).abs() < 1e-12);
        assert!((hz_to_mel(12_000.0) - (15.0 + 12f64.ln() * 27.0 / 6.4f64.ln())).abs() < 1e-12);
        for hz in [0.0, 10.0, 999.0, 1000.0, 1001.0, 4321.0, 12_000.0] {
            assert!((mel_to_hz(hz_to_mel(hz)) - hz).abs() < 1e-9 * hz.max(1.0));
        }
    }

    #[test]
    fn filterbank_is_triangular_and_area_normalised() {
        let fb = slaney_mel_filterbank(24_000, 1024, 128, 0.0, 12_000.0);
        assert_eq!(fb.len(), 128);
        let df = 24_000.0 / 1024.0;
        let mel_f: Vec<f64> = linspace(0.0, hz_to_mel(12_000.0), 130)
            .into_iter()
            .map(mel_to_hz)
            .collect();
        for (i, row) in fb.iter().enumerate() {
            assert_eq!(row.len(), 513);
            assert!(row.iter().all(|&w| w >= 0.0));
            assert!(row.iter().any(|&w| w > 0.0), "filter {i} is empty");
            // non-zero only strictly inside (f_i, f_{i+2}), rising then falling
            for (k, &w) in row.iter().enumerate() {
                let f = k as f64 * df;
                if f <= mel_f[i] || f >= mel_f[i + 2] {
                    assert_eq!(w, 0.0, "filter {i} bin {k}");
                }
            }
            let peak = row
                .iter()
                .cloned()
                .enumerate()
                .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a })
                .0;
            assert!(row[..=peak].windows(2).all(|w| w[0] <= w[1]));
            assert!(row[peak..].windows(2).all(|w| w[0] >= w[1]));
            // Slaney norm: a unit-area triangle; the Riemann sum is close once it spans many bins.
            let width_bins = (mel_f[i + 2] - mel_f[i]) / df;
            if width_bins > 8.0 {
                let area: f64 = row.iter().sum::<f64>() * df;
                assert!((area - 1.0).abs() < 0.02, "filter {i}: area {area}");
            }
        }
    }

    #[test]
    fn frame_count_and_short_input() {
        let cfg = MelConfig::speaker_encoder();
        assert_eq!(cfg.pad(), 384);
        for n in [256usize, 385, 511, 512, 1000, 24_000, 62_400] {
            let expect = (n + 768 >= 1024 && n > 384).then(|| 1 + (n + 768 - 1024) / 256);
            assert_eq!(cfg.frames(n), expect, "n={n}");
        }
        let mel = LogMel::speaker_encoder();
        assert_eq!(cfg.min_samples(), 385);
        for f in 1..20 {
            let n = cfg.samples_for_frames(f);
            assert!(
                cfg.frames(n).unwrap() >= f && cfg.frames(n - 1).is_none_or(|g| g < f),
                "f={f}"
            );
        }
        assert!(mel.compute(&vec![0.0; 384]).is_err());
        let out = mel.compute(&vec![0.0; 385]).unwrap();
        assert_eq!((out.frames, out.n_mels), (1, 128));
        // silence: magnitude sqrt(1e-9) everywhere, well under the clamp
        assert!(out
            .data
            .iter()
            .all(|&v| (v - (1e-5f64).ln() as f32).abs() < 1e-6));
    }

    #[test]
    fn sine_peaks_in_the_right_mel_band() {
        let mel = LogMel::speaker_encoder();
        let freq = 3000.0;
        let wav: Vec<f32> = (0..24_000)
            .map(|i| (0.5 * (2.0 * std::f64::consts::PI * freq * i as f64 / 24_000.0).sin()) as f32)
            .collect();
        let out = mel.compute(&wav).unwrap();
        assert_eq!(out.frames, 1 + (24_000 + 768 - 1024) / 256);
        let row = out.frame(out.frames / 2);
        let best = (0..128).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
        let mel_f: Vec<f64> = linspace(0.0, hz_to_mel(12_000.0), 130)
            .into_iter()
            .map(mel_to_hz)
            .collect();
        assert!(
            mel_f[best] < freq && freq < mel_f[best + 2],
            "peak in band {best}"
        );
        // magnitude of a 0.5-amplitude sine under a Hann window: 0.5 · 1024/4 = 128 at the peak bin
        let bin = (freq / (24_000.0 / 1024.0)).round() as usize;
        let fb = slaney_mel_filterbank(24_000, 1024, 128, 0.0, 12_000.0);
        assert!(fb[best][bin] > 0.0);
    }
}
