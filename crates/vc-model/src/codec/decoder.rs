//! The codec decoder `Qwen3TTSTokenizerV2Decoder` (docs/model.md §9.2), prefix `decoder.`:
//!
//! ```text
//! codes (T, 16) → RVQ decode (Σ entries → output_proj, first + rest)    (T, codebook_dim)
//!   → pre_conv CausalConv k3                                            (T, latent)
//!   → pre_transformer: input_proj → layers (RMSNorm, windowed attention, SwiGLU, LayerScale)
//!                      → norm → output_proj                             (T, latent)
//!   → for r in upsampling_ratios: CausalTransConv(k=r, s=r) → ConvNeXt   (T·4, latent)
//!   → decoder.0 CausalConv k7                                           (T·4, decoder_dim)
//!   → for r in upsample_rates: SnakeBeta → CausalTransConv(k=2r, s=r) → 3 residual units
//!   → SnakeBeta → CausalConv k7 → 1 channel → clamp(−1, 1)               (T·1920)
//! ```
//! [`Decoder::decode`] reproduces the wrapper's `chunked_decode` (300-frame chunks with 25
//! frames of left context, each chunk an independent forward, docs/model.md §9.2/§14).

use anyhow::{bail, ensure, Result};

use super::config::{CodecConfig, DecoderConfig};
use super::quantizer::{vec_of, RvqDecoder};
use super::transformer::{layer_norm_rows, rms_norm_rows, Flavour, Transformer, TransformerDims};
use crate::weights::Weights;
use vc_kernels::act::{gelu_erf_inplace, Act, SnakeParams};
use vc_kernels::conv::{CausalConv1d, PadMode, Seq};
use vc_kernels::conv_transpose::CausalConvTranspose1d;
use vc_kernels::depthwise_conv::DepthwiseCausalConv1d;
use vc_kernels::residual_unit::ResidualUnit;
use vc_kernels::rows_linear::Linear;

mod stream;
pub use stream::StreamDecoder;

/// `chunked_decode` defaults of the official decoder (not in the config).
pub const CHUNK_FRAMES: usize = 300;
pub const LEFT_CONTEXT_FRAMES: usize = 25;

/// ConvNeXt block: `x + γ·pwconv2(gelu(pwconv1(LayerNorm(dwconv(x)))))`.
#[derive(Debug, Clone)]
pub(crate) struct ConvNeXt {
    dwconv: DepthwiseCausalConv1d,
    norm_w: Vec<f32>,
    norm_b: Vec<f32>,
    pw1: Linear,
    pw2: Linear,
    gamma: Vec<f32>,
}

impl ConvNeXt {
    fn load(w: &Weights, p: &str, dim: usize) -> Result<Self> {
        let dwconv = DepthwiseCausalConv1d::from_torch(
            &vec_of(w, &format!("{p}.dwconv.conv.weight"), &[dim, 1, 7])?,
            dim,
            7,
            vec_of(w, &format!("{p}.dwconv.conv.bias"), &[dim])?,
        )?;
        let pw1 = Linear::from_torch(
            &vec_of(w, &format!("{p}.pwconv1.weight"), &[4 * dim, dim])?,
            4 * dim,
            dim,
            Some(vec_of(w, &format!("{p}.pwconv1.bias"), &[4 * dim])?),
        )?;
        let pw2 = Linear::from_torch(
            &vec_of(w, &format!("{p}.pwconv2.weight"), &[dim, 4 * dim])?,
            dim,
            4 * dim,
            Some(vec_of(w, &format!("{p}.pwconv2.bias"), &[dim])?),
        )?;
        Ok(ConvNeXt {
            dwconv,
            norm_w: vec_of(w, &format!("{p}.norm.weight"), &[dim])?,
            norm_b: vec_of(w, &format!("{p}.norm.bias"), &[dim])?,
            pw1,
            pw2,
            gamma: vec_of(w, &format!("{p}.gamma"), &[dim])?,
        })
    }

    fn forward(&self, x: &Seq) -> Result<Seq> {
        self.finish(self.dwconv.forward(x), x)
    }

    /// The block after its depth-wise conv: `h = dwconv(x)` for the rows of `x`.
    fn finish(&self, mut h: Seq, x: &Seq) -> Result<Seq> {
        layer_norm_rows(&mut h, &self.norm_w, &self.norm_b, 1e-6);
        let mut h = self.pw1.forward(&h, None);
        gelu_erf_inplace(&mut h.data);
        let mut y = self.pw2.forward(&h, None);
        let c = y.c;
        for (row, xr) in y.data.chunks_exact_mut(c).zip(x.data.chunks_exact(c)) {
            for ((v, &g), &xv) in row.iter_mut().zip(&self.gamma).zip(xr) {
                *v = xv + g * *v;
            }
        }
        Ok(y)
    }
}

