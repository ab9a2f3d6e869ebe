//! The speaker file: one x-vector (docs/model.md §8) as a safetensors file holding the f32
//! tensor `speaker_embedding` of shape `(D,)` (D = the talker's hidden size), written by
//! `voiceclone embed` and copied into every training checkpoint.
//!
//! A multi-speaker workspace (docs/training.md §3.3) holds one such file per speaker in a
//! directory, named [`file_name`]`(NAME)`; [`check_name`] and [`check_unique`] are the rules for
//! speaker names everywhere (prep, the manifest, the export's lower-cased `spk_id` keys).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::fsutil::write_atomic;

/// Name of the tensor inside the file.
pub const TENSOR_NAME: &str = "speaker_embedding";

/// The file's bytes for `embedding`, with optional string metadata.
pub fn to_bytes(embedding: &[f32], metadata: Option<HashMap<String, String>>) -> Result<Vec<u8>> {
    let data: Vec<u8> = embedding.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![embedding.len()], &data)
            .map_err(|e| anyhow::anyhow!("cannot build the embedding tensor: {e}"))?;
    safetensors::serialize([(TENSOR_NAME, view)], metadata)
        .map_err(|e| anyhow::anyhow!("cannot serialise the speaker embedding: {e}"))
}

/// Writes the speaker file atomically.
pub fn write(
    path: &Path,
    embedding: &[f32],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    write_atomic(path, &to_bytes(embedding, metadata)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Reads the x-vector of a speaker file (f32, or any float type widened to f32).
pub fn read(path: &Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read the speaker embedding {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", path.display()))?;
    let t = st.tensor(TENSOR_NAME).map_err(|_| {
        anyhow::anyhow!(
            "{} has no tensor {TENSOR_NAME} (was it written by `voiceclone embed`?)",
            path.display()
        )
    })?;
    if t.shape().len() != 1 {
        bail!(
            "{}: {TENSOR_NAME} has shape {:?}, expected one dimension",
            path.display(),
            t.shape()
        );
    }
    let data = t.data();
    let values = match t.dtype() {
        safetensors::Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        safetensors::Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        safetensors::Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => bail!(
            "{}: {TENSOR_NAME} has dtype {other:?}, expected a float type",
            path.display()
        ),
    };
    Ok(values)
}

/// [`read`], checked against the model's hidden size `dim`.
pub fn read_for_model(path: &Path, dim: usize) -> Result<Vec<f32>> {
    let x = read(path)?;
    if x.len() != dim {
        bail!(
            "the speaker embedding in {} has {} values, but the model needs {dim}: it was computed \
             with another model; run `voiceclone embed` again with this model",
            path.display(),
            x.len()
        );
    }
    Ok(x)
}

/// Longest speaker name accepted.
pub const MAX_NAME_CHARS: usize = 64;

/// Why `name` cannot be a speaker name, if it cannot: it must be non-empty, at most
/// [`MAX_NAME_CHARS`] characters, without surrounding white space, not start with `.`, and hold no
/// path separator (`/`, `\`), `:` or control character — it names files (`data/ref/NAME.wav`,
/// `data/speakers/NAME.safetensors`) and, lower-cased, a key of the export's `spk_id`.
pub fn check_name(name: &str) -> std::result::Result<(), String> {
    let why = if name.is_empty() {
        "is empty"
    } else if name.chars().count() > MAX_NAME_CHARS {
        "is longer than 64 characters"
    } else if name.trim() != name {
        "has white space at its start or end"
    } else if name.starts_with('.') {
        "starts with a dot"
    } else if name.contains(['/', '\\']) {
        "contains a path separator (/ or \\)"
    } else if name.contains(':') {
        "contains a colon"
    } else if name.chars().any(char::is_control) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(format!("the speaker name {name:?} {why}"))
}

/// Speaker names are compared case-insensitively (the official package looks speakers up in
/// lower case): the key two names must not share.
pub fn name_key(name: &str) -> String {
    name.to_lowercase()
}

/// Checks every name with [`check_name`] and that no two differ only in case.
pub fn check_unique<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let mut seen: HashMap<String, &str> = HashMap::new();
    for name in names {
        check_name(name).map_err(|e| anyhow::anyhow!(e))?;
        if let Some(other) = seen.insert(name_key(name), name) {
            if other != name {
                bail!(
                    "the speaker names {other:?} and {name:?} differ only in case; speaker names \
                     are compared case-insensitively (the exported model stores them in lower case)"
                );
            }
        }
    }
    Ok(())
}

/// File name of the speaker file of speaker `name` in a directory of speaker files.
pub fn file_name(name: &str) -> String {
    format!("{name}.safetensors")
}

/// The x-vectors of `names`, in that order, from the directory `dir` of speaker files, each
/// checked against the model's hidden size `dim`.
pub fn read_set(dir: &Path, names: &[String], dim: usize) -> Result<Vec<Vec<f32>>> {
    names
        .iter()
        .map(|name| {
            let path = dir.join(file_name(name));
            if !path.is_file() {
                bail!(
                    "no x-vector for speaker {name:?}: {} does not exist; run `voiceclone embed`",
                    path.display()
                );
            }
            read_for_model(&path, dim)
        })
        .collect()
}

/// The element-wise mean of x-vectors of equal length, accumulated in f64 and rounded once to
/// f32 (never in bf16, whose 8-bit mantissa would lose most of the averaging).
pub fn mean(vectors: &[Vec<f32>]) -> Result<Vec<f32>> {
    let Some(first) = vectors.first() else {
        bail!("no x-vectors to average");
    };
    let mut sum = vec![0f64; first.len()];
    for v in vectors {
        if v.len() != sum.len() {
            bail!(
                "x-vectors of {} and {} values cannot be averaged",
                sum.len(),
                v.len()
            );
        }
        for (s, x) in sum.iter_mut().zip(v) {
            *s += *x as f64;
        }
    }
    let n = vectors.len() as f64;
    Ok(sum.into_iter().map(|s| (s / n) as f32).collect())
}

/// The tensor of a speaker table file: the x-vectors of named speakers `(S, H)` f32, their names
/// (JSON list) in the metadata key `speakers` (a checkpoint's `speakers.safetensors`, an adapter
/// directory's, docs/training.md §7.1).
pub const TABLE: &str = "speaker_embeddings";

/// The bytes of a speaker table file of `speakers` (name, x-vector; all of one length).
pub fn table_bytes(speakers: &[(&str, &[f32])]) -> Result<Vec<u8>> {
    let Some((_, first)) = speakers.first() else {
        bail!("a speaker table needs at least one speaker");
    };
    if speakers.iter().any(|(_, x)| x.len() != first.len()) {
        bail!("the x-vectors of a speaker table must have one length");
    }
    let data: Vec<u8> = speakers
        .iter()
        .flat_map(|(_, x)| x.iter().flat_map(|v| v.to_le_bytes()))
        .collect();
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::F32,
        vec![speakers.len(), first.len()],
        &data,
    )
    .map_err(|e| anyhow::anyhow!("cannot build the speaker table: {e}"))?;
    let names: Vec<&str> = speakers.iter().map(|(n, _)| *n).collect();
    let meta = HashMap::from([("speakers".to_string(), serde_json::to_string(&names)?)]);
    safetensors::serialize([(TABLE, view)], Some(meta))
        .map_err(|e| anyhow::anyhow!("cannot serialise the speaker table: {e}"))
}

/// Reads a speaker table file: (name, x-vector) in table order.
pub fn read_table(path: &Path) -> Result<Vec<(String, Vec<f32>)>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .with_context(|| format!("{} is not a safetensors file", path.display()))?;
    let names: Vec<String> = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("speakers"))
        .and_then(|j| serde_json::from_str(j).ok())
        .with_context(|| format!("{} has no speaker names", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", path.display()))?;
    let t = st
        .tensor(TABLE)
        .map_err(|_| anyhow::anyhow!("{} has no tensor {TABLE}", path.display()))?;
    if t.dtype() != safetensors::Dtype::F32 || t.shape().len() != 2 || t.shape()[0] != names.len() {
        bail!(
            "{}: {TABLE} is {:?} {:?}, expected f32 ({}, H)",
            path.display(),
            t.dtype(),
            t.shape(),
            names.len()
        );
    }
    let h = t.shape()[1].max(1);
    let values: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(names
        .into_iter()
        .zip(values.chunks(h))
        .map(|(n, x)| (n, x.to_vec()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_checks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        let x = vec![0.5f32, -1.25, 3.0];
        let meta = HashMap::from([("model".to_string(), "m".to_string())]);
        write(&path, &x, Some(meta)).unwrap();
        assert_eq!(read(&path).unwrap(), x);
        assert_eq!(read_for_model(&path, 3).unwrap(), x);
        let e = read_for_model(&path, 4).unwrap_err().to_string();
        assert!(e.contains("has 3 values, but the model needs 4"), "{e}");
        std::fs::write(&path, b"not safetensors").unwrap();
        assert!(read(&path).is_err());
    }

    #[test]
    fn names_are_checked_and_unique_case_insensitively() {
        for good in ["alice", "Bob", "uncle_fu", "Anna-Lena 2", "zoë"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for (bad, why) in [
            ("", "is empty"),
            ("a/b", "path separator"),
            ("a\\b", "path separator"),
            ("..", "starts with a dot"),
            (" x", "white space"),
            ("c:d", "colon"),
            ("a\tb", "control character"),
        ] {
            let e = check_name(bad).unwrap_err();
            assert!(
                e.contains(why) && e.contains(&format!("{bad:?}")),
                "{bad:?}: {e}"
            );
        }
        assert!(check_name(&"x".repeat(65)).is_err());
        assert!(check_unique(["alice", "bob", "alice"]).is_ok());
        let e = check_unique(["Alice", "bob", "alice"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"Alice\" and \"alice\" differ only in case"),
            "{e}"
        );
        assert!(check_unique(["ok", "no/pe"]).is_err());
    }

    #[test]
    fn mean_is_exact_in_f32_and_sets_are_read_in_order() {
        // bf16 would round 1 + 2^-9 to 1; the f32 mean keeps it.
        let a = vec![1.0f32, -2.0];
        let b = vec![1.0 + 2f32.powi(-8), -4.0];
        assert_eq!(
            mean(&[a.clone(), b]).unwrap(),
            vec![1.0 + 2f32.powi(-9), -3.0]
        );
        assert!(mean(&[]).is_err());
        assert!(mean(&[a.clone(), vec![1.0]]).is_err());
        let dir = tempfile::tempdir().unwrap();
        write(&dir.path().join(file_name("bob")), &[3.0, 4.0], None).unwrap();
        write(&dir.path().join(file_name("al")), &a, None).unwrap();
        let names = vec!["bob".to_string(), "al".to_string()];
        let set = read_set(dir.path(), &names, 2).unwrap();
        assert_eq!(set, vec![vec![3.0, 4.0], a]);
        let e = read_set(dir.path(), &["cy".to_string()], 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no x-vector for speaker \"cy\""), "{e}");
    }
}
