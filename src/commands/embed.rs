//! `voiceclone embed`: the speaker x-vector of the reference clip (spec §7
//! `create_voice_clone_prompt`, §8) → `data/speaker.safetensors`, tensor `speaker_embedding`,
//! shape `(enc_dim,)`, f32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Device;

use super::model_source;
use crate::cli::EmbedArgs;
use crate::config::Config;
use crate::model::speaker::SpeakerEncoder;
use crate::workspace::Workspace;

/// File name of the embedding inside the workspace's `data/`.
pub const SPEAKER_FILE: &str = "speaker.safetensors";
/// Tensor name inside it.
pub const TENSOR_NAME: &str = "speaker_embedding";

pub fn run(ws: &Workspace, config: &Config, args: &EmbedArgs) -> Result<()> {
    let ref_audio = match &args.ref_audio {
        Some(path) => {
            if !path.is_file() {
                bail!(
                    "reference audio {} does not exist or is not a file",
                    path.display()
                );
            }
            path.clone()
        }
        None => {
            let path = ws.ref_wav();
            if !path.is_file() {
                bail!(
                    "no reference clip: {} does not exist in workspace {}. Run `voiceclone prep` first \
                     (it picks or copies the reference clip), or pass one: `voiceclone embed REF_AUDIO`",
                    ws.relative(&path),
                    ws.root().display()
                );
            }
            path
        }
    };
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| ws.data_dir().join(SPEAKER_FILE));
    if same_file(&output, &ref_audio) {
        bail!(
            "output {} is the reference audio itself; choose another -o path",
            output.display()
        );
    }

    let source = model_source(ws, &config.model.base)?;
    let encoder = SpeakerEncoder::from_model(&source, &Device::Cpu)
        .with_context(|| format!("cannot load the speaker encoder of {}", source.describe()))?;
    let rate = encoder.config.sample_rate;
    let wav = crate::audio::load_mono(&ref_audio, rate)?;
    let embedding = encoder.embed(&wav, rate).with_context(|| {
        format!(
            "cannot compute the speaker embedding of {}",
            ref_audio.display()
        )
    })?;

    let metadata = HashMap::from([
        (
            "format".to_string(),
            "voiceclone speaker embedding".to_string(),
        ),
        ("model".to_string(), config.model.base.clone()),
        ("ref_audio".to_string(), ref_audio.display().to_string()),
    ]);
    let bytes = serialize_embedding(&embedding, Some(metadata))?;
    crate::fsutil::write_atomic(&output, &bytes)
        .with_context(|| format!("cannot write {}", output.display()))?;
    println!(
        "wrote {}: {}-dimensional speaker embedding of {}",
        display_path(ws, &output),
        embedding.len(),
        display_path(ws, &ref_audio)
    );
    Ok(())
}

/// The safetensors bytes of a `(D,)` f32 tensor named [`TENSOR_NAME`].
pub fn serialize_embedding(
    embedding: &[f32],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let data: Vec<u8> = embedding.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![embedding.len()], &data)
            .map_err(|e| anyhow::anyhow!("cannot build the embedding tensor: {e}"))?;
    safetensors::serialize([(TENSOR_NAME, view)], metadata)
        .map_err(|e| anyhow::anyhow!("cannot serialise the speaker embedding: {e}"))
}

/// `model.base` as a [`ModelSource`]: a relative path that exists in the workspace is local;
/// anything else (absolute paths, hub ids) is passed on.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn display_path(ws: &Workspace, path: &Path) -> String {
    let abs: PathBuf = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    if abs.starts_with(ws.root()) {
        ws.relative(&abs)
    } else {
        path.display().to_string()
    }
}
