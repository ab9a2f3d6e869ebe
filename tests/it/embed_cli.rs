//! `voiceclone embed` end to end: the binary, a temporary workspace, the tiny Base fixture model
//! and the reference clip in several formats, compared with the official x-vector.

use crate::common::{self, fixtures};

use std::path::Path;

use candle_core::Device;
use common::{stderr, stdout, voiceclone};

fn model() -> String {
    fixtures().join("tiny-0b6").to_string_lossy().into_owned()
}

fn clip(name: &str) -> String {
    let path = fixtures().join("audio").join(name);
    assert!(
        path.is_file(),
        "missing fixture {} (scripts/assets/make_audio_fixtures.sh)",
        path.display()
    );
    path.to_string_lossy().into_owned()
}

fn official_xvector() -> Vec<f32> {
    let refs =
        candle_core::safetensors::load(fixtures().join("refs/tiny-0b6.safetensors"), &Device::Cpu)
            .unwrap();
    refs["xvector"].to_vec1::<f32>().unwrap()
}

/// The `speaker_embedding` tensor of a written file, checking its dtype and rank.
fn read_embedding(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names(), vec!["speaker_embedding"]);
    let t = st.tensor("speaker_embedding").unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    assert_eq!(t.shape().len(), 1);
    let v: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(v.len(), t.shape()[0]);
    v
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn embed_wav_matches_official_xvector() {
    let ws = tempfile::tempdir().unwrap();
    let out = voiceclone(
        ws.path(),
        &["embed", &clip("ref24k.wav"), "--model", &model()],
    );
    assert!(out.status.success(), "embed failed: {}", stderr(&out));
    let written = ws.path().join("data/speaker.safetensors");
    let got = read_embedding(&written);
    let want = official_xvector();
    let err = max_abs_diff(&got, &want);
    eprintln!("embed ref24k.wav: max abs error vs official {err:.3e}");
    assert!(
        err <= 1e-3,
        "x-vector differs from the official one by {err}"
    );
    let text = stdout(&out);
    assert!(
        text.contains("data/speaker.safetensors")
            && text.contains(&format!("{}-dimensional", want.len())),
        "{text}"
    );
    // no temporary files left next to the output
    let names: Vec<_> = std::fs::read_dir(ws.path().join("data"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("speaker.safetensors")]);

    // re-running overwrites our own derived output
    let again = voiceclone(
        ws.path(),
        &["embed", &clip("ref24k.wav"), "--model", &model()],
    );
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(read_embedding(&written), got);
}

#[test]
fn embed_flac_and_mp3() {
    let ws = tempfile::tempdir().unwrap();
    let wav_out = ws.path().join("wav.safetensors");
    let o = voiceclone(
        ws.path(),
        &[
            "embed",
            &clip("ref24k.wav"),
            "--model",
            &model(),
            "-o",
            wav_out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let from_wav = read_embedding(&wav_out);

    // lossless: the same samples, so the same embedding
    let flac_out = ws.path().join("out/flac.safetensors");
    let o = voiceclone(
        ws.path(),
        &[
            "embed",
            &clip("ref24k.flac"),
            "--model",
            &model(),
            "-o",
            flac_out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let from_flac = read_embedding(&flac_out);
    assert_eq!(
        from_flac, from_wav,
        "FLAC decodes to different samples than the WAV"
    );

    // lossy, 44.1 kHz stereo: decoded, down-mixed and resampled to 24 kHz; close, not equal.
    // (The tiny random-weight encoder is dominated by one common direction, so closeness is a
    // loose check here: decoding the same MP3 with ffmpeg gives 0.5 max abs, cosine 0.99988.)
    let mp3_out = ws.path().join("mp3.safetensors");
    let o = voiceclone(
        ws.path(),
        &[
            "embed",
            &clip("ref24k-44k-stereo.mp3"),
            "--model",
            &model(),
            "-o",
            mp3_out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let from_mp3 = read_embedding(&mp3_out);
    let err = max_abs_diff(&from_mp3, &from_wav);
    let scale = from_wav.iter().fold(0f32, |m, v| m.max(v.abs()));
    let cos = cosine(&from_mp3, &from_wav);
    eprintln!("mp3 vs wav: max abs diff {err:.3e} (|x| ≤ {scale:.3}), cosine {cos:.6}");
    assert!(
        err > 0.0,
        "a lossy MP3 should not give bit-identical features"
    );
    assert!(
        err <= 0.1 * scale && cos > 0.999,
        "MP3 embedding too far from the WAV one: {err}, cosine {cos}"
    );
}

#[test]
fn embed_without_argument_needs_prep() {
    let ws = tempfile::tempdir().unwrap();
    let out = voiceclone(ws.path(), &["embed", "--model", &model()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("voiceclone prep") && err.contains("data/ref.wav"),
        "{err}"
    );
    assert!(!ws.path().join("data/speaker.safetensors").exists());
}

#[test]
fn embed_without_argument_uses_workspace_reference_and_config() {
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("data")).unwrap();
    std::fs::copy(clip("ref24k.wav"), ws.path().join("data/ref.wav")).unwrap();
    // the model from the workspace config (model.base) instead of --model
    std::fs::write(
        ws.path().join("voiceclone.toml"),
        format!("[model]\nbase = {}\n", toml_string(&model())),
    )
    .unwrap();
    let out = voiceclone(ws.path(), &["embed"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = read_embedding(&ws.path().join("data/speaker.safetensors"));
    let err = max_abs_diff(&got, &official_xvector());
    assert!(err <= 1e-3, "{err}");
}

#[test]
fn embed_rejects_models_without_speaker_encoder_and_missing_audio() {
    let ws = tempfile::tempdir().unwrap();
    let model_dir = ws.path().join("cv");
    std::fs::create_dir_all(&model_dir).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tiny-0b6/config.json")).unwrap(),
    )
    .unwrap();
    config["tts_model_type"] = "custom_voice".into();
    config
        .as_object_mut()
        .unwrap()
        .remove("speaker_encoder_config");
    std::fs::write(model_dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        fixtures().join("tiny-0b6/model.safetensors"),
        model_dir.join("model.safetensors"),
    )
    .unwrap();
    let out = voiceclone(
        ws.path(),
        &[
            "embed",
            &clip("ref24k.wav"),
            "--model",
            model_dir.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no speaker encoder"),
        "{}",
        stderr(&out)
    );

    let out = voiceclone(ws.path(), &["embed", "no-such.wav", "--model", &model()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no-such.wav"), "{}", stderr(&out));
    assert!(!ws.path().join("data/speaker.safetensors").exists());
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// The command a message suggests is quoted for a POSIX shell: a speaker name with a space or
/// a quote gives a command that runs as printed.
#[test]
fn suggested_commands_quote_speaker_names() {
    let ws = tempfile::tempdir().unwrap();
    for (name, quoted) in [("Mary Ann", "'Mary Ann'"), ("O'Brien", r"'O'\''Brien'")] {
        let out = voiceclone(
            ws.path(),
            &["embed", "--speaker", name, "--model", &model()],
        );
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains(&format!("`voiceclone prep --speaker {quoted} INPUT...`")),
            "{err}"
        );
    }
}
