//! Gradients reach every parameter the fine-tuning recipe trains (docs/model.md §10.4 plus
//! `text_projection`, docs/training.md §2.2) through text embedding, talker and code predictor in
//! the differentiable numerics mode; the fused mode is shown to stop them (the candle 0.11
//! pitfall).

use std::path::Path;

use candle_core::{DType, Device, IndexOp, Tensor};
use vc_model::config::Qwen3TtsConfig;
use vc_model::ops::Numerics;
use vc_model::talker::Talker;
use vc_model::weights::Weights;
use vc_train::step::params::ParamStore;

struct Setup {
    cfg: Qwen3TtsConfig,
    store: ParamStore,
    refs: std::collections::HashMap<String, Tensor>,
}

fn setup(name: &str) -> Setup {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = root.join(name);
    let cfg = Qwen3TtsConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::load(
        &[dir.join("model.safetensors")],
        DType::F32,
        &Device::Cpu,
        |n| n.starts_with("talker."),
    )
    .unwrap();
    // Trainable: the whole talker incl. text_embedding, text_projection and the code predictor.
    let store = ParamStore::from_weights(&weights, |n| n.starts_with("talker.")).unwrap();
    let refs =
        candle_core::safetensors::load(root.join(format!("refs/{name}.safetensors")), &Device::Cpu)
            .unwrap();
    Setup { cfg, store, refs }
}

