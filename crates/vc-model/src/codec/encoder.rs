//! The codec encoder: HF `MimiModel` minus its decoder (docs/model.md §9.1), prefix `encoder.`.
//!
//! 24 kHz samples → SEANet (`encoder.encoder.layers.*`, causal convs, ELU, residual blocks,
//! strided downsampling by `upsampling_ratios` reversed) → 8-layer transformer
//! (`encoder.encoder_transformer`, full causal) → `encoder.downsample` (k4 s2, replicate padding)
//! → split RVQ (`encoder.quantizer`) → codes; the wrapper keeps the first
//! `encoder_valid_num_quantizers` codebooks and `ceil(samples / 1920)` frames.

use anyhow::{ensure, Result};

use super::config::{CodecConfig, EncoderConfig};
use super::quantizer::{vec_of, SplitRvqEncoder};
use super::transformer::{Flavour, Transformer, TransformerDims};
use super::winograd_outputs;
use crate::weights::Weights;
use vc_kernels::act::Act;
use vc_kernels::buf::par_new_vec;
use vc_kernels::conv::{num_threads, CausalConv1d, PadMode, Seq};
use vc_kernels::residual_unit::ResidualUnit;

/// Intermediate results of one encode, for parity tests.
#[derive(Debug, Clone)]
pub struct EncoderTrace {
    /// SEANet output `(T25, hidden)`.
    pub seanet: Seq,
    /// Transformer output `(T25, hidden)`.
    pub transformer: Seq,
    /// Downsample output = quantizer input `(T12.5, hidden)`.
    pub latent: Seq,
    /// Codes of every kept codebook, `(frames, n_q)` before trimming to the valid frames.
    pub codes: Vec<Vec<u32>>,
}

#[derive(Debug, Clone)]
struct Stage {
    residuals: Vec<ResidualUnit>,
    /// Preceded by ELU.
    down: CausalConv1d,
}

#[derive(Debug, Clone)]
pub struct Encoder {
    first: CausalConv1d,
    stages: Vec<Stage>,
    /// Preceded by ELU.
    last: CausalConv1d,
    transformer: Transformer,
    downsample: Option<CausalConv1d>,
    quantizer: SplitRvqEncoder,
}

fn conv(
    w: &Weights,
    name: &str,
    (cout, cin, k): (usize, usize, usize),
    bias: bool,
    stride: usize,
    dilation: usize,
    pad: PadMode,
) -> Result<CausalConv1d> {
    let wt = vec_of(w, &format!("{name}.weight"), &[cout, cin, k])?;
    let b = if bias {
        Some(vec_of(w, &format!("{name}.bias"), &[cout])?)
    } else {
        None
    };
    CausalConv1d::from_torch(&wt, (cout, cin, k), b, stride, dilation, pad)
}

impl Encoder {
    /// Loads `encoder.*` for `config` (keeping `encoder_valid_num_quantizers` codebooks).
    pub fn load(w: &Weights, config: &CodecConfig) -> Result<Self> {
        let c: &EncoderConfig = &config.encoder_config;
        let pad = match c.pad_mode.as_str() {
            "replicate" => PadMode::Replicate,
            _ => PadMode::Zero,
        };
        let p = "encoder.encoder.layers";
        // MimiEncoder.__init__: the module list index advances exactly like `len(model)`.
        let mut idx = 0usize;
        let first = conv(
            w,
            &format!("{p}.{idx}.conv"),
            (c.num_filters, c.audio_channels, c.kernel_size),
            true,
            1,
            1,
            pad,
        )?;
        idx += 1;
        let mut scaling = 1usize;
        let mut stages = Vec::new();
        for &ratio in c.upsampling_ratios.iter().rev() {
            let dim = scaling * c.num_filters;
            let hidden = dim / c.compress;
            let mut residuals = Vec::new();
            for j in 0..c.num_residual_layers {
                let dilation = c.dilation_growth_rate.pow(j as u32);
                let conv1 = conv(
                    w,
                    &format!("{p}.{idx}.block.1.conv"),
                    (hidden, dim, c.residual_kernel_size),
                    true,
                    1,
                    dilation,
                    pad,
                )?;
                let conv2 = conv(
                    w,
                    &format!("{p}.{idx}.block.3.conv"),
                    (dim, hidden, 1),
                    true,
                    1,
                    1,
                    pad,
                )?;
                residuals.push(ResidualUnit::new(
                    Act::Elu,
                    conv1,
                    Act::Elu,
                    conv2,
                    winograd_outputs(),
                )?);
                idx += 1;
            }
            idx += 1; // ELU
            let down = conv(
                w,
                &format!("{p}.{idx}.conv"),
                (dim * 2, dim, ratio * 2),
                true,
                ratio,
                1,
                pad,
            )?;
            idx += 1;
            stages.push(Stage { residuals, down });
            scaling *= 2;
        }
        idx += 1; // ELU
        let last = conv(
            w,
            &format!("{p}.{idx}.conv"),
            (c.hidden_size, scaling * c.num_filters, c.last_kernel_size),
            true,
            1,
            1,
            pad,
        )?;
        let transformer = Transformer::load(
            w,
            "encoder.encoder_transformer.",
            TransformerDims {
                hidden: c.hidden_size,
                layers: c.num_hidden_layers,
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim(),
                intermediate: c.intermediate_size,
                norm_eps: c.norm_eps,
                rope_theta: c.rope_theta,
                // The official (sdpa/eager) path builds a full causal mask (docs/model.md §9.1).
                window: None,
            },
            Flavour::Mimi,
        )?;
        let downsample = if c.has_downsample() {
            Some(conv(
                w,
                "encoder.downsample.conv",
                (c.hidden_size, c.hidden_size, c.downsample_kernel()),
                false,
                2,
                1,
                PadMode::Replicate,
            )?)
        } else {
            None
        };
        let semantic = c.num_semantic_quantizers;
        let quantizer = SplitRvqEncoder::load(
            w,
            "encoder.quantizer.",
            c.hidden_size,
            c.vector_quantization_hidden_dimension,
            c.codebook_dim,
            c.codebook_size,
            semantic,
            config.encoder_valid_num_quantizers - semantic,
        )?;
        Ok(Encoder {
            first,
            stages,
            last,
            transformer,
            downsample,
            quantizer,
        })
    }

