//! One request spoken as it is generated (`voiceclone speak -o -`): its rows (chunks of a split
//! text) one after the other through the frame loop of [`super::rows`], each frame decoded by a
//! [`StreamDecoder`] on a second thread while the next is generated, the samples handed to the
//! caller as they come —
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

/// What the generating thread hands the decoding one.
enum ToDecoder {
    /// A chunk of the text begins (after the pause unless `first`), with its in-context
    /// reference frames to prime.
    Chunk {
        first: bool,
        ref_codes: Option<Vec<CodeFrame>>,
    },
    Frame([u32; 16]),
}

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
        mut sink: impl FnMut(&[f32]) -> Result<()> + Send,
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
        let plans = self.row_plans(req, opts)?;
        let pause = self.chunk_pause_samples();
        let decoder = self.codec.decoder();
        let mut out = Streamed::default();
        // Frames are decoded on a thread of their own while the next ones are generated
        // (docs/serving.md §4); whatever has piled up meanwhile is decoded in one push.
        let (tx, rx) = std::sync::mpsc::channel::<ToDecoder>();
        std::thread::scope(|scope| -> Result<()> {
            let decoding = scope.spawn(move || -> Result<usize> {
                let mut stream: Option<StreamDecoder<'_>> = None;
                let mut samples = 0;
                let mut next = rx.recv().ok();
                while let Some(msg) = next.take() {
                    match msg {
                        ToDecoder::Chunk { first, ref_codes } => {
                            if !first {
                                sink(&vec![0f32; pause])?;
                                samples += pause;
                            }
                            let mut s = StreamDecoder::new(decoder);
                            if let Some(r) = &ref_codes {
                                crate::kernels::pool::on_pool(|| s.prime(r))?;
                            }
                            stream = Some(s);
                        }
                        ToDecoder::Frame(f) => {
                            let mut frames = vec![f];
                            while let Ok(m) = rx.try_recv() {
                                match m {
                                    ToDecoder::Frame(f) => frames.push(f),
                                    other => {
                                        next = Some(other);
                                        break;
                                    }
                                }
                            }
                            let s = stream.as_mut().context("a frame before its chunk")?;
                            let wav = crate::kernels::pool::on_pool(|| s.push(&frames))?;
                            sink(&wav)?;
                            samples += wav.len();
                        }
                    }
                    if next.is_none() {
                        next = rx.recv().ok();
                    }
                }
                Ok(samples)
            });
            let generated = (|| -> Result<()> {
                let mut stepper = Stepper::new(talker);
                for (c, plan) in plans.iter().enumerate() {
                    let mut row = Row::start(
                        talker,
                        &plan.prompt,
                        self.pad_embed(),
                        loop_opts.clone(),
                        RowRng::new(opts.seed, 0, c as u64),
                        plan.adapter,
                    )?;
                    let chunk = ToDecoder::Chunk {
                        first: c == 0,
                        ref_codes: plan.ref_codes.clone(),
                    };
                    if tx.send(chunk).is_err() {
                        return Ok(()); // The decoding thread stopped: its error says why.
                    }
                    loop {
                        let outcome = stepper.step(talker, &mut [&mut row])?[0];
                        let (frame, end) = match outcome {
                            Outcome::Frame(f) => (Some(f), None),
                            Outcome::Last(f) => (Some(f), Some(None)),
                            Outcome::Eos(step) => (None, Some(Some(step))),
                        };
                        if let Some(f) = frame {
                            out.frames.push(f);
                            if tx.send(ToDecoder::Frame(f.0)).is_err() {
                                return Ok(());
                            }
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
                Ok(())
            })();
            drop(tx);
            let decoded = decoding
                .join()
                .map_err(|_| anyhow::anyhow!("the decoding thread panicked"))?;
            // A decoding or writing error first: generation stops because of it.
            out.samples = decoded?;
            generated
        })?;
        Ok(out)
    }
}
