//! Parity of the talker and the code predictor with the official implementation, on the tiny
//! random models of `tests/fixtures/` (references recorded by `scripts/reference/make_fixtures.py`, see
//! `tests/fixtures/README.md`). Every check runs for both fixture models (`tiny-0b6` without
//! and `tiny-1b7` with `small_to_mtp_projection`) and both numerics modes.

use crate::common::fixtures;
use std::collections::{BTreeSet, HashMap};

use candle_core::{DType, Device, IndexOp, Tensor};
use vc_model::code_predictor::greedy;
use vc_model::config::Qwen3TtsConfig;
use vc_model::layers::{RecordingSource, TensorSource};
use vc_model::ops::Numerics;
use vc_model::talker::Talker;
use vc_model::weights::Weights;

const MODELS: [&str; 2] = ["tiny-0b6", "tiny-1b7"];
const MODES: [Numerics; 3] = [Numerics::Fused, Numerics::Autograd, Numerics::Kernels];

/// docs/model.md §14: f32 logits of the official ops are within ~1.6e-5 of f64; allow ~100x.
const LOGITS_TOL: f32 = 2e-3;
const HIDDEN_TOL: f32 = 5e-4;
const EMBED_TOL: f32 = 1e-5;

struct Fixture {
    name: &'static str,
    cfg: Qwen3TtsConfig,
    talker: Talker,
    refs: HashMap<String, Tensor>,
    meta: serde_json::Value,
}

