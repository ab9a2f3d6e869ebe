//! `speech_tokenizer/config.json` of the 12 Hz codec (docs/model.md §2, §9). Missing fields take
//! the defaults of the official config classes (`MimiConfig` for the encoder,
//! `Qwen3TTSTokenizerV2DecoderConfig` for the decoder), exactly as the official loader fills
//! them in; the shipped file has every field the port reads.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;

use crate::config::read_json_config;

/// `model_type` of the 12 Hz speech tokenizer.
pub const MODEL_TYPE: &str = "qwen3_tts_tokenizer_12hz";

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct CodecConfig {
    pub model_type: String,
    pub encoder_config: EncoderConfig,
    pub decoder_config: DecoderConfig,
    #[serde(default = "d_16")]
    pub encoder_valid_num_quantizers: usize,
    #[serde(default = "d_24000")]
    pub input_sample_rate: u32,
    #[serde(default = "d_24000")]
    pub output_sample_rate: u32,
    #[serde(default = "d_1920")]
    pub encode_downsample_rate: usize,
    #[serde(default = "d_1920")]
    pub decode_upsample_rate: usize,
}

/// The encoder's `MimiConfig` (transformers 4.57.3 defaults).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct EncoderConfig {
    #[serde(default = "d_24000")]
    pub sampling_rate: u32,
    /// Written as `frame_rate` by `save_pretrained` of older versions and as `_frame_rate` by
    /// newer ones; absent means "derived from the strides" ([`EncoderConfig::frame_rate`]).
    #[serde(default)]
    pub frame_rate: Option<f64>,
    #[serde(default, rename = "_frame_rate")]
    pub frame_rate_private: Option<f64>,
    #[serde(default = "d_1")]
    pub audio_channels: usize,
    #[serde(default = "d_512")]
    pub hidden_size: usize,
    #[serde(default = "d_64")]
    pub num_filters: usize,
    #[serde(default = "d_1")]
    pub num_residual_layers: usize,
    #[serde(default = "d_ratios_enc")]
    pub upsampling_ratios: Vec<usize>,
    #[serde(default = "d_7")]
    pub kernel_size: usize,
    #[serde(default = "d_3")]
    pub last_kernel_size: usize,
    #[serde(default = "d_3")]
    pub residual_kernel_size: usize,
    #[serde(default = "d_2")]
    pub dilation_growth_rate: usize,
    #[serde(default = "d_true")]
    pub use_causal_conv: bool,
    #[serde(default = "d_constant")]
    pub pad_mode: String,
    #[serde(default = "d_2")]
    pub compress: usize,
    #[serde(default = "d_2048")]
    pub codebook_size: usize,
    #[serde(default = "d_256")]
    pub codebook_dim: usize,
    #[serde(default = "d_32")]
    pub num_quantizers: usize,
    #[serde(default)]
    pub use_conv_shortcut: bool,
    #[serde(default = "d_256")]
    pub vector_quantization_hidden_dimension: usize,
    #[serde(default = "d_1")]
    pub num_semantic_quantizers: usize,
    #[serde(default = "d_8")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_2048")]
    pub intermediate_size: usize,
    #[serde(default = "d_8")]
    pub num_attention_heads: usize,
    #[serde(default = "d_8")]
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "d_gelu")]
    pub hidden_act: String,
    #[serde(default = "d_1e5")]
    pub norm_eps: f64,
    #[serde(default = "d_1e4")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "d_250")]
    pub sliding_window: usize,
    #[serde(default)]
    pub attention_bias: bool,
}

/// `Qwen3TTSTokenizerV2DecoderConfig` (defaults of the official class).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct DecoderConfig {
    #[serde(default = "d_2048")]
    pub codebook_size: usize,
    /// Not an `__init__` parameter of the official class: the official model fails without it.
    pub codebook_dim: usize,
    #[serde(default = "d_1024")]
    pub hidden_size: usize,
    #[serde(default = "d_1024")]
    pub latent_dim: usize,
    #[serde(default = "d_1e4")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "d_16")]
    pub num_attention_heads: usize,
    #[serde(default = "d_16")]
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "d_72")]
    pub sliding_window: usize,
    #[serde(default = "d_3072")]
    pub intermediate_size: usize,
    #[serde(default = "d_silu")]
    pub hidden_act: String,
    #[serde(default = "d_1e5")]
    pub rms_norm_eps: f64,
    #[serde(default = "d_8")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_16")]
    pub num_quantizers: usize,
    #[serde(default = "d_ratios_dec")]
    pub upsample_rates: Vec<usize>,
    #[serde(default = "d_ratios_up")]
    pub upsampling_ratios: Vec<usize>,
    #[serde(default = "d_1536")]
    pub decoder_dim: usize,
}

