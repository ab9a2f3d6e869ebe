//! One thread decodes the frames of every open stream (docs/serving.md §4).
//!
//! The generation thread makes a frame for every row of the running batch at each step, and
//! each response's decode worker forwards its row's frames here. What arrives together goes
//! through the codec decoder in one pass ([`StreamDecoder::push_many`]): each layer's weights
//! are read once for all the streams instead of once per stream, which is what a CPU server is
//! bound by with a codec of the real size (docs/performance.md §10.4). A stream's samples do not
//! depend on which others share its passes (the decoder's products are row-invariant,
//! docs/model.md §9.5), so a stream joining or leaving changes no other stream's audio.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

use vc_generate::Synthesizer;
use vc_model::codec::{Decoder, StreamDecoder};

/// One frame's codes.
pub type Frame = [u32; 16];

/// How long a pass waits for the frames of the other open streams once the first has come:
/// the frames of one generation step reach the decode workers within microseconds of each
/// other, a step takes tens of milliseconds.
const GATHER: Duration = Duration::from_millis(2);

enum DecoderCommand {
    Open {
        id: u64,
        prime: Option<Vec<Frame>>,
        reply: mpsc::Sender<Result<()>>,
    },
    Push {
        id: u64,
        frames: Vec<Frame>,
        reply: mpsc::Sender<Result<Vec<f32>>>,
    },
    Close {
        id: u64,
    },
}

/// What the decoding thread has done, for `GET /health`.
#[derive(Debug, Default)]
pub struct DecodingStats {
    /// Passes through the decoder.
    pub passes: AtomicU64,
    /// Passes that decoded the frames of more than one stream.
    pub shared_passes: AtomicU64,
    /// The most streams one pass decoded.
    pub most_streams: AtomicUsize,
}

/// The decoding thread and the way to it.
pub struct StreamDecoding {
    commands: mpsc::Sender<DecoderCommand>,
    next_id: AtomicU64,
    pub stats: Arc<DecodingStats>,
}

impl StreamDecoding {
    /// Starts the thread; it ends when this and every [`OpenStream`] are dropped.
    pub fn start(synth: Arc<Synthesizer>) -> Result<Self> {
        let (commands, rx) = mpsc::channel();
        let stats = Arc::new(DecodingStats::default());
        let thread_stats = stats.clone();
        std::thread::Builder::new()
            .name("voiceclone-decode".into())
            .spawn(move || run(&synth, &rx, &thread_stats))
            .context("cannot start the decoding thread")?;
        Ok(StreamDecoding {
            commands,
            next_id: AtomicU64::new(0),
            stats,
        })
    }

    /// A new stream (one chunk of one response), with in-context reference frames taken into
    /// its state first when given (their samples are not produced, docs/model.md §7).
    pub fn open(&self, prime: Option<Vec<Frame>>) -> Result<OpenStream> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = mpsc::channel();
        self.commands
            .send(DecoderCommand::Open { id, prime, reply })
            .map_err(|_| gone())?;
        answer.recv().map_err(|_| gone())??;
        Ok(OpenStream {
            id,
            commands: self.commands.clone(),
        })
    }
}

fn gone() -> anyhow::Error {
    anyhow!("the decoding thread has stopped")
}

/// A stream open on the decoding thread; closed when dropped.
pub struct OpenStream {
    id: u64,
    commands: mpsc::Sender<DecoderCommand>,
}

impl OpenStream {
    /// Decodes the stream's next frames (in the pass of whatever other streams' frames are
    /// waiting): their `frames.len() × 1920` samples, as [`StreamDecoder::push`] gives them.
    pub fn push(&self, frames: Vec<Frame>) -> Result<Vec<f32>> {
        let (reply, answer) = mpsc::channel();
        self.commands
            .send(DecoderCommand::Push {
                id: self.id,
                frames,
                reply,
            })
            .map_err(|_| gone())?;
        answer.recv().map_err(|_| gone())?
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        // The thread may be gone already (shutting down): nothing left to close then.
        let _ = self.commands.send(DecoderCommand::Close { id: self.id });
    }
}

