//! The frame loop of docs/model.md §7: prefill the prompts, then per step pick code-0, let the code
//! predictor fill codebooks 1..15 (docs/model.md §5.2), and feed the frame embedding plus the next
//! trailing text vector back (docs/model.md §5.4) — one talker step per 80 ms frame, with a KV
//! cache.

use std::collections::BTreeSet;

use anyhow::{ensure, Result};
use candle_core::{DType, IndexOp, Tensor};

use super::prompt::{self, TalkerPrompt};
use super::runaway::{GuardReason, RowGuard, RowVerdict};
use super::sampling::{Code0Processors, RowRng, Sampling};
use vc_core::artifacts::codes::CodeFrame;
use vc_model::infer;
use vc_model::talker::Talker;

/// Decoding settings of one generation call.
#[derive(Debug, Clone)]
pub struct LoopOptions {
    /// Code-0 choice (the talker).
    pub code0: Sampling,
    /// Codebooks 1..15 (the code predictor).
    pub sub_codes: Sampling,
    pub processors: Code0Processors,
    /// At most this many frames per row (the official `max_new_tokens` − 1, docs/model.md §14);
    /// a row's [`RowGuard`] may stop it sooner.
    pub max_frames: usize,
}

/// The frames of one row and how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub frames: Vec<CodeFrame>,
    /// The step whose code-0 was EOS (= the frame count), or `None` when the frame limit or a
    /// guard ended it.
    pub eos_step: Option<usize>,
    /// The guard that stopped the row (docs/model.md §7.2), if one did.
    pub stopped: Option<GuardReason>,
}

/// Called after every generated step with the number of frames of the longest running row.
pub trait StepObserver: FnMut(usize) {}
impl<F: FnMut(usize)> StepObserver for F {}

/// Picks one code per batch row from f32 logits rows, for codebook `j` (1..=15).
use vc_model::infer::SubCodePick;

/// A talker with its code predictor as the frame loop drives it: the candle modules
/// ([`Talker`], CUDA and `bf16`) or the row inference path ([`infer::RowTalker`]).
pub trait FrameModel {
    /// Caches and the last hidden state of a running batch.
    type State;
    fn num_code_groups(&self) -> usize;
    /// Prefills the prompts `(B, L, H)` (`mask` `(B, L)` marks left padding) into a new state
    /// with room for `capacity` positions.
    fn start(&self, embeds: &Tensor, mask: Option<&Tensor>, capacity: usize)
        -> Result<Self::State>;
    /// Code-0 logits of every row's last position, f32.
    fn code0_logits(&self, state: &mut Self::State) -> Result<Vec<Vec<f32>>>;
    /// Codebooks 1..15 for the chosen code-0 of every row (docs/model.md §5.2).
    fn sub_codes(
        &self,
        state: &mut Self::State,
        c0: &[u32],
        pick: &mut SubCodePick<'_>,
    ) -> Result<Vec<Vec<u32>>>;
    /// Feeds one frame per row plus its text vector `(B, H)` (docs/model.md §5.4).
    fn feed(&self, state: &mut Self::State, frames: &[[u32; 16]], text: &Tensor) -> Result<()>;
}

/// State of the candle talker in the loop.
pub struct CandleState {
    cache: vc_model::layers::DecoderCache,
    cp_cache: vc_model::layers::DecoderCache,
    last: Tensor,
}

impl FrameModel for Talker {
    type State = CandleState;

    fn num_code_groups(&self) -> usize {
        self.code_predictor.num_code_groups()
    }

    fn start(
        &self,
        embeds: &Tensor,
        mask: Option<&Tensor>,
        capacity: usize,
    ) -> Result<CandleState> {
        let mut cache = self.new_cache(capacity);
        let hidden = self.forward(embeds, mask, Some(&mut cache))?;
        let last = hidden.i((.., embeds.dim(1)? - 1))?;
        Ok(CandleState {
            cache,
            cp_cache: self.code_predictor.new_cache(),
            last,
        })
    }

    fn code0_logits(&self, st: &mut CandleState) -> Result<Vec<Vec<f32>>> {
        Ok(self
            .codec_logits(&st.last)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?)
    }

    fn sub_codes(
        &self,
        st: &mut CandleState,
        c0: &[u32],
        pick: &mut SubCodePick<'_>,
    ) -> Result<Vec<Vec<u32>>> {
        let device = self.codec_head.device().clone();
        let c0_t = Tensor::new(c0, &device)?;
        let sub = self.predict_sub_codes(&st.last, &c0_t, &mut st.cp_cache, |j, l: &Tensor| {
            let rows = l.to_vec2::<f32>()?;
            let ids = pick(j, rows).map_err(candle_core::Error::msg)?;
            Tensor::new(ids.as_slice(), &device)
        })?;
        Ok(sub.to_vec2::<u32>()?)
    }

    fn feed(&self, st: &mut CandleState, frames: &[[u32; 16]], text: &Tensor) -> Result<()> {
        let flat: Vec<u32> = frames.iter().flatten().copied().collect();
        let frame = Tensor::from_vec(flat, (frames.len(), 16), self.codec_head.device())?;
        let next = (self.frame_embed(&frame)? + text)?.unsqueeze(1)?;
        st.last = self.forward(&next, None, Some(&mut st.cache))?.squeeze(1)?;
        Ok(())
    }
}

/// State of [`infer::RowTalker`] in the loop: the whole batch's caches and last hidden states.
pub struct RowTalkerState {
    cache: infer::Cache,
    cp_cache: infer::Cache,
    /// `(B, H)`.
    last: Vec<f32>,
    rows: usize,
}

impl FrameModel for infer::RowTalker {
    type State = RowTalkerState;

