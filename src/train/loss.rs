//! The corrected fine-tuning objective (docs/model.md §10.3 "Correct objective",
//! docs/training.md §2.1): `text_projection` applied to the text channel, a single label shift for
//! code-0, and the code predictor fed the hidden state that *predicted* code-0 of each frame, as at
//! inference.
//!
//! `L_talker` = mean cross-entropy of `codec_head(H[p])` against the code-0 label of input p+1,
//! over every labelled position of the batch (the frames and EOS of each sample);
//! `L_sub` = mean over all frames and codebooks 1..15 of the teacher-forced predictor CE;
//! `L = L_talker + 0.3 · L_sub`.

use candle_core::{DType, Result, Tensor, D};

use super::batch::BatchTensors;
use super::cpu_ops;
use crate::model::ops::Numerics;
use crate::model::talker::Talker;

/// Weight of the sub-talker loss (official commit `680d4e9`).
pub const SUB_LOSS_WEIGHT: f64 = 0.3;

/// The loss of one (micro-)batch: scalar f32 tensors, `total` is differentiable.
#[derive(Debug, Clone)]
pub struct Loss {
    pub total: Tensor,
    pub talker: Tensor,
    pub sub: Tensor,
}

/// Where the text-channel rows come from: by default `talker.text_embedding[text_ids]`; the
/// trainer may instead pass the batch's distinct rows (a small trainable copy) and the batch's
/// ids into them, so that the gradient is row-sparse instead of a dense 151936-row table.
#[derive(Debug, Clone, Copy)]
pub struct TextRows<'a> {
    /// `(K, text_hidden)` rows.
    pub table: &'a Tensor,
    /// `(B, N)` indices into `table`.
    pub ids: &'a Tensor,
}

/// The talker input `E` `(B, N, H)` in the talker's dtype (docs/model.md §10.2, §10.3):
/// `text_embed(text ids)·text_mask + codec_embedding(codec ids)·codec_embedding_mask
/// + x-vector at position 6 + Σ_{i=1..15} cp.codec_embedding[i-1](code_i)·codec_mask`.
/// `speaker` is the speaker table `(S, H)` — row `b.speaker_index[r]` is row r's x-vector
/// (docs/training.md §3.3) — or one x-vector `(H,)` for every row; it is data (detached).
pub fn input_embeddings(talker: &Talker, b: &BatchTensors, speaker: &Tensor) -> Result<Tensor> {
    input_embeddings_with(talker, b, speaker, None)
}

/// [`input_embeddings`] with the text rows taken from `text` when given.
pub fn input_embeddings_with(
    talker: &Talker,
    b: &BatchTensors,
    speaker: &Tensor,
    text: Option<TextRows>,
) -> Result<Tensor> {
    let dtype = talker.codec_embedding.dtype();
    let cast = |t: &Tensor| t.to_dtype(dtype);
    let text = match text {
        Some(t) => talker
            .text_projection
            .forward(&crate::model::ops::embedding(t.table, t.ids)?)?,
        None => talker.text_embed(&b.text_ids)?,
    }
    .broadcast_mul(&cast(&b.text_mask)?)?;
    let codec = talker
        .codec_embed(&b.codec_channel_ids)?
        .broadcast_mul(&cast(&b.codec_embedding_mask)?)?;
    let table = match speaker.rank() {
        1 => speaker.reshape((1, ()))?,
        _ => speaker.clone(),
    };
    // Each row's own x-vector `(B, 1, H)`, masked onto position 6.
    let rows = table.detach().index_select(&b.speaker_index, 0)?;
    let spk = cast(&b.speaker_mask)?.broadcast_mul(&cast(&rows)?.unsqueeze(1)?)?;
    let sub = talker
        .code_predictor
        .embed_sub_codes(&b.codec_ids)?
        .broadcast_mul(&cast(&b.codec_mask)?)?;
    ((text + codec)? + spk)? + sub
}

/// `L`, `L_talker` and `L_sub` of one batch.
pub fn sft_loss(talker: &Talker, b: &BatchTensors, speaker: &Tensor) -> Result<Loss> {
    sft_loss_with(talker, b, speaker, None)
}

/// [`sft_loss`] with the text rows taken from `text` when given (see [`TextRows`]).
pub fn sft_loss_with(
    talker: &Talker,
    b: &BatchTensors,
    speaker: &Tensor,
    text: Option<TextRows>,
) -> Result<Loss> {
    let e = input_embeddings_with(talker, b, speaker, text)?;
    let n = b.len;
    // The last input (EOS of the longest sample) is never fed: inputs are E[:, :N-1].
    let hidden = talker.forward(&e.narrow(1, 0, n - 1)?, None, None)?;
    let h = hidden.dim(D::Minus1)?;
    let hidden = hidden.reshape((b.rows * (n - 1), h))?;

    let kernels = talker.numerics() == Numerics::CpuKernels;
    let logits = talker.codec_logits(&hidden.index_select(&b.label_rows, 0)?)?;
    let l_talker = cross_entropy(&logits, &b.labels, kernels)?;

    let frame_hidden = hidden.index_select(&b.frame_rows, 0)?;
    // Codebook-major logits (15, F, V) against the targets in the same order; the mean over all
    // (frame, codebook) pairs does not depend on the order.
    let sub_logits = talker.sub_code_logits_by_codebook(&frame_hidden, &b.frame_codes)?;
    let groups = b.frame_codes.dim(1)?;
    let vocab = sub_logits.dim(2)?;
    let sub_targets = b
        .frame_codes
        .narrow(1, 1, groups - 1)?
        .t()?
        .contiguous()?
        .flatten_all()?;
    let l_sub = cross_entropy(&sub_logits.reshape(((), vocab))?, &sub_targets, kernels)?;

    let total = (&l_talker + (&l_sub * SUB_LOSS_WEIGHT)?)?;
    Ok(Loss {
        total,
        talker: l_talker,
        sub: l_sub,
    })
}

/// Mean cross-entropy of `logits` `(M, V)` (any float dtype; computed in f32) against `targets`
/// `(M,)`: the fused CPU kernel ([`cpu_ops::CrossEntropy`]) with `kernels`, plain
/// differentiable ops otherwise.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, kernels: bool) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let targets = targets.to_dtype(DType::U32)?.contiguous()?;
    if kernels {
        return logits.apply_op2(&targets, cpu_ops::CrossEntropy::default());
    }
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?, 1)?;
    (lse - picked)?.mean_all()
}
