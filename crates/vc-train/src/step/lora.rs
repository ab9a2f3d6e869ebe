//! Low-rank adaptation (docs/training.md §13): which talker matrices carry adapters, the
//! adapters' names, shapes and first values (as PEFT's `LoraConfig` makes them), and what a run
//! with adapters trains: both factors of every adapter and the tensors of `train.lora_full`.
//! Everything else stays frozen in the backend's storage dtype (docs/training.md §5.5).

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::step::trainable::{Glob, TRAINABLE_PREFIX};
use vc_core::config::TrainConfig;
use vc_core::rng::SplitMix64;
use vc_model::layers::{adapter_names, AdapterSpec};

/// The decoder stacks whose layers' projections may carry adapters.
const DECODERS: [&str; 2] = [
    "talker.model.layers.",
    "talker.code_predictor.model.layers.",
];

/// The projections of one decoder layer (docs/model.md §4.1), relative to the layer.
const PROJECTIONS: [&str; 7] = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

/// Whether `name` is a matrix an adapter may sit on: a projection of a decoder layer of the
/// talker or of the code predictor (what [`vc_model::layers::Projection`] loads).
pub fn is_adaptable(name: &str) -> bool {
    DECODERS.iter().any(|d| {
        name.strip_prefix(d)
            .and_then(|rest| rest.split_once('.'))
            .is_some_and(|(layer, proj)| {
                layer.parse::<usize>().is_ok() && PROJECTIONS.contains(&proj)
            })
    })
}

/// One factor of an adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Factor {
    /// `A` `(rank, in)`: PEFT's Kaiming-uniform start.
    Down { rank: usize, inp: usize },
    /// `B` `(out, rank)`: zeros, so that a fresh adapter changes nothing.
    Up { out: usize, rank: usize },
}

impl Factor {
    fn shape(self) -> Vec<usize> {
        match self {
            Factor::Down { rank, inp } => vec![rank, inp],
            Factor::Up { out, rank } => vec![out, rank],
        }
    }
}

/// What a checkpoint records of its adapters beyond the trained names (which the identity's
/// digest of the trained set already covers): a run with another rank or α is another run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraIdentity {
    pub rank: usize,
    pub alpha: f64,
}

// `train.lora_alpha` is validated finite, so equality is an equivalence.
impl Eq for LoraIdentity {}

impl LoraIdentity {
    /// `α / r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// The adapters of a run.
#[derive(Debug, Clone)]
pub struct Lora {
    pub rank: usize,
    pub alpha: f64,
    /// The adapted matrices and their `(out, in)`, by name.
    pub targets: BTreeMap<String, [usize; 2]>,
    /// The tensors trained fully beside the adapters.
    pub full: Vec<String>,
    factors: BTreeMap<String, Factor>,
    seed: u64,
}

impl Lora {
    /// The adapters `c` asks for on a base model whose talker tensors are `tensors` (name,
    /// shape); `None` for a full fine-tune (`train.lora_rank = 0`). Every glob must match.
    pub fn from_config(c: &TrainConfig, tensors: &[(&str, &[usize])]) -> Result<Option<Self>> {
        if c.lora_rank == 0 {
            return Ok(None);
        }
        let rank = c.lora_rank;
        let alpha = if c.lora_alpha == 0.0 {
            2.0 * rank as f64
        } else {
            c.lora_alpha
        };
        let talker: Vec<(&str, &[usize])> = tensors
            .iter()
            .copied()
            .filter(|(n, _)| n.starts_with(TRAINABLE_PREFIX))
            .collect();
        let mut targets = BTreeMap::new();
        for pattern in &c.lora_targets {
            let g = Glob::new(pattern);
            let hits: Vec<&(&str, &[usize])> = talker
                .iter()
                .filter(|(n, _)| is_adaptable(n) && g.matches(n))
                .collect();
            if hits.is_empty() {
                bail!(
                    "train.lora_targets pattern {pattern:?} matches no matrix an adapter can sit \
                     on (the q/k/v/o and gate/up/down projections of the decoder layers, named \
                     like talker.model.layers.0.self_attn.q_proj.weight or \
                     talker.code_predictor.model.layers.0.mlp.up_proj.weight; train other \
                     tensors fully with train.lora_full)"
                );
            }
            for (n, s) in hits {
                let &[out, inp] = *s else {
                    bail!("{n} has shape {s:?}, not a matrix");
                };
                targets.insert(n.to_string(), [out, inp]);
            }
        }
        // A rank above a matrix's smaller side adds parameters, state and rank-wide
        // activations but nothing the product B·A can express (its rank is at most that side).
        if let Some((name, [out, inp])) = targets.iter().min_by_key(|(_, [o, i])| *o.min(i)) {
            let useful = *out.min(inp);
            if rank > useful {
                bail!(
                    "train.lora_rank = {rank} is larger than {name} ({out}×{inp}) can use: an \
                     adapter's product has rank at most its matrix's smaller side, so a rank \
                     above {useful} only costs memory; the largest useful rank for these \
                     targets is {useful} (train.lora_targets picks the matrices)"
                );
            }
        }
        let mut full = Vec::new();
        for pattern in &c.lora_full {
            let g = Glob::new(pattern);
            let before = full.len();
            full.extend(
                talker
                    .iter()
                    .filter(|(n, _)| g.matches(n))
                    .map(|(n, _)| n.to_string()),
            );
            if full.len() == before {
                bail!(
                    "train.lora_full pattern {pattern:?} matches no talker tensor (names look \
                     like talker.codec_head.weight; * matches any characters)"
                );
            }
        }
        full.sort();
        full.dedup();
        if let Some(f) = full.iter().find(|f| targets.contains_key(*f)) {
            bail!(
                "{f} is both adapted (train.lora_targets) and trained fully (train.lora_full): \
                 take it out of one of them"
            );
        }
        let mut factors = BTreeMap::new();
        for (name, &[out, inp]) in &targets {
            let (a, b) = adapter_names(name);
            factors.insert(a, Factor::Down { rank, inp });
            factors.insert(b, Factor::Up { out, rank });
        }
        Ok(Some(Self {
            rank,
            alpha,
            targets,
            full,
            factors,
            seed: c.seed,
        }))
    }

