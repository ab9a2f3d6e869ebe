//! The code predictor ("sub-talker", docs/model.md §5): a 5-layer Qwen3 decoder that turns the
//! talker's hidden state and code-0 into codebooks 1..15 of a frame.

use anyhow::bail;
use candle_core::{DType, Result, Tensor, D};

use super::autograd_ops;
use super::config::Qwen3TtsConfig;
use super::layers::{DecoderCache, DecoderStack, DecoderStackConfig, TensorSource};
use super::ops::{embedding, linear, Numerics};

/// Checkpoint prefix of the code predictor.
pub const PREFIX: &str = "talker.code_predictor";

/// Picks the next sub-code of every row: called with the codebook index `j` (1..=15, the
/// codebook being predicted) and its f32 logits `(B, vocab)`; returns `(B,)` u32 codes.
/// [`greedy`] is one; sampling strategies plug in here.
pub trait SubCodePicker: FnMut(usize, &Tensor) -> Result<Tensor> {}
impl<F: FnMut(usize, &Tensor) -> Result<Tensor>> SubCodePicker for F {}

/// Greedy pick: the arg-max of each row.
pub fn greedy(_codebook: usize, logits: &Tensor) -> Result<Tensor> {
    logits.argmax(D::Minus1)
}

#[derive(Debug, Clone)]
pub struct CodePredictor {
    pub decoder: DecoderStack,
    /// `model.codec_embedding.{i}` for codebook i+1 (i = 0..G-2), `(vocab, talker_hidden)`.
    pub codec_embedding: Vec<Tensor>,
    /// `lm_head.{j}` predicting codebook j+1, `(vocab, hidden)`.
    pub lm_head: Vec<Tensor>,
    /// `small_to_mtp_projection` (weight, bias): talker width -> predictor width; `None` (the
    /// official `Identity`) when both widths agree (0.6B).
    pub projection: Option<(Tensor, Tensor)>,
    num_code_groups: usize,
}

impl CodePredictor {
    pub fn load(
        src: &dyn TensorSource,
        cfg: &Qwen3TtsConfig,
        numerics: Numerics,
    ) -> anyhow::Result<Self> {
        Self::load_parts(src, cfg, numerics, true)
    }

