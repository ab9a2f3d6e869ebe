//! Times the parts of one generated frame on a model directory (docs/performance.md §2, §3):
//! the talker step, code-0 logits and pick, the 15 code-predictor steps, the frame embedding,
//! and the codec decode per frame; with the bytes of weights each part reads and the rate that
//! makes.
//!
//! With ROWS > 1, every part runs for that many rows at once, as the server's batch does
//! (docs/performance.md §10): times are per step of the whole batch.
//!
//!     cargo run --release --example profile_speak -- MODEL_DIR [f32|bf16-weights|q8|q4] [FRAMES] [ROWS]
//!
//! `VOICECLONE_ISA` narrows the kernels' paths (docs/performance.md §2.6).
use std::time::Instant;

use candle_core::Device;
use vc_core::hub::ModelSource;
use vc_generate::{Precision, Synthesizer};

fn main() -> anyhow::Result<()> {
    // As `speak` runs its frames: on a worker of the rayon pool (docs/performance.md §2.4).
    vc_kernels::pool::on_pool(run)
}

fn run() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .expect("usage: profile_speak MODEL_DIR [PRECISION] [FRAMES] [ROWS]");
    // The crate's memory-reuse policy, as the `voiceclone` binary applies it.
    vc_kernels::alloc::keep_freed_memory();
    vc_kernels::isa::IsaCap::from_env().map_err(anyhow::Error::msg)?;
    let prec = match std::env::args().nth(2).as_deref() {
        Some("f32") => Precision::F32,
        Some("q8") => Precision::Q8,
        Some("q4") => Precision::Q4,
        None | Some("bf16-weights") | Some("bf16w") => Precision::Bf16Weights,
        Some(other) => anyhow::bail!("unknown precision {other}"),
    };
    let n: usize = std::env::args().nth(3).map_or(Ok(20), |s| s.parse())?;
    let b: usize = std::env::args().nth(4).map_or(Ok(1), |s| s.parse())?;
    anyhow::ensure!(b >= 1, "ROWS must be at least 1");
    let t0 = Instant::now();
    let s = Synthesizer::load(&ModelSource::Local(dir.into()), prec, &Device::Cpu)?;
    eprintln!(
        "load {:.2} s: {}",
        t0.elapsed().as_secs_f64(),
        s.describe_backend()
    );
    let talker = s.row_talker().expect("the row inference path");
    let h = talker.hidden_size();
    let mut rng = vc_core::rng::SplitMix64::new(1);
    let mut noise = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| rng.next_f64() as f32 * 2.0 - 1.0)
            .collect()
    };
    let prompt = 12;
    let mut cache = talker.new_cache(prompt + n + 1);
    let hid = talker.forward(&noise(b * prompt * h), b, prompt, None, &mut cache)?;
    let mut last: Vec<f32> = (0..b)
        .flat_map(|r| hid[((r + 1) * prompt - 1) * h..(r + 1) * prompt * h].to_vec())
        .collect();
    let mut cp = talker.code_predictor.new_cache();
    let (mut t_step, mut t_head, mut t_cp, mut t_embed) = (0.0, 0.0, 0.0, 0.0);
    let mut frames = Vec::new();
    for i in 0..=n {
        let t = Instant::now();
        let logits = talker.codec_logits(&last, b);
        let c0: Vec<u32> = logits
            .chunks_exact(logits.len() / b)
            .map(|l| {
                // Codebook entries only (the head's vocabulary also holds control codes).
                (0..2048.min(l.len()))
                    .max_by(|&x, &y| l[x].total_cmp(&l[y]))
                    .unwrap_or(0) as u32
            })
            .collect();
        let d_head = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let sub = talker.predict_sub_codes(&last, &c0, &mut cp, &mut |_, rows| {
            Ok(rows
                .iter()
                .map(|r| {
                    (0..r.len())
                        .max_by(|&a, &b| r[a].total_cmp(&r[b]))
                        .unwrap_or(0) as u32
                })
                .collect())
        })?;
        let d_cp = t.elapsed().as_secs_f64();
        let batch: Vec<[u32; 16]> = (0..b)
            .map(|r| {
                let mut frame = [0u32; 16];
                frame[0] = c0[r];
                frame[1..].copy_from_slice(&sub[r]);
                frame
            })
            .collect();
        frames.push(batch[0].to_vec());
        let t = Instant::now();
        let mut x = talker.frame_embed(&batch)?;
        x.iter_mut().zip(noise(b * h)).for_each(|(a, b)| *a += b);
        let d_embed = t.elapsed().as_secs_f64();
        let t = Instant::now();
        last = talker.forward(&x, b, 1, None, &mut cache)?;
        let d_step = t.elapsed().as_secs_f64();
        if i > 0 {
            // The first frame pays page faults and warm-up; it is not counted.
            t_step += d_step;
            t_head += d_head;
            t_cp += d_cp;
            t_embed += d_embed;
        }
    }
    let t = Instant::now();
    let wav = s.codec.decode(&frames)?;
    let t_decode = t.elapsed().as_secs_f64() / frames.len() as f64;
    let nf = n as f64;
    let (step_b, cp_b) = (
        talker.step_weight_bytes() as f64,
        talker.code_predictor.weight_bytes_per_frame() as f64,
    );
    let ms = |v: f64| v / nf * 1e3;
    println!(
        "precision {prec}, {n} frames of {b} row(s) (after one warm-up frame), {} samples of row 0 decoded",
        wav.len()
    );
    println!(
        "talker step    {:7.2} ms  ({:.0} MB of weights, {:.1} GB/s)",
        ms(t_step),
        step_b / 1e6,
        step_b / (t_step / nf) / 1e9
    );
    println!("code-0 pick    {:7.2} ms", ms(t_head));
    println!(
        "code predictor {:7.2} ms  ({:.0} MB of weights over 15 steps, {:.1} GB/s)",
        ms(t_cp),
        cp_b / 1e6,
        cp_b / (t_cp / nf) / 1e9
    );
    println!("frame embed    {:7.2} ms", ms(t_embed));
    println!(
        "codec decode   {:7.2} ms per frame (all frames at once)",
        t_decode * 1e3
    );
    let total = ms(t_step + t_head + t_cp + t_embed) + t_decode * 1e3;
    println!(
        "frame total    {:7.2} ms  ({:.2} frames/s; weights {:.2} GB/s overall)",
        total,
        1e3 / total,
        (step_b + cp_b) / (total / 1e3) / 1e9
    );
    Ok(())
}
