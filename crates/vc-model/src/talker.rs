//! The talker (docs/model.md §3.3, §4): text embedding + projection, codec embedding, a 28-layer
//! Qwen3 decoder over `inputs_embeds`, `codec_head` for code-0, and the code predictor
//! (docs/model.md §5) it owns.

use candle_core::{Result, Tensor, D};

use super::code_predictor::{CodePredictor, SubCodePicker};
use super::config::{Qwen3TtsConfig, TalkerConfig};
use super::layers::{DecoderCache, DecoderStack, DecoderStackConfig, TensorSource};
use super::ops::{embedding, linear, Numerics};
use super::weights::Weights;

/// Checkpoint prefix of the talker.
pub const PREFIX: &str = "talker";

/// `Qwen3TTSTalkerResizeMLP` with biases: `fc2(silu(fc1(x)))` (docs/model.md §3.3).
#[derive(Debug, Clone)]
pub struct TextProjection {
    pub fc1_weight: Tensor,
    pub fc1_bias: Tensor,
    pub fc2_weight: Tensor,
    pub fc2_bias: Tensor,
    pub numerics: Numerics,
}

impl TextProjection {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.numerics;
        let h = linear(x, &self.fc1_weight, Some(&self.fc1_bias), n)?.silu()?;
        linear(&h, &self.fc2_weight, Some(&self.fc2_bias), n)
    }
}

#[derive(Debug, Clone)]
pub struct Talker {
    /// `model.text_embedding` `(text_vocab, text_hidden)`.
    pub text_embedding: Tensor,
    pub text_projection: TextProjection,
    /// `model.codec_embedding` `(codec_vocab, hidden)`.
    pub codec_embedding: Tensor,
    pub decoder: DecoderStack,
    /// `codec_head` `(codec_vocab, hidden)`, no bias.
    pub codec_head: Tensor,
    pub code_predictor: CodePredictor,
    cfg: TalkerConfig,
}

impl Talker {
    /// Builds the talker and its code predictor from a loaded checkpoint.
    pub fn load(
        weights: &Weights,
        cfg: &Qwen3TtsConfig,
        numerics: Numerics,
    ) -> anyhow::Result<Self> {
        Self::from_source(weights, cfg, numerics)
    }

    /// Builds from any tensor source (a checkpoint, or the trainer's parameter store). The
    /// tensors must suit `numerics` (see [`Numerics::check`]).
    pub fn from_source(
        src: &dyn TensorSource,
        cfg: &Qwen3TtsConfig,
        numerics: Numerics,
    ) -> anyhow::Result<Self> {
        let t = &cfg.talker_config;
        let (h, th) = (t.hidden_size, t.text_hidden_size);
        let get = |name: &str, shape: &[usize]| src.tensor(&format!("{PREFIX}.{name}"), shape);
        let text_projection = TextProjection {
            fc1_weight: get("text_projection.linear_fc1.weight", &[th, th])?,
            fc1_bias: get("text_projection.linear_fc1.bias", &[th])?,
            fc2_weight: get("text_projection.linear_fc2.weight", &[h, th])?,
            fc2_bias: get("text_projection.linear_fc2.bias", &[h])?,
            numerics,
        };
        let fc1 = &text_projection.fc1_bias;
        numerics.check(fc1.device(), fc1.dtype())?;
        Ok(Self {
            text_embedding: get("model.text_embedding.weight", &[t.text_vocab_size, th])?,
            text_projection,
            codec_embedding: get("model.codec_embedding.weight", &[t.vocab_size, h])?,
            decoder: DecoderStack::load(
                src,
                &format!("{PREFIX}.model"),
                DecoderStackConfig::talker(t)?,
                numerics,
            )?,
            codec_head: get("codec_head.weight", &[t.vocab_size, h])?,
            code_predictor: CodePredictor::load(src, cfg, numerics)?,
            cfg: t.clone(),
        })
    }

    pub fn config(&self) -> &TalkerConfig {
        &self.cfg
    }

    pub fn numerics(&self) -> Numerics {
        self.decoder.numerics()
    }

    /// `text_projection(text_embedding(ids))` (docs/model.md §3.3): `ids` of any shape -> `(...,
    /// hidden)`.
    pub fn text_embed(&self, ids: &Tensor) -> Result<Tensor> {
        // The table may be stored narrower than the activations (f16 inference weights).
        let rows = embedding(&self.text_embedding, ids)?;
        self.text_projection
            .forward(&rows.to_dtype(self.text_projection.fc1_bias.dtype())?)
    }

    /// `codec_embedding(ids)`: `ids` of any shape -> `(..., hidden)`.
    pub fn codec_embed(&self, ids: &Tensor) -> Result<Tensor> {
        embedding(&self.codec_embedding, ids)
    }

    /// Embedding of whole frames `(..., 16)` (docs/model.md §5.4): `codec_embedding(c0) +
    /// Σ_{i=1..15} code_predictor.codec_embedding[i-1](c_i)`.
    pub fn frame_embed(&self, codes: &Tensor) -> Result<Tensor> {
        let last = codes.rank().saturating_sub(1);
        let c0 = codes.narrow(last, 0, 1)?.squeeze(last)?;
        self.codec_embed(&c0)? + self.code_predictor.embed_sub_codes(codes)?
    }

    /// A KV cache for incremental decoding with room for `initial_capacity` positions.
    pub fn new_cache(&self, initial_capacity: usize) -> DecoderCache {
        self.decoder.new_cache(initial_capacity)
    }

    /// Final-norm hidden states `(B, S, H)` for `inputs_embeds` `(B, S, H)`. `attention_mask`
    /// `(B, S)` (1 = real, 0 = left padding) covers the new tokens only; the cache remembers
    /// earlier padding and each row's next position (docs/model.md §4.1, §14).
    pub fn forward(
        &self,
        inputs_embeds: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut DecoderCache>,
    ) -> Result<Tensor> {
        self.decoder.forward(inputs_embeds, attention_mask, cache)
    }

    /// `codec_head(hidden)`: code-0 logits `(..., codec_vocab)` in the activation dtype.
    pub fn codec_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        linear(hidden, &self.codec_head, None, self.numerics())
    }

    /// Teacher-forced code-predictor logits `(N, 15, 2048)` for frames `codes` `(N, 16)` given the
    /// talker hidden states `(N, H)` that predicted their code-0 (docs/model.md §5, §10.3).
    pub fn sub_code_logits(&self, hidden: &Tensor, codes: &Tensor) -> Result<Tensor> {
        let c0 = codes.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
        self.code_predictor
            .teacher_forced_logits(hidden, &self.codec_embed(&c0)?, codes)
    }

    /// [`Self::sub_code_logits`] codebook-major: `(15, N, 2048)`.
    pub fn sub_code_logits_by_codebook(&self, hidden: &Tensor, codes: &Tensor) -> Result<Tensor> {
        let c0 = codes.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
        self.code_predictor.teacher_forced_logits_by_codebook(
            hidden,
            &self.codec_embed(&c0)?,
            codes,
        )
    }

    /// Generates codebooks 1..15 for code-0 ids `c0` `(B,)` and the hidden states `(B, H)` that
    /// produced them (docs/model.md §5.2); returns `(B, 15)` u32. `cache` comes from
    /// `code_predictor.new_cache()` and is reset here.
    pub fn predict_sub_codes(
        &self,
        hidden: &Tensor,
        c0: &Tensor,
        cache: &mut DecoderCache,
        pick: impl SubCodePicker,
    ) -> Result<Tensor> {
        self.code_predictor
            .generate(hidden, &self.codec_embed(c0)?, cache, pick)
    }
}
