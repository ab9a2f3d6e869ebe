//! The 12 Hz speech tokenizer `Qwen3-TTS-Tokenizer-12Hz` (docs/model.md §9): 24 kHz audio ↔ frames
//! of 16 codes at 12.5 Hz (1920 samples per frame; code 0 = semantic codebook).
//!
//! Every size comes from `speech_tokenizer/config.json` ([`config`]). Runs on the CPU in f32 with
//! its own kernels (in [`vc_kernels`]): convolutions as GEMMs over strided views of
//! channels-last activations, tiled over time with the preceding activation fused in
//! ([`vc_kernels::conv`]);
//! the encoder's residual units' k7 convs as Winograd F(2,7) ([`vc_kernels::winograd`];
//! `VOICECLONE_CODEC_WINOGRAD=0` for direct convolution, `4` for F(4,7): faster, ~3× the
//! rounding error, see [`winograd_outputs`]; the decoder convolves directly, so that streamed
//! decoding equals it bit for bit, docs/model.md §9.5); vectorised ELU / SnakeBeta / GELU
//! ([`vc_kernels::act`]).
//! Both directions use all cores (`RAYON_NUM_THREADS` caps them). Parity with the official
//! code: `tests/it/codec_parity.rs`; speed: `scripts/bench/codec.sh`.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use vc_core::hub::ModelSource;
//! use vc_model::codec::Codec;
//! let codec = Codec::load(&ModelSource::parse("Qwen/Qwen3-TTS-12Hz-0.6B-Base")?)?;
//! let wav = vc_audio::load_mono(std::path::Path::new("ref.wav"), codec.sample_rate())?;
//! let codes = codec.encode(&wav)?; // ceil(len / 1920) frames × 16 codes
//! let audio = codec.decode(&codes)?; // frames × 1920 samples, in [−1, 1]
//! # Ok(()) }
//! ```

mod config;
mod decoder;
mod encoder;
pub mod quantizer;
pub mod transformer;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Device};

pub use config::CodecConfig;
pub use decoder::{Decoder, DecoderTrace, StreamDecoder};
pub use encoder::{Encoder, EncoderTrace};

use crate::files::SpeechTokenizerFiles;
use crate::weights::Weights;
use vc_core::hub::ModelSource;

/// Codes of one utterance: one row per frame, one code per codebook (`num_quantizers` wide).
pub type Codes = Vec<Vec<u32>>;

/// The codec: encoder and decoder of one `speech_tokenizer` checkpoint.
#[derive(Debug, Clone)]
pub struct Codec {
    config: CodecConfig,
    encoder: Encoder,
    decoder: Decoder,
}

