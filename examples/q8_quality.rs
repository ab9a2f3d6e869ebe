//! Quality of the `q8` (or `q4`) precision against `f32` on a model directory (its
//! figures in the README, docs/usage.md and docs/performance.md §3, §2.6):
//!
//! - per matrix: the relative error `‖y_q − y_f32‖ / ‖y_f32‖` of its product with random
//!   activation rows (uniform in [-1, 1]; activations are quantized per row as in generation);
//! - teacher-forced generation over `STEPS` (default 500) frames: both models read the same
//!   frames (chosen greedily by f32 among the 2048 codes, so EOS never ends the run); at every
//!   step the code-0 logits' relative error, whether both pick the same code-0 (top-1
//!   agreement), the KL divergence `KL(p_f32 ‖ p_q)` of the code-0 distribution (softmax over
//!   the ids sampling may draw: the 2048 codes and EOS), and the code predictor's top-1
//!   agreement on the 15 sub-codes given the f32 sub-codes before them.
//!
//!     cargo run --release --example q8_quality -- MODEL_DIR [STEPS] [q8|q4]
use anyhow::Result;
use vc_core::hub::ModelSource;
use vc_model::files::ModelFiles;
use vc_model::infer::RowTalker;
use vc_model::linear::{Input, WeightFormat};
use vc_model::weights::MappedWeights;

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]))
        .unwrap_or(0) as u32
}

fn log_softmax(v: &[f32]) -> Vec<f64> {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
    let lse = v.iter().map(|x| (*x as f64 - m).exp()).sum::<f64>().ln() + m;
    v.iter().map(|x| *x as f64 - lse).collect()
}

