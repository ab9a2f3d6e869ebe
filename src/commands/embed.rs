//! `voiceclone embed`: the speaker x-vector of the reference clip (docs/model.md §7
//! `create_voice_clone_prompt`, docs/model.md §8) → `data/speaker.safetensors`, tensor
//! `speaker_embedding`, shape `(enc_dim,)`, f32.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use crate::artifacts::speaker;
use crate::cli::EmbedArgs;
use crate::config::Config;
use crate::model::speaker::SpeakerEncoder;
use crate::workspace::Workspace;

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
    let output = args.output.clone().unwrap_or_else(|| ws.speaker_file());
    if same_file(&output, &ref_audio) {
        bail!(
            "output {} is the reference audio itself; choose another -o path",
            output.display()
        );
    }

    let source = ws.model_source(&config.model.base)?;
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
    speaker::write(&output, &embedding, Some(metadata))?;
    println!(
        "wrote {}: {}-dimensional speaker embedding of {}",
        ws.display(&output),
        embedding.len(),
        ws.display(&ref_audio)
    );
    Ok(())
}

/// Whether two paths name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}
