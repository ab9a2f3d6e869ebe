//! The talker's parameters grouped into the units of docs/training.md §5.1, in forward order: the
//! embedding group, each decoder layer, the head group, the code predictor. A unit is what a
//! sharded (FSDP) step gathers, runs and frees at once; the single-device trainer uses the
//! grouping to order parameters and to describe them in checkpoints.
//!
//! The code predictor's 15 input tables (`talker.code_predictor.model.codec_embedding.*`) belong
//! to the embedding unit: they build the talker's input (the frame embedding of
//! docs/model.md §5.4), and the same unit computes the predictor's teacher-forced inputs from
//! them, so no weight is needed by two units.
//!
//! Each unit's forward computation is in [`forward`].

pub mod forward;

use std::fmt;

use anyhow::{bail, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Unit {
    /// `talker.model.text_embedding`, `talker.text_projection.*`, `talker.model.codec_embedding`,
    /// `talker.code_predictor.model.codec_embedding.*`.
    Embeddings,
    /// `talker.model.layers.{i}.*`.
    Layer(usize),
    /// `talker.model.norm`, `talker.codec_head`.
    Head,
    /// The rest of `talker.code_predictor.*`.
    CodePredictor,
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unit::Embeddings => write!(f, "embeddings"),
            Unit::Layer(i) => write!(f, "layer.{i}"),
            Unit::Head => write!(f, "head"),
            Unit::CodePredictor => write!(f, "code_predictor"),
        }
    }
}

impl Unit {
    /// Every unit of a talker with `layers` decoder layers, in forward order.
    pub fn all(layers: usize) -> Vec<Unit> {
        std::iter::once(Unit::Embeddings)
            .chain((0..layers).map(Unit::Layer))
            .chain([Unit::Head, Unit::CodePredictor])
            .collect()
    }
}

/// The unit of a talker tensor name.
pub fn unit_of(name: &str) -> Result<Unit> {
    if name.starts_with("talker.code_predictor.model.codec_embedding.") {
        return Ok(Unit::Embeddings);
    }
    if name.starts_with("talker.code_predictor.") {
        return Ok(Unit::CodePredictor);
    }
    if let Some(rest) = name.strip_prefix("talker.model.layers.") {
        if let Some(i) = rest.split('.').next().and_then(|s| s.parse().ok()) {
            return Ok(Unit::Layer(i));
        }
    }
    if name.starts_with("talker.model.text_embedding.")
        || name.starts_with("talker.text_projection.")
        || name.starts_with("talker.model.codec_embedding.")
    {
        return Ok(Unit::Embeddings);
    }
    if name.starts_with("talker.model.norm.") || name.starts_with("talker.codec_head.") {
        return Ok(Unit::Head);
    }
    bail!("tensor {name} belongs to no known part of the talker")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_the_forward_order() {
        let names = [
            "talker.code_predictor.lm_head.3.weight",
            "talker.codec_head.weight",
            "talker.model.layers.10.mlp.up_proj.weight",
            "talker.model.layers.2.input_layernorm.weight",
            "talker.text_projection.linear_fc1.bias",
            "talker.model.norm.weight",
            "talker.code_predictor.model.codec_embedding.4.weight",
        ];
        let mut units: Vec<Unit> = names.iter().map(|n| unit_of(n).unwrap()).collect();
        units.sort();
        assert_eq!(
            units,
            [
                Unit::Embeddings,
                Unit::Embeddings,
                Unit::Layer(2),
                Unit::Layer(10),
                Unit::Head,
                Unit::Head,
                Unit::CodePredictor
            ]
        );
        assert_eq!(Unit::Layer(3).to_string(), "layer.3");
        assert!(unit_of("speaker_encoder.fc.weight").is_err());
    }
}
