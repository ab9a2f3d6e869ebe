//! The training step's forward computation cut at the unit boundaries of docs/training.md §5.1,
//! each a pure function of (weights, inputs):
//!
//! - [`EmbeddingUnit`]: batch ids → the talker inputs `E`, plus the code predictor's
//!   teacher-forced input embeddings of every frame (its tables belong to this unit, so the
//!   predictor unit needs no weights of another unit);
//! - the decoder layers ([`vc_model::layers::DecoderLayer`], one unit each);
//! - [`HeadUnit`]: final norm and `codec_head` → `L_talker`, and the hidden states that predicted
//!   code-0 of each frame;
//! - the code predictor unit → `L_sub` ([`sub_loss`]).
//!
//! The single-device step chains them on the whole model in one autograd graph; the sharded step
//! (docs/distributed.md §4) runs them one unit at a time on gathered weights and recomputes
//! each unit with `Var`s for its backward pass. Both use these functions, so both compute the
//! same thing.

use candle_core::{DType, Result, Tensor, D};

use crate::batch::BatchTensors;
use crate::optim::host_kernels;
use vc_model::code_predictor::CodePredictor;
use vc_model::config::Qwen3TtsConfig;
use vc_model::layers::TensorSource;
use vc_model::ops::{embedding, rms_norm, Numerics};
use vc_model::talker::{Talker, TextProjection, PREFIX};

/// Weight of the sub-talker loss (official commit `680d4e9`).
pub const SUB_LOSS_WEIGHT: f64 = 0.3;

/// Where the text-channel rows come from: `table[ids]`. The table is the whole
/// `text_embedding` with the batch's text ids, or (row-sparse training) a small trainable copy of
/// the rows the step uses with ids into it, so that the gradient is not a dense 151936-row table.
#[derive(Debug, Clone, Copy)]
pub struct TextRows<'a> {
    /// `(K, text_hidden)` rows.
    pub table: &'a Tensor,
    /// `(B, N)` indices into `table`.
    pub ids: &'a Tensor,
}

/// The embedding unit's weights: `text_projection`, `codec_embedding` and the code predictor's
/// `codec_embedding.{i}` tables (the text table comes in as [`TextRows`]).
#[derive(Debug, Clone)]
pub struct EmbeddingUnit {
    pub text_projection: TextProjection,
    pub codec_embedding: Tensor,
    /// `talker.code_predictor.model.codec_embedding.{i}`, i = 0..G-2.
    pub cp_embeddings: Vec<Tensor>,
}

/// What the embedding unit produces for one micro-batch.
#[derive(Debug, Clone)]
pub struct Embedded {
    /// The talker inputs `E[:, :N-1]` `(B, N-1, H)` (the last input is never fed).
    pub inputs: Tensor,
    /// `codec_embedding(code-0)` of every frame, `(F, H)`.
    pub c0_embed: Tensor,
    /// The predictor's teacher-forced inputs `cp_emb[i-1](code_i)`, i = 1..G-2, `(F, G-2, H)`.
    pub sub_embeds: Tensor,
}

impl EmbeddingUnit {
    /// The unit of a built talker (sharing its tensors).
    pub fn of(talker: &Talker) -> Self {
        Self {
            text_projection: talker.text_projection.clone(),
            codec_embedding: talker.codec_embedding.clone(),
            cp_embeddings: talker.code_predictor.codec_embedding.clone(),
        }
    }

