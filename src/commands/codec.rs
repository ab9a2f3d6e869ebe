//! `voiceclone codec encode|decode`: single files through the speech tokenizer, with the same
//! `{"codes": [[16 ints], ...]}` JSON that `speak --save-codes` writes.

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::codes::{load_codec, to_frame};
use crate::audio::{self, wav};
use crate::cli::CodecCommand;
use crate::codes::{codes_to_json, parse_codes, Frame};
use crate::config::Config;
use crate::fsutil::write_atomic;
use crate::workspace::Workspace;

pub fn run(ws: &Workspace, config: &Config, cmd: &CodecCommand) -> Result<()> {
    match cmd {
        CodecCommand::Encode { audio, output, .. } => {
            let codec = load_codec(ws, config)?;
            let samples = audio::load_mono(audio, codec.sample_rate())?;
            anyhow::ensure!(!samples.is_empty(), "{} contains no audio", audio.display());
            let frames: Vec<Frame> = codec
                .encode(&samples)?
                .iter()
                .map(|r| to_frame(r))
                .collect::<Result<_>>()?;
            let doc = json!({ "codes": codes_to_json(&frames) });
            write_atomic(output, (serde_json::to_string(&doc)? + "\n").as_bytes())?;
            println!("wrote {}: {} frames", output.display(), frames.len());
        }
        CodecCommand::Decode { codes, output, .. } => {
            let text = std::fs::read_to_string(codes)
                .with_context(|| format!("cannot read {}", codes.display()))?;
            let doc: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", codes.display()))?;
            let frames = parse_codes(doc.get("codes")).with_context(|| {
                format!(
                    "{}: expected {{\"codes\": [[16 non-negative ints], ...]}}",
                    codes.display()
                )
            })?;
            anyhow::ensure!(!frames.is_empty(), "{} holds no frames", codes.display());
            let codec = load_codec(ws, config)?;
            let samples = codec
                .decode(&frames)
                .with_context(|| format!("cannot decode {}", codes.display()))?;
            wav::write_pcm16(output, &samples, codec.output_sample_rate())?;
            println!(
                "wrote {}: {} frames, {:.2} s at {} Hz",
                output.display(),
                frames.len(),
                samples.len() as f64 / codec.output_sample_rate() as f64,
                codec.output_sample_rate()
            );
        }
    }
    Ok(())
}
