//! Streaming codec decoding: the samples of each frame as soon as the frame exists, equal bit for
//! bit to [`Decoder::decode`] of the whole sequence (docs/model.md §9.2 and §9.5,
//! docs/serving.md §4).
//!
//! The decoder is causal everywhere — causal convolutions, transposed convolutions that drop
//! their right overhang, sliding-window causal attention — so the output of frame t depends on
//! frames ≤ t only. [`StreamDecoder`] keeps, per chunk, what the next frame needs of the past:
//! the last `k_eff − 1` input rows of every convolution, the transformer's keys and values within
//! its window. It reproduces the official chunking exactly: at every 300-frame boundary the state
//! is reset and the 25 frames of left context are run again (positions restart at 0), and, as
//! [`Decoder::decode`] does, the convolution stack only sees the last
//! [`Decoder::conv_reach_frames`] of them.
//!
//! What differs from the offline pass is only how many rows each operation gets at once, and
//! every operation rounds a row the same way whatever that number is (docs/model.md §9.5), so
//! the samples are the same floats (`tests/it/serve_stream.rs` compares bits).

use std::collections::VecDeque;

use anyhow::{ensure, Result};

use super::super::transformer::{rms_norm_rows, WindowKvCache};
use super::{clamp_unit, Decoder, CHUNK_FRAMES, LEFT_CONTEXT_FRAMES};
use vc_kernels::conv::{ConvWindow, Seq};

/// The last `keep` input rows of one causal operation, and how many rows it has seen.
#[derive(Debug, Clone)]
struct Hist {
    kept: Seq,
    seen: usize,
    keep: usize,
}

impl Hist {
    fn new(keep: usize, channels: usize) -> Self {
        Hist {
            kept: Seq::zeros(0, channels),
            seen: 0,
            keep,
        }
    }

    /// Appends `new` rows: returns the kept rows followed by the new ones, the index of its
    /// first row, and the index of the first new row.
    fn push(&mut self, new: Seq) -> (Seq, usize, usize) {
        let first_new = self.seen;
        let offset = first_new - self.kept.t;
        let mut data = std::mem::take(&mut self.kept.data);
        data.extend_from_slice(&new.data);
        let x = Seq::new(data, self.kept.t + new.t, new.c);
        let k = self.keep.min(x.t);
        self.kept = x.rows(x.t - k, x.t);
        self.seen += new.t;
        (x, offset, first_new)
    }
}

/// Everything a chunk carries from one frame to the next.
#[derive(Debug, Clone)]
struct ChunkState {
    pre_conv: Hist,
    kv: WindowKvCache,
    /// Per upsampling stage: the transposed conv's and the ConvNeXt dwconv's inputs.
    upsample: Vec<(Hist, Hist)>,
    first: Hist,
    /// Per decoder block: its transposed conv's input, then each residual unit's.
    blocks: Vec<(Hist, Vec<Hist>)>,
    final_conv: Hist,
    /// While the convolution stack has seen nothing of this chunk: the transformer outputs of
    /// frames whose samples are not wanted, only the last `conv_reach_frames` of them.
    pending: Option<Seq>,
}

/// Incremental decoding of one frame sequence (one utterance).
#[derive(Debug, Clone)]
pub struct StreamDecoder<'d> {
    dec: &'d Decoder,
    /// Frames pushed so far (the sequence's frame index of the next one).
    frames: usize,
    /// Frames of the current chunk pushed so far (its left context not counted).
    chunk_frames: usize,
    /// The last [`LEFT_CONTEXT_FRAMES`] frames, for the context of the next chunk.
    recent: VecDeque<Vec<u32>>,
    reach: usize,
    st: ChunkState,
}

impl<'d> StreamDecoder<'d> {
    pub fn new(dec: &'d Decoder) -> Self {
        StreamDecoder {
            dec,
            frames: 0,
            chunk_frames: 0,
            recent: VecDeque::with_capacity(LEFT_CONTEXT_FRAMES + 1),
            reach: dec.conv_reach_frames(),
            st: Self::fresh(dec),
        }
    }