    /// `α / r`.
    pub fn scale(&self) -> f64 {
        self.identity().scale()
    }

    /// What the model is built with.
    pub fn spec(&self) -> AdapterSpec {
        AdapterSpec {
            rank: self.rank,
            scale: self.scale(),
        }
    }

    pub fn identity(&self) -> LoraIdentity {
        LoraIdentity {
            rank: self.rank,
            alpha: self.alpha,
        }
    }

    /// The trained tensors: both factors of every adapter, then the fully trained ones.
    pub fn trained(&self) -> Vec<String> {
        self.factors.keys().chain(&self.full).cloned().collect()
    }

    /// The shape of adapter factor `name`, `None` if it is not one.
    pub fn factor_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.factors.get(name).map(|f| f.shape())
    }

    /// The first value of adapter factor `name` (f32, on `device`), `None` if it is not one.
    /// `A` is PEFT's `kaiming_uniform_(a = √5)`, i.e. uniform in ±1/√in, drawn from the run's
    /// seed and the factor's name (the same values on every rank and in any order); `B` is 0.
    pub fn initial(&self, name: &str, device: &Device) -> Result<Option<Tensor>> {
        let Some(&f) = self.factors.get(name) else {
            return Ok(None);
        };
        let t = match f {
            Factor::Down { rank, inp } => {
                let bound = 1.0 / (inp as f64).sqrt();
                let mut rng = SplitMix64::new(self.seed ^ name_hash(name));
                let v: Vec<f32> = (0..rank * inp)
                    .map(|_| ((2.0 * rng.next_f64() - 1.0) * bound) as f32)
                    .collect();
                Tensor::from_vec(v, (rank, inp), device)?
            }
            Factor::Up { out, rank } => Tensor::zeros((out, rank), DType::F32, device)?,
        };
        Ok(Some(t))
    }
}