    /// [`Self::load`], without the input embedding tables when `with_embeddings` is false: a
    /// sharded training step computes the predictor's inputs in its embedding unit and gives
    /// them to [`Self::logits_from_inputs`] (docs/training.md §5.1).
    pub fn load_parts(
        src: &dyn TensorSource,
        cfg: &Qwen3TtsConfig,
        numerics: Numerics,
        with_embeddings: bool,
    ) -> anyhow::Result<Self> {
        let t = &cfg.talker_config;
        let c = &t.code_predictor_config;
        if c.num_code_groups < 2 {
            bail!("code_predictor_config.num_code_groups must be at least 2");
        }
        let n = c.num_code_groups - 1;
        let decoder = DecoderStack::load(
            src,
            &format!("{PREFIX}.model"),
            DecoderStackConfig::code_predictor(c)?,
            numerics,
        )?;
        let codec_embedding = (0..if with_embeddings { n } else { 0 })
            .map(|i| {
                src.tensor(
                    &format!("{PREFIX}.model.codec_embedding.{i}.weight"),
                    &[c.vocab_size, t.hidden_size],
                )
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let lm_head = (0..n)
            .map(|j| {
                src.tensor(
                    &format!("{PREFIX}.lm_head.{j}.weight"),
                    &[c.vocab_size, c.hidden_size],
                )
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let projection = if cfg.has_mtp_projection() {
            let p = format!("{PREFIX}.small_to_mtp_projection");
            Some((
                src.tensor(&format!("{p}.weight"), &[c.hidden_size, t.hidden_size])?,
                src.tensor(&format!("{p}.bias"), &[c.hidden_size])?,
            ))
        } else {
            None
        };
        Ok(Self {
            decoder,
            codec_embedding,
            lm_head,
            projection,
            num_code_groups: c.num_code_groups,
        })
    }

    /// Codebooks per frame (16), including code-0.
    pub fn num_code_groups(&self) -> usize {
        self.num_code_groups
    }

    /// A cache for [`Self::generate`], sized for one frame; reuse it across frames.
    pub fn new_cache(&self) -> DecoderCache {
        self.decoder.new_cache(self.num_code_groups)
    }

    /// `small_to_mtp_projection`, applied to every predictor input (docs/model.md §5.1).
    pub fn project(&self, x: &Tensor) -> Result<Tensor> {
        match &self.projection {
            Some((w, b)) => linear(x, w, Some(b), self.decoder.numerics()),
            None => Ok(x.clone()),
        }
    }

    /// `codec_embedding[i-1](codes[..., i])` summed over i = 1..G-1 for codes `(..., G)`:
    /// the predictor's part of the frame embedding (docs/model.md §5.4), talker width.
    pub fn embed_sub_codes(&self, codes: &Tensor) -> Result<Tensor> {
        let g = codes.dim(D::Minus1)?;
        if g != self.num_code_groups {
            candle_core::bail!(
                "frame codes have {g} codebooks, expected {}",
                self.num_code_groups
            );
        }
        let last = codes.rank() - 1;
        let mut sum = embedding(
            &self.codec_embedding[0],
            &codes.narrow(last, 1, 1)?.squeeze(last)?,
        )?;
        for i in 2..g {
            let ids = codes.narrow(last, i, 1)?.squeeze(last)?;
            sum = (sum + embedding(&self.codec_embedding[i - 1], &ids)?)?;
        }
        Ok(sum)
    }

    /// Teacher-forced logits (the training path, `forward_sub_talker_finetune`,
    /// docs/model.md §10.3): input `[h, talker.codec_embedding(c0), cp_emb[0](c1), …,
    /// cp_emb[G-3](c_{G-2})]` (`G` positions), projected, through the decoder (causal), and
    /// `lm_head[j]` at position `j+1`. `hidden` `(N, Ht)` is the talker state that predicted c0,
    /// `c0_embed` `(N, Ht)` is `talker.codec_embedding(c0)`, `codes` `(N, G)` the frame (its last
    /// code is not an input). Returns `(N, G-1, vocab)`; row j predicts codebook j+1.
    pub fn teacher_forced_logits(
        &self,
        hidden: &Tensor,
        c0_embed: &Tensor,
        codes: &Tensor,
    ) -> Result<Tensor> {
        self.teacher_forced_logits_by_codebook(hidden, c0_embed, codes)?
            .transpose(0, 1)
    }

    /// [`Self::teacher_forced_logits`] codebook-major, `(G-1, N, vocab)` (the layout the
    /// training kernels produce without copies).
    pub fn teacher_forced_logits_by_codebook(
        &self,
        hidden: &Tensor,
        c0_embed: &Tensor,
        codes: &Tensor,
    ) -> Result<Tensor> {
        let sub = self.teacher_forced_embeddings(codes)?;
        let x = Tensor::cat(&[&hidden.unsqueeze(1)?, &c0_embed.unsqueeze(1)?, &sub], 1)?;
        self.logits_from_inputs(&x)
    }

    /// `cp_emb[i-1](codes[:, i])` for i = 1..G-2, `(N, G-2, Ht)`: the teacher-forced inputs after
    /// `[h, c0_embed]` (the last code of a frame is never an input).
    pub fn teacher_forced_embeddings(&self, codes: &Tensor) -> Result<Tensor> {
        let (_, g) = codes.dims2()?;
        if g != self.num_code_groups {
            candle_core::bail!(
                "frame codes have {g} codebooks, expected {}",
                self.num_code_groups
            );
        }
        if self.codec_embedding.len() + 1 != g {
            candle_core::bail!("this code predictor was loaded without its input embeddings");
        }
        let parts = (1..g - 1)
            .map(|i| embedding(&self.codec_embedding[i - 1], &codes.narrow(1, i, 1)?))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 1)
    }

    /// The teacher-forced logits `(G-1, N, vocab)` (codebook-major) of the predictor inputs
    /// `x` `(N, G, Ht)` = `[h, c0_embed, cp_emb[0](c1), …]`, projected, through the decoder
    /// (causal) and `lm_head[j]` at position `j+1`.
    pub fn logits_from_inputs(&self, x: &Tensor) -> Result<Tensor> {
        let (n, g, _) = x.dims3()?;
        if g != self.num_code_groups {
            candle_core::bail!(
                "predictor inputs have {g} positions, expected {}",
                self.num_code_groups
            );
        }
        let x = self.project(x)?;
        let out = self.decoder.forward(&x, None, None)?; // (N, G, Hc)
        let numerics = self.decoder.numerics();
        let logits = if numerics == Numerics::Kernels {
            autograd_ops::shifted_heads(&out, &Tensor::stack(&self.lm_head, 0)?)?
        } else {
            let logits = (0..g - 1)
                .map(|j| {
                    linear(
                        &out.narrow(1, j + 1, 1)?.squeeze(1)?,
                        &self.lm_head[j],
                        None,
                        numerics,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::stack(&logits, 0)?
        };
        debug_assert_eq!(logits.dims()[..2], [g - 1, n]);
        Ok(logits)
    }

    /// Generates codebooks 1..G-1 of a frame (docs/model.md §5.2): prefill `[h, c0_embed]` at
    /// positions 0, 1 on an emptied `cache`, then one token per step; `lm_head[j]` gives codebook
    /// j+1 and `pick(j+1, logits_f32)` chooses it. `hidden`, `c0_embed`: `(B, Ht)`. Returns `(B,
    /// G-1)` u32.
    pub fn generate(
        &self,
        hidden: &Tensor,
        c0_embed: &Tensor,
        cache: &mut DecoderCache,
        mut pick: impl SubCodePicker,
    ) -> Result<Tensor> {
        cache.reset();
        let g = self.num_code_groups;
        let mut x = self.project(&Tensor::stack(&[hidden, c0_embed], 1)?)?; // (B, 2, Hc)
        let mut codes = Vec::with_capacity(g - 1);
        for j in 0..g - 1 {
            let out = self.decoder.forward(&x, None, Some(cache))?;
            let last = out.narrow(1, out.dim(1)? - 1, 1)?.squeeze(1)?; // (B, Hc)
            let logits = linear(&last, &self.lm_head[j], None, self.decoder.numerics())?
                .to_dtype(DType::F32)?;
            let code = pick(j + 1, &logits)?.to_dtype(DType::U32)?; // (B,)
            if j + 1 < g - 1 {
                x = self.project(&embedding(&self.codec_embedding[j], &code)?.unsqueeze(1)?)?;
            }
            codes.push(code);
        }
        Tensor::stack(&codes, 1)
    }
}
