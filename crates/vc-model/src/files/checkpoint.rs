//! The checkpoint files of a model directory: `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json` (transformers' lookup order), checked from their headers
//! alone before anything is loaded.
//!
//! Reading only the headers costs a few kilobytes per file, yet catches what would otherwise
//! surface late or obscurely: a truncated download (the header promises more data than the
//! file holds), a corrupt header, and a checkpoint that belongs to another model size (tensor
//! shapes that contradict `config.json`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use safetensors::tensor::Metadata;
use safetensors::Dtype;
use serde::Deserialize;

use crate::config::Qwen3TtsConfig;
use vc_core::hub::ModelSource;

pub const SINGLE_FILE: &str = "model.safetensors";
pub const SHARD_INDEX: &str = "model.safetensors.index.json";

/// safetensors' own limit on the JSON header.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor as the file header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Index into [`Checkpoint::shards`].
    pub shard: usize,
}

/// The checkpoint shards of a model and the tensors their headers declare.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub shards: Vec<PathBuf>,
    tensors: BTreeMap<String, TensorInfo>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Finds the checkpoint of `source` (downloading hub files) and reads its headers.
    pub fn resolve(source: &ModelSource) -> Result<Self> {
        if let Some(single) = source.optional_file(SINGLE_FILE)? {
            return Self::open(vec![single]);
        }
        let Some(index_path) = source.optional_file(SHARD_INDEX)? else {
            // Offline, "neither" may only mean "not cached" (`none_of` says which).
            return Err(source.none_of(&[SINGLE_FILE, SHARD_INDEX]));
        };
        let text = std::fs::read_to_string(&index_path)
            .with_context(|| format!("cannot read {}", index_path.display()))?;
        let index: ShardIndex = serde_json::from_str(&text).with_context(|| {
            format!("{} is not a safetensors shard index", index_path.display())
        })?;
        let names: BTreeSet<&String> = index.weight_map.values().collect();
        if names.is_empty() {
            bail!("{}: weight_map lists no shards", index_path.display());
        }
        let shards = names
            .iter()
            .map(|name| {
                source
                    .file(name)
                    .with_context(|| format!("shard listed in {}", index_path.display()))
            })
            .collect::<Result<Vec<_>>>()?;
        let checkpoint = Self::open(shards)?;
        // Every tensor the index promises must be in the shard it names.
        for (tensor, shard_name) in &index.weight_map {
            let found = checkpoint
                .tensors
                .get(tensor)
                .map(|t| &checkpoint.shards[t.shard]);
            if !found.is_some_and(|p| p.ends_with(shard_name)) {
                bail!(
                    "{}: tensor {tensor} should be in {shard_name}, but {}",
                    index_path.display(),
                    match found {
                        Some(p) => format!("it is in {}", p.display()),
                        None => "no shard has it".to_string(),
                    }
                );
            }
        }
        Ok(checkpoint)
    }

    /// Reads and checks the header of every shard; a tensor may appear in only one of them.
    pub fn open(shards: Vec<PathBuf>) -> Result<Self> {
        let mut tensors = BTreeMap::new();
        for (i, path) in shards.iter().enumerate() {
            for (name, info) in read_header(path)?.tensors() {
                let entry = TensorInfo {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    shard: i,
                };
                if let Some(prev) = tensors.insert(name.clone(), entry) {
                    bail!(
                        "tensor {name} is in two checkpoint files: {} and {}",
                        shards[prev.shard].display(),
                        path.display()
                    );
                }
            }
        }
        Ok(Checkpoint { shards, tensors })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Checks that the tensors which pin down the architecture have the shapes `config`
    /// implies (names and shapes: docs/model.md §4.3, §5.3, §8.3). The full per-tensor check
    /// happens when the model loads (`Weights::get`); this one fails fast, before gigabytes are
    /// read.
    pub fn check_matches(&self, config: &Qwen3TtsConfig, config_path: &Path) -> Result<()> {
        for (name, shape) in expected_shapes(config) {
            match self.tensors.get(&name) {
                None => bail!(
                    "checkpoint {} has no tensor {name}, which {} requires",
                    self.files_display(),
                    config_path.display()
                ),
                Some(info) if info.shape != shape => bail!(
                    "checkpoint {}: tensor {name} has shape {:?} but {} implies {shape:?} \
                     (is the checkpoint from another model size?)",
                    self.shards[info.shard].display(),
                    info.shape,
                    config_path.display()
                ),
                Some(_) => {}
            }
        }
        Ok(())
    }

    fn files_display(&self) -> String {
        let names: Vec<String> = self
            .shards
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        names.join(", ")
    }
}

