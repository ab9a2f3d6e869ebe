//! The frame loop of docs/model.md §7 for rows that join and leave a running batch at frame
//! boundaries (continuous batching, docs/serving.md §3): each [`Row`] owns its talker cache,
//! history and random stream; [`step`] advances every given row by one frame with the matrix
//! products shared.
//!
//! A row gives exactly the frames [`super::talker_loop::generate`] gives it alone (`b = 1`):
//! the same prefill, the same processors and draws from its own stream in the same order, and
//! per-row arithmetic that does not depend on the other rows
//! ([`infer::RowDecoderStack::step_rows`]). Runs on the row inference path ([`infer::RowTalker`]).

use std::collections::BTreeSet;

use anyhow::{ensure, Result};
use candle_core::DType;

use super::prompt::TalkerPrompt;
use super::runaway::{GuardReason, RowGuard, RowVerdict};
use super::sampling::RowRng;
use super::talker_loop::LoopOptions;
use vc_core::artifacts::codes::CodeFrame;
use vc_model::infer;

/// One generated row (an utterance, or a chunk of a long one) in the running batch.
pub struct Row {
    cache: infer::Cache,
    /// Final hidden state of the last position, `(H)`.
    last: Vec<f32>,
    /// Text vectors added to generated frames, `(K, H)` (docs/model.md §5.4).
    trailing: Vec<f32>,
    /// `tts_pad_embed`, `(H)`, once `trailing` is used up.
    pad: Vec<f32>,
    history: BTreeSet<u32>,
    step: usize,
    opts: LoopOptions,
    /// Its frame limit and the runaway guard (docs/model.md §7.2).
    guard: RowGuard,
    rng: RowRng,
    /// The adapter the row speaks with (docs/serving.md §7); `None`: the base model.
    adapter: Option<infer::AdapterId>,
}

/// What one [`step`] did for a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// A frame; the row goes on.
    Frame(CodeFrame),
    /// A frame, and the frame limit ends the row.
    Last(CodeFrame),
    /// A frame, and a guard ends the row (docs/model.md §7.2): the frames so far are kept.
    Stopped(CodeFrame, GuardReason),
    /// Code 0 was EOS at this step (= the row's frame count): the row ends without a frame.
    Eos(usize),
}

impl Row {
    /// Prefills `prompt` alone (as `talker_loop::generate` does for one row), computing with
    /// `adapter` (put on `talker` with `infer::RowTalker::add_adapter`) when one is given;
    /// `guard` ends the row besides EOS.
    pub fn start(
        talker: &infer::RowTalker,
        prompt: &TalkerPrompt,
        pad: &candle_core::Tensor,
        opts: LoopOptions,
        guard: RowGuard,
        rng: RowRng,
        adapter: Option<infer::AdapterId>,
    ) -> Result<Row> {
        ensure!(
            talker.code_predictor.num_code_groups() == 16,
            "the port handles 16 codebooks per frame"
        );
        let (l, h) = prompt.embeds.dims2()?;
        ensure!(l > 0, "empty prompt");
        let x: Vec<f32> = prompt
            .embeds
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        let mut cache = talker.new_cache(l + opts.max_frames.min(4096) + 1);
        cache.bind_adapters(&[adapter])?;
        let hidden = talker.forward(&x, 1, l, None, &mut cache)?;
        let trailing: Vec<f32> = prompt
            .trailing
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        let pad: Vec<f32> = pad.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        ensure!(
            pad.len() == h && trailing.len().is_multiple_of(h),
            "text vectors do not match the talker width {h}"
        );
        Ok(Row {
            cache,
            last: hidden[(l - 1) * h..l * h].to_vec(),
            trailing,
            pad,
            history: BTreeSet::new(),
            step: 0,
            opts,
            guard,
            rng,
            adapter,
        })
    }

    /// Frames generated so far.
    pub fn frames(&self) -> usize {
        self.step
    }

    /// Positions in the talker cache (prompt and fed frames).
    pub fn cached(&self) -> usize {
        self.cache.len()
    }
}

/// The code-predictor cache shared by the steps (reset for every frame).
pub struct Stepper {
    cp_cache: infer::Cache,
}

impl Stepper {
    pub fn new(talker: &infer::RowTalker) -> Self {
        Stepper {
            cp_cache: talker.code_predictor.new_cache(),
        }
    }

