//! One request spoken as it is generated (`voiceclone speak -o -`): its rows (chunks of a split
//! text) one after the other through the frame loop of [`super::continuous_batch`], the frames decoded by a
//! [`StreamDecoder`] on a second thread while the next ones are generated, in the chunks
//! [`AudioChunks`] sets, the samples handed to the caller as they come — what `voiceclone
//! serve` does for one stream (docs/serving.md §4), without the server.
//!
//! The samples are those of [`Synthesizer::synthesize`] for the same request and seed: a row
//! gives the frames the batched loop gives it alone, and the stream decoder gives the offline
//! decoder's samples bit for bit; in-context voices may differ by the one-sample shift of the
//! reference cut (docs/serving.md §4).

use std::sync::mpsc::TryRecvError;

use anyhow::{Context, Result};

use super::audio_chunks::AudioChunks;
use super::continuous_batch::{Row, StepOutcome, Stepper};
use super::runaway::GuardStop;
use super::sampling::RowRng;
use super::synthesizer::{DecodeOptions, Request, Synthesizer};
use vc_core::artifacts::codes::CodeFrame;
use vc_model::codec::StreamDecoder;

/// What the generating thread hands the decoding one.
enum ToDecoder {
    Chunk(ChunkStart),
    Frame([u32; 16]),
}

/// A chunk of the text begins (after the pause unless `first`), with its in-context reference
/// frames to prime.
struct ChunkStart {
    first: bool,
    ref_codes: Option<Vec<CodeFrame>>,
}

/// What a streamed request made.
#[derive(Debug, Clone, Default)]
pub struct Streamed {
    /// Every generated frame, all chunks in order.
    pub frames: Vec<CodeFrame>,
    /// Per chunk: the EOS step, or `None` when the frame limit or a guard stopped it.
    pub eos_steps: Vec<Option<usize>>,
    /// The chunks a runaway guard stopped (docs/model.md §7.2).
    pub guard_stops: Vec<GuardStop>,
    /// Samples handed to the sink (pauses between chunks included).
    pub samples: usize,
    /// Chunks of frames decoded and handed to the sink ([`AudioChunks`]).
    pub audio_chunks: usize,
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
    /// `RowRng::new(seed, 0, c)`), calling `sink` with the samples of every chunk of frames
    /// as it is decoded (`opts.stream_chunk_frames`) and with the pause between text chunks.
    /// Off the row inference path (the candle modules), the request is synthesised
    /// whole and handed over once.
    pub fn stream(
        &self,
        req: &Request,
        opts: &DecodeOptions,
        mut sink: impl FnMut(&[f32]) -> Result<()> + Send,
    ) -> Result<Streamed> {
        let Some(talker) = self.row_talker() else {
            let speech = self
                .synthesize(std::slice::from_ref(req), opts, |_, _, _| {})?
                .pop()
                .context("no speech for the request")?;
            sink(&speech.wav)?;
            return Ok(Streamed {
                samples: speech.wav.len(),
                audio_chunks: 1,
                frames: speech.frames,
                eos_steps: speech.eos_steps,
                guard_stops: speech.guard_stops,
            });
        };
        let loop_opts = self.loop_options(opts);
        let delay = test_frame_delay();
        let plans = self.row_plans(req, opts)?;
        let pause = self.chunk_pause_samples();
        let decoder = self.codec.decoder();
        let mut out = Streamed::default();
        let most = opts.stream_chunk_frames;
        // Frames are decoded on a thread of their own while the next ones are generated, in
        // the chunks `AudioChunks` sets (docs/serving.md §4.1).
        let (tx, rx) = std::sync::mpsc::channel::<ToDecoder>();
        std::thread::scope(|scope| -> Result<()> {
            let decoding = scope.spawn(move || -> Result<(usize, usize)> {
                let mut stream: Option<StreamDecoder<'_>> = None;
                let mut chunks = AudioChunks::new(most);
                let mut waiting: Vec<[u32; 16]> = Vec::new();
                // A text chunk that begins after the waiting frames; whether more can come.
                let mut begins: Option<ChunkStart> = None;
                let mut open = true;
                let (mut samples, mut pushes) = (0, 0);
                loop {
                    // What has arrived meanwhile, without waiting for more.
                    while begins.is_none() && open {
                        match rx.try_recv() {
                            Ok(ToDecoder::Frame(f)) => waiting.push(f),
                            Ok(ToDecoder::Chunk(c)) => begins = Some(c),
                            Err(TryRecvError::Empty) => break,
                            Err(TryRecvError::Disconnected) => open = false,
                        }
                    }
                    // A text chunk's last frames go out however few they are.
                    let ends = begins.is_some() || !open;
                    if !waiting.is_empty() && (ends || chunks.ready(waiting.len())) {
                        let s = stream.as_mut().context("a frame before its chunk")?;
                        let wav = vc_kernels::pool::on_pool(|| s.push(&waiting))?;
                        chunks.sent(waiting.len());
                        waiting.clear();
                        sink(&wav)?;
                        samples += wav.len();
                        pushes += 1;
                    }
                    if let Some(ChunkStart { first, ref_codes }) = begins.take() {
                        if !first {
                            sink(&vec![0f32; pause])?;
                            samples += pause;
                        }
                        let mut s = StreamDecoder::new(decoder);
                        if let Some(r) = &ref_codes {
                            vc_kernels::pool::on_pool(|| s.prime(r))?;
                        }
                        stream = Some(s);
                        continue;
                    }
                    if !open {
                        return Ok((samples, pushes));
                    }
                    match rx.recv() {
                        Ok(ToDecoder::Frame(f)) => waiting.push(f),
                        Ok(ToDecoder::Chunk(c)) => begins = Some(c),
                        Err(_) => open = false,
                    }
                }
            });
            let generated = (|| -> Result<()> {
                let mut stepper = Stepper::new(talker);
                for (c, plan) in plans.iter().enumerate() {
                    let mut row = Row::start(
                        talker,
                        &plan.prompt,
                        self.pad_embed(),
                        loop_opts.clone(),
                        plan.guard.clone(),
                        RowRng::new(opts.seed, 0, c as u64),
                        plan.adapter,
                    )?;
                    let chunk = ToDecoder::Chunk(ChunkStart {
                        first: c == 0,
                        ref_codes: plan.ref_codes.clone(),
                    });
                    if tx.send(chunk).is_err() {
                        return Ok(()); // The decoding thread stopped: its error says why.
                    }
                    let mut frames = 0;
                    loop {
                        let outcome = stepper.step(talker, &mut [&mut row])?[0];
                        let (frame, end) = match outcome {
                            StepOutcome::Frame(f) => (Some(f), None),
                            StepOutcome::Last(f) => (Some(f), Some(None)),
                            StepOutcome::Stopped(f, why) => {
                                out.guard_stops.push(GuardStop::new(
                                    c,
                                    &plan.text,
                                    frames + 1,
                                    why,
                                ));
                                (Some(f), Some(None))
                            }
                            StepOutcome::Eos(step) => (None, Some(Some(step))),
                        };
                        if let Some(f) = frame {
                            frames += 1;
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
            (out.samples, out.audio_chunks) = decoded?;
            generated
        })?;
        Ok(out)
    }
}