#[derive(Debug, Clone)]
struct Block {
    snake: Act,
    up: CausalConvTranspose1d,
    residuals: Vec<ResidualUnit>,
}

#[derive(Debug, Clone)]
pub struct Decoder {
    quantizer: RvqDecoder,
    pre_conv: CausalConv1d,
    input_proj: Linear,
    transformer: Transformer,
    norm: Vec<f32>,
    norm_eps: f32,
    output_proj: Linear,
    upsample: Vec<(CausalConvTranspose1d, ConvNeXt)>,
    first: CausalConv1d,
    blocks: Vec<Block>,
    final_snake: Act,
    final_conv: CausalConv1d,
    /// Output samples per frame.
    pub upsample_total: usize,
}

/// Intermediate results of one forward, for parity tests (channels-last).
#[derive(Debug, Clone, Default)]
pub struct DecoderTrace {
    pub quantized: Seq,
    pub pre_conv: Seq,
    pub pre_transformer: Seq,
    pub upsample: Vec<Seq>,
    /// Outputs of `decoder.decoder.0` and of each upsampling block.
    pub decoder: Vec<Seq>,
    pub wav_preclamp: Vec<f32>,
}

fn snake(w: &Weights, p: &str, dim: usize) -> Result<Act> {
    Ok(Act::Snake(SnakeParams::from_log(
        &vec_of(w, &format!("{p}.alpha"), &[dim])?,
        &vec_of(w, &format!("{p}.beta"), &[dim])?,
    )))
}

fn causal_conv(
    w: &Weights,
    p: &str,
    (cout, cin, k): (usize, usize, usize),
    dilation: usize,
) -> Result<CausalConv1d> {
    CausalConv1d::from_torch(
        &vec_of(w, &format!("{p}.conv.weight"), &[cout, cin, k])?,
        (cout, cin, k),
        Some(vec_of(w, &format!("{p}.conv.bias"), &[cout])?),
        1,
        dilation,
        PadMode::Zero,
    )
}

fn trans_conv(
    w: &Weights,
    p: &str,
    (cin, cout, k): (usize, usize, usize),
    stride: usize,
) -> Result<CausalConvTranspose1d> {
    CausalConvTranspose1d::from_torch(
        &vec_of(w, &format!("{p}.conv.weight"), &[cin, cout, k])?,
        (cin, cout, k),
        Some(vec_of(w, &format!("{p}.conv.bias"), &[cout])?),
        stride,
    )
}