impl CodecConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self =
            read_json_config(path, MODEL_TYPE, "a Qwen3-TTS 12 Hz speech tokenizer")?;
        config
            .validate()
            .with_context(|| format!("{}: unsupported speech tokenizer config", path.display()))?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.model_type == MODEL_TYPE,
            "model_type {:?} is not supported (expected {MODEL_TYPE:?})",
            self.model_type
        );
        let e = &self.encoder_config;
        let d = &self.decoder_config;
        ensure!(
            e.audio_channels == 1,
            "encoder_config.audio_channels must be 1"
        );
        ensure!(
            e.use_causal_conv,
            "encoder_config.use_causal_conv=false is not supported"
        );
        ensure!(
            e.pad_mode == "constant" || e.pad_mode == "replicate",
            "encoder_config.pad_mode {:?} is not supported",
            e.pad_mode
        );
        ensure!(
            !e.use_conv_shortcut,
            "encoder_config.use_conv_shortcut=true is not supported"
        );
        ensure!(
            matches!(e.hidden_act.as_str(), "gelu"),
            "encoder_config.hidden_act {:?} is not supported",
            e.hidden_act
        );
        ensure!(
            !e.attention_bias && !d.attention_bias,
            "attention_bias=true is not supported"
        );
        for (name, scaling) in [
            ("encoder_config", &e.rope_scaling),
            ("decoder_config", &d.rope_scaling),
        ] {
            if let Some(s) = scaling {
                let kind = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(|v| v.as_str());
                if !(s.is_null() || kind == Some("default")) {
                    bail!("{name}.rope_scaling {s} is not supported");
                }
            }
        }
        ensure!(
            e.num_attention_heads.is_multiple_of(e.num_key_value_heads)
                && d.num_attention_heads.is_multiple_of(d.num_key_value_heads),
            "num_attention_heads must be a multiple of num_key_value_heads"
        );
        ensure!(
            e.num_semantic_quantizers < e.num_quantizers,
            "encoder_config.num_semantic_quantizers must be below num_quantizers"
        );
        ensure!(
            self.encoder_valid_num_quantizers <= e.num_quantizers
                && self.encoder_valid_num_quantizers > e.num_semantic_quantizers,
            "encoder_valid_num_quantizers {} must be in ({}, {}]",
            self.encoder_valid_num_quantizers,
            e.num_semantic_quantizers,
            e.num_quantizers
        );
        ensure!(
            d.num_quantizers == self.encoder_valid_num_quantizers,
            "decoder_config.num_quantizers {} differs from encoder_valid_num_quantizers {}",
            d.num_quantizers,
            self.encoder_valid_num_quantizers
        );
        ensure!(
            d.num_quantizers > 1,
            "decoder_config.num_quantizers must be > 1"
        );
        ensure!(
            d.codebook_dim.is_multiple_of(2),
            "decoder_config.codebook_dim must be even"
        );
        ensure!(
            matches!(d.hidden_act.as_str(), "silu"),
            "decoder_config.hidden_act {:?} is not supported",
            d.hidden_act
        );
        ensure!(
            d.upsample_rates.iter().all(|&r| r > 0) && d.upsampling_ratios.iter().all(|&r| r > 0),
            "decoder upsampling rates must be positive"
        );
        let levels = d.upsample_rates.len() as u32;
        ensure!(
            d.decoder_dim.is_multiple_of(1usize << levels),
            "decoder_config.decoder_dim {} is not divisible by 2^{levels}",
            d.decoder_dim
        );
        let up: usize = d
            .upsample_rates
            .iter()
            .chain(&d.upsampling_ratios)
            .product();
        ensure!(
            up == self.decode_upsample_rate,
            "the decoder upsamples by {up} but decode_upsample_rate is {}",
            self.decode_upsample_rate
        );
        let down = e.hop_length() * e.downsample_stride();
        ensure!(
            down == self.encode_downsample_rate,
            "the encoder downsamples by {down} but encode_downsample_rate is {}",
            self.encode_downsample_rate
        );
        ensure!(
            self.input_sample_rate == e.sampling_rate,
            "input_sample_rate {} differs from encoder_config.sampling_rate {}",
            self.input_sample_rate,
            e.sampling_rate
        );
        Ok(())
    }
}

impl EncoderConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Product of the SEANet strides.
    pub fn hop_length(&self) -> usize {
        self.upsampling_ratios.iter().product()
    }

    /// `MimiConfig.encodec_frame_rate`: the SEANet output rate.
    pub fn encodec_frame_rate(&self) -> f64 {
        (self.sampling_rate as f64 / self.hop_length() as f64).ceil()
    }

    /// `MimiConfig.frame_rate`: the configured value or, when absent, derived from the strides
    /// (which include the downsample's stride 2).
    pub fn frame_rate(&self) -> f64 {
        self.frame_rate_private
            .or(self.frame_rate)
            .unwrap_or_else(|| self.sampling_rate as f64 / (self.hop_length() * 2) as f64)
    }

    /// `MimiModel` builds its downsample conv only when the frame rates differ.
    pub fn has_downsample(&self) -> bool {
        self.frame_rate() != self.encodec_frame_rate()
    }

    /// Kernel of the downsample conv: `2 * int(encodec_frame_rate / frame_rate)`.
    pub fn downsample_kernel(&self) -> usize {
        2 * (self.encodec_frame_rate() / self.frame_rate()) as usize
    }

    pub fn downsample_stride(&self) -> usize {
        if self.has_downsample() {
            2
        } else {
            1
        }
    }
}