/// A push waiting for its pass.
struct Waiting {
    id: u64,
    frames: Vec<Frame>,
    reply: mpsc::Sender<Result<Vec<f32>>>,
}

fn run(synth: &Synthesizer, commands: &mpsc::Receiver<DecoderCommand>, stats: &DecodingStats) {
    let decoder = synth.codec.decoder();
    let mut streams: HashMap<u64, StreamDecoder<'_>> = HashMap::new();
    let mut waiting: Vec<Waiting> = Vec::new();
    loop {
        let Ok(first) = commands.recv() else {
            return;
        };
        take(decoder, first, &mut streams, &mut waiting);
        while let Ok(cmd) = commands.try_recv() {
            take(decoder, cmd, &mut streams, &mut waiting);
        }
        if waiting.is_empty() {
            continue;
        }
        // The other open streams' frames of the same step are on their way.
        let deadline = Instant::now() + GATHER;
        while waiting.len() < streams.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match commands.recv_timeout(left) {
                Ok(cmd) => take(decoder, cmd, &mut streams, &mut waiting),
                Err(_) => break,
            }
        }
        decode_pass(&mut streams, std::mem::take(&mut waiting), stats);
    }
}

/// Applies a command; a push joins the next pass.
fn take<'d>(
    decoder: &'d Decoder,
    cmd: DecoderCommand,
    streams: &mut HashMap<u64, StreamDecoder<'d>>,
    waiting: &mut Vec<Waiting>,
) {
    match cmd {
        DecoderCommand::Open { id, prime, reply } => {
            let mut s = StreamDecoder::new(decoder);
            let primed = match prime {
                Some(frames) => vc_kernels::pool::on_pool(|| s.prime(&frames)),
                None => Ok(()),
            };
            if primed.is_ok() {
                streams.insert(id, s);
            }
            let _ = reply.send(primed);
        }
        DecoderCommand::Push { id, frames, reply } => waiting.push(Waiting { id, frames, reply }),
        DecoderCommand::Close { id } => {
            streams.remove(&id);
        }
    }
}

/// Decodes every waiting push in one pass and answers each.
fn decode_pass(
    streams: &mut HashMap<u64, StreamDecoder<'_>>,
    waiting: Vec<Waiting>,
    stats: &DecodingStats,
) {
    let (known, unknown): (Vec<Waiting>, Vec<Waiting>) = waiting
        .into_iter()
        .partition(|w| streams.contains_key(&w.id));
    for w in unknown {
        let _ = w
            .reply
            .send(Err(anyhow!("frames for a stream that is not open")));
    }
    if known.is_empty() {
        return;
    }
    // A worker waits for its answer before it pushes again, so each stream is here once.
    let mut jobs: Vec<(&mut StreamDecoder<'_>, &[Frame])> = Vec::with_capacity(known.len());
    let mut order = Vec::with_capacity(known.len());
    for (id, s) in streams.iter_mut() {
        if let Some(i) = known.iter().position(|w| w.id == *id) {
            order.push(i);
            jobs.push((s, &known[i].frames));
        }
    }
    let decoded = vc_kernels::pool::on_pool(|| StreamDecoder::push_many(&mut jobs));
    stats.passes.fetch_add(1, Ordering::Relaxed);
    if jobs.len() > 1 {
        stats.shared_passes.fetch_add(1, Ordering::Relaxed);
    }
    stats.most_streams.fetch_max(jobs.len(), Ordering::Relaxed);
    match decoded {
        Ok(samples) => {
            for (i, wav) in order.into_iter().zip(samples) {
                let _ = known[i].reply.send(Ok(wav));
            }
        }
        Err(e) => {
            for w in &known {
                let _ = w.reply.send(Err(anyhow!("{e:#}")));
            }
        }
    }
}