impl Decoder {
    pub fn load(w: &Weights, config: &CodecConfig) -> Result<Self> {
        let c: &DecoderConfig = &config.decoder_config;
        let p = "decoder.";
        let quantizer = RvqDecoder::load(
            w,
            &format!("{p}quantizer."),
            c.codebook_size,
            c.vq_dim(),
            c.codebook_dim,
            1,
            c.num_quantizers,
        )?;
        let pre_conv = causal_conv(
            w,
            &format!("{p}pre_conv"),
            (c.latent_dim, c.codebook_dim, 3),
            1,
        )?;
        let t = format!("{p}pre_transformer.");
        let input_proj = Linear::from_torch(
            &vec_of(
                w,
                &format!("{t}input_proj.weight"),
                &[c.hidden_size, c.latent_dim],
            )?,
            c.hidden_size,
            c.latent_dim,
            Some(vec_of(w, &format!("{t}input_proj.bias"), &[c.hidden_size])?),
        )?;
        let output_proj = Linear::from_torch(
            &vec_of(
                w,
                &format!("{t}output_proj.weight"),
                &[c.latent_dim, c.hidden_size],
            )?,
            c.latent_dim,
            c.hidden_size,
            Some(vec_of(w, &format!("{t}output_proj.bias"), &[c.latent_dim])?),
        )?;
        let transformer = Transformer::load(
            w,
            &t,
            TransformerDims {
                hidden: c.hidden_size,
                layers: c.num_hidden_layers,
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim(),
                intermediate: c.intermediate_size,
                norm_eps: c.rms_norm_eps,
                rope_theta: c.rope_theta,
                window: Some(c.sliding_window),
            },
            Flavour::Qwen,
        )?;
        let norm = vec_of(w, &format!("{t}norm.weight"), &[c.hidden_size])?;
        let mut upsample = Vec::new();
        for (i, &r) in c.upsampling_ratios.iter().enumerate() {
            let u = format!("{p}upsample.{i}");
            upsample.push((
                trans_conv(w, &format!("{u}.0"), (c.latent_dim, c.latent_dim, r), r)?,
                ConvNeXt::load(w, &format!("{u}.1"), c.latent_dim)?,
            ));
        }
        let d = format!("{p}decoder.");
        let first = causal_conv(w, &format!("{d}0"), (c.decoder_dim, c.latent_dim, 7), 1)?;
        let mut blocks = Vec::new();
        for (i, &r) in c.upsample_rates.iter().enumerate() {
            let in_dim = c.decoder_dim >> i;
            let out_dim = c.decoder_dim >> (i + 1);
            let b = format!("{d}{}.block", i + 1);
            let mut residuals = Vec::new();
            for (j, dilation) in [1usize, 3, 9].into_iter().enumerate() {
                let u = format!("{b}.{}", j + 2);
                residuals.push(ResidualUnit::new(
                    snake(w, &format!("{u}.act1"), out_dim)?,
                    causal_conv(w, &format!("{u}.conv1"), (out_dim, out_dim, 7), dilation)?,
                    snake(w, &format!("{u}.act2"), out_dim)?,
                    causal_conv(w, &format!("{u}.conv2"), (out_dim, out_dim, 1), 1)?,
                    // Direct convolution, never Winograd: a Winograd tile mixes its rows'
                    // inputs, so where a streamed push cuts a tile would change the rounding,
                    // and streamed decoding must equal this one bit for bit (docs/model.md §9.5).
                    0,
                )?);
            }
            blocks.push(Block {
                snake: snake(w, &format!("{b}.0"), in_dim)?,
                up: trans_conv(w, &format!("{b}.1"), (in_dim, out_dim, 2 * r), r)?,
                residuals,
            });
        }
        let n = c.upsample_rates.len();
        let out_dim = c.decoder_dim >> n;
        let final_snake = snake(w, &format!("{d}{}", n + 1), out_dim)?;
        let final_conv = causal_conv(w, &format!("{d}{}", n + 2), (1, out_dim, 7), 1)?;
        Ok(Decoder {
            quantizer,
            pre_conv,
            input_proj,
            transformer,
            norm,
            norm_eps: c.rms_norm_eps as f32,
            output_proj,
            upsample,
            first,
            blocks,
            final_snake,
            final_conv,
            upsample_total: config.decode_upsample_rate,
        })
    }

    pub fn num_quantizers(&self) -> usize {
        self.quantizer.num_quantizers()
    }

    /// Checks that every frame has one code per quantizer, each in range.
    pub fn check_codes<R: AsRef<[u32]>>(&self, codes: &[R]) -> Result<()> {
        let (nq, entries) = (self.quantizer.num_quantizers(), self.quantizer.entries());
        for (t, frame) in codes.iter().enumerate() {
            let frame = frame.as_ref();
            if frame.len() != nq {
                bail!(
                    "frame {t} has {} codes, the codec expects {nq} (one per codebook)",
                    frame.len()
                );
            }
            if let Some((q, &v)) = frame
                .iter()
                .enumerate()
                .find(|(_, &v)| v as usize >= entries)
            {
                bail!("frame {t}, codebook {q}: code {v} is out of range (codebooks have {entries} entries)");
            }
        }
        Ok(())
    }

    /// One forward pass over `codes` (positions restart at 0), with every intermediate.
    pub fn forward_trace(&self, codes: &[&[u32]]) -> Result<DecoderTrace> {
        let mut trace = DecoderTrace::default();
        trace.wav_preclamp = self.run(codes, 0, Some(&mut trace))?;
        Ok(trace)
    }

    /// One forward pass → clamped samples (`frames × upsample_total`).
    pub fn forward(&self, codes: &[&[u32]]) -> Result<Vec<f32>> {
        let mut wav = self.run(codes, 0, None)?;
        clamp_unit(&mut wav);
        Ok(wav)
    }

    /// The forward pass over `codes` with the convolution stack after the transformer starting
    /// at frame `skip`: the samples (before the clamp) of frames `skip..`. Frames from
    /// `skip + conv_reach_frames()` on are exactly those of a full pass ([`Decoder::decode`]
    /// uses this to skip most of each chunk's left context).
    pub fn forward_from(&self, codes: &[&[u32]], skip: usize) -> Result<Vec<f32>> {
        self.run(codes, skip, None)
    }