/// Outputs per Winograd tile for the encoder's residual units' first conv: `VOICECLONE_CODEC_WINOGRAD`
/// (0 = direct GEMM convolution), default 2 (F(2,7): 4 instead of 7 GEMM products per output).
pub fn winograd_outputs() -> usize {
    std::env::var("VOICECLONE_CODEC_WINOGRAD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

impl Codec {
    /// From a model: a Qwen3-TTS model (its `speech_tokenizer/`) or a standalone tokenizer
    /// (`Qwen/Qwen3-TTS-Tokenizer-12Hz`: `config.json` + `model.safetensors` at the root), local
    /// or on the hub.
    pub fn load(source: &ModelSource) -> Result<Self> {
        let (config, weights) = match source.optional_file("speech_tokenizer/config.json")? {
            Some(config) => (config, source.file("speech_tokenizer/model.safetensors")?),
            None => {
                // Offline, "neither" may only mean "not cached" (`none_of` says which).
                let Some(config) = source.optional_file("config.json")? else {
                    return Err(source.none_of(&["speech_tokenizer/config.json", "config.json"]));
                };
                (config, source.file("model.safetensors")?)
            }
        };
        Self::from_paths(&config, &[weights])
    }

    /// From the speech tokenizer files of a resolved model directory.
    pub fn from_files(files: &SpeechTokenizerFiles) -> Result<Self> {
        Self::from_paths(&files.config, &files.checkpoint.shards)
    }

    /// From a directory holding `config.json` and `model.safetensors` (either layout above).
    pub fn load_dir(dir: &Path) -> Result<Self> {
        Self::load(&ModelSource::Local(dir.to_path_buf()))
    }

    /// From a config file and its safetensors file(s).
    pub fn from_paths(config_path: &Path, weights: &[PathBuf]) -> Result<Self> {
        let config = CodecConfig::from_file(config_path)?;
        let w = Weights::load(weights, DType::F32, &Device::Cpu, |name| {
            name.starts_with("encoder.") || name.starts_with("decoder.")
        })?;
        let encoder = Encoder::load(&w, &config)
            .with_context(|| format!("speech tokenizer encoder ({})", config_path.display()))?;
        let decoder = Decoder::load(&w, &config)
            .with_context(|| format!("speech tokenizer decoder ({})", config_path.display()))?;
        Ok(Codec {
            config,
            encoder,
            decoder,
        })
    }

    pub fn config(&self) -> &CodecConfig {
        &self.config
    }

    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// Input rate of [`Codec::encode`] (24 kHz).
    pub fn sample_rate(&self) -> u32 {
        self.config.input_sample_rate
    }

    /// Rate of [`Codec::decode`]'s output (24 kHz).
    pub fn output_sample_rate(&self) -> u32 {
        self.config.output_sample_rate
    }

    /// Input samples per code frame (1920).
    pub fn samples_per_frame(&self) -> usize {
        self.config.encode_downsample_rate
    }

    /// Codes per frame (16).
    pub fn num_quantizers(&self) -> usize {
        self.config.encoder_valid_num_quantizers
    }

    /// Frames [`Codec::encode`] returns for `samples` input samples: `ceil(samples / 1920)`.
    pub fn frames_for(&self, samples: usize) -> usize {
        samples.div_ceil(self.samples_per_frame())
    }

    /// Codes of a mono waveform at [`Codec::sample_rate`] (raw samples, no normalisation, as the
    /// official wrapper): `ceil(len / 1920)` frames × `num_quantizers` codes. Empty input gives
    /// no frames.
    pub fn encode(&self, wav: &[f32]) -> Result<Codes> {
        if wav.is_empty() {
            return Ok(Vec::new());
        }
        let mut codes = self.encoder.encode_trace(wav)?.codes;
        codes.truncate(self.frames_for(wav.len()));
        Ok(codes)
    }

    /// Codes of several waveforms; every item gets exactly the codes [`Codec::encode`] gives it
    /// alone (items do not influence each other).
    pub fn encode_batch(&self, wavs: &[&[f32]]) -> Result<Vec<Codes>> {
        wavs.iter().map(|w| self.encode(w)).collect()
    }

    /// The official batched wrapper's codes: every waveform right-padded with zeros to the
    /// longest one, encoded, and cut to `ceil(len / 1920)` frames. The last frame of a shorter
    /// item can differ from [`Codec::encode`]'s (its convolutions see the encoder's response to
    /// the padding instead of their own zero/replicate padding), so results depend on the batch;
    /// use this only to reproduce codes made by the official batched `encode`.
    pub fn encode_batch_padded(&self, wavs: &[&[f32]]) -> Result<Vec<Codes>> {
        let longest = wavs.iter().map(|w| w.len()).max().unwrap_or(0);
        wavs.iter()
            .map(|w| {
                if w.is_empty() {
                    return Ok(Vec::new());
                }
                let mut padded = w.to_vec();
                padded.resize(longest, 0.0);
                let mut codes = self.encoder.encode_trace(&padded)?.codes;
                codes.truncate(self.frames_for(w.len()));
                Ok(codes)
            })
            .collect()
    }

    /// Waveform of `codes` (frames of `num_quantizers` codes, each below the codebook size):
    /// `frames × 1920` samples at [`Codec::output_sample_rate`], clamped to [−1, 1]. Decodes in
    /// 300-frame chunks with 25 frames of left context, like the official decoder.
    pub fn decode<R: AsRef<[u32]>>(&self, codes: &[R]) -> Result<Vec<f32>> {
        self.decoder.check_codes(codes)?;
        if codes.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<&[u32]> = codes.iter().map(|r| r.as_ref()).collect();
        self.decoder.decode(&rows)
    }
}
