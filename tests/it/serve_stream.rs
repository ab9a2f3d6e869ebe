//! Streaming codec decoding (docs/serving.md §4): the samples [`StreamDecoder`] gives frame by
//! frame, in any grouping of the frames, equal the offline `Codec::decode` of the whole
//! sequence (the official chunked decoder: 300-frame chunks with 25 frames of left context) bit
//! for bit, across the chunk boundary, and with in-context reference frames primed in front
//! (docs/model.md §9.5 says why they can). Pushes of one to a few frames give the decoder's
//! layers a few rows, which take the GEMM's few-row kernel (`kernels::few_rows`), larger pushes
//! the `gemm` crate's: the bits must not tell them apart. The fixture models share one codec,
//! stored in f32 as the official one is; every test also runs on a copy stored in bf16 (other
//! weights, so other samples, and a load path that widens every tensor).
//! `examples/bench_codec --stream --push N` checks the same on the full-size one.

use crate::common::fixtures;

use candle_core::{DType, Device};
use vc_model::codec::{Codec, StreamDecoder};

/// The fixture codec as stored, and a copy of it stored in bf16.
fn codecs() -> [(&'static str, &'static Codec); 2] {
    static F32: std::sync::OnceLock<Codec> = std::sync::OnceLock::new();
    static BF16: std::sync::OnceLock<Codec> = std::sync::OnceLock::new();
    let dir = fixtures().join("tiny-0b6/speech_tokenizer");
    let f32_stored = F32.get_or_init(|| Codec::load_dir(&dir).unwrap());
    let bf16_stored = BF16.get_or_init(|| {
        let copy = tempfile::tempdir().unwrap();
        for name in ["config.json", "preprocessor_config.json"] {
            std::fs::copy(dir.join(name), copy.path().join(name)).unwrap();
        }
        let tensors: std::collections::HashMap<_, _> =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
                .unwrap()
                .into_iter()
                .map(|(k, t)| {
                    assert_eq!(
                        t.dtype(),
                        DType::F32,
                        "{k}: the fixture codec is stored in f32"
                    );
                    (k, t.to_dtype(DType::BF16).unwrap())
                })
                .collect();
        candle_core::safetensors::save(&tensors, copy.path().join("model.safetensors")).unwrap();
        Codec::load_dir(copy.path()).unwrap()
    });
    [("f32-stored", f32_stored), ("bf16-stored", bf16_stored)]
}

/// The 330 frames the official decoder was recorded on (`scripts/reference/make_fixtures.py`).
fn long_codes() -> Vec<Vec<u32>> {
    let path = fixtures().join("refs/codec.safetensors");
    let refs = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    refs["decode.long.codes"]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(|v| v as u32).collect())
        .collect()
}

/// Samples whose bits differ, and the largest difference.
fn differences(a: &[f32], b: &[f32]) -> (usize, f32) {
    assert_eq!(a.len(), b.len(), "sample counts differ");
    let differing = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits());
    let count = differing.clone().count();
    (
        count,
        differing.map(|(x, y)| (x - y).abs()).fold(0.0, f32::max),
    )
}

/// Pushes `codes` in groups of the sizes `groups` cycles through.
fn streamed(codec: &Codec, codes: &[Vec<u32>], groups: &[usize], prime: &[Vec<u32>]) -> Vec<f32> {
    let mut s = StreamDecoder::new(codec.decoder());
    if !prime.is_empty() {
        s.prime(prime).unwrap();
    }
    let mut out = Vec::new();
    let (mut i, mut g) = (0, 0);
    while i < codes.len() {
        let n = groups[g % groups.len()].min(codes.len() - i);
        let samples = s.push(&codes[i..i + n]).unwrap();
        assert_eq!(
            samples.len(),
            n * 1920,
            "frames {i}..{} give 1920 samples each",
            i + n
        );
        out.extend_from_slice(&samples);
        i += n;
        g += 1;
    }
    assert_eq!(s.frames(), prime.len() + codes.len());
    out
}

#[test]
fn streamed_decoding_equals_the_offline_decoder_across_the_chunk_boundary() {
    let codes = long_codes();
    assert_eq!(codes.len(), 330);
    for (stored, codec) in codecs() {
        let offline = codec.decode(&codes).unwrap();
        for groups in [
            &[1][..],
            &[2],
            &[7],
            &[300],
            &[3, 1, 7],
            &[64],
            &[299, 2, 29],
        ] {
            let (count, err) = differences(&streamed(codec, &codes, groups, &[]), &offline);
            assert_eq!(
                count, 0,
                "{stored} codec, groups {groups:?}: {count} streamed samples differ (by up to \
                 {err:.3e})"
            );
        }
    }
}

