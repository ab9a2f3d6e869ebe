//! The frame loop of docs/model.md §7: prefill the prompts, then per step pick code-0, let the code
//! predictor fill codebooks 1..15 (docs/model.md §5.2), and feed the frame embedding plus the next
//! trailing text vector back (docs/model.md §5.4) — one talker step per 80 ms frame, with a KV
//! cache.

use std::collections::BTreeSet;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, IndexOp, Tensor};

use super::prompt::{self, TalkerPrompt};
use super::sampling::{Code0Processors, RowRng, Sampling};
use crate::artifacts::CodeFrame;
use crate::model::talker::Talker;

/// Decoding settings of one generation call.
#[derive(Debug, Clone)]
pub struct LoopOptions {
    /// Code-0 choice (the talker).
    pub code0: Sampling,
    /// Codebooks 1..15 (the code predictor).
    pub sub_codes: Sampling,
    pub processors: Code0Processors,
    /// At most this many frames per row (the official `max_new_tokens` − 1, docs/model.md §14).
    pub max_frames: usize,
}

/// The frames of one row and how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub frames: Vec<CodeFrame>,
    /// The step whose code-0 was EOS (= the frame count), or `None` when `max_frames` ended it.
    pub eos_step: Option<usize>,
}

/// Called after every generated step with the number of frames of the longest running row.
pub trait StepObserver: FnMut(usize) {}
impl<F: FnMut(usize)> StepObserver for F {}

/// Generates all rows together (left-padded batch; a row gives the same codes alone,
/// docs/model.md §14). `rngs[i]` is row i's random stream; `pad` is `tts_pad_embed` `(1, H)`.
pub fn generate(
    talker: &Talker,
    prompts: &[TalkerPrompt],
    pad: &Tensor,
    opts: &LoopOptions,
    rngs: &mut [RowRng],
    mut observe: impl StepObserver,
) -> Result<Vec<Generated>> {
    let b = prompts.len();
    ensure!(
        b > 0 && rngs.len() == b,
        "one random stream per row is needed"
    );
    let groups = talker.code_predictor.num_code_groups();
    ensure!(
        groups == 16,
        "the port handles 16 codebooks per frame, the model has {groups}"
    );
    let device = talker.codec_head.device().clone();
    let (embeds, mask, trailing) = prompt::batch(prompts, pad)?;
    let trailing_len = trailing.dim(1)?;
    let prompt_len = embeds.dim(1)?;
    let eos = opts.processors.eos;

    let mut cache = talker.new_cache(prompt_len + opts.max_frames.min(4096) + 1);
    let mut cp_cache = talker.code_predictor.new_cache();
    let all_real = prompts
        .iter()
        .all(|p| p.embeds.dim(0).ok() == Some(prompt_len));
    let mask = (!all_real).then_some(&mask);
    let hidden = talker.forward(&embeds, mask, Some(&mut cache))?;
    let mut last = hidden.i((.., prompt_len - 1))?; // (B, H)

    let mut history = vec![BTreeSet::new(); b];
    let mut out: Vec<Generated> = (0..b)
        .map(|_| Generated {
            frames: Vec::new(),
            eos_step: None,
        })
        .collect();
    let mut running = vec![true; b];
    let mut step = 0;
    loop {
        // Code-0 of this step for every running row; finished rows are fed EOS (discarded).
        let logits = talker
            .codec_logits(&last)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let mut c0 = vec![eos; b];
        for r in 0..b {
            if !running[r] {
                continue;
            }
            let mut scores = logits[r].clone();
            opts.processors.apply(&mut scores, &history[r], step);
            let id = opts.code0.pick(&mut scores, &mut rngs[r]);
            if id == eos {
                running[r] = false;
                out[r].eos_step = Some(step);
            } else {
                history[r].insert(id);
                c0[r] = id;
            }
        }
        if !running.iter().any(|&r| r) {
            break;
        }
        let c0_t = Tensor::new(c0.as_slice(), &device)?;
        let sub = talker.predict_sub_codes(&last, &c0_t, &mut cp_cache, |_j, l: &Tensor| {
            pick_rows(l, &opts.sub_codes, rngs, &running, &device)
        })?; // (B, 15)
        let sub_host = sub.to_vec2::<u32>()?;
        for r in 0..b {
            if running[r] {
                let mut frame = [0u32; 16];
                frame[0] = c0[r];
                frame[1..].copy_from_slice(&sub_host[r]);
                out[r].frames.push(CodeFrame(frame));
                if out[r].frames.len() >= opts.max_frames {
                    running[r] = false;
                }
            }
        }
        step += 1;
        observe(step);
        if !running.iter().any(|&r| r) {
            break;
        }
        let frame = Tensor::cat(&[c0_t.unsqueeze(1)?, sub], 1)?;
        let text = if step - 1 < trailing_len {
            trailing.i((.., step - 1))?
        } else {
            pad.broadcast_as((b, pad.dim(1)?))?.contiguous()?
        };
        let next = (talker.frame_embed(&frame)? + text)?.unsqueeze(1)?;
        last = talker.forward(&next, None, Some(&mut cache))?.squeeze(1)?;
    }
    Ok(out)
}

/// The sub-code picker: each running row draws from its own stream; finished rows take 0.
fn pick_rows(
    logits: &Tensor,
    sampling: &Sampling,
    rngs: &mut [RowRng],
    running: &[bool],
    device: &Device,
) -> candle_core::Result<Tensor> {
    let rows = logits.to_vec2::<f32>()?;
    let ids: Vec<u32> = rows
        .into_iter()
        .enumerate()
        .map(|(r, mut scores)| {
            if running[r] {
                sampling.pick(&mut scores, &mut rngs[r])
            } else {
                0
            }
        })
        .collect();
    Tensor::new(ids.as_slice(), device)
}
