//! Greedy generation parity with the official `generate_voice_clone` / `generate_custom_voice`
//! (docs/model.md §14): every case recorded by `scripts/reference/make_fixtures.py` in
//! `tests/fixtures/refs/<model>.speak.{json,safetensors}` is replayed through the library the
//! way `voiceclone speak` runs it — model loaded from its directory like a download, voice made
//! from the reference clip, prompts, left-padded batch, frame loop, codec decode, ICL cut —
//! and must give the same codes, the same frame count and EOS step, and the same waveform.

use crate::common::fixtures;
use std::collections::HashMap;
use vc_core::artifacts::codes::CodeFrame;

use candle_core::{DType, Device, Tensor};
use vc_core::hub::ModelSource;
use vc_generate::runaway::RunawayGuard;
use vc_generate::sampling::Sampling;
use vc_generate::{DecodeOptions, Precision, Request, Synthesizer, Voice};

const WAV_TOL: f32 = 2e-3;

struct Refs {
    cases: Vec<serde_json::Value>,
    tensors: HashMap<String, Tensor>,
}

fn load_refs(model: &str) -> Refs {
    let dir = fixtures().join("refs");
    let json = dir.join(format!("{model}.speak.json"));
    let text = std::fs::read_to_string(&json).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (made by scripts/reference/make_fixtures.py)",
            json.display()
        )
    });
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = match v {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(mut o) => o
            .remove("cases")
            .and_then(|c| c.as_array().cloned())
            .expect("a \"cases\" list"),
        _ => panic!("unexpected JSON in {}", json.display()),
    };
    let tensors = candle_core::safetensors::load(
        dir.join(format!("{model}.speak.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    Refs { cases, tensors }
}

fn frames_of(t: &Tensor) -> Vec<CodeFrame> {
    t.to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap()
        .into_iter()
        .map(|r| {
            let v: Vec<u32> = r.into_iter().map(|x| x as u32).collect();
            CodeFrame::from_row(&v).unwrap()
        })
        .collect()
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// Both exact precisions of the row inference path: f32, and bf16-stored matrices (the same
/// weight values for these bf16 checkpoints, f32 arithmetic), which must give the same codes.
fn run_model(model: &str) {
    for precision in [Precision::F32, Precision::Bf16Weights] {
        run_model_in(model, precision);
    }
}

fn run_model_in(model: &str, precision: Precision) {
    run_model_from(model, &fixtures().join(model), precision);
}

/// Replays `model`'s recorded cases on the model directory `dir` (the fixture, or a copy).
fn run_model_from(model: &str, dir: &std::path::Path, precision: Precision) {
    let refs = load_refs(model);
    let source = ModelSource::Local(dir.to_path_buf());
    let mut synth = Synthesizer::load(&source, precision, &Device::Cpu).unwrap();
    assert_eq!(synth.precision(), precision);
    assert!(!refs.cases.is_empty());
    for case in &refs.cases {
        let name = case["name"].as_str().unwrap();
        let tag = format!("{model} {precision:?} {name}");
        let texts = strings(&case["texts"]);
        let languages = strings(&case["languages"]);
        let mode = case["mode"].as_str().unwrap();
        let voice = match mode {
            "custom" => Voice::Speaker(case["speaker"].as_str().unwrap().to_string()),
            "xvec" | "icl" => {
                let wav_path = fixtures().join(case["ref_audio"].as_str().unwrap());
                let wav = vc_audio::load_mono(&wav_path, 24_000).unwrap();
                let ref_text = (mode == "icl").then(|| case["ref_text"].as_str().unwrap());
                synth.clone_voice(&wav, ref_text).unwrap()
            }
            other => panic!("{tag}: unknown mode {other}"),
        };
        if let Voice::Icl { ref_codes, .. } = &voice {
            let want = frames_of(&refs.tensors[&format!("{name}.ref_codes")]);
            assert_eq!(ref_codes, &want, "{tag}: reference codes");
        }
        let max_new_tokens = case["max_new_tokens"].as_u64().unwrap() as usize;
        let opts = DecodeOptions {
            code0: Sampling::GREEDY,
            sub_codes: Sampling::GREEDY,
            repetition_penalty: case["repetition_penalty"].as_f64().unwrap(),
            max_frames: max_new_tokens - 1,
            // The guards stay on: a generation that ends by itself is unchanged by them.
            runaway: RunawayGuard::ON,
            seed: 0,
            batch_size: texts.len(),
            max_chunk_chars: 0,
            stream_chunk_frames: 1,
        };
        let requests: Vec<Request> = texts
            .iter()
            .zip(&languages)
            .map(|(t, l)| Request {
                text: t.clone(),
                language: l.clone(),
                voice: voice.clone(),
                non_streaming: case["non_streaming_mode"].as_bool().unwrap(),
                pace: None,
            })
            .collect();
        let speech = synth.synthesize(&requests, &opts, |_, _, _| {}).unwrap();
        if let Some(branch) = case["icl_branch"].as_str() {
            let got = format!("{:?}", speech[0].icl_branches[0]);
            let want = match branch {
                "text_longer" => "Some(TextLonger)",
                "codes_longer" => "Some(CodesLonger)",
                other => panic!("{tag}: unknown branch {other}"),
            };
            if !case["non_streaming_mode"].as_bool().unwrap() {
                assert_eq!(got, want, "{tag}: ICL branch");
            }
        }
        for (row, sp) in speech.iter().enumerate() {
            let meta = &case["rows"][row];
            let want = frames_of(&refs.tensors[&format!("{name}.{row}.codes")]);
            assert_eq!(
                sp.frames.len(),
                meta["frames"].as_u64().unwrap() as usize,
                "{tag}[{row}]: frame count"
            );
            assert_eq!(sp.frames, want, "{tag}[{row}]: codes");
            // The official loop samples one more code-0 after the last kept frame: an EOS there
            // changes nothing, so only an EOS before the limit is compared as a step.
            let want_eos = meta["eos_step"].as_u64().map(|s| s as usize);
            match want_eos {
                Some(s) if s < max_new_tokens - 1 => {
                    assert_eq!(sp.eos_steps, vec![Some(s)], "{tag}[{row}]: EOS step")
                }
                _ => assert_eq!(
                    sp.eos_steps,
                    vec![None],
                    "{tag}[{row}]: stopped by the limit"
                ),
            }
            let want_wav: Vec<f32> = refs.tensors[&format!("{name}.{row}.wav")]
                .to_vec1()
                .unwrap();
            assert_eq!(sp.wav.len(), want_wav.len(), "{tag}[{row}]: samples");
            let err = sp
                .wav
                .iter()
                .zip(&want_wav)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(err <= WAV_TOL, "{tag}[{row}]: waveform max abs error {err}");
            eprintln!(
                "{tag}[{row}]: {} frames, eos {:?}, waveform max abs error {err:.2e}",
                sp.frames.len(),
                sp.eos_steps[0]
            );
        }
    }
}

#[test]
fn greedy_voice_clone_matches_official_tiny_0b6() {
    run_model("tiny-0b6");
}

#[test]
fn greedy_voice_clone_matches_official_tiny_1b7() {
    run_model("tiny-1b7");
}

#[test]
fn greedy_custom_voice_matches_official() {
    run_model("tiny-0b6-custom");
}

/// An f32-stored copy of the fixture (the same values) under `auto`: the CPU picks f32, never a
/// rounding of the checkpoint, and the official codes come out.
#[test]
fn greedy_parity_on_an_f32_stored_checkpoint_under_auto() {
    let copy = crate::common::f32_stored_copy("tiny-0b6");
    let files =
        vc_model::files::ModelFiles::resolve(&ModelSource::Local(copy.path().into())).unwrap();
    let stored = Precision::stored(&files);
    assert_eq!(stored, Some(safetensors::Dtype::F32));
    let precision = Precision::auto(stored, false);
    assert_eq!(precision, Precision::F32);
    run_model_from("tiny-0b6", copy.path(), precision);
}

#[test]
fn auto_picks_bf16_weights_for_bf16_checkpoints_and_bf16_on_a_gpu() {
    use safetensors::Dtype;
    assert_eq!(
        Precision::auto(Some(Dtype::BF16), false),
        Precision::Bf16Weights
    );
    assert_eq!(Precision::auto(Some(Dtype::F16), false), Precision::F32);
    assert_eq!(Precision::auto(Some(Dtype::F32), false), Precision::F32);
    assert_eq!(Precision::auto(Some(Dtype::F32), true), Precision::Bf16);
    let files =
        vc_model::files::ModelFiles::resolve(&ModelSource::Local(fixtures().join("tiny-0b6")))
            .unwrap();
    assert_eq!(Precision::stored(&files), Some(Dtype::BF16));
}