    fn num_code_groups(&self) -> usize {
        self.code_predictor.num_code_groups()
    }

    fn start(
        &self,
        embeds: &Tensor,
        mask: Option<&Tensor>,
        capacity: usize,
    ) -> Result<RowTalkerState> {
        let (b, l, h) = embeds.dims3()?;
        let x: Vec<f32> = embeds.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let valid: Option<Vec<Vec<bool>>> = match mask {
            Some(m) => Some(
                m.to_dtype(DType::F32)?
                    .to_vec2::<f32>()?
                    .into_iter()
                    .map(|r| r.into_iter().map(|v| v != 0.0).collect())
                    .collect(),
            ),
            None => None,
        };
        let mut cache = self.new_cache(capacity);
        let hidden = self.forward(&x, b, l, valid.as_deref(), &mut cache)?;
        let mut last = Vec::with_capacity(b * h);
        for r in 0..b {
            last.extend_from_slice(&hidden[(r * l + l - 1) * h..(r * l + l) * h]);
        }
        Ok(RowTalkerState {
            cache,
            cp_cache: self.code_predictor.new_cache(),
            last,
            rows: b,
        })
    }

    fn code0_logits(&self, st: &mut RowTalkerState) -> Result<Vec<Vec<f32>>> {
        let logits = self.codec_logits(&st.last, st.rows);
        let v = logits.len() / st.rows.max(1);
        Ok(logits.chunks_exact(v).map(<[f32]>::to_vec).collect())
    }

    fn sub_codes(
        &self,
        st: &mut RowTalkerState,
        c0: &[u32],
        pick: &mut SubCodePick<'_>,
    ) -> Result<Vec<Vec<u32>>> {
        self.predict_sub_codes(&st.last, c0, &mut st.cp_cache, pick)
    }

    fn feed(&self, st: &mut RowTalkerState, frames: &[[u32; 16]], text: &Tensor) -> Result<()> {
        let mut x = self.frame_embed(frames)?;
        let t: Vec<f32> = text.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        ensure!(t.len() == x.len(), "text vectors do not match the frames");
        x.iter_mut().zip(&t).for_each(|(a, b)| *a += b);
        st.last = self.forward(&x, st.rows, 1, None, &mut st.cache)?;
        Ok(())
    }
}

/// Generates all rows together (left-padded batch; a row gives the same codes alone,
/// docs/model.md §14). `guards[i]` ends row i besides EOS (its frame limit, the runaway guard of
/// docs/model.md §7.2); `rngs[i]` is row i's random stream; `pad` is `tts_pad_embed` `(1, H)`.
pub fn generate<M: FrameModel>(
    talker: &M,
    prompts: &[TalkerPrompt],
    pad: &Tensor,
    opts: &LoopOptions,
    guards: &mut [RowGuard],
    rngs: &mut [RowRng],
    mut observe: impl StepObserver,
) -> Result<Vec<Generated>> {
    let b = prompts.len();
    ensure!(
        b > 0 && rngs.len() == b && guards.len() == b,
        "one random stream and one guard per row are needed"
    );
    let groups = talker.num_code_groups();
    ensure!(
        groups == 16,
        "the port handles 16 codebooks per frame, the model has {groups}"
    );
    let (embeds, mask, trailing) = prompt::batch(prompts, pad)?;
    let trailing_len = trailing.dim(1)?;
    let prompt_len = embeds.dim(1)?;
    let eos = opts.processors.eos;

    let all_real = prompts
        .iter()
        .all(|p| p.embeds.dim(0).ok() == Some(prompt_len));
    let mask = (!all_real).then_some(&mask);
    let mut state = talker.start(&embeds, mask, prompt_len + opts.max_frames.min(4096) + 1)?;

    let mut history = vec![BTreeSet::new(); b];
    let mut out: Vec<Generated> = (0..b)
        .map(|_| Generated {
            frames: Vec::new(),
            eos_step: None,
            stopped: None,
        })
        .collect();
    let mut running = vec![true; b];
    let mut step = 0;
    loop {
        // Code-0 of this step for every running row; finished rows are fed EOS (discarded).
        let logits = talker.code0_logits(&mut state)?;
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
        // The sub-code picker: each running row draws from its own stream; finished rows take 0.
        let sub = {
            let running = &running;
            let rngs = &mut *rngs;
            let sampling = &opts.sub_codes;
            let mut pick = |_j: usize, rows: Vec<Vec<f32>>| -> Result<Vec<u32>> {
                Ok(rows
                    .into_iter()
                    .enumerate()
                    .map(|(r, mut scores)| {
                        if running[r] {
                            sampling.pick(&mut scores, &mut rngs[r])
                        } else {
                            0
                        }
                    })
                    .collect())
            };
            talker.sub_codes(&mut state, &c0, &mut pick)?
        };
        let mut frames = Vec::with_capacity(b);
        for r in 0..b {
            let mut frame = [0u32; 16];
            frame[0] = c0[r];
            frame[1..].copy_from_slice(&sub[r]);
            frames.push(frame);
            if running[r] {
                out[r].frames.push(CodeFrame(frame));
                match guards[r].after_frame(c0[r], out[r].frames.len()) {
                    RowVerdict::Continue => {}
                    RowVerdict::Limit => running[r] = false,
                    RowVerdict::Stop(why) => {
                        running[r] = false;
                        out[r].stopped = Some(why);
                    }
                }
            }
        }
        step += 1;
        observe(step);
        if !running.iter().any(|&r| r) {
            break;
        }
        let text = if step - 1 < trailing_len {
            trailing.i((.., step - 1))?
        } else {
            pad.broadcast_as((b, pad.dim(1)?))?.contiguous()?
        };
        talker.feed(&mut state, &frames, &text)?;
    }
    Ok(out)
}
