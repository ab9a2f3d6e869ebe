//! The adapter directory of `voiceclone export --adapter-only` (docs/training.md §13): PEFT's
//! `adapter_config.json` and `adapter_model.safetensors` (names prefixed `base_model.model.`,
//! f32), and the speakers' x-vectors. What a reader needs to put the adapters on the base model:
//! rank, α, the factors of every adapted matrix, the tensors of whole modules saved beside them,
//! and the speakers in row order.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// PEFT's configuration file.
pub const CONFIG: &str = "adapter_config.json";
/// PEFT's weights file.
pub const WEIGHTS: &str = "adapter_model.safetensors";
/// The speakers' x-vectors, a speaker table file ([`super::speaker::read_table`]).
pub const SPEAKERS: &str = "speakers.safetensors";
/// What PEFT prefixes the names of the model it wraps with.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// The largest adapter scale `α / r` accepted anywhere (training, export, loading): PEFT's and
/// our defaults give 1–2 and recipes in use stay within 16; far beyond, the adapter swamps
/// the weight it adapts and the model speaks noise (docs/training.md §13).
pub const MAX_ADAPTER_SCALE: f64 = 64.0;

/// One f32 tensor of the adapter file.
#[derive(Debug, Clone)]
pub struct Values {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// The factors of one adapted matrix: `a` `(r, in)`, `b` `(out, r)`.
#[derive(Debug, Clone)]
pub struct Factors {
    pub a: Values,
    pub b: Values,
}

/// An adapter directory, read.
#[derive(Debug, Clone)]
pub struct AdapterDir {
    pub dir: PathBuf,
    pub rank: usize,
    pub alpha: f64,
    /// What the export recorded as the base model (`model.base` of the run).
    pub base_model: String,
    /// By adapted matrix (`….weight`).
    pub factors: BTreeMap<String, Factors>,
    /// Tensors of the modules saved whole (train.lora_full), by name.
    pub saved: BTreeMap<String, Values>,
    /// The speakers in row order (row 3000 first), lower-case names.
    pub speakers: Vec<(String, Vec<f32>)>,
}

#[derive(Deserialize)]
struct PeftConfig {
    peft_type: String,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    rank_pattern: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    alpha_pattern: serde_json::Map<String, serde_json::Value>,
}

impl AdapterDir {
    /// Reads `dir`; errors name the file and what is wrong.
    pub fn read(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join(CONFIG);
        let text = std::fs::read_to_string(&cfg_path).with_context(|| {
            format!(
                "cannot read {} (an adapter directory is written by `voiceclone export \
                 --adapter-only`)",
                cfg_path.display()
            )
        })?;
        let cfg: PeftConfig = serde_json::from_str(&text).with_context(|| {
            format!("{} is not a PEFT adapter configuration", cfg_path.display())
        })?;
        let plain = cfg.peft_type == "LORA"
            && cfg.r > 0
            && cfg.lora_alpha >= 0.0
            && cfg.lora_alpha.is_finite()
            && !cfg.use_dora
            && !cfg.use_rslora
            && !cfg.fan_in_fan_out
            && cfg.bias.as_deref().is_none_or(|b| b == "none")
            && cfg.rank_pattern.is_empty()
            && cfg.alpha_pattern.is_empty();
        if plain && cfg.lora_alpha / cfg.r as f64 > MAX_ADAPTER_SCALE {
            bail!(
                "{}: lora_alpha {} over r {} scales the adapters by {:e}, beyond the {} that \
                 any adapter in use needs: the voice would be noise",
                cfg_path.display(),
                cfg.lora_alpha,
                cfg.r,
                cfg.lora_alpha / cfg.r as f64,
                MAX_ADAPTER_SCALE
            );
        }
        if !plain {
            bail!(
                "{}: only plain LoRA adapters are supported (peft_type LORA, r > 0, lora_alpha \
                 ≥ 0, bias \"none\", no DoRA, rsLoRA, fan_in_fan_out or per-module rank and \
                 alpha patterns)",
                cfg_path.display()
            );
        }
        let w_path = dir.join(WEIGHTS);
        let bytes =
            std::fs::read(&w_path).with_context(|| format!("cannot read {}", w_path.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .with_context(|| format!("{} is not a safetensors file", w_path.display()))?;
        let mut halves: BTreeMap<String, (Option<Values>, Option<Values>)> = BTreeMap::new();
        let mut saved = BTreeMap::new();
        for (key, view) in st.iter() {
            if view.dtype() != safetensors::Dtype::F32 {
                bail!(
                    "{}: {key} is {:?}, expected F32",
                    w_path.display(),
                    view.dtype()
                );
            }
            let name = key.strip_prefix(PEFT_PREFIX).with_context(|| {
                format!(
                    "{}: {key} does not start with {PEFT_PREFIX}",
                    w_path.display()
                )
            })?;
            let values = Values {
                shape: view.shape().to_vec(),
                data: view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            };
            if let Some(m) = name.strip_suffix(".lora_A.weight") {
                halves.entry(format!("{m}.weight")).or_default().0 = Some(values);
            } else if let Some(m) = name.strip_suffix(".lora_B.weight") {
                halves.entry(format!("{m}.weight")).or_default().1 = Some(values);
            } else {
                saved.insert(name.to_string(), values);
            }
        }
        let mut factors = BTreeMap::new();
        for (weight, pair) in halves {
            let (Some(a), Some(b)) = pair else {
                bail!(
                    "{}: the adapter of {weight} lacks one of its factors",
                    w_path.display()
                );
            };
            let ok = a.shape.len() == 2
                && b.shape.len() == 2
                && a.shape[0] == cfg.r
                && b.shape[1] == cfg.r;
            if !ok {
                bail!(
                    "{}: the factors of {weight} are {:?} and {:?}, not (r, in) and (out, r) \
                     with r = {}",
                    w_path.display(),
                    a.shape,
                    b.shape,
                    cfg.r
                );
            }
            factors.insert(weight, Factors { a, b });
        }
        let speakers = super::speaker::read_table(&dir.join(SPEAKERS))?;
        let base_model = cfg.base_model_name_or_path.unwrap_or_default();
        Ok(Self {
            dir: dir.to_path_buf(),
            rank: cfg.r,
            alpha: cfg.lora_alpha,
            base_model,
            factors,
            saved,
            speakers,
        })
    }

    /// `α / r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// Writes `speakers` (name, x-vector) to `path` in the layout of [`SPEAKERS`].
pub fn write_speakers(speakers: &[(String, Vec<f32>)], path: &Path) -> Result<()> {
    let rows: Vec<(&str, &[f32])> = speakers
        .iter()
        .map(|(n, x)| (n.as_str(), x.as_slice()))
        .collect();
    let bytes = super::speaker::table_bytes(&rows)?;
    crate::fsutil::write_atomic(path, &bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}
