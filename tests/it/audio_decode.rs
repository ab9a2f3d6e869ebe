//! Decoder tests: a known tone in every supported format must come back at its frequency and
//! level, at the file's sample rate, mono.

use std::path::{Path, PathBuf};

use vc_audio::analysis::{goertzel_db, rms_db, sine};
use vc_audio::{decode::decode_file, decode::DecodeError};

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

/// The first `fraction` of `bytes`, written to `dir/name`.
fn cut_file(dir: &Path, name: &str, bytes: &[u8], fraction: f64) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, &bytes[..(bytes.len() as f64 * fraction) as usize]).unwrap();
    path
}

#[test]
fn truncated_files_keep_their_readable_part() {
    let dir = tempfile::tempdir().unwrap();
    let wav = dir.path().join("full.wav");
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    write_wav(&wav, spec, &[sine(FREQ, 0.5, 16000, 16000)]);
    // (file, fraction of its bytes kept, rate, shortest and longest readable part in s).
    // ffmpeg's FLAC files start with 8 KiB of padding, so only the last 45 % holds audio.
    let cases = [
        (fixture("tone-44100.flac"), 0.8, 44100, 0.15, 0.3),
        (fixture("tone-44100.mp3"), 0.5, 44100, 0.2, 0.3),
        (wav, 1.0 / 3.0, 16000, 0.3, 0.35),
    ];
    for (path, fraction, rate, shortest, longest) in cases {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        let cut = cut_file(dir.path(), &format!("cut-{name}"), &bytes, fraction);
        let audio = decode_file(&cut).unwrap_or_else(|e| panic!("{name}: {e}"));
        let damage = audio.damage.clone().unwrap_or_default();
        assert!(
            damage.contains("truncated") && damage.contains("announces"),
            "{name}: {damage:?}"
        );
        let dur = audio.duration_seconds();
        assert!((shortest..=longest).contains(&dur), "{name}: {dur} s");
        assert_eq!(audio.sample_rate, rate);
        // The readable part is the tone, at its level.
        let n = audio.samples.len();
        let mid = &audio.samples[n / 5..n * 4 / 5];
        assert!((rms_db(mid) - LEVEL_DB).abs() < 0.3, "{name}");
        assert!(
            (goertzel_db(mid, FREQ, rate) - rms_db(mid)).abs() < 0.15,
            "{name}"
        );
    }
    // Complete files report no damage.
    for name in ["tone-44100.flac", "tone-44100.mp3", "tone-48000.ogg"] {
        assert_eq!(decode_file(&fixture(name)).unwrap().damage, None, "{name}");
    }
}

#[test]
fn a_damaged_flac_frame_becomes_silence_of_its_length() {
    let mut bytes = std::fs::read(fixture("tone-44100.flac")).unwrap();
    // Garble 200 bytes in the middle of the audio frames (after the 8 KiB padding block).
    let at = bytes.len() * 3 / 4;
    for b in &mut bytes[at..at + 200] {
        *b ^= 0x5a;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = cut_file(dir.path(), "garbled.flac", &bytes, 1.0);
    let audio = decode_file(&path).unwrap();
    let damage = audio.damage.clone().unwrap_or_default();
    assert!(damage.contains("replaced by silence"), "{damage:?}");
    // Everything after the damage keeps its time: the length is the full 0.5 s.
    assert!(
        (audio.duration_seconds() - 0.5).abs() < 0.001,
        "{}",
        audio.duration_seconds()
    );
    let silent = audio.samples.iter().filter(|&&v| v == 0.0).count();
    assert!(silent > 1000, "only {silent} silent samples");
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

    // Cut off before any audio: the FLAC inside its padding block, the M4A before its index.
    for name in ["tone-44100.flac", "tone-22050-alac.m4a"] {
        let bytes = std::fs::read(fixture(name)).unwrap();
        let cut = cut_file(dir.path(), &format!("cut-{name}"), &bytes, 0.5);
        let err = decode_file(&cut).expect_err(name);
        assert!(
            matches!(&err, DecodeError::Corrupt(m) if m.contains("truncated") || m.contains("moov")),
            "{name}: {err:?}"
        );
    }

    let missing = dir.path().join("gone.wav");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &missing).unwrap();
    assert!(matches!(decode_file(&missing), Err(DecodeError::Open(_))));
}