    /// One frame for every row (docs/model.md §7): code 0 from each row's last hidden state,
    /// codebooks 1–15 for the rows that did not stop, then the frames fed back for those that
    /// go on. Rows that end ([`StepOutcome::Last`], [`StepOutcome::Stopped`],
    /// [`StepOutcome::Eos`]) must not be stepped again.
    pub fn step(
        &mut self,
        talker: &infer::RowTalker,
        rows: &mut [&mut Row],
    ) -> Result<Vec<StepOutcome>> {
        let n = rows.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let h = talker.hidden_size();
        let mut last = Vec::with_capacity(n * h);
        for r in rows.iter() {
            last.extend_from_slice(&r.last);
        }
        let logits = talker.codec_logits(&last, n);
        let v = logits.len() / n;
        let mut outcome: Vec<Option<StepOutcome>> = vec![None; n];
        let mut c0 = Vec::with_capacity(n);
        let mut running = Vec::with_capacity(n);
        for (i, r) in rows.iter_mut().enumerate() {
            let mut scores = logits[i * v..(i + 1) * v].to_vec();
            let p = &r.opts.processors;
            p.apply(&mut scores, &r.history, r.step);
            let id = r.opts.code0.pick(&mut scores, &mut r.rng);
            if id == p.eos {
                outcome[i] = Some(StepOutcome::Eos(r.step));
            } else {
                r.history.insert(id);
                c0.push(id);
                running.push(i);
            }
        }
        if running.is_empty() {
            return Ok(outcome.into_iter().map(|o| o.expect("set")).collect());
        }
        let mut hidden = Vec::with_capacity(running.len() * h);
        for &i in &running {
            hidden.extend_from_slice(&rows[i].last);
        }
        let sub = {
            let mut picked: Vec<&mut Row> = Vec::with_capacity(running.len());
            // Disjoint mutable borrows of the running rows, in order.
            let mut rest: &mut [&mut Row] = rows;
            let mut base = 0;
            for &i in &running {
                let (_, tail) = rest.split_at_mut(i - base);
                let (row, tail) = tail.split_first_mut().expect("index in range");
                picked.push(row);
                rest = tail;
                base = i + 1;
            }
            // The code predictor's rows compute with their rows' adapters.
            let adapters: Vec<_> = picked.iter().map(|r| r.adapter).collect();
            self.cp_cache.reset();
            self.cp_cache.bind_adapters(&adapters)?;
            let mut pick = |_j: usize, logits: Vec<Vec<f32>>| -> Result<Vec<u32>> {
                Ok(logits
                    .into_iter()
                    .zip(picked.iter_mut())
                    .map(|(mut scores, row)| row.opts.sub_codes.pick(&mut scores, &mut row.rng))
                    .collect())
            };
            talker.predict_sub_codes(&hidden, &c0, &mut self.cp_cache, &mut pick)?
        };
        let mut feed_rows = Vec::new();
        let mut feed_frames = Vec::new();
        for (k, &i) in running.iter().enumerate() {
            let mut frame = [0u32; 16];
            frame[0] = c0[k];
            frame[1..].copy_from_slice(&sub[k]);
            let row = &mut rows[i];
            row.step += 1;
            outcome[i] = Some(match row.guard.after_frame(frame[0], row.step) {
                RowVerdict::Continue => {
                    feed_rows.push(i);
                    feed_frames.push(frame);
                    StepOutcome::Frame(CodeFrame(frame))
                }
                RowVerdict::Limit => StepOutcome::Last(CodeFrame(frame)),
                RowVerdict::Stop(why) => StepOutcome::Stopped(CodeFrame(frame), why),
            });
        }
        if !feed_rows.is_empty() {
            let mut x = talker.frame_embed(&feed_frames)?;
            for (k, &i) in feed_rows.iter().enumerate() {
                let row = &rows[i];
                let t = row.step - 1;
                let text = if (t + 1) * h <= row.trailing.len() {
                    &row.trailing[t * h..(t + 1) * h]
                } else {
                    &row.pad[..]
                };
                x[k * h..(k + 1) * h]
                    .iter_mut()
                    .zip(text)
                    .for_each(|(a, b)| *a += b);
            }
            let mut caches: Vec<&mut infer::Cache> = Vec::with_capacity(feed_rows.len());
            let mut rest: &mut [&mut Row] = rows;
            let mut base = 0;
            for &i in &feed_rows {
                let (_, tail) = rest.split_at_mut(i - base);
                let (row, tail) = tail.split_first_mut().expect("index in range");
                caches.push(&mut row.cache);
                rest = tail;
                base = i + 1;
            }
            let out = talker.decoder.step_rows(&x, &mut caches)?;
            for (k, &i) in feed_rows.iter().enumerate() {
                rows[i].last.copy_from_slice(&out[k * h..(k + 1) * h]);
            }
        }
        Ok(outcome.into_iter().map(|o| o.expect("set")).collect())
    }
}
