//! The files of a Qwen3-TTS model in the official layout, resolved through a [`ModelSource`]
//! (local directory or hub repository) and checked before anything heavy is loaded:
//!
//! ```text
//! config.json                       required; parsed (docs/model.md §2)
//! generation_config.json            optional; sampling defaults with the wrapper's fallbacks
//! tokenizer.json                    optional; else vocab.json + merges.txt + tokenizer_config.json
//! model.safetensors                 or model.safetensors.index.json + its shards
//! speech_tokenizer/config.json      the 12 Hz codec (docs/model.md §9), resolved only when asked for
//! speech_tokenizer/model.safetensors
//! ```
//!
//! Every error names the file and what is wrong with it.

mod checkpoint;
mod generation;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};

pub use checkpoint::{Checkpoint, TensorInfo, SHARD_INDEX, SINGLE_FILE};
pub use generation::GenerationConfig;

use crate::config::Qwen3TtsConfig;
use crate::text::TextTokenizer;
use crate::weights::Weights;
use vc_core::hub::ModelSource;

pub const CONFIG: &str = "config.json";
pub const GENERATION_CONFIG: &str = "generation_config.json";
pub const TOKENIZER_JSON: &str = "tokenizer.json";
pub const VOCAB: &str = "vocab.json";
pub const MERGES: &str = "merges.txt";
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const SPEECH_TOKENIZER_CONFIG: &str = "speech_tokenizer/config.json";
pub const SPEECH_TOKENIZER_WEIGHTS: &str = "speech_tokenizer/model.safetensors";
/// `model_type` of the 12 Hz speech tokenizer; the 25 Hz one is not supported (docs/model.md §0).
const SPEECH_TOKENIZER_TYPE: &str = "qwen3_tts_tokenizer_12hz";

/// Where the text tokenizer of a model comes from (docs/model.md §3.1, §13 Q2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerFiles {
    /// A serialized fast tokenizer; `tokenizer_config.json` adds its added tokens when present
    /// (as transformers does).
    Json {
        tokenizer: PathBuf,
        config: Option<PathBuf>,
    },
    /// The slow-tokenizer files the official repositories ship, converted like `Qwen2Converter`.
    VocabMerges {
        vocab: PathBuf,
        merges: PathBuf,
        config: PathBuf,
    },
}

impl TokenizerFiles {
    /// `tokenizer.json` wins when present (transformers' `PreTrainedTokenizerFast` order);
    /// otherwise all three slow-tokenizer files are required, since without
    /// `tokenizer_config.json` the prompt's `<|im_start|>` would not be a special token.
    pub fn resolve(source: &ModelSource) -> Result<Self> {
        if let Some(tokenizer) = source.optional_file(TOKENIZER_JSON)? {
            let config = source.optional_file(TOKENIZER_CONFIG)?;
            return Ok(TokenizerFiles::Json { tokenizer, config });
        }
        let need = |name: &str| {
            source.file(name).with_context(|| {
                format!(
                    "the text tokenizer needs {VOCAB}, {MERGES} and {TOKENIZER_CONFIG} (or a {TOKENIZER_JSON}); \
                     {name} is missing"
                )
            })
        };
        Ok(TokenizerFiles::VocabMerges {
            vocab: need(VOCAB)?,
            merges: need(MERGES)?,
            config: need(TOKENIZER_CONFIG)?,
        })
    }
}

/// The speech tokenizer (codec) files inside a model directory.
#[derive(Debug, Clone)]
pub struct SpeechTokenizerFiles {
    pub config: PathBuf,
    pub checkpoint: Checkpoint,
}

/// A resolved and checked model directory.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    pub source: ModelSource,
    pub config_path: PathBuf,
    pub config: Qwen3TtsConfig,
    pub generation: GenerationConfig,
    pub tokenizer: TokenizerFiles,
    pub checkpoint: Checkpoint,
    /// What an adapter put on these files changes as the weights load
    /// ([`ModelFiles::with_adapter`], docs/training.md §13).
    pub overlay: Option<std::sync::Arc<super::overlay::WeightOverlay>>,
}

impl ModelFiles {
    /// Resolves (downloading hub files) and checks everything but the speech tokenizer: the
    /// configs parse, the tokenizer files exist, and the checkpoint headers are complete and
    /// agree with `config.json`.
    pub fn resolve(source: &ModelSource) -> Result<Self> {
        let config_path = source.file(CONFIG)?;
        let config = Qwen3TtsConfig::from_file(&config_path)?;
        let generation = match source.optional_file(GENERATION_CONFIG)? {
            Some(path) => GenerationConfig::from_file(&path)?,
            None => GenerationConfig::default(),
        };
        let tokenizer = TokenizerFiles::resolve(source)?;
        let checkpoint = Checkpoint::resolve(source)?;
        checkpoint.check_matches(&config, &config_path)?;
        Ok(ModelFiles {
            source: source.clone(),
            config_path,
            config,
            generation,
            tokenizer,
            checkpoint,
            overlay: None,
        })
    }

    /// Builds the text tokenizer and checks that its ids fit the talker's text embedding.
    pub fn text_tokenizer(&self) -> Result<TextTokenizer> {
        let tokenizer = TextTokenizer::from_files(&self.tokenizer)?;
        check_text_vocab(&tokenizer, &self.config, &self.config_path)?;
        Ok(tokenizer)
    }

    /// Loads the checkpoint tensors whose names pass `keep` (see [`Weights::load`]).
    pub fn load_weights(
        &self,
        dtype: DType,
        device: &Device,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Weights> {
        Weights::load(&self.checkpoint.shards, dtype, device, keep)
    }

    /// Resolves the speech tokenizer (downloading it from the hub on first use) and checks
    /// its config type and checkpoint header.
    pub fn speech_tokenizer(&self) -> Result<SpeechTokenizerFiles> {
        let config = self.source.file(SPEECH_TOKENIZER_CONFIG)?;
        check_model_type(&config, SPEECH_TOKENIZER_TYPE)?;
        let weights = self.source.file(SPEECH_TOKENIZER_WEIGHTS)?;
        Ok(SpeechTokenizerFiles {
            config,
            checkpoint: Checkpoint::open(vec![weights])?,
        })
    }
}

/// Token ids index `talker.model.text_embedding` (docs/model.md §3.3): a tokenizer from another
/// model could produce ids past its end, which would only fail (or silently misbehave)
/// mid-synthesis.
fn check_text_vocab(
    tokenizer: &TextTokenizer,
    config: &Qwen3TtsConfig,
    config_path: &Path,
) -> Result<()> {
    let rows = config.talker_config.text_vocab_size;
    let max = tokenizer.max_token_id() as usize;
    if max >= rows {
        bail!(
            "the tokenizer produces ids up to {max}, but {} has talker_config.text_vocab_size {rows} \
             (is the tokenizer from another model?)",
            config_path.display()
        );
    }
    for (key, id) in [
        ("tts_pad_token_id", config.tts_pad_token_id),
        ("tts_bos_token_id", config.tts_bos_token_id),
        ("tts_eos_token_id", config.tts_eos_token_id),
    ] {
        if id as usize >= rows {
            bail!(
                "{}: {key} {id} is outside the text vocabulary ({rows} rows)",
                config_path.display()
            );
        }
    }
    Ok(())
}

fn check_model_type(path: &Path, expected: &str) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let found = value
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("<missing>");
    if found != expected {
        bail!(
            "{}: model_type {found:?} is not supported (expected {expected:?})",
            path.display()
        );
    }
    Ok(())
}