impl Fixture {
    /// Loads a fixture model the way a real model directory is loaded.
    fn load(name: &'static str, numerics: Numerics) -> Self {
        let dir = fixtures().join(name);
        let cfg = Qwen3TtsConfig::from_file(&dir.join("config.json")).unwrap();
        let weights = Weights::load(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
            |n| n.starts_with("talker."),
        )
        .unwrap();
        let talker = Talker::load(&weights, &cfg, numerics).unwrap();
        let refs_dir = fixtures().join("refs");
        let refs = candle_core::safetensors::load(
            refs_dir.join(format!("{name}.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        let meta = serde_json::from_str(
            &std::fs::read_to_string(refs_dir.join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        Self {
            name,
            cfg,
            talker,
            refs,
            meta,
        }
    }

    fn r(&self, key: &str) -> &Tensor {
        self.refs
            .get(key)
            .unwrap_or_else(|| panic!("{}: reference {key} missing", self.name))
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn check(what: &str, got: &Tensor, want: &Tensor, tol: f32) -> f32 {
    let err = max_abs_diff(got, want);
    eprintln!("{what}: max abs error {err:.3e}");
    assert!(err <= tol, "{what}: max abs error {err:.3e} > {tol:.1e}");
    err
}

fn ids(v: &[i64]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn json_ids(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

#[test]
fn talker_prefill_matches_reference() {
    for name in MODELS {
        for mode in MODES {
            let f = Fixture::load(name, mode);
            for case in ["single", "batch"] {
                let p = format!("talker.{case}");
                let embeds = f.r(&format!("{p}.inputs_embeds"));
                let mask = f.r(&format!("{p}.attention_mask"));
                let (hidden, states) = f
                    .talker
                    .decoder
                    .forward_hidden_states(embeds, Some(mask), None)
                    .unwrap();
                let tag = format!("{name} {mode:?} {case}");
                // HF's output_hidden_states: inputs, layer outputs but the last, final norm
                // (docs/model.md §14).
                let ref_states = f.r(&format!("{p}.hidden_states"));
                assert_eq!(states.len(), ref_states.dim(0).unwrap());
                for (i, s) in states.iter().enumerate() {
                    check(
                        &format!("{tag} hidden_states[{i}]"),
                        s,
                        &ref_states.get(i).unwrap(),
                        HIDDEN_TOL,
                    );
                }
                check(
                    &format!("{tag} hidden"),
                    &hidden,
                    f.r(&format!("{p}.hidden")),
                    HIDDEN_TOL,
                );
                let logits = f.talker.codec_logits(&hidden).unwrap();
                check(
                    &format!("{tag} logits"),
                    &logits,
                    f.r(&format!("{p}.logits")),
                    LOGITS_TOL,
                );
                // The plain forward gives the same.
                let plain = f.talker.forward(embeds, Some(mask), None).unwrap();
                assert_eq!(max_abs_diff(&plain, &hidden), 0.0);
            }
        }
    }
}

/// Rebuilds the recorded prompts (x-vector-only voice clone, streaming text, docs/model.md §6 tail
/// A) from the token ids with `text_embed` / `codec_embed`: checks the text path
/// (docs/model.md §3.3).
#[test]
fn prompt_embeddings_from_ids_match_reference() {
    for name in MODELS {
        let f = Fixture::load(name, Numerics::Fused);
        let t = &f.cfg.talker_config;
        let te = |v: &[i64]| f.talker.text_embed(&ids(v)).unwrap();
        let ce = |v: &[i64]| f.talker.codec_embed(&ids(v)).unwrap();
        let (pad, bos, eos) = (
            f.cfg.tts_pad_token_id as i64,
            f.cfg.tts_bos_token_id as i64,
            f.cfg.tts_eos_token_id as i64,
        );
        let tts_pad = te(&[pad]);
        check(
            &format!("{name} tts_pad_embed"),
            &tts_pad.squeeze(0).unwrap(),
            f.r("talker.single.tts_pad_embed"),
            EMBED_TOL,
        );
        let xvec = f.r("xvector").unsqueeze(0).unwrap();
        for case in ["single", "batch"] {
            let p = format!("talker.{case}");
            let meta = &f.meta[format!("talker_{case}")];
            let ref_embeds = f.r(&format!("{p}.inputs_embeds"));
            let ref_trailing = f.r(&format!("{p}.trailing_text_hidden"));
            let (_, seq, _) = ref_embeds.dims3().unwrap();
            let trailing_len = ref_trailing.dim(1).unwrap();
            for (row, lang) in meta["languages"].as_array().unwrap().iter().enumerate() {
                let input_ids = json_ids(&meta["input_ids"][row]);
                let lang = lang.as_str().unwrap().to_lowercase();
                let mut codec: Vec<i64> = if lang == "auto" {
                    vec![
                        t.codec_nothink_id,
                        t.codec_think_bos_id,
                        t.codec_think_eos_id,
                    ]
                } else {
                    vec![
                        t.codec_think_id,
                        t.codec_think_bos_id,
                        t.codec_language_id[&lang],
                        t.codec_think_eos_id,
                    ]
                }
                .into_iter()
                .map(i64::from)
                .collect();
                let n_lang = codec.len();
                codec.push(t.codec_pad_id as i64);
                // role | tts_pad + codec(P) | tts_pad + x-vector | tts_bos + codec(pad) | T[0] + codec(bos)
                let text_part = Tensor::cat(
                    &[
                        tts_pad.repeat((n_lang, 1)).unwrap(),
                        tts_pad.clone(),
                        te(&[bos]),
                    ],
                    0,
                )
                .unwrap();
                let codec_part = Tensor::cat(
                    &[ce(&codec[..n_lang]), xvec.clone(), ce(&codec[n_lang..])],
                    0,
                )
                .unwrap();
                let text = &input_ids[3..input_ids.len() - 5];
                let first = (te(&text[..1]) + ce(&[t.codec_bos_id as i64])).unwrap();
                let prompt = Tensor::cat(
                    &[
                        te(&input_ids[..3]),
                        (text_part + codec_part).unwrap(),
                        first,
                    ],
                    0,
                )
                .unwrap();
                let len = prompt.dim(0).unwrap();
                let want = ref_embeds.i((row, seq - len..)).unwrap();
                check(
                    &format!("{name} {case}[{row}] inputs_embeds"),
                    &prompt,
                    &want,
                    EMBED_TOL,
                );
                // Left padding is zeros.
                let padding = ref_embeds.i((row, ..seq - len)).unwrap();
                assert_eq!(
                    padding
                        .abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap(),
                    0.0
                );
                // trailing text = T[1:] ++ tts_eos, right-padded with tts_pad.
                let mut trailing = vec![te(&text[1..]), te(&[eos])];
                let k = text.len();
                if k < trailing_len {
                    trailing.push(tts_pad.repeat((trailing_len - k, 1)).unwrap());
                }
                let trailing = Tensor::cat(&trailing, 0).unwrap();
                check(
                    &format!("{name} {case}[{row}] trailing_text"),
                    &trailing,
                    &ref_trailing.get(row).unwrap(),
                    EMBED_TOL,
                );
            }
        }
    }
}

/// Code-0 pick of the official loop (docs/model.md §7): repetition penalty over generated ids,
/// min_new_tokens = 2, suppression of the control ids except EOS; greedy.
fn pick_code0(logits: &[f32], history: &[u32], step: usize, eos: usize) -> u32 {
    let mut s = logits.to_vec();
    for &t in history.iter().collect::<BTreeSet<_>>() {
        let v = &mut s[t as usize];
        *v = if *v < 0.0 { *v * 1.05 } else { *v / 1.05 };
    }
    let vocab = s.len();
    for (i, v) in s.iter_mut().enumerate() {
        if (i >= vocab - 1024 && i != eos) || (i == eos && step < 2) {
            *v = f32::NEG_INFINITY;
        }
    }
    let best = s
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0;
    best as u32
}

/// Replays the recorded greedy generation (2 frames) with the KV cache: prefill, code-0 from
/// the logits, sub-codes from the predictor, frame embedding + trailing text fed back, decode.
#[test]
fn greedy_generation_loop_matches_reference() {
    for name in MODELS {
        for mode in MODES {
            let f = Fixture::load(name, mode);
            let eos = f.cfg.talker_config.codec_eos_token_id as usize;
            for case in ["single", "batch"] {
                let p = format!("talker.{case}");
                let meta = &f.meta[format!("talker_{case}")];
                let tag = format!("{name} {mode:?} {case}");
                let embeds = f.r(&format!("{p}.inputs_embeds"));
                let mask = f.r(&format!("{p}.attention_mask"));
                let trailing = f.r(&format!("{p}.trailing_text_hidden"));
                let pad_embed = f.r(&format!("{p}.tts_pad_embed"));
                let b = embeds.dim(0).unwrap();
                let want: Vec<Tensor> = (0..b)
                    .map(|r| f.r(&format!("{p}.codes.{r}")).clone())
                    .collect();
                let frames = want[0].dim(0).unwrap();
                let mut cache = f.talker.new_cache(4);
                let mut cp_cache = f.talker.code_predictor.new_cache();
                let mut hidden = f
                    .talker
                    .forward(embeds, Some(mask), Some(&mut cache))
                    .unwrap();
                let mut history = vec![Vec::new(); b];
                for step in 0..frames {
                    let last = hidden.i((.., hidden.dim(1).unwrap() - 1)).unwrap(); // (B, H)
                    let logits = f
                        .talker
                        .codec_logits(&last)
                        .unwrap()
                        .to_vec2::<f32>()
                        .unwrap();
                    let c0: Vec<u32> = (0..b)
                        .map(|r| pick_code0(&logits[r], &history[r], step, eos))
                        .collect();
                    for r in 0..b {
                        assert_eq!(
                            i64::from(c0[r]),
                            meta["greedy_code0"][r][step].as_i64().unwrap(),
                            "{tag} code0"
                        );
                        history[r].push(c0[r]);
                    }
                    let c0 = Tensor::new(c0.as_slice(), &Device::Cpu).unwrap();
                    let sub = f
                        .talker
                        .predict_sub_codes(&last, &c0, &mut cp_cache, greedy)
                        .unwrap();
                    let frame = Tensor::cat(&[c0.unsqueeze(1).unwrap(), sub], 1).unwrap(); // (B, 16)
                    for (r, w) in want.iter().enumerate() {
                        let got: Vec<i64> = frame
                            .get(r)
                            .unwrap()
                            .to_dtype(DType::I64)
                            .unwrap()
                            .to_vec1()
                            .unwrap();
                        assert_eq!(
                            got,
                            w.get(step).unwrap().to_vec1::<i64>().unwrap(),
                            "{tag} frame {step} row {r}"
                        );
                    }
                    let text = if step < trailing.dim(1).unwrap() {
                        trailing.i((.., step)).unwrap()
                    } else {
                        pad_embed.unsqueeze(0).unwrap().repeat((b, 1)).unwrap()
                    };
                    let next = (f.talker.frame_embed(&frame).unwrap() + text)
                        .unwrap()
                        .unsqueeze(1)
                        .unwrap();
                    hidden = f.talker.forward(&next, None, Some(&mut cache)).unwrap();
                }
                eprintln!("{tag}: {frames} greedy frames identical");
            }
        }
    }
}

#[test]
fn kv_cache_incremental_matches_full_forward() {
    for name in MODELS {
        for mode in MODES {
            let f = Fixture::load(name, mode);
            for case in ["single", "batch"] {
                let p = format!("talker.{case}");
                let embeds = f.r(&format!("{p}.inputs_embeds"));
                let mask = f.r(&format!("{p}.attention_mask"));
                let seq = embeds.dim(1).unwrap();
                let full = f.talker.forward(embeds, Some(mask), None).unwrap();
                for k in [1, 4] {
                    // A tiny initial capacity also exercises the buffer growth.
                    let mut cache = f.talker.new_cache(2);
                    let mut outs = vec![f
                        .talker
                        .forward(
                            &embeds.narrow(1, 0, k).unwrap(),
                            Some(&mask.narrow(1, 0, k).unwrap()),
                            Some(&mut cache),
                        )
                        .unwrap()];
                    for i in k..seq {
                        let x = embeds.narrow(1, i, 1).unwrap();
                        let m = mask.narrow(1, i, 1).unwrap();
                        outs.push(f.talker.forward(&x, Some(&m), Some(&mut cache)).unwrap());
                    }
                    assert_eq!(cache.len(), seq);
                    let inc = Tensor::cat(&outs, 1).unwrap();
                    let tag = format!("{name} {mode:?} {case} prefill {k} + steps");
                    check(&tag, &inc, &full, 1e-4);
                }
            }
        }
    }
}

#[test]
fn code_predictor_matches_reference() {
    for name in MODELS {
        for mode in MODES {
            let f = Fixture::load(name, mode);
            let tag = format!("{name} {mode:?}");
            let h = f.r("cp.h").unsqueeze(0).unwrap();
            let frame = f.r("cp.frame").unsqueeze(0).unwrap();
            let logits = f.talker.sub_code_logits(&h, &frame).unwrap();
            let want = f.r("cp.teacher_forced_logits").unsqueeze(0).unwrap();
            check(
                &format!("{tag} teacher-forced logits"),
                &logits,
                &want,
                LOGITS_TOL,
            );

            let c0 = frame.i((.., 0)).unwrap();
            let mut cache = f.talker.code_predictor.new_cache();
            let mut seen = Vec::new();
            let codes = f
                .talker
                .predict_sub_codes(&h, &c0, &mut cache, |j: usize, l: &Tensor| {
                    seen.push(j);
                    greedy(j, l)
                })
                .unwrap();
            assert_eq!(seen, (1..16).collect::<Vec<_>>());
            let got: Vec<i64> = codes
                .squeeze(0)
                .unwrap()
                .to_dtype(DType::I64)
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(
                got,
                f.r("cp.greedy_codes").to_vec1::<i64>().unwrap(),
                "{tag} greedy sub-codes"
            );
            // The cache is reusable: a second frame gives the same codes.
            let again = f
                .talker
                .predict_sub_codes(&h, &c0, &mut cache, greedy)
                .unwrap();
            assert_eq!(
                again
                    .to_dtype(DType::I64)
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
                    .to_vec1::<i64>()
                    .unwrap(),
                got
            );
        }
    }
}

/// The frame embedding (docs/model.md §5.4) on the recorded frames equals the explicit 16-way sum.
#[test]
fn frame_embedding_is_the_sixteen_way_sum() {
    let f = Fixture::load("tiny-1b7", Numerics::Fused);
    let frames = f.r("talker.single.codes.0"); // (2, 16)
    let got = f.talker.frame_embed(frames).unwrap();
    let cp = &f.talker.code_predictor;
    for r in 0..frames.dim(0).unwrap() {
        let codes = frames.get(r).unwrap().to_vec1::<i64>().unwrap();
        let mut want = f.talker.codec_embedding.get(codes[0] as usize).unwrap();
        for (table, &code) in cp.codec_embedding.iter().zip(&codes[1..]) {
            want = (want + table.get(code as usize).unwrap()).unwrap();
        }
        assert!(max_abs_diff(&got.get(r).unwrap(), &want) < 1e-6);
    }
}

/// Loading reads every `talker.*` tensor of the checkpoint (nothing silently ignored), and the
/// 1.7B layout is the one with `small_to_mtp_projection`.
#[test]
fn every_talker_tensor_is_used() {
    for name in MODELS {
        let dir = fixtures().join(name);
        let cfg = Qwen3TtsConfig::from_file(&dir.join("config.json")).unwrap();
        let weights = Weights::load(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
            |_| true,
        )
        .unwrap();
        let rec = RecordingSource::new(&weights as &dyn TensorSource);
        let talker = Talker::from_source(&rec, &cfg, Numerics::Fused).unwrap();
        let all: BTreeSet<String> = weights.names_with_prefix("talker.").into_iter().collect();
        assert_eq!(rec.used(), all, "{name}");
        assert_eq!(
            talker.code_predictor.projection.is_some(),
            name == "tiny-1b7"
        );
    }
}

#[test]
fn wrong_shapes_are_named_errors() {
    let dir = fixtures().join("tiny-0b6");
    let mut cfg = Qwen3TtsConfig::from_file(&dir.join("config.json")).unwrap();
    cfg.talker_config.intermediate_size += 1;
    let weights = Weights::load(
        &[dir.join("model.safetensors")],
        DType::F32,
        &Device::Cpu,
        |n| n.starts_with("talker."),
    )
    .unwrap();
    let err = format!(
        "{:#}",
        Talker::load(&weights, &cfg, Numerics::Fused).unwrap_err()
    );
    assert!(
        err.contains("talker.model.layers.0.mlp.gate_proj.weight"),
        "{err}"
    );
}
