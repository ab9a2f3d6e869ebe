//! Times forward and backward of the training graph's parts on a model directory (CPU, f32):
//! the code predictor on teacher-forced frames, the talker decoder, and their heads + losses.
//!
//!   cargo run --release --example profile_train -- MODEL_DIR [frames] [talker_len]
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use vc_core::hub::ModelSource;
use vc_model::files::ModelFiles;
use vc_model::ops::Numerics;
use vc_model::talker::Talker;
use vc_train::step::params::ParamStore;
use vc_train::step::units::forward::cross_entropy;

fn timed<T>(
    what: &str,
    reps: usize,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let mut out = f()?; // warm-up
    let t = Instant::now();
    for _ in 0..reps {
        out = f()?;
    }
    println!(
        "{what:<40} {:8.1} ms",
        t.elapsed().as_secs_f64() / reps as f64 * 1e3
    );
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .expect("usage: profile_train MODEL_DIR [frames] [talker_len]");
    let frames: usize = args.next().map_or(Ok(230), |a| a.parse())?;
    let len: usize = args.next().map_or(Ok(170), |a| a.parse())?;
    vc_kernels::alloc::keep_freed_memory();
    let dev = Device::Cpu;
    let files = ModelFiles::resolve(&ModelSource::Local(dir.into()))?;
    let weights = files.load_weights(DType::F32, &dev, |n| n.starts_with("talker."))?;
    let store = ParamStore::from_weights(&weights, |n| n.starts_with("talker."))?;
    let talker = Talker::from_source(&store, &files.config, Numerics::Kernels)?;
    let h = talker.config().hidden_size;
    let cp_vocab = files.config.talker_config.code_predictor_config.vocab_size as u32;
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);

    let hidden = Var::from_tensor(&Tensor::randn(0f32, 1.0, (frames, h), &dev)?)?;
    let codes: Vec<u32> = (0..frames * 16)
        .map(|i| (i as u32 * 7919) % cp_vocab)
        .collect();
    let codes = Tensor::from_vec(codes, (frames, 16), &dev)?;
    let targets = codes.narrow(1, 1, 15)?.t()?.contiguous()?.flatten_all()?;
    let cp = &talker.code_predictor;
    let c0e = talker.codec_embed(&codes.narrow(1, 0, 1)?.squeeze(1)?)?;
    let g = 16;
    let xin = timed("  cp inputs (embeddings, cat)", reps, || {
        let mut inputs = vec![hidden.as_tensor().unsqueeze(1)?, c0e.unsqueeze(1)?];
        for i in 1..g - 1 {
            inputs.push(vc_model::ops::embedding(
                &cp.codec_embedding[i - 1],
                &codes.narrow(1, i, 1)?,
            )?);
        }
        Ok(Tensor::cat(&inputs, 1)?)
    })?;
    let l0 = &cp.decoder.layers[0];
    let xr = xin.reshape((frames * g, h))?;
    let gk = vc_model::autograd_ops::linear;
    let up = timed("  one linear 256->768 (kernel)", reps, || {
        Ok(gk(&xr, &l0.gate_proj.weight, None)?)
    })?;
    for n in [128usize, 256, 512, 768, 1536] {
        let w = Tensor::randn(0f32, 1.0, (n, h), &dev)?;
        let t = Instant::now();
        for _ in 0..5 {
            gk(&xr, &w, None)?;
        }
        let dt = t.elapsed().as_secs_f64() / 5.0;
        println!(
            "  gemm {}x{h}x{n}: {:.1} GFLOP/s",
            frames * g,
            2.0 * (frames * g * h * n) as f64 / dt / 1e9
        );
    }
    timed("  one linear 768->256 (kernel)", reps, || {
        Ok(gk(&up, &l0.down_proj.weight, None)?)
    })?;
    timed("  one linear 256->768 (candle)", reps, || {
        Ok(xr.matmul(&l0.gate_proj.weight.t()?)?)
    })?;
    timed("  rms norm", reps, || {
        Ok(vc_model::autograd_ops::rms_norm(
            &xr,
            &l0.input_layernorm,
            1e-6,
        )?)
    })?;
    {
        let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (frames, g, 256), &dev)?)?;
        let k = Var::from_tensor(&Tensor::randn(0f32, 1.0, (frames, g, 128), &dev)?)?;
        let bias: Vec<f32> = (0..g * g)
            .map(|i| {
                if i % g > i / g {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let bias = Tensor::from_vec(bias, (1, 1, g, g), &dev)?;
        let a = timed("  attention fwd", reps, || {
            Ok(vc_model::autograd_ops::attention(
                q.as_tensor(),
                k.as_tensor(),
                k.as_tensor(),
                64,
                0.125,
                Some(&bias),
            )?
            .sum_all()?)
        })?;
        timed("  attention bwd", reps, || Ok(a.backward()?))?;
        let u = Var::from_tensor(&up)?;
        let s = timed("  swiglu fwd", reps, || {
            Ok(vc_model::autograd_ops::swiglu(u.as_tensor(), u.as_tensor())?.sum_all()?)
        })?;
        timed("  swiglu bwd", reps, || Ok(s.backward()?))?;
    }
    timed("  swiglu", reps, || {
        Ok(vc_model::autograd_ops::swiglu(&up, &up)?)
    })?;
    let out = timed("  cp decoder forward", reps, || {
        Ok(cp.decoder.forward(&xin, None, None)?)
    })?;
    let heads = timed("  cp heads stack", reps, || {
        Ok(Tensor::stack(&cp.lm_head, 0)?)
    })?;
    let logits = timed("  cp heads", reps, || {
        Ok(vc_model::autograd_ops::shifted_heads(&out, &heads)?)
    })?;
    timed("  cp CE", reps, || {
        Ok(cross_entropy(
            &logits.reshape(((), cp_vocab as usize))?,
            &targets,
            true,
        )?)
    })?;
    let loss = timed("code predictor forward + CE", reps, || {
        let logits = talker.sub_code_logits_by_codebook(hidden.as_tensor(), &codes)?;
        Ok(cross_entropy(
            &logits.reshape(((), cp_vocab as usize))?,
            &targets,
            true,
        )?)
    })?;
    timed("code predictor backward", reps, || Ok(loss.backward()?))?;

    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, len, h), &dev)?)?;
    let out = timed("talker decoder forward", reps, || {
        Ok(talker.forward(x.as_tensor(), None, None)?.sum_all()?)
    })?;
    timed("talker decoder backward", reps, || Ok(out.backward()?))?;
    Ok(())
}
