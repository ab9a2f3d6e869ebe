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

use anyhow::Result;

use super::super::conv::Seq;
use super::super::transformer::{rms_norm_rows, KvCache};
use super::{clamp_unit, Decoder, CHUNK_FRAMES, LEFT_CONTEXT_FRAMES};

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
    kv: KvCache,
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
            for f in &part {
                if self.recent.len() == LEFT_CONTEXT_FRAMES {
                    self.recent.pop_front();
                }
                self.recent.push_back(f.to_vec());
            }
            self.frames += take;
            self.chunk_frames += take;
            i += take;
        }
        clamp_unit(&mut wav);
        Ok(wav)
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
        let st = &mut self.st;
        let q = d.quantizer.decode(codes);
        let (x, off, a) = st.pre_conv.push(q);
        let pc = d
            .pre_conv
            .forward_range(&x, off, st.pre_conv.seen, None, (a, st.pre_conv.seen));
        let h = d.input_proj.forward(&pc, None);
        let mut h = d.transformer.forward_cached(&h, &mut st.kv);
        rms_norm_rows(&mut h, &d.norm, d.norm_eps);
        let x = d.output_proj.forward(&h, None);
        if let Some(p) = &mut st.pending {
            if !emit {
                // Only the last `reach` rows can still reach a sample (Decoder::decode's skip).
                p.data.extend_from_slice(&x.data);
                p.t += x.t;
                if p.t > self.reach {
                    *p = p.rows(p.t - self.reach, p.t);
                }
                return Ok(Vec::new());
            }
        }
        if let Some(p) = st.pending.take() {
            if p.t > 0 {
                Self::conv_stack(d, st, p)?;
            }
        }
        let wav = Self::conv_stack(d, st, x)?;
        Ok(if emit { wav } else { Vec::new() })
    }

    /// The convolution stack after the transformer on the next rows (frame rate).
    fn conv_stack(d: &Decoder, st: &mut ChunkState, mut x: Seq) -> Result<Vec<f32>> {
        for ((up, cnx), (hu, hd)) in d.upsample.iter().zip(st.upsample.iter_mut()) {
            let (xx, off, a) = hu.push(x);
            let u = up.forward_range(&xx, off, hu.seen, None, (a, hu.seen));
            let (uu, off, a) = hd.push(u.clone());
            let h = cnx.dwconv.forward_range(&uu, off, (a, hd.seen));
            x = cnx.finish(h, &u)?;
        }
        let (xx, off, a) = st.first.push(x);
        x = d
            .first
            .forward_range(&xx, off, st.first.seen, None, (a, st.first.seen));
        for (b, (hu, hr)) in d.blocks.iter().zip(st.blocks.iter_mut()) {
            let (xx, off, a) = hu.push(x);
            x =
                b.up.forward_range(&xx, off, hu.seen, Some(&b.snake), (a, hu.seen));
            for (r, h) in b.residuals.iter().zip(hr.iter_mut()) {
                let (xx, off, a) = h.push(x);
                x = r.forward_range(&xx, off, (a, h.seen));
            }
        }
        let (xx, off, a) = st.final_conv.push(x);
        let wav = d
            .final_conv
            .forward_range(
                &xx,
                off,
                st.final_conv.seen,
                Some(&d.final_snake),
                (a, st.final_conv.seen),
            )
            .data;
        Ok(wav)
    }
}
