//! The corrected fine-tuning objective (docs/model.md §10.3 "Correct objective",
//! docs/training.md §2.1): `text_projection` applied to the text channel, a single label shift for
//! code-0, and the code predictor fed the hidden state that *predicted* code-0 of each frame, as
//! at inference.
//!
//! `L_talker` = mean cross-entropy of `codec_head(H[p])` against the code-0 label of input p+1,
//! over every labelled position of the batch (the frames and EOS of each sample);
//! `L_sub` = mean over all frames and codebooks 1..15 of the teacher-forced predictor CE;
//! `L = L_talker + 0.3 · L_sub`. The pieces are the units of [`crate::step::units::forward`]; here they run
//! chained on a whole model, in one autograd graph.

use candle_core::{Result, Tensor};

use crate::batch::BatchTensors;
use crate::step::units::forward::{sub_loss, EmbeddingUnit, HeadUnit, TextRows, SUB_LOSS_WEIGHT};
use vc_model::layers::StepContext;
use vc_model::talker::Talker;

/// The loss of one (micro-)batch: scalar f32 tensors, `total` is differentiable.
#[derive(Debug, Clone)]
pub struct Loss {
    pub total: Tensor,
    pub talker: Tensor,
    pub sub: Tensor,
}

/// The talker input `E` `(B, N, H)` of a batch, with the whole text table (see
/// [`EmbeddingUnit::input_embeddings`]).
pub fn input_embeddings(talker: &Talker, b: &BatchTensors, speaker: &Tensor) -> Result<Tensor> {
    let text = TextRows {
        table: &talker.text_embedding,
        ids: &b.text_ids,
    };
    EmbeddingUnit::of(talker).input_embeddings(b, speaker, text)
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
    let text = text.unwrap_or(TextRows {
        table: &talker.text_embedding,
        ids: &b.text_ids,
    });
    let emb = EmbeddingUnit::of(talker).forward(b, speaker, text)?;
    let (rows, len, _) = emb.inputs.dims3()?;
    let step = StepContext::causal(
        talker.decoder.rope(),
        rows,
        len,
        emb.inputs.dtype(),
        talker.numerics(),
        emb.inputs.device(),
    )?;
    let x = talker.decoder.forward_layers(&emb.inputs, &step)?;
    let (l_talker, frame_hidden) = HeadUnit::of(talker).forward(&x, b)?;
    let l_sub = sub_loss(
        &talker.code_predictor,
        &frame_hidden,
        &emb.c0_embed,
        &emb.sub_embeds,
        &b.frame_codes,
    )?;
    let total = (&l_talker + (&l_sub * SUB_LOSS_WEIGHT)?)?;
    Ok(Loss {
        total,
        talker: l_talker,
        sub: l_sub,
    })
}
