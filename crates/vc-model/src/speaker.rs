//! The speaker encoder of the Base checkpoints: an ECAPA-TDNN variant without BatchNorm that
//! turns the log-mel of a 24 kHz reference clip into the x-vector the talker takes as a single
//! codec-stream embedding (docs/model.md §8.2, `Qwen3TTSSpeakerEncoder` in `modeling_qwen3_tts.py`;
//! tensor names docs/model.md §8.3, prefix `speaker_encoder.`).
//!
//! ```text
//! x (B, mel, T) ─ TDNN k5 ─ SE-Res2Net(d2) ─ SE-Res2Net(d3) ─ SE-Res2Net(d4)
//!                              └────────────── cat ──────────────┘
//!                                                 └─ MFA TDNN k1 ─ attentive stats pooling ─ fc ─> (B, enc_dim)
//! ```
//!
//! Every convolution is `Conv1d(padding="same", padding_mode="reflect")` with a bias. The
//! encoder is frozen during fine-tuning, so this is inference-only code (fused candle ops are
//! fine); each block is a pure function of its plain-tensor weights and its input. It always
//! runs in f32 (the official code runs it in the model dtype; f32 is the more exact choice).

use std::collections::BTreeSet;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, D};

use super::config::{Qwen3TtsConfig, SpeakerEncoderConfig};
use super::files::Checkpoint;
use super::mel::LogMel;
use super::weights::Weights;
use vc_core::hub::ModelSource;

/// Prefix of the speaker-encoder tensors in `model.safetensors`.
pub const PREFIX: &str = "speaker_encoder.";

/// A `Conv1d(c_in → c_out, k, dilation, padding="same", padding_mode="reflect")` with bias.
#[derive(Debug, Clone)]
pub struct Conv1d {
    /// `(c_out, c_in, k)`.
    pub weight: Tensor,
    /// `(c_out,)`.
    pub bias: Tensor,
    pub dilation: usize,
}

impl Conv1d {
    fn load(
        w: &Weights,
        name: &str,
        c_out: usize,
        c_in: usize,
        k: usize,
        dilation: usize,
    ) -> Result<Self> {
        Ok(Conv1d {
            weight: w.get(&format!("{name}.weight"), &[c_out, c_in, k])?,
            bias: w.get(&format!("{name}.bias"), &[c_out])?,
            dilation,
        })
    }

    fn kernel(&self) -> usize {
        self.weight.dims()[2]
    }

    /// PyTorch's "same" padding: `d·(k−1)` in total, the extra sample (even kernels) on the right.
    pub fn same_padding(&self) -> (usize, usize) {
        let total = self.dilation * (self.kernel() - 1);
        (total / 2, total - total / 2)
    }

    /// `(B, c_in, T) → (B, c_out, T)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (c_out, _, k) = self.weight.dims3()?;
        let y = if k == 1 {
            // A pointwise convolution is a matmul over channels.
            self.weight.squeeze(2)?.broadcast_matmul(&x.contiguous()?)?
        } else {
            let (left, right) = self.same_padding();
            reflect_pad_time(x, left, right)?.conv1d(&self.weight, 0, 1, self.dilation, 1)?
        };
        Ok(y.broadcast_add(&self.bias.reshape((1, c_out, 1))?)?)
    }
}

/// `F.pad(x, (left, right), mode="reflect")` on the last (time) dimension of `(B, C, T)`.
pub fn reflect_pad_time(x: &Tensor, left: usize, right: usize) -> Result<Tensor> {
    if left == 0 && right == 0 {
        return Ok(x.clone());
    }
    let t = x.dim(D::Minus1)?;
    ensure!(
        left < t && right < t,
        "reflect padding ({left}, {right}) needs more than {t} frames"
    );
    let idx: Vec<u32> = (1..=left)
        .rev()
        .chain(0..t)
        .chain((1..=right).map(|i| t - 1 - i))
        .map(|i| i as u32)
        .collect();
    let idx = Tensor::from_vec(idx, left + t + right, x.device())?;
    Ok(x.contiguous()?.index_select(&idx, 2)?)
}

/// `TDNN = ReLU(conv)`.
#[derive(Debug, Clone)]
pub struct Tdnn {
    pub conv: Conv1d,
}