    /// SEANet: `(samples, 1)` → `(T25, hidden)`.
    pub fn seanet(&self, wav: &[f32]) -> Seq {
        let mut h = self.stem(wav);
        for stage in &self.stages[1..] {
            for r in &stage.residuals {
                h = r.forward(&h);
            }
            h = stage.down.forward(&h, Some(&Act::Elu));
        }
        self.last.forward(&h, Some(&Act::Elu))
    }

    /// The full-rate part of SEANet — first conv, first stage's residual units, ELU and its
    /// strided conv — computed tile by tile over the strided conv's output, so the two
    /// full-rate intermediates (the encoder's largest tensors, 64 × 24 000 values per second)
    /// are never stored. Each tile recomputes the few rows of left context its receptive field
    /// needs; rows whose context would be cut are never used.
    fn stem(&self, wav: &[f32]) -> Seq {
        let stage = &self.stages[0];
        let down = &stage.down;
        let total = wav.len(); // the first conv and the residual units keep the length
        let t_out = down.out_len(total);
        let halo0 = self.first.k_eff() - 1;
        let halos: Vec<usize> = stage
            .residuals
            .iter()
            .map(|r| r.conv1.k_eff() - 1)
            .collect();
        let halo_res: usize = halos.iter().sum();
        let cout = down.cout;
        let tile = (4096 / down.stride)
            .max(64)
            .min(t_out.div_ceil(num_threads()))
            .max(1);
        // Each tile runs the layers on its window (they parallelise inside, rayon nests).
        let out = par_new_vec(
            t_out * cout,
            tile * cout,
            || (),
            |i, part, _| {
                let a = i * tile;
                let b = a + part.len() / cout;
                // Full-rate rows the strided conv reads, and the first conv's rows they need.
                let (r0, r1) = down.input_rows(a, b, total);
                let q0 = r0.saturating_sub(halo_res);
                let w0 = q0.saturating_sub(halo0);
                let mut h = self
                    .first
                    .forward(&Seq::new(wav[w0..r1].to_vec(), r1 - w0, 1), None);
                // First row whose whole receptive field was inside the window (0: the window
                // starts at the signal's start, where the zero padding is the real one).
                let mut valid = if w0 == 0 { 0 } else { w0 + halo0 };
                for (r, halo) in stage.residuals.iter().zip(&halos) {
                    h = r.forward(&h);
                    if valid > 0 {
                        valid += halo;
                    }
                }
                debug_assert!(valid <= r0.max(w0));
                let y = down.forward_window(&h, w0, total, Some(&Act::Elu), (a, b));
                part.copy_from(&y.data)
            },
        );
        Seq::new(out, t_out, cout)
    }

    /// SEANet layer by layer (no fusion), to check [`Encoder::seanet`] against.
    pub fn seanet_unfused(&self, wav: &[f32]) -> Seq {
        let mut h = self
            .first
            .forward(&Seq::new(wav.to_vec(), wav.len(), 1), None);
        for stage in &self.stages {
            for r in &stage.residuals {
                h = r.forward(&h);
            }
            h = stage.down.forward(&h, Some(&Act::Elu));
        }
        self.last.forward(&h, Some(&Act::Elu))
    }

    /// Codes of all kept codebooks for every frame the network produces
    /// (`ceil(len / 1920)` for an unpadded input), with the intermediates.
    pub fn encode_trace(&self, wav: &[f32]) -> Result<EncoderTrace> {
        ensure!(!wav.is_empty(), "cannot encode an empty waveform");
        let seanet = self.seanet(wav);
        let transformer = self.transformer.forward(&seanet);
        let latent = match &self.downsample {
            Some(d) => d.forward(&transformer, None),
            None => transformer.clone(),
        };
        let codes = self.quantizer.encode(&latent);

        Ok(EncoderTrace {
            seanet,
            transformer,
            latent,
            codes,
        })
    }
}
