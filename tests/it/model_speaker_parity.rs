//! Parity of the log-mel front end and the ECAPA-TDNN speaker encoder with the official Python
//! package (`qwen-tts==0.1.1`, torch f32 on CPU), on the tiny Base models and the reference
//! clip that `scripts/reference/make_fixtures.py` committed under `tests/fixtures/` (see its README).
//! Tolerances: docs/model.md §14 (official log-mel f32 error ≈ 2e-4, x-vector ≈ 1e-5).

use crate::common::fixtures;
use std::collections::HashMap;

use candle_core::{Device, Tensor};
use vc_core::hub::ModelSource;
use vc_model::mel::LogMel;
use vc_model::speaker::SpeakerEncoder;

fn refs(name: &str) -> HashMap<String, Tensor> {
    let path = fixtures().join("refs").join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn audio_meta() -> serde_json::Value {
    let path = fixtures().join("refs/audio.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The reference clip, read the way `voiceclone embed` reads it.
fn reference_wav() -> Vec<f32> {
    let meta = audio_meta();
    let wav_path = fixtures().join(meta["wav"].as_str().unwrap());
    let wav = vc_audio::load_mono(&wav_path, 24_000).unwrap();
    assert_eq!(wav.len() as u64, meta["samples"].as_u64().unwrap());
    // same samples as the official reader (int16 / 32768)
    for (a, b) in wav.iter().zip(meta["first_samples"].as_array().unwrap()) {
        assert_eq!(*a as f64, b.as_f64().unwrap());
    }
    wav
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn encoder(model: &str) -> SpeakerEncoder {
    let dir = fixtures().join(model);
    let source = ModelSource::parse(dir.to_str().unwrap()).unwrap();
    assert!(matches!(source, ModelSource::Local(_)));
    SpeakerEncoder::from_model(&source, &Device::Cpu).unwrap()
}

#[test]
fn log_mel_matches_official() {
    let wav = reference_wav();
    let mel = LogMel::speaker_encoder().compute(&wav).unwrap();
    let want = refs("audio")["audio.mel"].clone();
    assert_eq!(want.dims(), &[mel.frames, mel.n_mels]);
    assert_eq!(mel.frames, 1 + (wav.len() + 768 - 1024) / 256);
    let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let err = max_abs_diff(&mel.data, &want);
    let range = want
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    eprintln!(
        "log-mel: max abs error {err:.3e} (values {:.2}..{:.2})",
        range.0, range.1
    );
    // The official f32 STFT loses precision only near the noise floor (log-mel ≈ −11, where
    // |X|² is ~1e-10 of the frame's energy); above it the two agree to a few 1e-6.
    let err_loud = mel
        .data
        .iter()
        .zip(&want)
        .filter(|(_, w)| **w > -5.0)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    eprintln!("log-mel: max abs error {err_loud:.3e} where the official value is above -5");
    assert!(
        err_loud <= 1e-4,
        "log-mel differs by {err_loud} on bins well above the noise floor"
    );
    assert!(
        err <= 2e-3,
        "log-mel differs from the official one by {err}"
    );
}

#[test]
fn xvector_matches_official_for_both_models() {
    let wav = reference_wav();
    let official_mel = refs("audio")["audio.mel"].unsqueeze(0).unwrap();
    for model in ["tiny-0b6", "tiny-1b7"] {
        let enc = encoder(model);
        let want = refs(model)["xvector"].to_vec1::<f32>().unwrap();
        assert_eq!(enc.dim(), want.len());

        // encoder alone, on the official features
        let got = enc
            .forward(&official_mel)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let err_encoder = max_abs_diff(&got, &want);

        // end to end: waveform -> our mel -> encoder
        let got = enc.embed(&wav, 24_000).unwrap();
        let err = max_abs_diff(&got, &want);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        eprintln!(
            "{model}: x-vector max abs error {err:.3e} end to end, {err_encoder:.3e} on the official mel (|x| ≤ {scale:.3})"
        );
        assert!(
            err_encoder <= 1e-4,
            "{model}: encoder differs by {err_encoder} on identical features"
        );
        assert!(
            err <= 1e-3,
            "{model}: x-vector differs from the official one by {err}"
        );
    }
}

#[test]
fn batched_forward_equals_single() {
    let enc = encoder("tiny-0b6");
    let mel = refs("audio")["audio.mel"].clone();
    let a = mel.narrow(0, 0, 100).unwrap();
    let b = mel.narrow(0, 50, 100).unwrap();
    let batch = Tensor::stack(&[&a, &b], 0).unwrap();
    let out = enc.forward(&batch).unwrap();
    assert_eq!(out.dims(), &[2, enc.dim()]);
    for (i, x) in [a, b].iter().enumerate() {
        let single = enc
            .forward(&x.unsqueeze(0).unwrap())
            .unwrap()
            .squeeze(0)
            .unwrap();
        let err = max_abs_diff(
            &single.to_vec1::<f32>().unwrap(),
            &out.get(i).unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(err < 1e-5, "row {i}: {err}");
    }
}

#[test]
fn too_short_audio_is_a_clear_error() {
    let enc = encoder("tiny-0b6");
    // 4 frames: the dilation-4 Res2Net convolutions cannot reflect-pad that
    let err = enc
        .embed(&vec![0.1; 4 * 256], 24_000)
        .unwrap_err()
        .to_string();
    assert!(err.contains("too short"), "{err}");
    assert!(enc.embed(&vec![0.1; 5 * 256], 24_000).is_ok());
    let err = enc
        .embed(&vec![0.1; 24_000], 16_000)
        .unwrap_err()
        .to_string();
    assert!(err.contains("24000 Hz"), "{err}");
}

#[test]
fn model_without_speaker_encoder_is_a_clear_error() {
    let src = fixtures().join("tiny-0b6");
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["tts_model_type"] = "custom_voice".into();
    config
        .as_object_mut()
        .unwrap()
        .remove("speaker_encoder_config");
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let source = ModelSource::Local(dir.path().to_path_buf());
    let err = format!(
        "{:#}",
        SpeakerEncoder::from_model(&source, &Device::Cpu).unwrap_err()
    );
    assert!(
        err.contains("no speaker encoder") && err.contains("custom_voice"),
        "{err}"
    );
}

#[test]
fn missing_or_misshapen_tensor_names_the_tensor() {
    let src = fixtures().join("tiny-0b6");
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    // one more attention channel than the checkpoint has
    let att = config["speaker_encoder_config"]["enc_attention_channels"]
        .as_u64()
        .unwrap();
    config["speaker_encoder_config"]["enc_attention_channels"] = (att + 1).into();
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let source = ModelSource::Local(dir.path().to_path_buf());
    let err = format!(
        "{:#}",
        SpeakerEncoder::from_model(&source, &Device::Cpu).unwrap_err()
    );
    assert!(
        err.contains("speaker_encoder.asp.tdnn.conv.weight"),
        "{err}"
    );
}