/// FNV-1a of a name: a per-tensor stream of the seed's generator.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rank: usize, targets: &[&str], full: &[&str]) -> TrainConfig {
        let mut c = vc_core::config::resolve_layers(vec![])
            .unwrap()
            .config
            .train;
        c.lora_rank = rank;
        c.lora_targets = targets.iter().map(|s| s.to_string()).collect();
        c.lora_full = full.iter().map(|s| s.to_string()).collect();
        c
    }

    const TENSORS: [(&str, &[usize]); 5] = [
        ("talker.model.layers.0.self_attn.q_proj.weight", &[8, 4]),
        ("talker.model.layers.0.self_attn.q_norm.weight", &[2]),
        (
            "talker.code_predictor.model.layers.1.mlp.down_proj.weight",
            &[4, 6],
        ),
        ("talker.codec_head.weight", &[10, 4]),
        ("speaker_encoder.fc.weight", &[3, 3]),
    ];

    #[test]
    fn targets_factors_and_first_values() {
        assert!(is_adaptable("talker.model.layers.12.mlp.gate_proj.weight"));
        assert!(!is_adaptable("talker.model.layers.x.mlp.gate_proj.weight"));
        assert!(!is_adaptable("talker.codec_head.weight"));
        let c = config(2, &["talker.*_proj.weight"], &["talker.codec_head.weight"]);
        let l = Lora::from_config(&c, &TENSORS).unwrap().unwrap();
        assert_eq!(l.alpha, 4.0);
        assert_eq!(l.scale(), 2.0);
        assert_eq!(l.targets.len(), 2);
        assert_eq!(
            l.trained(),
            [
                "talker.code_predictor.model.layers.1.mlp.down_proj.lora_A.weight",
                "talker.code_predictor.model.layers.1.mlp.down_proj.lora_B.weight",
                "talker.model.layers.0.self_attn.q_proj.lora_A.weight",
                "talker.model.layers.0.self_attn.q_proj.lora_B.weight",
                "talker.codec_head.weight",
            ]
        );
        let a_name = "talker.model.layers.0.self_attn.q_proj.lora_A.weight";
        let a = l.initial(a_name, &Device::Cpu).unwrap().unwrap();
        assert_eq!(a.dims(), [2, 4]);
        let v: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.abs() <= 0.5 && *x != 0.0), "{v:?}");
        // Drawn from the name: the same again, another for another factor.
        let again: Vec<f32> = l
            .initial(a_name, &Device::Cpu)
            .unwrap()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(v, again);
        let b = l
            .initial(
                "talker.model.layers.0.self_attn.q_proj.lora_B.weight",
                &Device::Cpu,
            )
            .unwrap()
            .unwrap();
        assert_eq!(b.dims(), [8, 2]);
        assert_eq!(
            b.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
        assert!(l
            .initial("talker.codec_head.weight", &Device::Cpu)
            .unwrap()
            .is_none());
    }

    #[test]
    fn globs_that_match_nothing_or_twice_are_refused() {
        assert!(Lora::from_config(&config(0, &["x"], &[]), &TENSORS)
            .unwrap()
            .is_none());
        let e = Lora::from_config(&config(2, &["talker.codec_head.weight"], &[]), &TENSORS)
            .unwrap_err();
        assert!(e.to_string().contains("lora_full"), "{e}");
        let e = Lora::from_config(
            &config(2, &["talker.*_proj.weight"], &["talker.typo"]),
            &TENSORS,
        )
        .unwrap_err();
        assert!(e.to_string().contains("talker.typo"), "{e}");
        let e = Lora::from_config(
            &config(
                2,
                &["talker.*_proj.weight"],
                &["talker.model.layers.0.self_attn.q_proj.weight"],
            ),
            &TENSORS,
        )
        .unwrap_err();
        assert!(e.to_string().contains("both adapted"), "{e}");
    }

    /// The smallest adapted side bounds the rank: here the predictor's down projection (4×6)
    /// when every projection is adapted, the talker's q projection (8×4) alone otherwise.
    #[test]
    fn a_rank_above_the_smaller_side_is_refused_naming_the_largest_useful_one() {
        let all = ["talker.*_proj.weight"];
        assert!(Lora::from_config(&config(4, &all, &[]), &TENSORS).is_ok());
        let e = Lora::from_config(&config(5, &all, &[]), &TENSORS).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("largest useful rank for these targets is 4")
                && e.contains("talker.code_predictor.model.layers.1.mlp.down_proj.weight (4×6)"),
            "{e}"
        );
        let q = ["talker.model.layers.0.self_attn.q_proj.weight"];
        assert!(Lora::from_config(&config(4, &q, &[]), &TENSORS).is_ok());
        let e = Lora::from_config(&config(1_000_000, &q, &[]), &TENSORS).unwrap_err();
        assert!(e.to_string().contains("is 4"), "{e}");
    }
}