#[test]
fn the_two_stored_codecs_are_different_decoders() {
    // Else the bf16-stored runs would prove nothing beyond the f32-stored ones.
    let codes = long_codes();
    let [(_, a), (_, b)] = codecs();
    let (count, _) = differences(
        &a.decode(&codes[..20]).unwrap(),
        &b.decode(&codes[..20]).unwrap(),
    );
    assert!(count > 20 * 1920 / 2, "only {count} samples differ");
}

#[test]
fn primed_reference_frames_equal_decoding_them_and_cutting_their_samples() {
    let codes = long_codes();
    let (reference, generated) = (&codes[..40], &codes[40..120]);
    for (stored, codec) in codecs() {
        let whole = codec.decode(&codes[..120]).unwrap();
        let want = &whole[40 * 1920..];
        for groups in [&[1][..], &[5, 2]] {
            let (count, err) = differences(&streamed(codec, generated, groups, reference), want);
            assert_eq!(
                count, 0,
                "{stored} codec, primed, groups {groups:?}: {count} samples differ (by up to \
                 {err:.3e})"
            );
        }
    }
}

/// Streams decoded together ([`StreamDecoder::push_many`], as `serve` decodes the frames of all
/// its open streams in one pass): four utterances starting at different steps, pushing
/// different numbers of frames per step, one primed with reference frames, each crossing the
/// 300-frame chunk boundary at its own step and leaving when it ends. Every stream's samples
/// must be those of decoding it alone, to the bit, whoever shares its steps.
#[test]
fn streams_decoded_together_equal_each_stream_decoded_alone() {
    for (stored, codec) in codecs() {
        streams_together(stored, codec);
    }
}

fn streams_together(stored: &str, codec: &Codec) {
    let codes = long_codes();
    // Four utterances: the recorded frames from four starting points, of four lengths.
    let utterances: Vec<Vec<Vec<u32>>> = (0..4)
        .map(|i| {
            codes
                .iter()
                .cycle()
                .skip(37 * i)
                .take(318 - 41 * i)
                .cloned()
                .collect()
        })
        .collect();
    let reference = &codes[200..230];
    let solo: Vec<Vec<f32>> = utterances
        .iter()
        .enumerate()
        .map(|(i, u)| {
            if i == 2 {
                streamed(codec, u, &[1], reference)
            } else {
                codec.decode(u).unwrap()
            }
        })
        .collect();
    let sizes = [1usize, 1, 2, 1, 7, 1, 3];
    let mut streams: Vec<Option<StreamDecoder<'_>>> = (0..4).map(|_| None).collect();
    let mut next = [0usize; 4];
    let mut out: Vec<Vec<f32>> = vec![Vec::new(); 4];
    let mut shared_steps = 0;
    for step in 0.. {
        if (0..4).all(|i| next[i] == utterances[i].len()) {
            break;
        }
        for (i, s) in streams.iter_mut().enumerate() {
            // Stream i joins at step 5·i.
            if s.is_none() && step == 5 * i {
                let mut d = StreamDecoder::new(codec.decoder());
                if i == 2 {
                    d.prime(reference).unwrap();
                }
                *s = Some(d);
            }
        }
        let mut jobs: Vec<(&mut StreamDecoder<'_>, &[Vec<u32>])> = Vec::new();
        let mut who = Vec::new();
        for (i, s) in streams.iter_mut().enumerate() {
            if let Some(d) = s.as_mut() {
                let left = utterances[i].len() - next[i];
                if left == 0 {
                    continue;
                }
                let n = sizes[(step + i) % sizes.len()].min(left);
                jobs.push((d, &utterances[i][next[i]..next[i] + n]));
                who.push((i, n));
            }
        }
        if jobs.len() > 1 {
            shared_steps += 1;
        }
        let samples = StreamDecoder::push_many(&mut jobs).unwrap();
        for ((i, n), w) in who.into_iter().zip(samples) {
            assert_eq!(w.len(), n * 1920, "stream {i}: 1920 samples per frame");
            out[i].extend_from_slice(&w);
            next[i] += n;
        }
        for (i, s) in streams.iter_mut().enumerate() {
            if next[i] == utterances[i].len() {
                // Leaves as soon as it is done.
                *s = None;
            }
        }
    }
    assert!(
        shared_steps > 100,
        "{stored} codec: the streams shared only {shared_steps} steps"
    );
    for (i, (got, want)) in out.iter().zip(&solo).enumerate() {
        let (count, err) = differences(got, want);
        assert_eq!(
            count, 0,
            "{stored} codec, stream {i}: {count} samples differ from its solo decode (by up \
             to {err:.3e})"
        );
    }
}
