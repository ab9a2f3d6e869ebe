//! Parity of the 12 Hz codec (docs/model.md §9) with the official Python package
//! (`qwen-tts==0.1.1`, torch f32 on CPU) on the tiny codec in
//! `tests/fixtures/tiny-0b6/speech_tokenizer/` and the references `scripts/reference/make_fixtures.py`
//! recorded in `tests/fixtures/refs/codec.*` (see the fixtures README). Codes must match exactly
//! (every nearest-neighbour lookup of the fixture has a relative gap ≥ 1e-3); audio within 2e-3
//! (docs/model.md §14; the official f32 error is 1.4e-4).

use crate::common::fixtures;
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use vc_core::hub::ModelSource;
use vc_kernels::conv::Seq;
use vc_model::codec::quantizer::SplitRvqEncoder;
use vc_model::codec::{Codec, Codes};
use vc_model::files::ModelFiles;
use vc_model::weights::Weights;

fn refs() -> &'static HashMap<String, Tensor> {
    static REFS: std::sync::OnceLock<HashMap<String, Tensor>> = std::sync::OnceLock::new();
    REFS.get_or_init(|| {
        let path = fixtures().join("refs/codec.safetensors");
        candle_core::safetensors::load(&path, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

fn meta() -> serde_json::Value {
    let path = fixtures().join("refs/codec.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The codec of the tiny model directory, loaded the way a downloaded model is.
fn codec() -> &'static Codec {
    static CODEC: std::sync::OnceLock<Codec> = std::sync::OnceLock::new();
    CODEC.get_or_init(|| {
        let source = ModelSource::parse(fixtures().join("tiny-0b6").to_str().unwrap()).unwrap();
        Codec::load(&source).unwrap()
    })
}

fn ref_f32(name: &str) -> Vec<f32> {
    refs()[name]
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn ref_codes(name: &str) -> Codes {
    refs()[name]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(|v| v as u32).collect())
        .collect()
}

/// A `[1, C, T]` reference as channels-last rows.
fn ref_channels_first(name: &str) -> Seq {
    let t = &refs()[name];
    let (_, c, len) = t.dims3().unwrap();
    Seq::from_channels_first(&ref_f32(name), c, len)
}

/// A `[1, T, C]` reference.
fn ref_time_major(name: &str) -> Seq {
    let t = &refs()[name];
    let (_, len, c) = t.dims3().unwrap();
    Seq::new(ref_f32(name), len, c)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_seq(what: &str, got: &Seq, want: &Seq, tol: f32) {
    assert_eq!((got.t, got.c), (want.t, want.c), "{what}: shape");
    let err = max_abs_diff(&got.data, &want.data);
    let scale = want.data.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    eprintln!("{what}: max abs diff {err:.3e} (max |ref| {scale:.3})");
    assert!(err <= tol, "{what}: max abs diff {err} > {tol}");
}

/// A fixture clip read the way `voiceclone codes` reads audio.
fn clip(name: &str) -> Vec<f32> {
    let m = &meta()["clips"][name];
    let wav = vc_audio::load_mono(&fixtures().join(m["wav"].as_str().unwrap()), 24_000).unwrap();
    assert_eq!(wav.len() as u64, m["samples"].as_u64().unwrap());
    for (a, b) in wav.iter().zip(m["first_samples"].as_array().unwrap()) {
        assert_eq!(
            *a as f64,
            b.as_f64().unwrap(),
            "{name}: samples differ from the reference"
        );
    }
    wav
}

fn first_diff(a: &Codes, b: &Codes) -> Option<(usize, usize)> {
    for (t, (ra, rb)) in a.iter().zip(b).enumerate() {
        for (q, (x, y)) in ra.iter().zip(rb).enumerate() {
            if x != y {
                return Some((t, q));
            }
        }
    }
    None
}

#[test]
fn encoder_intermediates_match_official() {
    let trace = codec().encoder().encode_trace(&clip("clip1")).unwrap();
    check_seq(
        "seanet",
        &trace.seanet,
        &ref_channels_first("encode.clip1.seanet"),
        1e-4,
    );
    check_seq(
        "transformer",
        &trace.transformer,
        &ref_time_major("encode.clip1.transformer"),
        1e-4,
    );
    check_seq(
        "latent",
        &trace.latent,
        &ref_channels_first("encode.clip1.latent"),
        1e-4,
    );

    // All 32 quantizers (the codec keeps 16) and both input projections, from our latent.
    let dir = fixtures().join("tiny-0b6/speech_tokenizer");
    let cfg = codec().config().encoder_config.clone();
    let w = Weights::load(
        &[dir.join("model.safetensors")],
        DType::F32,
        &Device::Cpu,
        |n| n.starts_with("encoder.quantizer."),
    )
    .unwrap();
    let q = SplitRvqEncoder::load(
        &w,
        "encoder.quantizer.",
        cfg.hidden_size,
        cfg.vector_quantization_hidden_dimension,
        cfg.codebook_dim,
        cfg.codebook_size,
        cfg.num_semantic_quantizers,
        cfg.num_quantizers - cfg.num_semantic_quantizers,
    )
    .unwrap();
    let (_, sem_proj) = q.semantic.encode(&trace.latent);
    let (_, aco_proj) = q.acoustic.encode(&trace.latent);
    check_seq(
        "semantic input_proj",
        &sem_proj,
        &ref_channels_first("encode.clip1.semantic_proj"),
        1e-4,
    );
    check_seq(
        "acoustic input_proj",
        &aco_proj,
        &ref_channels_first("encode.clip1.acoustic_proj"),
        1e-4,
    );
    let all = q.encode(&trace.latent);
    assert_eq!(all, ref_codes("encode.clip1.codes_all"), "all 32 codebooks");
}

#[test]
fn fused_encoder_stem_equals_layer_by_layer() {
    // Lengths around tile and stride boundaries, short inputs included.
    let wav = clip("clip2");
    for len in [1usize, 7, 1919, 1920, 4096 * 4 + 3, 40800, 76800] {
        let fused = codec().encoder().seanet(&wav[..len]);
        let plain = codec().encoder().seanet_unfused(&wav[..len]);
        assert_eq!((fused.t, fused.c), (plain.t, plain.c), "len {len}");
        let err = max_abs_diff(&fused.data, &plain.data);
        assert!(err <= 1e-6, "len {len}: {err}");
    }
}

#[test]
fn encode_codes_match_official_exactly() {
    for name in ["clip1", "clip2"] {
        let wav = clip(name);
        let codes = codec().encode(&wav).unwrap();
        let want = ref_codes(&format!("encode.{name}.codes"));
        assert_eq!(codes.len(), wav.len().div_ceil(1920), "{name}: frames");
        assert_eq!(codes.len(), want.len());
        assert!(codes.iter().all(|r| r.len() == 16));
        assert_eq!(
            first_diff(&codes, &want),
            None,
            "{name}: first differing (frame, codebook)"
        );
    }
    // clip2 is a whole number of frames: its latent is also recorded.
    let trace = codec().encoder().encode_trace(&clip("clip2")).unwrap();
    check_seq(
        "clip2 latent",
        &trace.latent,
        &ref_channels_first("encode.clip2.latent"),
        1e-4,
    );
}

#[test]
fn model_files_and_standalone_layouts_load_the_same_codec() {
    let wav = clip("clip1");
    let want = ref_codes("encode.clip1.codes");
    // Through the resolved model directory (what `voiceclone codes` does with a model).
    let source = ModelSource::parse(fixtures().join("tiny-0b6").to_str().unwrap()).unwrap();
    let files = ModelFiles::resolve(&source).unwrap();
    let from_files = Codec::from_files(&files.speech_tokenizer().unwrap()).unwrap();
    assert_eq!(from_files.encode(&wav).unwrap(), want);
    // The standalone tokenizer layout (`Qwen/Qwen3-TTS-Tokenizer-12Hz`): config.json at the root.
    let standalone = Codec::load_dir(&fixtures().join("tiny-0b6/speech_tokenizer")).unwrap();
    assert_eq!(standalone.encode(&wav).unwrap(), want);
    assert_eq!(standalone.sample_rate(), 24_000);
    assert_eq!(standalone.samples_per_frame(), 1920);
    assert_eq!(standalone.num_quantizers(), 16);
}

#[test]
fn batched_encode() {
    let (a, b) = (clip("clip1"), clip("clip2"));
    let singles = vec![codec().encode(&a).unwrap(), codec().encode(&b).unwrap()];
    // Batch-independent: every item gets its single-encode codes.
    assert_eq!(codec().encode_batch(&[&a, &b]).unwrap(), singles);
    assert_eq!(
        codec().encode_batch(&[&b, &a]).unwrap(),
        vec![singles[1].clone(), singles[0].clone()]
    );
    // The official padded batch, reproduced exactly (its row 0 differs in the last frame).
    let padded = codec().encode_batch_padded(&[&a, &b]).unwrap();
    assert_eq!(padded[0], ref_codes("encode.batch.codes.0"));
    assert_eq!(padded[1], ref_codes("encode.batch.codes.1"));
    let differing: Vec<usize> = (0..padded[0].len())
        .filter(|&t| padded[0][t] != singles[0][t])
        .collect();
    let recorded: Vec<usize> = meta()["encode_batch"]["row0"]
        ["frames_differing_from_single_encode"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(differing, recorded);
    assert_eq!(codec().encode(&[]).unwrap(), Codes::new());
}

#[test]
fn decoder_intermediates_match_official() {
    let codes = ref_codes("encode.clip1.codes");
    let rows: Vec<&[u32]> = codes.iter().map(|r| r.as_slice()).collect();
    let tr = codec().decoder().forward_trace(&rows).unwrap();
    check_seq(
        "quantized",
        &tr.quantized,
        &ref_channels_first("decode.clip1.quantized"),
        1e-5,
    );
    check_seq(
        "pre_conv",
        &tr.pre_conv,
        &ref_channels_first("decode.clip1.pre_conv"),
        1e-4,
    );
    check_seq(
        "pre_transformer",
        &tr.pre_transformer,
        &ref_time_major("decode.clip1.pre_transformer"),
        1e-4,
    );
    for i in 0..2 {
        let name = format!("decode.clip1.upsample.{i}");
        check_seq(&name, &tr.upsample[i], &ref_channels_first(&name), 2e-4);
    }
    for i in 0..2 {
        let name = format!("decode.clip1.decoder.{i}");
        check_seq(&name, &tr.decoder[i], &ref_channels_first(&name), 5e-4);
    }
    let pre = ref_f32("decode.clip1.wav_preclamp");
    let err = max_abs_diff(&tr.wav_preclamp, &pre);
    eprintln!("wav_preclamp: max abs diff {err:.3e}");
    assert!(err <= 2e-3);
}

#[test]
fn decode_matches_official() {
    let codes = ref_codes("encode.clip1.codes");
    let wav = codec().decode(&codes).unwrap();
    let want = ref_f32("decode.clip1.wav");
    assert_eq!(wav.len(), codes.len() * 1920);
    let err = max_abs_diff(&wav, &want);
    eprintln!("decode clip1: max abs diff {err:.3e}");
    assert!(err <= 2e-3, "decoded audio differs by {err}");
    assert!(wav.iter().all(|v| v.abs() <= 1.0));
    // Fixed-size arrays work as input too.
    let arrays: Vec<[u32; 16]> = codes
        .iter()
        .map(|r| r.as_slice().try_into().unwrap())
        .collect();
    assert_eq!(codec().decode(&arrays).unwrap(), wav);
}

#[test]
fn long_decode_reproduces_the_chunking() {
    let codes = ref_codes("decode.long.codes");
    assert_eq!(codes.len(), 330);
    let rows: Vec<&[u32]> = codes.iter().map(|r| r.as_slice()).collect();
    // The pre-transformer of each chunk: frames 0..300 (window active), then 275..330 with
    // positions restarting at 0.
    let c0 = codec().decoder().forward_trace(&rows[0..300]).unwrap();
    check_seq(
        "chunk0 pre_transformer",
        &c0.pre_transformer,
        &ref_time_major("decode.long.pre_transformer.chunk0"),
        1e-4,
    );
    let c1 = codec().decoder().forward_trace(&rows[275..330]).unwrap();
    check_seq(
        "chunk1 pre_transformer",
        &c1.pre_transformer,
        &ref_time_major("decode.long.pre_transformer.chunk1"),
        1e-4,
    );
    let wav = codec().decode(&codes).unwrap();
    let m = &meta()["decode_long"];
    assert_eq!(wav.len() as u64, m["samples"].as_u64().unwrap());
    let from = m["wav_tail_from_sample"].as_u64().unwrap() as usize;
    let tail_err = max_abs_diff(&wav[from..], &ref_f32("decode.long.wav_tail"));
    let strided: Vec<f32> = wav.iter().step_by(32).copied().collect();
    let stride_err = max_abs_diff(&strided, &ref_f32("decode.long.wav_stride32"));
    eprintln!("long decode: tail max abs diff {tail_err:.3e}, every 32nd sample {stride_err:.3e}");
    assert!(tail_err <= 2e-3 && stride_err <= 2e-3);
    let sum: f64 = wav.iter().map(|&v| v as f64).sum();
    let want_sum = m["sum"].as_f64().unwrap();
    assert!(
        (sum - want_sum).abs() < 1e-3 * wav.len() as f64,
        "sum {sum} vs {want_sum}"
    );
}

#[test]
fn bad_codes_are_rejected_with_a_clear_error() {
    let mut codes = ref_codes("encode.clip1.codes");
    codes[3][5] = 2048;
    let err = format!("{:#}", codec().decode(&codes).unwrap_err());
    assert!(err.contains("frame 3") && err.contains("2048"), "{err}");
    let short = vec![vec![0u32; 15]];
    let err = format!("{:#}", codec().decode(&short).unwrap_err());
    assert!(err.contains("15 codes") && err.contains("16"), "{err}");
    assert!(codec().decode::<Vec<u32>>(&[]).unwrap().is_empty());
}

#[test]
fn chunk_context_skip_is_exact() {
    // The second chunk of the long decode: 25 frames of context, then 30 kept frames. The conv
    // stack only needs `conv_reach_frames()` of that context (10 with the real kernels).
    let codes = ref_codes("decode.long.codes");
    let rows: Vec<&[u32]> = codes[275..330].iter().map(|r| r.as_slice()).collect();
    let dec = codec().decoder();
    let reach = dec.conv_reach_frames();
    assert_eq!(reach, 10);
    let spf = 1920;
    let full = dec.forward_from(&rows, 0).unwrap();
    let skipped = dec.forward_from(&rows, 25 - reach).unwrap();
    assert_eq!(skipped.len(), (55 - (25 - reach)) * spf);
    let err = max_abs_diff(&full[25 * spf..], &skipped[reach * spf..]);
    // Only rounding may differ (tiles and Winograd groups start elsewhere).
    assert!(
        err <= 2e-5,
        "skipping context frames changed the output by {err}"
    );
    // Without any context for the conv stack the kept frames do change (the check can fail).
    let none = dec.forward_from(&rows, 25).unwrap();
    let err = max_abs_diff(&full[25 * spf..], &none);
    assert!(err > 1e-3, "{err}");
}