fn ids(v: &[u32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

/// The corrected SFT loss of docs/model.md §10.3 on one sample in the docs/model.md §10.2 layout
/// (x-vector-only, auto language, non-streaming): `L = CE(code-0) + 0.3 CE(sub-codes)`.
fn sft_loss(talker: &Talker, s: &Setup) -> Tensor {
    let t = &s.cfg.talker_config;
    let (pad, bos, eos) = (
        s.cfg.tts_pad_token_id,
        s.cfg.tts_bos_token_id,
        s.cfg.tts_eos_token_id,
    );
    let role = [151644u32, 77091, 198];
    let text = [9707u32, 1879, 13];
    // Three frames: the two recorded ones and the predictor reference frame.
    let frames = Tensor::cat(
        &[
            s.refs["talker.single.codes.0"].clone(),
            s.refs["cp.frame"].unsqueeze(0).unwrap(),
        ],
        0,
    )
    .unwrap()
    .to_dtype(DType::U32)
    .unwrap();
    let n_frames = frames.dim(0).unwrap();
    let xvec = s.refs["xvector"].unsqueeze(0).unwrap();

    let te = |v: &[u32]| talker.text_embed(&ids(v)).unwrap();
    let ce = |v: &[u32]| talker.codec_embed(&ids(v)).unwrap();
    let tts_pad = te(&[pad]);
    let pads = |n: usize| tts_pad.repeat((n, 1)).unwrap();
    let lt = text.len();
    let mut text_ids = vec![pad; 3];
    text_ids.push(bos);
    text_ids.extend_from_slice(&text);
    text_ids.push(eos);
    let mut codec_ids = vec![
        t.codec_nothink_id,
        t.codec_think_bos_id,
        t.codec_think_eos_id,
    ];
    let codec_head_ids_len = codec_ids.len();
    codec_ids.extend(std::iter::repeat_n(t.codec_pad_id, 1 + lt + 1));
    codec_ids.push(t.codec_bos_id);
    // pos 0..2 role | 3..5 pad+think | 6 pad+x-vector | 7 bos+pad | text+pad | eos+pad | pad+bos | frames
    let embeds = Tensor::cat(
        &[
            te(&role),
            (te(&text_ids[..3]) + ce(&codec_ids[..codec_head_ids_len])).unwrap(),
            (tts_pad.clone() + xvec).unwrap(),
            (te(&text_ids[3..]) + ce(&codec_ids[codec_head_ids_len..codec_ids.len() - 1])).unwrap(),
            (tts_pad.clone() + ce(&[t.codec_bos_id])).unwrap(),
            (pads(n_frames) + talker.frame_embed(&frames).unwrap()).unwrap(),
        ],
        0,
    )
    .unwrap()
    .unsqueeze(0)
    .unwrap();
    // The final `eos` input is never fed (inputs are E[0..N-2]).
    let hidden = talker
        .forward(&embeds, None, None)
        .unwrap()
        .squeeze(0)
        .unwrap();
    // p_k = 8 + Lt + 1 + k predicts code-0 of frame k; p_T predicts EOS.
    let first = 8 + lt + 1;
    let h = hidden.i(first..first + n_frames + 1).unwrap();
    let mut targets: Vec<u32> = frames.i((.., 0)).unwrap().to_vec1().unwrap();
    targets.push(t.codec_eos_token_id);
    let logits = talker.codec_logits(&h).unwrap();
    let l_talker = candle_nn::loss::cross_entropy(&logits, &ids(&targets)).unwrap();
    let sub = talker
        .sub_code_logits(&h.i(..n_frames).unwrap(), &frames)
        .unwrap(); // (T, 15, V)
    let v = sub.dim(2).unwrap();
    let sub_targets = frames.i((.., 1..)).unwrap().flatten_all().unwrap();
    let l_sub =
        candle_nn::loss::cross_entropy(&sub.reshape(((), v)).unwrap(), &sub_targets).unwrap();
    (l_talker + (l_sub * 0.3).unwrap()).unwrap()
}

#[test]
fn every_trained_parameter_gets_a_gradient() {
    for (name, numerics) in [
        ("tiny-0b6", Numerics::Kernels),
        ("tiny-1b7", Numerics::Kernels),
        ("tiny-0b6", Numerics::Autograd),
        ("tiny-1b7", Numerics::Autograd),
    ] {
        let s = setup(name);
        let talker = Talker::from_source(&s.store, &s.cfg, numerics).unwrap();
        let name = format!("{name} ({numerics:?})");
        let name = name.as_str();
        let loss = sft_loss(&talker, &s);
        let value = loss.to_scalar::<f32>().unwrap();
        assert!(value.is_finite() && value > 0.0, "{name}: loss {value}");
        let grads = loss.backward().unwrap();
        let mut checked = 0;
        for p in &s.store.params {
            let (param, var) = (&p.name, &p.var);
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient for {param}"));
            let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
            assert!(
                g.iter().all(|x| x.is_finite()),
                "{name}: non-finite gradient for {param}"
            );
            assert!(
                g.iter().any(|&x| x != 0.0),
                "{name}: zero gradient for {param}"
            );
            checked += 1;
        }
        // Every talker tensor of the checkpoint is a parameter (and some are optional).
        let has_proj = s
            .store
            .var("talker.code_predictor.small_to_mtp_projection.weight")
            .is_some();
        assert_eq!(has_proj, name.starts_with("tiny-1b7"));
        assert!(s
            .store
            .var("talker.text_projection.linear_fc1.bias")
            .is_some());
        eprintln!("{name}: loss {value:.4}, {checked} parameters with finite non-zero gradients");

        // The gradients are right, not merely present: central finite differences along the
        // gradient direction for parameters behind the hand-written RMSNorm, softmax and RoPE.
        for param in [
            "talker.model.layers.0.self_attn.q_norm.weight",
            "talker.model.layers.1.self_attn.k_proj.weight",
            "talker.model.layers.0.input_layernorm.weight",
            "talker.text_projection.linear_fc1.weight",
            "talker.code_predictor.model.layers.0.self_attn.k_norm.weight",
            "talker.code_predictor.model.norm.weight",
        ] {
            let var = s.store.var(param).unwrap();
            let g = grads.get(var.as_tensor()).unwrap().clone();
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .sqrt()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            // Along the unit direction g/|g| the derivative is |g|; step so that the loss moves by
            // about 0.005: above f32 noise, small enough for the central difference even where the
            // curvature is strong (the predictor k_norm of tiny-1b7 needs it).
            let step = 0.005 / norm;
            let original = var.as_tensor().copy().unwrap();
            let at = |sign: f32| {
                let delta = (&g * (sign * step / norm) as f64).unwrap();
                var.set(&(&original + delta).unwrap()).unwrap();
                sft_loss(&talker, &s).to_scalar::<f32>().unwrap()
            };
            let numeric = (at(1.0) - at(-1.0)) / (2.0 * step);
            var.set(&original).unwrap();
            let rel = (numeric - norm).abs() / norm;
            eprintln!(
                "{name}: {param}: |g| {norm:.4e}, finite difference {numeric:.4e} (rel {rel:.1e})"
            );
            assert!(
                rel < 1e-2,
                "{name}: {param}: analytic {norm} vs finite difference {numeric}"
            );
        }

        // The fused kernels compute the same loss but record no backward op: the attention
        // projections behind the fused softmax/RoPE/RMSNorm get nothing.
        let fused = Talker::from_source(&s.store, &s.cfg, Numerics::Fused).unwrap();
        let loss_fused = sft_loss(&fused, &s);
        let diff = (loss_fused.to_scalar::<f32>().unwrap() - value).abs();
        assert!(
            diff < 1e-4 * value.max(1.0),
            "{name}: fused loss differs by {diff}"
        );
        let grads = loss_fused.backward().unwrap();
        let q = s
            .store
            .var("talker.model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        assert!(
            grads.get(q.as_tensor()).is_none(),
            "{name}: fused mode unexpectedly propagated to q_proj"
        );
    }
}