fn main() -> Result<()> {
    let dir = std::env::args()
        .nth(1)
        .expect("usage: q8_quality MODEL_DIR [STEPS] [q8|q4]");
    let steps: usize = std::env::args().nth(2).map_or(Ok(500), |s| s.parse())?;
    let (name, format) = match std::env::args().nth(3).as_deref() {
        None | Some("q8") => ("q8", WeightFormat::Q8),
        Some("q4") => ("q4", WeightFormat::Q4),
        Some(other) => anyhow::bail!("{other} is not q8 or q4"),
    };
    let files = ModelFiles::resolve(&ModelSource::Local(dir.clone().into()))?;
    let mapped = MappedWeights::open(&files.checkpoint.shards)?;
    let f32m = RowTalker::load(&mapped, &files.config, WeightFormat::F32)?;
    let t = std::time::Instant::now();
    let qm = RowTalker::load(&mapped, &files.config, format)?;
    eprintln!("{name} load + quantize {:.2} s", t.elapsed().as_secs_f64());
    let cfg = &files.config.talker_config;
    let eos = cfg.codec_eos_token_id as usize;

    // Per-matrix relative error on random rows.
    let mut seed = 7u64;
    let mut noise = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    };
    let mut by_kind: std::collections::BTreeMap<String, (f64, f64, usize)> = Default::default();
    for ((name, wf), (_, wq)) in f32m.matrices().iter().zip(qm.matrices().iter()) {
        let k = wf.dims().1;
        let x = noise(4 * k);
        let inp = Input::new(&x, 4, k);
        let e = rel(&wq.forward(&inp), &wf.forward(&inp));
        let kind = name
            .rsplit('.')
            .nth(1)
            .map(|s| {
                if s.chars().all(|c| c.is_ascii_digit()) {
                    "lm_head"
                } else {
                    s
                }
            })
            .unwrap_or("?")
            .to_string();
        let kind = if name.contains("code_predictor") {
            format!("cp.{kind}")
        } else {
            format!("talker.{kind}")
        };
        let entry = by_kind.entry(kind).or_insert((0.0, 0.0, 0));
        entry.0 += e;
        entry.1 = entry.1.max(e);
        entry.2 += 1;
    }
    println!("per-matrix relative error of {name} products (random rows):");
    let (mut sum, mut count, mut worst) = (0.0, 0usize, 0f64);
    for (kind, (s, m, n)) in &by_kind {
        println!(
            "  {kind:<22} mean {:.4}  max {:.4}  ({n} matrices)",
            s / *n as f64,
            m
        );
        sum += s;
        count += n;
        worst = worst.max(*m);
    }
    println!(
        "  all                    mean {:.4}  max {:.4}  ({count} matrices)",
        sum / count as f64,
        worst
    );

    // Teacher-forced steps.
    let h = f32m.hidden_size();
    let prompt: Vec<u32> = (0..8).map(|i| 1000 + 37 * i).collect();
    let mut x = f32m.text_embed(&prompt)?;
    let bos = f32m.codec_embed(&vec![cfg.codec_pad_id; prompt.len()])?;
    x.iter_mut().zip(&bos).for_each(|(a, b)| *a += b);
    let pad = f32m.text_embed(&[files.config.tts_pad_token_id])?;
    let cap = prompt.len() + steps + 1;
    let (mut cf, mut cq) = (f32m.new_cache(cap), qm.new_cache(cap));
    let (mut pf, mut pq) = (
        f32m.code_predictor.new_cache(),
        qm.code_predictor.new_cache(),
    );
    let hf = f32m.forward(&x, 1, prompt.len(), None, &mut cf)?;
    let hq = qm.forward(&x, 1, prompt.len(), None, &mut cq)?;
    let (mut lf, mut lq) = (
        hf[(prompt.len() - 1) * h..].to_vec(),
        hq[(prompt.len() - 1) * h..].to_vec(),
    );
    let (mut err_sum, mut top1, mut kl_sum, mut kl_max, mut sub_agree, mut sub_total) =
        (0f64, 0usize, 0f64, 0f64, 0usize, 0usize);
    let started = std::time::Instant::now();
    for step in 0..steps {
        let (zf, zq) = (f32m.codec_logits(&lf, 1), qm.codec_logits(&lq, 1));
        err_sum += rel(&zq, &zf);
        let (c0f, c0q) = (argmax(&zf[..2048]), argmax(&zq[..2048]));
        top1 += (c0f == c0q) as usize;
        let allowed = |z: &[f32]| -> Vec<f32> {
            let mut v = z[..2048].to_vec();
            v.push(z[eos]);
            v
        };
        let (lpf, lpq) = (log_softmax(&allowed(&zf)), log_softmax(&allowed(&zq)));
        let kl: f64 = lpf.iter().zip(&lpq).map(|(a, b)| a.exp() * (a - b)).sum();
        kl_sum += kl;
        kl_max = kl_max.max(kl);
        // f32 sub-codes, then the quantized model's picks given the same previous codes.
        let subf = f32m.predict_sub_codes(&lf, &[c0f], &mut pf, &mut |_, rows| {
            Ok(vec![argmax(&rows[0])])
        })?;
        let forced = subf[0].clone();
        let mut agree = 0;
        qm.predict_sub_codes(&lq, &[c0f], &mut pq, &mut |j, rows| {
            agree += (argmax(&rows[0]) == forced[j - 1]) as usize;
            Ok(vec![forced[j - 1]])
        })?;
        sub_agree += agree;
        sub_total += forced.len();
        let mut frame = [0u32; 16];
        frame[0] = c0f;
        frame[1..].copy_from_slice(&forced);
        let mut xf = f32m.frame_embed(&[frame])?;
        xf.iter_mut().zip(&pad).for_each(|(a, b)| *a += b);
        lf = f32m.forward(&xf, 1, 1, None, &mut cf)?;
        lq = qm.forward(&xf, 1, 1, None, &mut cq)?;
        if (step + 1) % 100 == 0 {
            eprintln!(
                "{} steps ({:.0} s)",
                step + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    let n = steps as f64;
    println!("teacher-forced over {steps} steps ({dir}):");
    println!("  code-0 logits relative error  mean {:.4}", err_sum / n);
    println!(
        "  code-0 top-1 agreement        {:.1} % ({top1}/{steps})",
        100.0 * top1 as f64 / n
    );
    println!(
        "  code-0 KL(f32 ‖ {name})           mean {:.2e} nats, max {:.2e}",
        kl_sum / n,
        kl_max
    );
    println!(
        "  sub-code top-1 agreement      {:.1} % ({sub_agree}/{sub_total})",
        100.0 * sub_agree as f64 / sub_total as f64
    );
    Ok(())
}