impl Tdnn {
    fn load(
        w: &Weights,
        name: &str,
        c_out: usize,
        c_in: usize,
        k: usize,
        dilation: usize,
    ) -> Result<Self> {
        Ok(Tdnn {
            conv: Conv1d::load(w, &format!("{name}.conv"), c_out, c_in, k, dilation)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.conv.forward(x)?.relu()?)
    }
}

/// `SqueezeExcitationRes2NetBlock`: TDNN k1 → Res2Net → TDNN k1 → squeeze-excitation, plus the
/// residual.
#[derive(Debug, Clone)]
pub struct SeRes2NetBlock {
    pub tdnn1: Tdnn,
    /// `scale − 1` TDNNs on `channels / scale` channels (`res2net_block.blocks.{0..}`).
    pub res2net: Vec<Tdnn>,
    pub tdnn2: Tdnn,
    pub se_conv1: Conv1d,
    pub se_conv2: Conv1d,
    pub scale: usize,
}

impl SeRes2NetBlock {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.tdnn1.forward(x)?;
        // Res2Net: o0 = y0, o1 = TDNN_0(y1), o_j = TDNN_{j-1}(y_j + o_{j-1}).
        let chunks = y.chunk(self.scale, 1)?;
        let mut outs: Vec<Tensor> = Vec::with_capacity(self.scale);
        for (i, part) in chunks.iter().enumerate() {
            let o = match i {
                0 => part.clone(),
                1 => self.res2net[0].forward(part)?,
                _ => self.res2net[i - 1].forward(&(part + &outs[i - 1])?)?,
            };
            outs.push(o);
        }
        let y = self.tdnn2.forward(&Tensor::cat(&outs, 1)?)?;
        // squeeze-excitation over the time average
        let s = y.mean_keepdim(2)?;
        let s = self.se_conv1.forward(&s)?.relu()?;
        let s = candle_nn::ops::sigmoid(&self.se_conv2.forward(&s)?)?;
        Ok((y.broadcast_mul(&s)? + x)?)
    }
}

/// Attentive statistics pooling with global context (SpeechBrain's `AttentiveStatisticsPooling`
/// with all frames valid).
#[derive(Debug, Clone)]
pub struct AttentiveStatsPool {
    /// `TDNN(3C → attention, k1)`.
    pub tdnn: Tdnn,
    /// `Conv1d(attention → C, k1)`.
    pub conv: Conv1d,
}

const ASP_EPS: f64 = 1e-12;

impl AttentiveStatsPool {
    /// `(B, C, T) → (B, 2C, 1)`: the attention-weighted mean and standard deviation.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(2)?;
        // global context: plain mean and (population) std over time
        let mean = x.mean_keepdim(2)?;
        let std = x
            .broadcast_sub(&mean)?
            .sqr()?
            .mean_keepdim(2)?
            .clamp(ASP_EPS, f64::INFINITY)?
            .sqrt()?;
        let (b, c, _) = x.dims3()?;
        let context = Tensor::cat(
            &[
                x.clone(),
                mean.broadcast_as((b, c, t))?,
                std.broadcast_as((b, c, t))?,
            ],
            1,
        )?;
        let a = self.conv.forward(&self.tdnn.forward(&context)?.tanh()?)?;
        let w = candle_nn::ops::softmax(&a, 2)?;
        let mean_w = (&w * x)?.sum_keepdim(2)?;
        let var_w = (w * x.broadcast_sub(&mean_w)?.sqr()?)?.sum_keepdim(2)?;
        let std_w = var_w.clamp(ASP_EPS, f64::INFINITY)?.sqrt()?;
        Ok(Tensor::cat(&[mean_w, std_w], 1)?)
    }
}

/// The whole encoder, weights as plain tensors.
#[derive(Debug, Clone)]
pub struct SpeakerEncoder {
    pub config: SpeakerEncoderConfig,
    /// `blocks.0`: TDNN(mel_dim → channels[0], k[0], d[0]).
    pub block0: Tdnn,
    /// `blocks.1..n-2`.
    pub blocks: Vec<SeRes2NetBlock>,
    pub mfa: Tdnn,
    pub asp: AttentiveStatsPool,
    /// `Conv1d(2·channels[-1] → enc_dim, k1)`.
    pub fc: Conv1d,
}