    fn fresh(dec: &Decoder) -> ChunkState {
        let keep = |k_eff: usize| k_eff - 1;
        ChunkState {
            pre_conv: Hist::new(keep(dec.pre_conv.k_eff()), dec.pre_conv.cin),
            kv: dec.transformer.new_cache(),
            upsample: dec
                .upsample
                .iter()
                .map(|(up, cnx)| {
                    (
                        Hist::new(up.taps() - 1, up.cin),
                        Hist::new(cnx.dwconv.kernel - 1, cnx.dwconv.channels),
                    )
                })
                .collect(),
            first: Hist::new(keep(dec.first.k_eff()), dec.first.cin),
            blocks: dec
                .blocks
                .iter()
                .map(|b| {
                    (
                        Hist::new(b.up.taps() - 1, b.up.cin),
                        b.residuals
                            .iter()
                            .map(|r| Hist::new(keep(r.conv1.k_eff()), r.conv1.cin))
                            .collect(),
                    )
                })
                .collect(),
            final_conv: Hist::new(keep(dec.final_conv.k_eff()), dec.final_conv.cin),
            pending: Some(Seq::zeros(0, dec.output_proj.cout)),
        }
    }

    /// Frames pushed so far.
    pub fn frames(&self) -> usize {
        self.frames
    }

    /// Decodes the next frames: their `frames.len() × 1920` samples, clamped to [−1, 1].
    pub fn push<R: AsRef<[u32]>>(&mut self, frames: &[R]) -> Result<Vec<f32>> {
        self.advance(frames, true)
    }

    /// Takes the next frames into the state without producing their samples (the reference
    /// frames of in-context cloning, whose audio the official wrapper cuts off,
    /// docs/model.md §7); cheaper than [`Self::push`] while no sample has been produced in the
    /// current chunk.
    pub fn prime<R: AsRef<[u32]>>(&mut self, frames: &[R]) -> Result<()> {
        self.advance(frames, false).map(|_| ())
    }

