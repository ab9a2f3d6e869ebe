//! The talker of the row inference path (docs/model.md §3.3, §4): the text and codec
//! embeddings, the decoder stack that picks code 0 of each frame, its head, the code predictor
//! it owns, and the low-rank adapters put on both stacks (docs/serving.md §7): the entry point
//! the generation loop holds, built on [`super::decoder_stack`] and [`super::code_predictor`].

use std::collections::BTreeMap;

use anyhow::{bail, ensure, Context, Result};

use vc_core::artifacts::adapter::Factors;
use vc_kernels::libm;

use super::adapters::AdapterId;
use super::code_predictor::{RowCodePredictor, SubCodePick};
use super::decoder_stack::{Cache, RowDecoderStack};
use crate::config::Qwen3TtsConfig;
use crate::layers::DecoderStackConfig;
use crate::linear::{Input, LinearWeight, Table, WeightFormat};
use crate::weights::MappedWeights;

/// The talker (docs/model.md §3.3, §4) with its code predictor, on the row inference path.
pub struct RowTalker {
    text_embedding: Table,
    fc1: LinearWeight,
    fc1_bias: Vec<f32>,
    fc2: LinearWeight,
    fc2_bias: Vec<f32>,
    codec_embedding: Table,
    pub decoder: RowDecoderStack,
    codec_head: LinearWeight,
    pub code_predictor: RowCodePredictor,
    format: WeightFormat,
    /// Adapters put on with [`Self::add_adapter`].
    adapters: usize,
}

impl RowTalker {
    /// Builds the talker from a mapped checkpoint with its matrices in `format`. The text
    /// projection (used only for prompts) is never quantized: q8 and q4 keep it bf16.
    pub fn load(src: &MappedWeights, cfg: &Qwen3TtsConfig, format: WeightFormat) -> Result<Self> {
        const P: &str = crate::talker::PREFIX;
        let t = &cfg.talker_config;
        let (h, th) = (t.hidden_size, t.text_hidden_size);
        let proj_format = match format {
            WeightFormat::Q8 | WeightFormat::Q4 => WeightFormat::Bf16,
            f => f,
        };
        let name = |n: &str| format!("{P}.{n}");
        let table = |n: &str, rows: usize, width: usize| -> Result<Table> {
            Ok(match format {
                // f32 of an f32-stored table; bf16-stored tables widen exactly when read.
                WeightFormat::F32 | WeightFormat::Bf16 | WeightFormat::Q8 | WeightFormat::Q4 => {
                    Table::load(src, &name(n), rows, width)?
                }
            })
        };
        Ok(Self {
            text_embedding: table("model.text_embedding.weight", t.text_vocab_size, th)?,
            fc1: LinearWeight::load(
                src,
                &name("text_projection.linear_fc1.weight"),
                th,
                th,
                proj_format,
            )?,
            fc1_bias: src.f32(&name("text_projection.linear_fc1.bias"), &[th])?,
            fc2: LinearWeight::load(
                src,
                &name("text_projection.linear_fc2.weight"),
                h,
                th,
                proj_format,
            )?,
            fc2_bias: src.f32(&name("text_projection.linear_fc2.bias"), &[h])?,
            codec_embedding: table("model.codec_embedding.weight", t.vocab_size, h)?,
            decoder: RowDecoderStack::load(
                src,
                &name("model"),
                DecoderStackConfig::talker(t)?,
                format,
            )?,
            codec_head: LinearWeight::load(
                src,
                &name("codec_head.weight"),
                t.vocab_size,
                h,
                format,
            )?,
            code_predictor: RowCodePredictor::load(src, cfg, format)?,
            format,
            adapters: 0,
        })
    }

