//! The code predictor of the row inference path (docs/model.md §5): the small decoder that
//! picks codebooks 1..15 of a frame once the talker has picked code 0, with its embedding
//! tables, its heads and the projection into its width. It is one of the two models built on
//! [`super::decoder_stack`], loaded and run apart from the talker.

use anyhow::{ensure, Result};

use super::decoder_stack::{Cache, RowDecoderStack};
use crate::config::Qwen3TtsConfig;
use crate::layers::DecoderStackConfig;
use crate::linear::{Input, LinearWeight, Table, WeightFormat};
use crate::weights::MappedWeights;

/// The code predictor (docs/model.md §5) for inference.
pub struct RowCodePredictor {
    pub decoder: RowDecoderStack,
    /// Codebook i+1's table (talker width).
    embeddings: Vec<Table>,
    /// `lm_head[j]` predicts codebook j+1.
    pub(super) heads: Vec<LinearWeight>,
    /// `small_to_mtp_projection` (1.7B); `None` = identity.
    pub(super) projection: Option<(LinearWeight, Vec<f32>)>,
    groups: usize,
}

/// Picks codes from f32 logits rows: called with the codebook index (1..=15) and one logits row
/// per batch row; returns one code per row.
pub type SubCodePick<'a> = dyn FnMut(usize, Vec<Vec<f32>>) -> Result<Vec<u32>> + 'a;

impl RowCodePredictor {
    pub(super) fn load(
        src: &MappedWeights,
        cfg: &Qwen3TtsConfig,
        format: WeightFormat,
    ) -> Result<Self> {
        const P: &str = crate::code_predictor::PREFIX;
        let t = &cfg.talker_config;
        let c = &t.code_predictor_config;
        ensure!(
            c.num_code_groups >= 2,
            "code_predictor_config.num_code_groups must be at least 2"
        );
        let n = c.num_code_groups - 1;
        let decoder = RowDecoderStack::load(
            src,
            &format!("{P}.model"),
            DecoderStackConfig::code_predictor(c)?,
            format,
        )?;
        let embeddings = (0..n)
            .map(|i| {
                Table::load(
                    src,
                    &format!("{P}.model.codec_embedding.{i}.weight"),
                    c.vocab_size,
                    t.hidden_size,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let heads = (0..n)
            .map(|j| {
                LinearWeight::load(
                    src,
                    &format!("{P}.lm_head.{j}.weight"),
                    c.vocab_size,
                    c.hidden_size,
                    format,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let projection = if cfg.has_mtp_projection() {
            let p = format!("{P}.small_to_mtp_projection");
            Some((
                LinearWeight::load(
                    src,
                    &format!("{p}.weight"),
                    c.hidden_size,
                    t.hidden_size,
                    format,
                )?,
                src.f32(&format!("{p}.bias"), &[c.hidden_size])?,
            ))
        } else {
            None
        };
        Ok(Self {
            decoder,
            embeddings,
            heads,
            projection,
            groups: c.num_code_groups,
        })
    }

    /// Codebooks per frame, code 0 included.
    pub fn num_code_groups(&self) -> usize {
        self.groups
    }

    /// A cache for [`Self::generate`], reused across frames.
    pub fn new_cache(&self) -> Cache {
        self.decoder.new_cache(self.groups)
    }

    /// Bytes of the matrices one frame reads (15 steps; the projection on 16 inputs).
    pub fn weight_bytes_per_frame(&self) -> usize {
        let steps = self.groups - 1;
        steps * self.decoder.weight_bytes()
            + self.heads.iter().map(LinearWeight::bytes).sum::<usize>()
            + self
                .projection
                .as_ref()
                .map_or(0, |(w, _)| steps * w.bytes())
    }

    fn project(&self, x: Vec<f32>, rows: usize) -> Vec<f32> {
        match &self.projection {
            Some((w, b)) => w.forward_bias(&Input::new(&x, rows, w.dims().1), b),
            None => x,
        }
    }

    /// Sum of the sub-code embeddings of frames `(n, 16)` (docs/model.md §5.4), talker width.
    pub fn embed_sub_codes(&self, frames: &[[u32; 16]], out: &mut [f32]) -> Result<()> {
        let w = self.embeddings[0].width();
        for (f, o) in frames.iter().zip(out.chunks_exact_mut(w)) {
            for (i, table) in self.embeddings.iter().enumerate() {
                table.add_row(f[i + 1] as usize, o)?;
            }
        }
        Ok(())
    }

    /// Codebooks 1..15 of a frame (docs/model.md §5.2): prefill `[h, c0_embed]`, then one token
    /// per step; `hidden` and `c0_embed` are `(b, Ht)`. Returns `b` rows of 15 codes.
    pub fn generate(
        &self,
        hidden: &[f32],
        c0_embed: &[f32],
        b: usize,
        cache: &mut Cache,
        pick: &mut SubCodePick<'_>,
    ) -> Result<Vec<Vec<u32>>> {
        cache.reset();
        let ht = hidden.len() / b.max(1);
        let mut x = Vec::with_capacity(2 * b * ht);
        for r in 0..b {
            x.extend_from_slice(&hidden[r * ht..(r + 1) * ht]);
            x.extend_from_slice(&c0_embed[r * ht..(r + 1) * ht]);
        }
        let mut x = self.project(x, 2 * b);
        let mut s = 2;
        let hc = self.decoder.cfg.hidden_size;
        let mut codes = vec![Vec::with_capacity(self.groups - 1); b];
        for j in 0..self.groups - 1 {
            let out = self.decoder.forward(&x, b, s, None, cache)?;
            let mut last = Vec::with_capacity(b * hc);
            for r in 0..b {
                last.extend_from_slice(&out[(r * s + s - 1) * hc..(r * s + s) * hc]);
            }
            let logits = self.heads[j].forward(&Input::new(&last, b, hc));
            let v = self.heads[j].dims().0;
            let rows: Vec<Vec<f32>> = logits.chunks_exact(v).map(<[f32]>::to_vec).collect();
            let picked = pick(j + 1, rows)?;
            ensure!(
                picked.len() == b,
                "the sub-code picker returned {} codes for {b} rows",
                picked.len()
            );
            for (r, c) in picked.iter().enumerate() {
                codes[r].push(*c);
            }
            if j + 1 < self.groups - 1 {
                x = self.project(self.embeddings[j].gather(&picked)?, b);
                s = 1;
            }
        }
        Ok(codes)
    }
}