    /// Decodes the next frames of several streams of one decoder at once (docs/serving.md §4):
    /// per stream exactly what [`Self::push`] of its frames gives, to the bit, but the rows of
    /// all of them go through each layer's products together, so a layer's weights are read
    /// once per step for all the streams instead of once per stream. A stream may appear once.
    pub fn push_many<R: AsRef<[u32]>>(
        jobs: &mut [(&mut StreamDecoder<'d>, &[R])],
    ) -> Result<Vec<Vec<f32>>> {
        let Some(first) = jobs.first() else {
            return Ok(Vec::new());
        };
        let dec = first.0.dec;
        for (s, frames) in jobs.iter() {
            ensure!(
                std::ptr::eq(s.dec, dec),
                "streams of different decoders cannot be decoded together"
            );
            s.dec.check_codes(frames)?;
        }
        let mut wavs: Vec<Vec<f32>> = jobs
            .iter()
            .map(|(_, f)| Vec::with_capacity(f.len() * dec.upsample_total))
            .collect();
        let mut next = vec![0usize; jobs.len()];
        loop {
            // Every stream with frames left takes what its chunk still holds.
            let mut members = Vec::new();
            for (i, (s, frames)) in jobs.iter_mut().enumerate() {
                if next[i] == frames.len() {
                    continue;
                }
                if s.chunk_frames == CHUNK_FRAMES {
                    s.restart()?;
                }
                let take = (CHUNK_FRAMES - s.chunk_frames).min(frames.len() - next[i]);
                members.push((i, take));
            }
            if members.is_empty() {
                break;
            }
            let parts: Vec<Vec<&[u32]>> = members
                .iter()
                .map(|&(i, take)| {
                    let f = jobs[i].1;
                    f[next[i]..next[i] + take]
                        .iter()
                        .map(|c| c.as_ref())
                        .collect()
                })
                .collect();
            let mut states: Vec<&mut ChunkState> = Vec::with_capacity(members.len());
            let mut wanted = members.iter().map(|&(i, _)| i).peekable();
            for (i, (s, _)) in jobs.iter_mut().enumerate() {
                if wanted.peek() == Some(&i) {
                    wanted.next();
                    states.push(&mut s.st);
                }
            }
            let samples = Self::run_many(dec, &mut states, &parts)?;
            for ((&(i, take), part), w) in members.iter().zip(&parts).zip(samples) {
                wavs[i].extend_from_slice(&w);
                jobs[i].0.commit(part);
                next[i] += take;
            }
        }
        for w in &mut wavs {
            clamp_unit(w);
        }
        Ok(wavs)
    }

    fn advance<R: AsRef<[u32]>>(&mut self, frames: &[R], emit: bool) -> Result<Vec<f32>> {
        self.dec.check_codes(frames)?;
        let mut wav = Vec::with_capacity(if emit {
            frames.len() * self.dec.upsample_total
        } else {
            0
        });
        let mut i = 0;
        while i < frames.len() {
            if self.chunk_frames == CHUNK_FRAMES {
                self.restart()?;
            }
            let take = (CHUNK_FRAMES - self.chunk_frames).min(frames.len() - i);
            let part: Vec<&[u32]> = frames[i..i + take].iter().map(|f| f.as_ref()).collect();
            let samples = self.run(&part, emit)?;
            wav.extend_from_slice(&samples);
            self.commit(&part);
            i += take;
        }
        clamp_unit(&mut wav);
        Ok(wav)
    }

    /// Counts frames that went through the network and keeps the last ones as the next
    /// chunk's left context.
    fn commit(&mut self, part: &[&[u32]]) {
        for f in part {
            if self.recent.len() == LEFT_CONTEXT_FRAMES {
                self.recent.pop_front();
            }
            self.recent.push_back(f.to_vec());
        }
        self.frames += part.len();
        self.chunk_frames += part.len();
    }

    /// A new chunk: fresh state, then the left context as `chunk_plan` gives it (positions
    /// restart at 0; the convolution stack sees only the last `reach` context frames).
    fn restart(&mut self) -> Result<()> {
        self.st = Self::fresh(self.dec);
        self.chunk_frames = 0;
        let context: Vec<Vec<u32>> = self.recent.iter().cloned().collect();
        let start = self.frames;
        let n = if start > LEFT_CONTEXT_FRAMES {
            LEFT_CONTEXT_FRAMES
        } else {
            start
        };
        let rows: Vec<&[u32]> = context[context.len() - n..]
            .iter()
            .map(|f| f.as_slice())
            .collect();
        self.run(&rows, false)?;
        Ok(())
    }

    /// Frames of the current chunk through the network; samples (unclamped) when `emit`.
    fn run(&mut self, codes: &[&[u32]], emit: bool) -> Result<Vec<f32>> {
        let d = self.dec;
        if !emit && self.st.pending.is_some() {
            // Only the last `reach` rows can still reach a sample (Decoder::decode's skip).
            let x = Self::front_many(d, &mut [&mut self.st], &[codes.to_vec()])
                .pop()
                .expect("one stream");
            let p = self.st.pending.as_mut().expect("checked above");
            p.data.extend_from_slice(&x.data);
            p.t += x.t;
            if p.t > self.reach {
                *p = p.rows(p.t - self.reach, p.t);
            }
            return Ok(Vec::new());
        }
        let mut wav = Self::run_many(d, &mut [&mut self.st], &[codes.to_vec()])?;
        Ok(if emit {
            wav.pop().expect("one stream")
        } else {
            Vec::new()
        })
    }

    /// The frames `codes[i]` of each stream `states[i]` through the whole network (the
    /// convolution stack taking first what a stream's chunk left pending): each stream's samples.
    fn run_many(
        d: &Decoder,
        states: &mut [&mut ChunkState],
        codes: &[Vec<&[u32]>],
    ) -> Result<Vec<Vec<f32>>> {
        let xs = Self::front_many(d, states, codes);
        for st in states.iter_mut() {
            if let Some(p) = st.pending.take() {
                if p.t > 0 {
                    // The context frames' samples are not wanted.
                    Self::conv_stack_many(d, &mut [&mut **st], vec![p])?;
                }
            }
        }
        Self::conv_stack_many(d, states, xs)
    }

    /// The layers before the convolution stack (frame rate): quantizer, pre-conv, transformer
    /// (each stream on its own cache), norm and projection, the streams' rows sharing each
    /// product.
    fn front_many(d: &Decoder, states: &mut [&mut ChunkState], codes: &[Vec<&[u32]>]) -> Vec<Seq> {
        let rows: Vec<usize> = codes.iter().map(|c| c.len()).collect();
        let all: Vec<&[u32]> = codes.iter().flatten().copied().collect();
        let q = d.quantizer.decode(&all).split(&rows);
        let pushed: Vec<(Seq, usize, usize)> = states
            .iter_mut()
            .zip(q)
            .map(|(st, q)| st.pre_conv.push(q))
            .collect();
        let windows: Vec<ConvWindow<'_>> = pushed
            .iter()
            .zip(states.iter())
            .map(|((x, off, a), st)| window(x, *off, *a, &st.pre_conv))
            .collect();
        let pc = d.pre_conv.forward_ranges(&windows, None);
        let h = d
            .input_proj
            .forward(&Seq::stack(&pc, d.input_proj.cin), None);
        let mut caches: Vec<&mut WindowKvCache> = states.iter_mut().map(|st| &mut st.kv).collect();
        let hs = d
            .transformer
            .forward_cached_many(&h.split(&rows), &mut caches);
        let mut h = Seq::stack(&hs, d.output_proj.cin);
        rms_norm_rows(&mut h, &d.norm, d.norm_eps);
        d.output_proj.forward(&h, None).split(&rows)
    }

    /// The convolution stack after the transformer on each stream's next rows (frame rate).
    /// Layers whose rows are few (the upsampling stages, `decoder.0`, each block's transposed
    /// conv) take all streams in one product; the residual units and the last conv, with many
    /// rows per stream and small weights, run stream by stream.
    fn conv_stack_many(
        d: &Decoder,
        states: &mut [&mut ChunkState],
        mut xs: Vec<Seq>,
    ) -> Result<Vec<Vec<f32>>> {
        for (si, (up, cnx)) in d.upsample.iter().enumerate() {
            let pushed: Vec<(Seq, usize, usize)> = states
                .iter_mut()
                .zip(xs)
                .map(|(st, x)| st.upsample[si].0.push(x))
                .collect();
            let windows: Vec<ConvWindow<'_>> = pushed
                .iter()
                .zip(states.iter())
                .map(|((x, off, a), st)| window(x, *off, *a, &st.upsample[si].0))
                .collect();
            let us = up.forward_ranges(&windows, None);
            let mut hs = Vec::with_capacity(us.len());
            for (st, u) in states.iter_mut().zip(&us) {
                let hd = &mut st.upsample[si].1;
                let (uu, off, a) = hd.push(u.clone());
                hs.push(cnx.dwconv.forward_range(&uu, off, (a, hd.seen)));
            }
            let rows: Vec<usize> = us.iter().map(|u| u.t).collect();
            let c = cnx.dwconv.channels;
            xs = cnx
                .finish(Seq::stack(&hs, c), &Seq::stack(&us, c))?
                .split(&rows);
        }
        let pushed: Vec<(Seq, usize, usize)> = states
            .iter_mut()
            .zip(xs)
            .map(|(st, x)| st.first.push(x))
            .collect();
        let windows: Vec<ConvWindow<'_>> = pushed
            .iter()
            .zip(states.iter())
            .map(|((x, off, a), st)| window(x, *off, *a, &st.first))
            .collect();
        xs = d.first.forward_ranges(&windows, None);
        for (bi, b) in d.blocks.iter().enumerate() {
            let pushed: Vec<(Seq, usize, usize)> = states
                .iter_mut()
                .zip(xs)
                .map(|(st, x)| st.blocks[bi].0.push(x))
                .collect();
            let windows: Vec<ConvWindow<'_>> = pushed
                .iter()
                .zip(states.iter())
                .map(|((x, off, a), st)| window(x, *off, *a, &st.blocks[bi].0))
                .collect();
            xs = b.up.forward_ranges(&windows, Some(&b.snake));
            for (st, x) in states.iter_mut().zip(xs.iter_mut()) {
                for (r, h) in b.residuals.iter().zip(st.blocks[bi].1.iter_mut()) {
                    let (xx, off, a) = h.push(std::mem::take(x));
                    *x = r.forward_range(&xx, off, (a, h.seen));
                }
            }
        }
        let mut wavs = Vec::with_capacity(xs.len());
        for (st, x) in states.iter_mut().zip(xs) {
            let (xx, off, a) = st.final_conv.push(x);
            let seen = st.final_conv.seen;
            wavs.push(
                d.final_conv
                    .forward_range(&xx, off, seen, Some(&d.final_snake), (a, seen))
                    .data,
            );
        }
        Ok(wavs)
    }
}

/// The window a [`Hist::push`] just made: `x` (the kept rows, then the new ones) from row
/// `offset`, output rows from the first new one `a` to everything seen.
fn window<'a>(x: &'a Seq, offset: usize, a: usize, hist: &Hist) -> ConvWindow<'a> {
    ConvWindow {
        x,
        offset,
        total: hist.seen,
        range: (a, hist.seen),
    }
}