    /// Builds the unit from `src` (e.g. gathered shards).
    pub fn load(
        src: &dyn TensorSource,
        cfg: &Qwen3TtsConfig,
        numerics: Numerics,
    ) -> anyhow::Result<Self> {
        let t = &cfg.talker_config;
        let c = &t.code_predictor_config;
        let (h, th) = (t.hidden_size, t.text_hidden_size);
        let get = |name: &str, shape: &[usize]| src.tensor(&format!("{PREFIX}.{name}"), shape);
        let text_projection = TextProjection {
            fc1_weight: get("text_projection.linear_fc1.weight", &[th, th])?,
            fc1_bias: get("text_projection.linear_fc1.bias", &[th])?,
            fc2_weight: get("text_projection.linear_fc2.weight", &[h, th])?,
            fc2_bias: get("text_projection.linear_fc2.bias", &[h])?,
            numerics,
        };
        let cp_embeddings = (0..c.num_code_groups.saturating_sub(1))
            .map(|i| {
                get(
                    &format!("code_predictor.model.codec_embedding.{i}.weight"),
                    &[c.vocab_size, h],
                )
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            text_projection,
            codec_embedding: get("model.codec_embedding.weight", &[t.vocab_size, h])?,
            cp_embeddings,
        })
    }

    /// The talker input `E` `(B, N, H)` (docs/model.md §10.2, §10.3):
    /// `text_projection(text rows)·text_mask + codec_embedding(codec ids)·codec_embedding_mask
    /// + x-vector at position 6 + Σ_{i=1..15} cp.codec_embedding[i-1](code_i)·codec_mask`.
    /// `speaker` is the speaker table `(S, H)` — row `b.speaker_index[r]` is row r's x-vector
    /// (docs/training.md §3.3) — or one x-vector `(H,)` for every row; it is data (detached).
    pub fn input_embeddings(
        &self,
        b: &BatchTensors,
        speaker: &Tensor,
        text: TextRows,
    ) -> Result<Tensor> {
        let dtype = self.codec_embedding.dtype();
        let cast = |t: &Tensor| t.to_dtype(dtype);
        let rows = embedding(text.table, text.ids)?;
        let text = self
            .text_projection
            .forward(&rows.to_dtype(self.text_projection.fc1_bias.dtype())?)?
            .broadcast_mul(&cast(&b.text_mask)?)?;
        let codec = embedding(&self.codec_embedding, &b.codec_channel_ids)?
            .broadcast_mul(&cast(&b.codec_embedding_mask)?)?;
        let table = match speaker.rank() {
            1 => speaker.reshape((1, ()))?,
            _ => speaker.clone(),
        };
        // Each row's own x-vector `(B, 1, H)`, masked onto position 6.
        let rows = table.detach().index_select(&b.speaker_index, 0)?;
        let spk = cast(&b.speaker_mask)?.broadcast_mul(&cast(&rows)?.unsqueeze(1)?)?;
        let sub = self
            .sum_sub_codes(&b.codec_ids)?
            .broadcast_mul(&cast(&b.codec_mask)?)?;
        ((text + codec)? + spk)? + sub
    }

    /// `Σ_{i=1..G-1} cp.codec_embedding[i-1](codes[..., i])` for codes `(..., G)`
    /// (docs/model.md §5.4).
    fn sum_sub_codes(&self, codes: &Tensor) -> Result<Tensor> {
        let last = codes.rank() - 1;
        let mut sum = embedding(
            &self.cp_embeddings[0],
            &codes.narrow(last, 1, 1)?.squeeze(last)?,
        )?;
        for (i, table) in self.cp_embeddings.iter().enumerate().skip(1) {
            let ids = codes.narrow(last, i + 1, 1)?.squeeze(last)?;
            sum = (sum + embedding(table, &ids)?)?;
        }
        Ok(sum)
    }

    /// The unit's outputs for one micro-batch.
    pub fn forward(&self, b: &BatchTensors, speaker: &Tensor, text: TextRows) -> Result<Embedded> {
        let e = self.input_embeddings(b, speaker, text)?;
        let codes = &b.frame_codes;
        let g = codes.dim(1)?;
        let c0 = codes.narrow(1, 0, 1)?.squeeze(1)?;
        let sub = (1..g - 1)
            .map(|i| embedding(&self.cp_embeddings[i - 1], &codes.narrow(1, i, 1)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Embedded {
            inputs: e.narrow(1, 0, b.len - 1)?,
            c0_embed: embedding(&self.codec_embedding, &c0)?,
            sub_embeds: Tensor::cat(&sub, 1)?,
        })
    }
}

/// The head unit: the talker's final norm and `codec_head`.
#[derive(Debug, Clone)]
pub struct HeadUnit {
    pub norm: Tensor,
    pub codec_head: Tensor,
    pub eps: f64,
    pub numerics: Numerics,
}

impl HeadUnit {
    pub fn of(talker: &Talker) -> Self {
        Self {
            norm: talker.decoder.norm.clone(),
            codec_head: talker.codec_head.clone(),
            eps: talker.config().rms_norm_eps,
            numerics: talker.numerics(),
        }
    }