    /// Puts a low-rank adapter on the decoder-layer matrices its factors name (`….weight`,
    /// `a` `(r, in)`, `b` `(out, r)`), kept factored with `scale` (α/r and any strength): the
    /// rows a cache binds to the returned id compute with it, the others with the base
    /// (docs/serving.md §7). Every other tensor stays the base model's.
    pub fn add_adapter(
        &mut self,
        factors: BTreeMap<String, Factors>,
        scale: f64,
    ) -> Result<AdapterId> {
        ensure!(!factors.is_empty(), "the adapter changes no matrix");
        let id = AdapterId(self.adapters);
        const TALKER: &str = "talker.model";
        const CP: &str = "talker.code_predictor.model";
        for (name, f) in factors {
            let projection = if name.starts_with(CP) {
                self.code_predictor.decoder.projection_mut(CP, &name)
            } else {
                self.decoder.projection_mut(TALKER, &name)
            };
            let Some(p) = projection else {
                bail!(
                    "the adapter changes {name}, which is not a decoder-layer projection of \
                     this model"
                );
            };
            p.add(id, f.a.shape[0], f.a.data, f.b.data, scale)
                .with_context(|| format!("the adapter of {name}"))?;
        }
        self.adapters += 1;
        Ok(id)
    }

    pub fn format(&self) -> WeightFormat {
        self.format
    }

    pub fn hidden_size(&self) -> usize {
        self.decoder.cfg.hidden_size
    }

    /// Every matrix a frame reads, named as in the checkpoint.
    pub fn matrices(&self) -> Vec<(String, &LinearWeight)> {
        let mut out = self.decoder.matrices("talker.model");
        out.push(("talker.codec_head.weight".into(), &self.codec_head));
        let cp = &self.code_predictor;
        out.extend(cp.decoder.matrices("talker.code_predictor.model"));
        for (j, h) in cp.heads.iter().enumerate() {
            out.push((format!("talker.code_predictor.lm_head.{j}.weight"), h));
        }
        if let Some((w, _)) = &cp.projection {
            out.push((
                "talker.code_predictor.small_to_mtp_projection.weight".into(),
                w,
            ));
        }
        out
    }

    /// Bytes of the matrices one talker step reads (layers and `codec_head`).
    pub fn step_weight_bytes(&self) -> usize {
        self.decoder.weight_bytes() + self.codec_head.bytes()
    }

    /// `text_projection(text_embedding(ids))` `(ids.len(), H)` (docs/model.md §3.3).
    pub fn text_embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let rows = self.text_embedding.gather(ids)?;
        let th = self.text_embedding.width();
        let mut h = self
            .fc1
            .forward_bias(&Input::new(&rows, ids.len(), th), &self.fc1_bias);
        h.iter_mut().for_each(|v| *v /= 1.0 + libm::exp(-*v));
        Ok(self
            .fc2
            .forward_bias(&Input::new(&h, ids.len(), th), &self.fc2_bias))
    }

    /// `codec_embedding(ids)` `(ids.len(), H)`.
    pub fn codec_embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.codec_embedding.gather(ids)
    }

    /// Frame embeddings `(frames.len(), H)` (docs/model.md §5.4).
    pub fn frame_embed(&self, frames: &[[u32; 16]]) -> Result<Vec<f32>> {
        let ids: Vec<u32> = frames.iter().map(|f| f[0]).collect();
        let mut out = self.codec_embedding.gather(&ids)?;
        self.code_predictor.embed_sub_codes(frames, &mut out)?;
        Ok(out)
    }

    /// A talker cache with room for `capacity` positions.
    pub fn new_cache(&self, capacity: usize) -> Cache {
        self.decoder.new_cache(capacity)
    }

    /// Final-norm hidden states `(b, s, H)` (see [`RowDecoderStack::forward`]).
    pub fn forward(
        &self,
        x: &[f32],
        b: usize,
        s: usize,
        valid: Option<&[Vec<bool>]>,
        cache: &mut Cache,
    ) -> Result<Vec<f32>> {
        self.decoder.forward(x, b, s, valid, cache)
    }

    /// Code-0 logits `(rows, vocab)` for hidden states `(rows, H)`.
    pub fn codec_logits(&self, hidden: &[f32], rows: usize) -> Vec<f32> {
        self.codec_head
            .forward(&Input::new(hidden, rows, self.hidden_size()))
    }

    /// Codebooks 1..15 for code-0 ids `c0` and the hidden states `(b, H)` that chose them.
    pub fn predict_sub_codes(
        &self,
        hidden: &[f32],
        c0: &[u32],
        cache: &mut Cache,
        pick: &mut SubCodePick<'_>,
    ) -> Result<Vec<Vec<u32>>> {
        let e = self.codec_embed(c0)?;
        self.code_predictor
            .generate(hidden, &e, c0.len(), cache, pick)
    }
}