/// Architecture-defining tensors: embeddings, heads, final norms, and per layer the attention
/// and MLP input projections (these catch a wrong hidden size, head layout, intermediate size
/// or layer count). Not every tensor: the model loaders check the rest.
fn expected_shapes(config: &Qwen3TtsConfig) -> Vec<(String, Vec<usize>)> {
    let t = &config.talker_config;
    let cp = &t.code_predictor_config;
    let mut out: Vec<(String, Vec<usize>)> = vec![
        (
            "talker.model.text_embedding.weight".into(),
            vec![t.text_vocab_size, t.text_hidden_size],
        ),
        (
            "talker.model.codec_embedding.weight".into(),
            vec![t.vocab_size, t.hidden_size],
        ),
        (
            "talker.text_projection.linear_fc1.weight".into(),
            vec![t.text_hidden_size, t.text_hidden_size],
        ),
        (
            "talker.text_projection.linear_fc2.weight".into(),
            vec![t.hidden_size, t.text_hidden_size],
        ),
        ("talker.model.norm.weight".into(), vec![t.hidden_size]),
        (
            "talker.codec_head.weight".into(),
            vec![t.vocab_size, t.hidden_size],
        ),
        (
            "talker.code_predictor.model.norm.weight".into(),
            vec![cp.hidden_size],
        ),
    ];
    let layers = [
        (
            "talker.model",
            t.num_hidden_layers,
            t.num_attention_heads * t.head_dim,
            t.intermediate_size,
            t.hidden_size,
        ),
        (
            "talker.code_predictor.model",
            cp.num_hidden_layers,
            cp.num_attention_heads * cp.head_dim,
            cp.intermediate_size,
            cp.hidden_size,
        ),
    ];
    for (prefix, n, q_dim, inter, hidden) in layers {
        for i in 0..n {
            out.push((
                format!("{prefix}.layers.{i}.self_attn.q_proj.weight"),
                vec![q_dim, hidden],
            ));
            out.push((
                format!("{prefix}.layers.{i}.mlp.gate_proj.weight"),
                vec![inter, hidden],
            ));
        }
    }
    // Codebooks 1..G-1 each have an input embedding (talker width) and an output head
    // (docs/model.md §5.1).
    for j in 0..t.num_code_groups.saturating_sub(1) {
        out.push((
            format!("talker.code_predictor.model.codec_embedding.{j}.weight"),
            vec![cp.vocab_size, t.hidden_size],
        ));
        out.push((
            format!("talker.code_predictor.lm_head.{j}.weight"),
            vec![cp.vocab_size, cp.hidden_size],
        ));
    }
    if config.has_mtp_projection() {
        out.push((
            "talker.code_predictor.small_to_mtp_projection.weight".into(),
            vec![cp.hidden_size, t.hidden_size],
        ));
    }
    // Only Base models have a speaker encoder (`Qwen3TTSForConditionalGeneration.__init__`); a
    // fine-tuned export (custom_voice) keeps `speaker_encoder_config` but drops its tensors
    // (docs/model.md §10.5).
    if let Some(se) = config
        .speaker_encoder_config
        .as_ref()
        .filter(|_| config.tts_model_type == "base")
    {
        // The x-vector (output of `fc`) is added to the codec embeddings: width enc_dim
        // (docs/model.md §2).
        out.push(("speaker_encoder.fc.bias".into(), vec![se.enc_dim]));
    }
    out
}

/// Parses a safetensors header (without reading tensor data) and checks that the file is as
/// long as the header says.
fn read_header(path: &Path) -> Result<Metadata> {
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("cannot open checkpoint {}", path.display()))?;
    let file_len = file
        .metadata()
        .with_context(|| format!("cannot stat {}", path.display()))?
        .len();
    let broken = |what: String| {
        anyhow!(
            "checkpoint {} is not a valid safetensors file: {what}",
            path.display()
        )
    };
    if file_len < 8 {
        return Err(broken(format!(
            "only {file_len} bytes (truncated or empty download?)"
        )));
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(broken(format!("header length {header_len} is implausible")));
    }
    if 8 + header_len > file_len {
        return Err(broken(format!(
            "truncated: the header needs {} bytes but the file has {file_len} (incomplete download?)",
            8 + header_len
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let metadata: Metadata =
        serde_json::from_slice(&header).map_err(|e| broken(format!("invalid header: {e}")))?;
    let expected = 8 + header_len + metadata.data_len() as u64;
    if file_len < expected {
        return Err(broken(format!(
            "truncated: the header describes {expected} bytes but the file has only {file_len} \
             (incomplete download? delete it and fetch it again)"
        )));
    }
    if file_len > expected {
        return Err(broken(format!(
            "{} unexpected bytes after the last tensor",
            file_len - expected
        )));
    }
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let data = [0u8; 16];
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 2], &data).unwrap();
        safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
        let ok = Checkpoint::open(vec![path.clone()]).unwrap();
        assert_eq!(ok.tensor("w").unwrap().shape, vec![2, 2]);

        let bytes = std::fs::read(&path).unwrap();
        for (cut, needle) in [
            (4, "only 4 bytes"),
            (12, "header needs"),
            (bytes.len() - 3, "describes"),
        ] {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            let err = format!("{:#}", Checkpoint::open(vec![path.clone()]).unwrap_err());
            assert!(
                err.contains("model.safetensors") && err.contains(needle),
                "{err}"
            );
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(b"xx");
        std::fs::write(&path, &longer).unwrap();
        let err = format!("{:#}", Checkpoint::open(vec![path.clone()]).unwrap_err());
        assert!(err.contains("2 unexpected bytes"), "{err}");
    }
}
