//! A checkpoint's `index.json` (docs/training.md §7.1): its schema — step, world size, data
//! cursor and RNG state, the run's identity, every tensor's shape and row ranges per rank —
//! and reading and updating it.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::sampler::Cursor;
use crate::step::params::ParamStore;

use super::{Identity, FORMAT, INDEX, VERSION};

/// Rows `[start, end)` of a tensor held by `rank`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRows {
    pub rank: usize,
    pub rows: [usize; 2],
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamInfo {
    pub shape: Vec<usize>,
    pub unit: String,
    pub shards: Vec<RankRows>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerInfo {
    pub name: String,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Updates taken (AdamW's bias-correction step count).
    pub step: u64,
    /// How the state is kept (docs/training.md §6.5); checkpoints from before the modes are
    /// fp32.
    #[serde(default)]
    pub state: vc_core::config::OptimizerState,
}

/// `index.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    pub format: String,
    pub version: u32,
    pub world_size: usize,
    /// Optimizer steps completed.
    pub step: usize,
    /// Epoch of the data cursor (0-based).
    pub epoch: usize,
    pub cursor: Cursor,
    /// The data-order RNG: algorithm and its state at the start of `epoch`.
    pub rng: RngInfo,
    /// SHA-256 of `identity`.
    pub config_digest: String,
    pub identity: Identity,
    /// SHA-256 of the training samples (text ids and codes) the cursor refers to.
    pub data_sha256: String,
    pub optimizer: OptimizerInfo,
    /// Loss of the last step before this checkpoint.
    pub loss: Option<f64>,
    /// What the validations up to this step found (docs/training.md §14.3); absent in
    /// checkpoints of runs that never validated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<crate::selection::Selection>,
    pub params: BTreeMap<String, ParamInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngInfo {
    pub algorithm: String,
    pub state: u64,
}

impl Index {
    /// Describes the parameter set of a single-device run (every row on rank 0).
    pub fn describe_params(params: &ParamStore) -> BTreeMap<String, ParamInfo> {
        params
            .params
            .iter()
            .map(|p| {
                let rows = p.shape().first().copied().unwrap_or(1);
                (
                    p.name.clone(),
                    ParamInfo {
                        shape: p.shape().to_vec(),
                        unit: p.unit.to_string(),
                        shards: vec![RankRows {
                            rank: 0,
                            rows: [0, rows],
                        }],
                    },
                )
            })
            .collect()
    }
}

/// Records `selection` in the index of the complete checkpoint `dir` (atomically): what an
/// evaluation found after the checkpoint was written (its samples' score,
/// docs/training.md §14.5). Killed before, the checkpoint keeps the selection it was written with.
pub fn write_selection(dir: &Path, selection: &crate::selection::Selection) -> Result<()> {
    let mut index = read_index(dir)?;
    index.selection = Some(selection.clone());
    let mut json = serde_json::to_string_pretty(&index)?;
    json.push('\n');
    vc_core::fsutil::write_atomic(&dir.join(INDEX), json.as_bytes())
        .with_context(|| format!("cannot update {}", dir.join(INDEX).display()))
}

pub fn read_index(dir: &Path) -> Result<Index> {
    let path = dir.join(INDEX);
    let text =
        fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let index: Index = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a voiceclone checkpoint index", path.display()))?;
    if index.format != FORMAT || index.version != VERSION {
        bail!(
            "{}: unsupported checkpoint format {:?} version {}",
            path.display(),
            index.format,
            index.version
        );
    }
    Ok(index)
}