    fn run(
        &self,
        codes: &[&[u32]],
        skip: usize,
        mut trace: Option<&mut DecoderTrace>,
    ) -> Result<Vec<f32>> {
        ensure!(!codes.is_empty(), "no frames to decode");
        ensure!(skip < codes.len(), "cannot skip every frame");
        let quantized = self.quantizer.decode(codes);
        let pre_conv = self.pre_conv.forward(&quantized, None);
        let h = self.input_proj.forward(&pre_conv, None);
        let mut h = self.transformer.forward(&h);
        rms_norm_rows(&mut h, &self.norm, self.norm_eps);
        let mut x = self.output_proj.forward(&h, None);
        if let Some(t) = trace.as_deref_mut() {
            t.quantized = quantized;
            t.pre_conv = pre_conv;
            t.pre_transformer = x.clone();
        }
        if skip > 0 {
            x = x.rows(skip, x.t);
        }
        for (up, cnx) in &self.upsample {
            let u = up.forward(&x, None);
            x = cnx.forward(&u)?;
            if let Some(t) = trace.as_deref_mut() {
                t.upsample.push(x.clone());
            }
        }
        x = self.first.forward(&x, None);
        if let Some(t) = trace.as_deref_mut() {
            t.decoder.push(x.clone());
        }
        for b in &self.blocks {
            x = b.up.forward(&x, Some(&b.snake));
            for r in &b.residuals {
                x = r.forward(&x);
            }
            if let Some(t) = trace.as_deref_mut() {
                t.decoder.push(x.clone());
            }
        }
        let wav = self.final_conv.forward(&x, Some(&self.final_snake)).data;
        Ok(wav)
    }

    /// How many frames back (at the code rate) an output sample of the convolution stack after
    /// the transformer can see: its receptive field, from the kernels and strides.
    pub fn conv_reach_frames(&self) -> usize {
        // Walk from the output back to the transformer, in samples of each stage's rate.
        let mut reach = self.final_conv.k_eff() - 1;
        for b in self.blocks.iter().rev() {
            for r in &b.residuals {
                reach += r.conv1.k_eff() - 1;
            }
            reach = reach.div_ceil(b.up.stride) + b.up.taps() - 1;
        }
        reach += self.first.k_eff() - 1;
        for (up, cnx) in self.upsample.iter().rev() {
            reach += cnx.dwconv.kernel - 1;
            reach = reach.div_ceil(up.stride) + up.taps() - 1;
        }
        reach
    }

    /// The official `chunked_decode`: chunks of [`CHUNK_FRAMES`] frames, each decoded on its own
    /// with up to [`LEFT_CONTEXT_FRAMES`] frames of left context whose samples are dropped.
    pub fn decode(&self, codes: &[&[u32]]) -> Result<Vec<f32>> {
        let mut wav = Vec::with_capacity(codes.len() * self.upsample_total);
        let reach = self.conv_reach_frames();
        for (start, end, context) in chunk_plan(codes.len(), CHUNK_FRAMES, LEFT_CONTEXT_FRAMES) {
            // The context frames only matter through the transformer and the last `reach`
            // frames before the kept ones: the conv stack skips the rest (same samples).
            let skip = context.saturating_sub(reach);
            let part = self.run(&codes[start - context..end], skip, None)?;
            wav.extend_from_slice(&part[(context - skip) * self.upsample_total..]);
        }
        clamp_unit(&mut wav);
        Ok(wav)
    }
}

fn clamp_unit(wav: &mut [f32]) {
    for v in wav.iter_mut() {
        *v = v.clamp(-1.0, 1.0);
    }
}

/// `(start, end, context)` of each chunk, exactly as `chunked_decode` walks the frames:
/// `context = left_context if start − left_context > 0 else start`.
pub fn chunk_plan(frames: usize, chunk: usize, left_context: usize) -> Vec<(usize, usize, usize)> {
    let mut plan = Vec::new();
    let mut start = 0;
    while start < frames {
        let end = (start + chunk).min(frames);
        let context = if start > left_context {
            left_context
        } else {
            start
        };
        plan.push((start, end, context));
        start = end;
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_plan_matches_official_walk() {
        assert_eq!(chunk_plan(0, 300, 25), vec![]);
        assert_eq!(chunk_plan(1, 300, 25), vec![(0, 1, 0)]);
        assert_eq!(chunk_plan(300, 300, 25), vec![(0, 300, 0)]);
        assert_eq!(chunk_plan(301, 300, 25), vec![(0, 300, 0), (300, 301, 25)]);
        assert_eq!(
            chunk_plan(750, 300, 25),
            vec![(0, 300, 0), (300, 600, 25), (600, 750, 25)]
        );
        // start ≤ context: the whole prefix is context (only reachable with chunk ≤ context).
        assert_eq!(
            chunk_plan(30, 10, 25),
            vec![(0, 10, 0), (10, 20, 10), (20, 30, 20)]
        );
        // Every frame is produced exactly once.
        for frames in [1usize, 299, 300, 301, 599, 600, 601, 1000] {
            let plan = chunk_plan(frames, 300, 25);
            let covered: usize = plan.iter().map(|(s, e, _)| e - s).sum();
            assert_eq!(covered, frames);
        }
    }
}