impl DecoderConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Channels of the residual VQ inside the decoder's quantizer (`codebook_dim // 2`).
    pub fn vq_dim(&self) -> usize {
        self.codebook_dim / 2
    }
}

fn d_true() -> bool {
    true
}
fn d_1() -> usize {
    1
}
fn d_2() -> usize {
    2
}
fn d_3() -> usize {
    3
}
fn d_7() -> usize {
    7
}
fn d_8() -> usize {
    8
}
fn d_16() -> usize {
    16
}
fn d_32() -> usize {
    32
}
fn d_64() -> usize {
    64
}
fn d_72() -> usize {
    72
}
fn d_250() -> usize {
    250
}
fn d_256() -> usize {
    256
}
fn d_512() -> usize {
    512
}
fn d_1024() -> usize {
    1024
}
fn d_1536() -> usize {
    1536
}
fn d_1920() -> usize {
    1920
}
fn d_2048() -> usize {
    2048
}
fn d_3072() -> usize {
    3072
}
fn d_24000() -> u32 {
    24000
}
fn d_1e5() -> f64 {
    1e-5
}
fn d_1e4() -> f64 {
    1e4
}
fn d_gelu() -> String {
    "gelu".into()
}
fn d_silu() -> String {
    "silu".into()
}
fn d_constant() -> String {
    "constant".into()
}
fn d_ratios_enc() -> Vec<usize> {
    vec![8, 6, 5, 4]
}
fn d_ratios_dec() -> Vec<usize> {
    vec![8, 5, 4, 3]
}
fn d_ratios_up() -> Vec<usize> {
    vec![2, 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped() -> serde_json::Value {
        // docs/model.md §2 values
        serde_json::json!({
            "model_type": "qwen3_tts_tokenizer_12hz",
            "encoder_valid_num_quantizers": 16,
            "input_sample_rate": 24000, "output_sample_rate": 24000,
            "encode_downsample_rate": 1920, "decode_upsample_rate": 1920,
            "encoder_config": {
                "audio_channels": 1, "num_filters": 64, "kernel_size": 7, "residual_kernel_size": 3,
                "last_kernel_size": 3, "num_residual_layers": 1, "dilation_growth_rate": 2,
                "compress": 2, "upsampling_ratios": [8, 6, 5, 4], "hidden_size": 512,
                "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
                "head_dim": 64, "intermediate_size": 2048, "hidden_act": "gelu", "norm_eps": 1e-5,
                "layer_scale_initial_scale": 0.01, "rope_theta": 10000, "max_position_embeddings": 8000,
                "sliding_window": 250, "num_quantizers": 32, "num_semantic_quantizers": 1,
                "codebook_size": 2048, "codebook_dim": 256, "vector_quantization_hidden_dimension": 256,
                "pad_mode": "constant", "use_causal_conv": true, "use_conv_shortcut": false,
                "_frame_rate": 12.5
            },
            "decoder_config": {
                "codebook_size": 2048, "codebook_dim": 512, "latent_dim": 1024, "decoder_dim": 1536,
                "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 16,
                "num_key_value_heads": 16, "head_dim": 64, "num_hidden_layers": 8, "rms_norm_eps": 1e-5,
                "rope_theta": 10000, "max_position_embeddings": 8000, "sliding_window": 72,
                "layer_scale_initial_scale": 0.01, "num_quantizers": 16, "num_semantic_quantizers": 1,
                "semantic_codebook_size": 4096, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
                "vector_quantization_hidden_dimension": 512, "hidden_act": "silu", "attention_bias": false
            }
        })
    }

    #[test]
    fn shipped_config_geometry() {
        let c: CodecConfig = serde_json::from_value(shipped()).unwrap();
        c.validate().unwrap();
        let e = &c.encoder_config;
        assert_eq!(e.hop_length(), 960);
        assert_eq!(e.encodec_frame_rate(), 25.0);
        assert_eq!(e.frame_rate(), 12.5);
        assert!(e.has_downsample());
        assert_eq!(e.downsample_kernel(), 4);
        assert_eq!(c.decoder_config.vq_dim(), 256);
        assert_eq!(c.decoder_config.head_dim(), 64);
    }

    #[test]
    fn frame_rate_derived_when_absent() {
        let mut v = shipped();
        v["encoder_config"]
            .as_object_mut()
            .unwrap()
            .remove("_frame_rate");
        let c: CodecConfig = serde_json::from_value(v).unwrap();
        assert_eq!(c.encoder_config.frame_rate(), 12.5);
        c.validate().unwrap();
    }

    #[test]
    fn inconsistent_rates_are_rejected() {
        let mut v = shipped();
        v["decode_upsample_rate"] = serde_json::json!(960);
        let c: CodecConfig = serde_json::from_value(v).unwrap();
        let err = format!("{:#}", c.validate().unwrap_err());
        assert!(err.contains("decode_upsample_rate"), "{err}");
        let mut v = shipped();
        v["model_type"] = serde_json::json!("qwen3_tts_tokenizer_25hz");
        let c: CodecConfig = serde_json::from_value(v).unwrap();
        assert!(c.validate().is_err());
    }
}
