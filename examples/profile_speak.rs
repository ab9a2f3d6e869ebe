//! Times the parts of one generated frame on a model directory (talker step, code predictor).
use candle_core::{DType, Device, Tensor};
use std::time::Instant;
use voiceclone::generate::{Precision, Synthesizer};
use voiceclone::hub::ModelSource;
use voiceclone::model::code_predictor::greedy;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).expect("model dir");
    // The crate's memory-reuse policy, as the `voiceclone` binary applies it.
    voiceclone::kernels::alloc::keep_freed_memory();
    let prec = match std::env::args().nth(2).as_deref() {
        Some("bf16w") => Precision::Bf16Weights,
        _ => Precision::F32,
    };
    let t0 = Instant::now();
    let s = Synthesizer::load(&ModelSource::Local(dir.into()), prec, &Device::Cpu)?;
    eprintln!("load {:.2}s", t0.elapsed().as_secs_f64());
    let h = s.config().talker_config.hidden_size;
    let talker = &s.talker;
    let x = Tensor::randn(0f32, 1.0, (1, 40, h), &Device::Cpu)?;
    let mut cache = talker.new_cache(200);
    let _ = talker.forward(&x, None, Some(&mut cache))?;
    let mut cp = talker.code_predictor.new_cache();
    let n = 10;
    let mut t_step = 0.0;
    let mut t_cp = 0.0;
    let mut t_head = 0.0;
    for _ in 0..n {
        let x1 = Tensor::randn(0f32, 1.0, (1, 1, h), &Device::Cpu)?;
        let t = Instant::now();
        let hid = talker.forward(&x1, None, Some(&mut cache))?.squeeze(1)?;
        t_step += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let logits = talker.codec_logits(&hid)?.to_dtype(DType::F32)?;
        let c0 = logits.argmax(1)?.to_dtype(DType::U32)?;
        t_head += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let _sub = talker.predict_sub_codes(&hid, &c0, &mut cp, greedy)?;
        t_cp += t.elapsed().as_secs_f64();
    }
    println!(
        "talker step {:.1} ms, head {:.1} ms, code predictor {:.1} ms per frame",
        t_step / n as f64 * 1e3,
        t_head / n as f64 * 1e3,
        t_cp / n as f64 * 1e3
    );
    Ok(())
}
