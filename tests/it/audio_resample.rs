//! Resampler quality: pass-band tones keep frequency and level (±0.1 dB up to 0.9 × the lower
//! Nyquist frequency) and images/aliases are suppressed by at least 60 dB.

use vc_audio::analysis::{goertzel_db, rms_db, sine};
use vc_audio::resample;

/// Level of `freq` in the steady middle of the resampled tone, relative to the input level.
fn through(freq: f64, from: u32, to: u32, probe: f64) -> (f64, f64) {
    let x = sine(freq, 0.5, from, from as usize);
    let y = resample::resample(&x, from, to).unwrap();
    assert_eq!(y.len(), resample::output_len(x.len(), from, to));
    let mid = &y[y.len() / 8..y.len() * 7 / 8];
    (
        goertzel_db(mid, freq, to) - rms_db(&x),
        goertzel_db(mid, probe, to) - rms_db(&x),
    )
}

#[test]
fn passband_is_flat_to_within_a_tenth_of_a_db() {
    let mut worst: f64 = 0.0;
    for (from, to) in [
        (48000, 24000),
        (44100, 16000),
        (16000, 24000),
        (8000, 24000),
        (22050, 16000),
    ] {
        let nyquist = from.min(to) as f64 / 2.0;
        for frac in [0.01, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9] {
            let f = (nyquist * frac).round();
            let (gain, _) = through(f, from, to, f);
            assert!(
                gain.abs() <= 0.1,
                "{from}->{to} Hz: {f} Hz changed by {gain:.3} dB"
            );
            worst = worst.max(gain.abs());
        }
    }
    eprintln!("worst pass-band deviation: {worst:.4} dB");
}

#[test]
fn downsampling_suppresses_aliases_by_60_db() {
    // A tone above the new Nyquist frequency would fold back to `to - f`.
    for (from, to, f) in [
        (48000u32, 24000u32, 13000.0),
        (48000, 24000, 20000.0),
        (44100, 16000, 9500.0),
        (24000, 16000, 11000.0),
    ] {
        let alias = to as f64 - f;
        let (_, at_alias) = through(f, from, to, alias);
        assert!(
            at_alias <= -60.0,
            "{from}->{to}: {f} Hz aliases to {alias} Hz at {at_alias:.1} dB"
        );
        eprintln!("{from}->{to}: {f} Hz alias at {alias} Hz: {at_alias:.1} dB");
    }
}

#[test]
fn upsampling_suppresses_images_by_60_db() {
    // Upsampling mirrors a tone around the old Nyquist frequency: f -> from - f.
    for (from, to, f) in [
        (16000u32, 24000u32, 7000.0),
        (16000, 24000, 5000.0),
        (8000, 24000, 3000.0),
        (22050, 24000, 9000.0),
    ] {
        let image = from as f64 - f;
        let (gain, at_image) = through(f, from, to, image);
        assert!(gain.abs() <= 0.1);
        assert!(
            at_image <= -60.0,
            "{from}->{to}: image of {f} Hz at {image} Hz is {at_image:.1} dB"
        );
        eprintln!("{from}->{to}: image of {f} Hz at {image} Hz: {at_image:.1} dB");
    }
}