    pub fn load(
        src: &dyn TensorSource,
        cfg: &Qwen3TtsConfig,
        numerics: Numerics,
    ) -> anyhow::Result<Self> {
        let t = &cfg.talker_config;
        Ok(Self {
            norm: src.tensor(&format!("{PREFIX}.model.norm.weight"), &[t.hidden_size])?,
            codec_head: src.tensor(
                &format!("{PREFIX}.codec_head.weight"),
                &[t.vocab_size, t.hidden_size],
            )?,
            eps: t.rms_norm_eps,
            numerics,
        })
    }

    /// `L_talker` (the mean cross-entropy of `codec_head(H[p])` against the code-0 label of
    /// input p+1, over every labelled position) and the hidden rows that predicted code-0 of each
    /// frame `(F, H)`, for the last layer's output `x` `(B, N-1, H)`.
    pub fn forward(&self, x: &Tensor, b: &BatchTensors) -> Result<(Tensor, Tensor)> {
        let hidden = rms_norm(x, &self.norm, self.eps, self.numerics)?;
        let h = hidden.dim(D::Minus1)?;
        let hidden = hidden.reshape(((), h))?;
        let rows = hidden.index_select(&b.label_rows, 0)?;
        let logits = vc_model::ops::linear(&rows, &self.codec_head, None, self.numerics)?;
        let kernels = self.numerics == Numerics::Kernels;
        let l_talker = cross_entropy(&logits, &b.labels, kernels)?;
        Ok((l_talker, hidden.index_select(&b.frame_rows, 0)?))
    }
}

/// `L_sub`: the mean over all frames and codebooks 1..15 of the teacher-forced predictor
/// cross-entropy, from the hidden rows that predicted each frame's code-0 `(F, H)` and the
/// embedding unit's outputs.
pub fn sub_loss(
    cp: &CodePredictor,
    frame_hidden: &Tensor,
    c0_embed: &Tensor,
    sub_embeds: &Tensor,
    frame_codes: &Tensor,
) -> Result<Tensor> {
    let x = Tensor::cat(
        &[
            &frame_hidden.unsqueeze(1)?,
            &c0_embed.unsqueeze(1)?,
            sub_embeds,
        ],
        1,
    )?;
    // Codebook-major logits (15, F, V) against the targets in the same order; the mean over all
    // (frame, codebook) pairs does not depend on the order.
    let logits = cp.logits_from_inputs(&x)?;
    let groups = frame_codes.dim(1)?;
    let vocab = logits.dim(2)?;
    let targets = frame_codes
        .narrow(1, 1, groups - 1)?
        .t()?
        .contiguous()?
        .flatten_all()?;
    let kernels = cp.decoder.numerics() == Numerics::Kernels;
    cross_entropy(&logits.reshape(((), vocab))?, &targets, kernels)
}

/// Mean cross-entropy of `logits` `(M, V)` (any float dtype; computed in f32) against `targets`
/// `(M,)`: the fused CPU kernel ([`host_kernels::CrossEntropy`]) with `kernels`, plain
/// differentiable ops otherwise.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, kernels: bool) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let targets = targets.to_dtype(DType::U32)?.contiguous()?;
    if kernels {
        return logits.apply_op2(&targets, host_kernels::CrossEntropy::default());
    }
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?, 1)?;
    (lse - picked)?.mean_all()
}
