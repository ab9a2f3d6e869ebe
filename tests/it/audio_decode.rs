//! Decoder tests: a known tone in every supported format must come back at its frequency and
//! level, at the file's sample rate, mono.

use std::path::{Path, PathBuf};

use voiceclone::audio::analysis::{goertzel_db, rms_db, sine};
use voiceclone::audio::{decode_file, DecodeError};

const FREQ: f64 = 997.0;
const LEVEL_DB: f64 = -6.0206; // amplitude 0.5

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/audio")
        .join(name)
}

/// Checks rate, length, that the energy sits at `FREQ`, and the level (within `tol_db`).
fn check_tone(path: &Path, rate: u32, seconds: f64, level_db: f64, tol_db: f64) {
    let audio = decode_file(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(audio.sample_rate, rate, "{}", path.display());
    let dur = audio.duration_seconds();
    // Lossy codecs add priming/padding frames; lossless ones must be exact.
    assert!((dur - seconds).abs() < 0.06, "{}: {dur} s", path.display());
    // Measure the steady middle, away from codec start-up and fade-out.
    let n = audio.samples.len();
    let mid = &audio.samples[n / 5..n * 4 / 5];
    let total = rms_db(mid);
    let at_tone = goertzel_db(mid, FREQ, rate);
    assert!(
        (total - level_db).abs() < tol_db,
        "{}: level {total:.3} dB",
        path.display()
    );
    assert!(
        (at_tone - total).abs() < 0.15,
        "{}: {at_tone:.3} dB at tone vs {total:.3} dB total",
        path.display()
    );
    // And not at a neighbouring frequency.
    assert!(
        goertzel_db(mid, FREQ * 1.5, rate) < level_db - 40.0,
        "{}",
        path.display()
    );
}

#[test]
fn flac_44100() {
    check_tone(&fixture("tone-44100.flac"), 44100, 0.5, LEVEL_DB, 0.05);
}

#[test]
fn mp3_44100() {
    check_tone(&fixture("tone-44100.mp3"), 44100, 0.5, LEVEL_DB, 0.3);
}

#[test]
fn ogg_vorbis_48000() {
    check_tone(&fixture("tone-48000.ogg"), 48000, 0.5, LEVEL_DB, 0.3);
}

#[test]
fn m4a_aac_32000() {
    check_tone(&fixture("tone-32000-aac.m4a"), 32000, 0.5, LEVEL_DB, 0.3);
}

#[test]
fn m4a_alac_22050() {
    check_tone(&fixture("tone-22050-alac.m4a"), 22050, 0.5, LEVEL_DB, 0.05);
}

fn write_wav(path: &Path, spec: hound::WavSpec, channels: &[Vec<f32>]) {
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for i in 0..channels[0].len() {
        for ch in channels {
            let s = ch[i];
            match (spec.sample_format, spec.bits_per_sample) {
                (hound::SampleFormat::Float, _) => w.write_sample(s).unwrap(),
                (_, 8) => w.write_sample((s * 127.0).round() as i8).unwrap(),
                (_, 16) => w.write_sample((s * 32767.0).round() as i16).unwrap(),
                (_, 24) => w.write_sample((s * 8_388_607.0).round() as i32).unwrap(),
                (_, 32) => w
                    .write_sample((s as f64 * 2_147_483_647.0).round() as i32)
                    .unwrap(),
                _ => unreachable!(),
            }
        }
    }
    w.finalize().unwrap();
}

#[test]
fn wav_integer_and_float_depths_at_several_rates() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (8, hound::SampleFormat::Int, 8000, 0.3),
        (16, hound::SampleFormat::Int, 16000, 0.01),
        (24, hound::SampleFormat::Int, 44100, 0.01),
        (32, hound::SampleFormat::Int, 48000, 0.01),
        (32, hound::SampleFormat::Float, 96000, 0.01),
    ];
    for (bits, format, rate, tol) in cases {
        let path = dir.path().join(format!("t{bits}-{format:?}-{rate}.wav"));
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: rate,
            bits_per_sample: bits,
            sample_format: format,
        };
        write_wav(&path, spec, &[sine(FREQ, 0.5, rate, rate as usize / 2)]);
        check_tone(&path, rate, 0.5, LEVEL_DB, tol);
    }
}

#[test]
fn stereo_is_downmixed_by_averaging() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stereo.wav");
    let spec = hound::WavSpec {
        channels: 2,
        sample_rate: 24000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    // Tone on the left only: the mono mix has half the amplitude (-6 dB).
    write_wav(
        &path,
        spec,
        &[sine(FREQ, 0.5, 24000, 12000), vec![0.0; 12000]],
    );
    check_tone(&path, 24000, 0.5, LEVEL_DB - 6.0206, 0.02);
}

#[test]
fn bad_files_give_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.wav");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(decode_file(&empty), Err(DecodeError::Empty)));

    let text = dir.path().join("notes.mp3");
    std::fs::write(
        &text,
        "these are not the samples you are looking for\n".repeat(50),
    )
    .unwrap();
    assert!(matches!(
        decode_file(&text),
        Err(DecodeError::UnknownFormat(_))
    ));

    let zero = dir.path().join("zero.wav");
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    hound::WavWriter::create(&zero, spec)
        .unwrap()
        .finalize()
        .unwrap();
    assert!(matches!(decode_file(&zero), Err(DecodeError::NoSamples)));

    for name in ["tone-44100.flac", "tone-22050-alac.m4a"] {
        let bytes = std::fs::read(fixture(name)).unwrap();
        let cut = dir.path().join(format!("cut-{name}"));
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let err = decode_file(&cut).expect_err(name);
        assert!(
            matches!(
                err,
                DecodeError::Corrupt(_) | DecodeError::UnknownFormat(_) | DecodeError::NoTrack
            ),
            "{name}: {err:?}"
        );
    }

    let wav = dir.path().join("trunc.wav");
    write_wav(&wav, spec, &[sine(FREQ, 0.5, 16000, 16000)]);
    let bytes = std::fs::read(&wav).unwrap();
    std::fs::write(&wav, &bytes[..bytes.len() / 3]).unwrap();
    assert!(
        matches!(decode_file(&wav), Err(DecodeError::Corrupt(_))),
        "{:?}",
        decode_file(&wav)
    );

    let missing = dir.path().join("gone.wav");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &missing).unwrap();
    assert!(matches!(decode_file(&missing), Err(DecodeError::Open(_))));
}
