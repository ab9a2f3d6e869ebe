//! One request spoken as it is generated (`voiceclone speak -o -`): its rows (chunks of a split
//! text) one after the other through the frame loop of [`super::rows`], each frame decoded as
//! soon as it is made by a [`StreamDecoder`], the samples handed to the caller as they come —
//! what `voiceclone serve` does for one stream (docs/serving.md §4), without the server.
//!
//! The samples are those of [`Synthesizer::synthesize`] for the same request and seed: a row
//! gives the frames the batched loop gives it alone, and the stream decoder gives the offline
//! decoder's samples bit for bit; in-context voices may differ by the one-sample shift of the
//! reference cut (docs/serving.md §4).

use anyhow::{Context, Result};

use super::rows::{Outcome, Row, Stepper};
use super::sampling::RowRng;
use super::synthesizer::{DecodeOptions, Request, Synthesizer};
use crate::artifacts::CodeFrame;
use crate::model::codec::StreamDecoder;

/// What a streamed request made.
#[derive(Debug, Clone, Default)]
pub struct Streamed {
    /// Every generated frame, all chunks in order.
    pub frames: Vec<CodeFrame>,
    /// Per chunk: the EOS step, or `None` when the frame limit stopped it.
    pub eos_steps: Vec<Option<usize>>,
    /// Samples handed to the sink (pauses between chunks included).
    pub samples: usize,
}

/// A test seam (`test-hooks`): `VOICECLONE_TEST_FRAME_DELAY_MS` slows every frame step of
/// `serve` and of a streamed `speak`, so tests can watch audio arrive while generation goes on.
pub fn test_frame_delay() -> Option<std::time::Duration> {
    #[cfg(feature = "test-hooks")]
    {
        std::env::var("VOICECLONE_TEST_FRAME_DELAY_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(std::time::Duration::from_millis)
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        None
    }
}

impl Synthesizer {
    /// Speaks `req` with `opts` (request line 0 of [`Self::synthesize`]: row `c` draws from
    /// `RowRng::new(seed, 0, c)`), calling `sink` with the samples of every frame as it is
    /// decoded and with the pause between chunks. Off the CPU inference path (the candle
    /// modules, on a GPU), the request is synthesised whole and handed over once.
    pub fn stream(
        &self,
        req: &Request,
        opts: &DecodeOptions,
        mut sink: impl FnMut(&[f32]) -> Result<()>,
    ) -> Result<Streamed> {
        let Some(talker) = self.cpu_talker() else {
            let speech = self
                .synthesize(std::slice::from_ref(req), opts, |_, _, _| {})?
                .pop()
                .context("no speech for the request")?;
            sink(&speech.wav)?;
            return Ok(Streamed {
                samples: speech.wav.len(),
                frames: speech.frames,
                eos_steps: speech.eos_steps,
            });
        };
        let loop_opts = self.loop_options(opts);
        let delay = test_frame_delay();
        let mut stepper = Stepper::new(talker);
        let mut out = Streamed::default();
        for (c, plan) in self.row_plans(req, opts)?.iter().enumerate() {
            if c > 0 {
                let pause = vec![0f32; self.chunk_pause_samples()];
                sink(&pause)?;
                out.samples += pause.len();
            }
            let mut row = Row::start(
                talker,
                &plan.prompt,
                self.pad_embed(),
                loop_opts.clone(),
                RowRng::new(opts.seed, 0, c as u64),
                plan.adapter,
            )?;
            let mut decoder = StreamDecoder::new(self.codec.decoder());
            if let Some(r) = &plan.ref_codes {
                decoder.prime(r)?;
            }
            loop {
                let outcome = stepper.step(talker, &mut [&mut row])?[0];
                let (frame, end) = match outcome {
                    Outcome::Frame(f) => (Some(f), None),
                    Outcome::Last(f) => (Some(f), Some(None)),
                    Outcome::Eos(step) => (None, Some(Some(step))),
                };
                if let Some(f) = frame {
                    let samples = decoder.push(&[f.0])?;
                    sink(&samples)?;
                    out.samples += samples.len();
                    out.frames.push(f);
                }
                if let Some(eos) = end {
                    out.eos_steps.push(eos);
                    break;
                }
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
            }
        }
        Ok(out)
    }
}
