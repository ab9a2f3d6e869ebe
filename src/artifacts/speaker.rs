//! The speaker file: one x-vector (docs/model.md §8) as a safetensors file holding the f32
//! tensor `speaker_embedding` of shape `(D,)` (D = the talker's hidden size), written by
//! `voiceclone embed` and copied into every training checkpoint.

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
}
