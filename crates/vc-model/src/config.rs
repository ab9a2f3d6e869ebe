//! `config.json` of a Qwen3-TTS model directory (docs/model.md §2). The class defaults of the
//! official code differ from the shipped values, so every field the port needs is read from the
//! file; fields the port does not use are ignored.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Qwen3TtsConfig {
    pub model_type: String,
    #[serde(default)]
    pub tokenizer_type: Option<String>,
    #[serde(default)]
    pub tts_model_size: Option<String>,
    /// "base" | "custom_voice" | "voice_design".
    pub tts_model_type: String,
    pub tts_pad_token_id: u32,
    pub tts_bos_token_id: u32,
    pub tts_eos_token_id: u32,
    pub talker_config: TalkerConfig,
    #[serde(default)]
    pub speaker_encoder_config: Option<SpeakerEncoderConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TalkerConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    /// Codec vocabulary: codebook-0 codes plus control ids.
    pub vocab_size: usize,
    pub text_vocab_size: usize,
    pub text_hidden_size: usize,
    pub num_code_groups: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    pub max_position_embeddings: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    pub codec_pad_id: u32,
    pub codec_bos_id: u32,
    pub codec_eos_token_id: u32,
    pub codec_think_id: u32,
    pub codec_nothink_id: u32,
    pub codec_think_bos_id: u32,
    pub codec_think_eos_id: u32,
    #[serde(default)]
    pub codec_language_id: BTreeMap<String, u32>,
    #[serde(default)]
    pub spk_id: BTreeMap<String, u32>,
    #[serde(default)]
    pub spk_is_dialect: BTreeMap<String, serde_json::Value>,
    pub code_predictor_config: CodePredictorConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CodePredictorConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_code_groups: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

/// Speaker encoder (ECAPA-TDNN) settings; absent fields take the official class defaults.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SpeakerEncoderConfig {
    #[serde(default = "default_mel_dim")]
    pub mel_dim: usize,
    pub enc_dim: usize,
    #[serde(default = "default_enc_channels")]
    pub enc_channels: Vec<usize>,
    #[serde(default = "default_enc_kernel_sizes")]
    pub enc_kernel_sizes: Vec<usize>,
    #[serde(default = "default_enc_dilations")]
    pub enc_dilations: Vec<usize>,
    #[serde(default = "default_attention_channels")]
    pub enc_attention_channels: usize,
    #[serde(default = "default_res2net_scale")]
    pub enc_res2net_scale: usize,
    #[serde(default = "default_se_channels")]
    pub enc_se_channels: usize,
    #[serde(default = "default_sample_rate")]
    pub sample_rate: u32,
}

fn default_act() -> String {
    "silu".into()
}
fn default_mel_dim() -> usize {
    128
}
fn default_enc_channels() -> Vec<usize> {
    vec![512, 512, 512, 512, 1536]
}
fn default_enc_kernel_sizes() -> Vec<usize> {
    vec![5, 3, 3, 3, 1]
}
fn default_enc_dilations() -> Vec<usize> {
    vec![1, 2, 3, 4, 1]
}
fn default_attention_channels() -> usize {
    128
}
fn default_res2net_scale() -> usize {
    8
}
fn default_se_channels() -> usize {
    128
}
fn default_sample_rate() -> u32 {
    24000
}

impl Qwen3TtsConfig {
    /// Reads and checks `config.json`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self = read_json_config(path, "qwen3_tts", "a Qwen3-TTS 12 Hz checkpoint")?;
        config
            .validate()
            .with_context(|| format!("{}: inconsistent config", path.display()))?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        let t = &self.talker_config;
        match self.tts_model_type.as_str() {
            "base" | "custom_voice" | "voice_design" => {}
            other => {
                bail!("tts_model_type {other:?} is not one of base, custom_voice, voice_design")
            }
        }
        if !t
            .num_attention_heads
            .is_multiple_of(t.num_key_value_heads.max(1))
        {
            bail!("talker_config: num_attention_heads must be a multiple of num_key_value_heads");
        }
        let cp = &t.code_predictor_config;
        if !cp
            .num_attention_heads
            .is_multiple_of(cp.num_key_value_heads.max(1))
        {
            bail!("code_predictor_config: num_attention_heads must be a multiple of num_key_value_heads");
        }
        if t.num_code_groups != cp.num_code_groups {
            bail!(
                "talker_config.num_code_groups differs from code_predictor_config.num_code_groups"
            );
        }
        if let Some(se) = &self.speaker_encoder_config {
            if se.enc_dim != t.hidden_size {
                bail!(
                    "speaker_encoder_config.enc_dim ({}) must equal talker_config.hidden_size ({})",
                    se.enc_dim,
                    t.hidden_size
                );
            }
        }
        Ok(())
    }

    /// True when the code predictor projects talker-width inputs down to its own width
    /// (`small_to_mtp_projection`, the 1.7B layout).
    pub fn has_mtp_projection(&self) -> bool {
        self.talker_config.hidden_size != self.talker_config.code_predictor_config.hidden_size
    }
}

/// Reads a JSON config whose `model_type` must be `expected` (`what` says what that is, for the
/// error) and deserialises it; every error names the file.
pub(crate) fn read_json_config<T: serde::de::DeserializeOwned>(
    path: &Path,
    expected: &str,
    what: &str,
) -> Result<T> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let raw: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let model_type = raw
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("<missing>");
    if model_type != expected {
        bail!(
            "{}: model_type {model_type:?} is not supported (expected {expected:?}, {what})",
            path.display()
        );
    }
    serde_json::from_value(raw)
        .with_context(|| format!("{}: not a valid {what} config", path.display()))
}