impl SpeakerEncoder {
    /// Builds the encoder from `weights` (tensor names `{prefix}blocks.0.conv.weight`, ...),
    /// checking every shape against `config`.
    pub fn load(weights: &Weights, prefix: &str, config: &SpeakerEncoderConfig) -> Result<Self> {
        check_config(config)?;
        let c = &config.enc_channels;
        let k = &config.enc_kernel_sizes;
        let d = &config.enc_dilations;
        let n = c.len();
        let name = |s: &str| format!("{prefix}{s}");
        let block0 = Tdnn::load(weights, &name("blocks.0"), c[0], config.mel_dim, k[0], d[0])?;
        let mut blocks = Vec::with_capacity(n - 2);
        for i in 1..n - 1 {
            let b = name(&format!("blocks.{i}"));
            let sub = c[i] / config.enc_res2net_scale;
            let res2net = (0..config.enc_res2net_scale - 1)
                .map(|j| {
                    Tdnn::load(
                        weights,
                        &format!("{b}.res2net_block.blocks.{j}"),
                        sub,
                        sub,
                        k[i],
                        d[i],
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            blocks.push(SeRes2NetBlock {
                tdnn1: Tdnn::load(weights, &format!("{b}.tdnn1"), c[i], c[i - 1], 1, 1)?,
                res2net,
                tdnn2: Tdnn::load(weights, &format!("{b}.tdnn2"), c[i], c[i], 1, 1)?,
                se_conv1: Conv1d::load(
                    weights,
                    &format!("{b}.se_block.conv1"),
                    config.enc_se_channels,
                    c[i],
                    1,
                    1,
                )?,
                se_conv2: Conv1d::load(
                    weights,
                    &format!("{b}.se_block.conv2"),
                    c[i],
                    config.enc_se_channels,
                    1,
                    1,
                )?,
                scale: config.enc_res2net_scale,
            });
        }
        let last = c[n - 1];
        let mfa_in: usize = c[1..n - 1].iter().sum();
        Ok(SpeakerEncoder {
            config: config.clone(),
            block0,
            blocks,
            mfa: Tdnn::load(weights, &name("mfa"), last, mfa_in, k[n - 1], d[n - 1])?,
            asp: AttentiveStatsPool {
                tdnn: Tdnn::load(
                    weights,
                    &name("asp.tdnn"),
                    config.enc_attention_channels,
                    3 * last,
                    1,
                    1,
                )?,
                conv: Conv1d::load(
                    weights,
                    &name("asp.conv"),
                    last,
                    config.enc_attention_channels,
                    1,
                    1,
                )?,
            },
            fc: Conv1d::load(weights, &name("fc"), config.enc_dim, 2 * last, 1, 1)?,
        })
    }

    /// Loads `config.json` and only the `speaker_encoder.*` tensors of a model directory or hub
    /// repository, in f32 on `device`. A model without a speaker encoder (CustomVoice,
    /// VoiceDesign) is an error that says so.
    pub fn from_model(source: &ModelSource, device: &Device) -> Result<Self> {
        let config_path = source.file("config.json")?;
        let config = Qwen3TtsConfig::from_file(&config_path)?;
        let Some(se) = &config.speaker_encoder_config else {
            bail!(
                "model {} (tts_model_type {:?}) has no speaker encoder (no speaker_encoder_config in {}); \
                 speaker embeddings need a Base model such as Qwen/Qwen3-TTS-12Hz-1.7B-Base",
                source.describe(),
                config.tts_model_type,
                config_path.display()
            );
        };
        let files = weight_files(source, PREFIX)?;
        let weights = Weights::load(&files, DType::F32, device, |name| name.starts_with(PREFIX))?;
        Self::load(&weights, PREFIX, se)
            .with_context(|| format!("cannot build the speaker encoder of {}", source.describe()))
    }

    /// Output dimension (`enc_dim`, the talker's hidden size).
    pub fn dim(&self) -> usize {
        self.config.enc_dim
    }

    /// The fewest mel frames the reflect-padded convolutions accept.
    pub fn min_frames(&self) -> usize {
        let mut convs = vec![&self.block0.conv, &self.mfa.conv];
        for b in &self.blocks {
            convs.extend(b.res2net.iter().map(|t| &t.conv));
        }
        convs
            .iter()
            .map(|c| {
                let (l, r) = c.same_padding();
                l.max(r) + 1
            })
            .max()
            .unwrap_or(1)
    }

    /// `(B, T, mel_dim)` log-mel features → `(B, enc_dim)` x-vectors.
    pub fn forward(&self, mel: &Tensor) -> Result<Tensor> {
        let (_, t, m) = mel.dims3()?;
        ensure!(
            m == self.config.mel_dim,
            "speaker encoder expects {} mel bins, got {m}",
            self.config.mel_dim
        );
        ensure!(
            t >= self.min_frames(),
            "speaker encoder needs at least {} mel frames, got {t}",
            self.min_frames()
        );
        let x = mel.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
        let mut h = self.block0.forward(&x)?;
        let mut outs = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            h = block.forward(&h)?;
            outs.push(h.clone());
        }
        let h = self.mfa.forward(&Tensor::cat(&outs, 1)?)?;
        let pooled = self.asp.forward(&h)?;
        Ok(self.fc.forward(&pooled)?.squeeze(2)?)
    }

    /// `extract_speaker_embedding`: a mono waveform at `sample_rate` (must be the encoder's
    /// 24 kHz) → log-mel → encoder → the `(enc_dim,)` x-vector.
    pub fn embed(&self, wav: &[f32], sample_rate: u32) -> Result<Vec<f32>> {
        ensure!(
            sample_rate == self.config.sample_rate,
            "the speaker encoder takes {} Hz audio, got {sample_rate} Hz",
            self.config.sample_rate
        );
        let mel = LogMel::speaker_encoder();
        let min_samples = mel.config().samples_for_frames(self.min_frames());
        ensure!(
            wav.len() >= min_samples,
            "reference audio too short for a speaker embedding: {} samples ({:.3} s), at least {} ({:.3} s) are needed",
            wav.len(),
            wav.len() as f64 / sample_rate as f64,
            min_samples,
            min_samples as f64 / sample_rate as f64
        );
        let features = mel
            .compute(wav)?
            .to_tensor(self.block0.conv.weight.device())?;
        let x = self.forward(&features)?;
        Ok(x.squeeze(0)?.to_vec1::<f32>()?)
    }
}

fn check_config(c: &SpeakerEncoderConfig) -> Result<()> {
    let n = c.enc_channels.len();
    ensure!(
        n == c.enc_kernel_sizes.len() && n == c.enc_dilations.len(),
        "speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations must have the same length"
    );
    ensure!(
        n >= 3,
        "speaker_encoder_config: enc_channels needs at least 3 entries"
    );
    ensure!(
        c.mel_dim == 128,
        "speaker_encoder_config.mel_dim is {} but the official front end always computes 128 mel bins",
        c.mel_dim
    );
    ensure!(
        c.enc_res2net_scale >= 2,
        "speaker_encoder_config.enc_res2net_scale must be at least 2"
    );
    ensure!(
        c.enc_kernel_sizes.iter().all(|&k| k >= 1) && c.enc_dilations.iter().all(|&d| d >= 1),
        "speaker_encoder_config: kernel sizes and dilations must be positive"
    );
    for i in 1..n - 1 {
        ensure!(
            c.enc_channels[i] == c.enc_channels[i - 1],
            "speaker_encoder_config: SE-Res2Net block {i} has {} input and {} output channels; the residual needs them equal",
            c.enc_channels[i - 1],
            c.enc_channels[i]
        );
        ensure!(
            c.enc_channels[i].is_multiple_of(c.enc_res2net_scale),
            "speaker_encoder_config: {} channels do not split into enc_res2net_scale={} parts",
            c.enc_channels[i],
            c.enc_res2net_scale
        );
    }
    Ok(())
}

/// The checkpoint files holding tensors that start with `prefix` (`model.safetensors`, or the
/// shards of `model.safetensors.index.json` that have any).
fn weight_files(source: &ModelSource, prefix: &str) -> Result<Vec<PathBuf>> {
    let checkpoint = Checkpoint::resolve(source)?;
    let shards: BTreeSet<usize> = checkpoint
        .tensor_names()
        .filter(|name| name.starts_with(prefix))
        .filter_map(|name| checkpoint.tensor(name).map(|t| t.shard))
        .collect();
    if shards.is_empty() {
        bail!(
            "model {}: config.json declares a speaker encoder but the checkpoint has no {prefix}* tensors",
            source.describe()
        );
    }
    Ok(shards
        .into_iter()
        .map(|i| checkpoint.shards[i].clone())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reflect_pad_time_matches_pytorch() {
        let x = Tensor::arange(0f32, 5.0, &Device::Cpu)
            .unwrap()
            .reshape((1, 1, 5))
            .unwrap();
        let y = reflect_pad_time(&x, 2, 3).unwrap();
        assert_eq!(
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![2.0, 1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 3.0, 2.0, 1.0]
        );
        assert!(reflect_pad_time(&x, 5, 0).is_err());
    }

    fn conv(c_out: usize, c_in: usize, k: usize, dilation: usize, seed: u64) -> Conv1d {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let w: Vec<f32> = (0..c_out * c_in * k).map(|_| next()).collect();
        let b: Vec<f32> = (0..c_out).map(|_| next()).collect();
        Conv1d {
            weight: Tensor::from_vec(w, (c_out, c_in, k), &Device::Cpu).unwrap(),
            bias: Tensor::from_vec(b, c_out, &Device::Cpu).unwrap(),
            dilation,
        }
    }

    /// Direct evaluation of a "same"+reflect dilated convolution.
    fn naive(conv: &Conv1d, x: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let w = conv.weight.to_vec3::<f32>().unwrap();
        let b = conv.bias.to_vec1::<f32>().unwrap();
        let t = x[0].len() as isize;
        let (left, _) = conv.same_padding();
        let reflect = |i: isize| -> usize {
            let i = if i < 0 { -i } else { i };
            (if i >= t { 2 * (t - 1) - i } else { i }) as usize
        };
        w.iter()
            .zip(&b)
            .map(|(wo, bo)| {
                (0..t)
                    .map(|n| {
                        let mut acc = *bo as f64;
                        for (wi, xi) in wo.iter().zip(x) {
                            for (j, wk) in wi.iter().enumerate() {
                                let src = n - left as isize + (j * conv.dilation) as isize;
                                acc += *wk as f64 * xi[reflect(src)] as f64;
                            }
                        }
                        acc as f32
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn same_reflect_conv_matches_direct_evaluation() {
        // odd kernels (the real configs) and an even one (padding extra on the right, as PyTorch)
        for (k, d) in [(1, 1), (3, 2), (5, 1), (3, 4), (4, 2)] {
            let c = conv(3, 2, k, d, (k * 10 + d) as u64);
            let x: Vec<Vec<f32>> = (0..2)
                .map(|ci| {
                    (0..11)
                        .map(|n| ((n * 7 + ci * 3) % 5) as f32 - 2.0)
                        .collect()
                })
                .collect();
            let xt = Tensor::from_vec(x.concat(), (1, 2, 11), &Device::Cpu).unwrap();
            let got = c
                .forward(&xt)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let want = naive(&c, &x);
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!((g - w).abs() < 1e-5, "k={k} d={d}: {g} vs {w}");
            }
        }
        assert_eq!(conv(1, 1, 4, 2, 0).same_padding(), (3, 3));
        assert_eq!(conv(1, 1, 2, 1, 0).same_padding(), (0, 1));
    }

    #[test]
    fn attentive_pooling_of_a_constant_signal_is_the_constant_and_zero_std() {
        let c = 2;
        let asp = AttentiveStatsPool {
            tdnn: Tdnn {
                conv: conv(3, 3 * c, 1, 1, 1),
            },
            conv: conv(c, 3, 1, 1, 2),
        };
        let x = Tensor::from_vec(vec![0.5f32; c * 7], (1, c, 7), &Device::Cpu)
            .unwrap()
            .broadcast_mul(&Tensor::from_vec(vec![1f32, -3.0], (1, c, 1), &Device::Cpu).unwrap())
            .unwrap();
        let out = asp
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(out.len(), 2 * c);
        assert!(
            (out[0] - 0.5).abs() < 1e-6 && (out[1] + 1.5).abs() < 1e-6,
            "{out:?}"
        );
        assert!(out[2] < 1e-5 && out[3] < 1e-5, "{out:?}");
    }
}
