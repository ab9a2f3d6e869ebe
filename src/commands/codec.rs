//! `voiceclone codec encode|decode`: single files through the speech tokenizer, with the same
//! `{"codes": [[16 ints], ...]}` JSON that `speak --save-codes` writes; `-o -` writes the JSON
//! or the WAV to standard output, as `speak -o -` does.

use anyhow::{Context, Result};

use super::output::{is_stdout, write_stdout};
use crate::cli::CodecCommand;
use vc_audio::{self as audio, wav};
use vc_core::artifacts::codes::{
    codes_file_text, frames_from_rows, read_codes_file, write_codes_file,
};
use vc_core::config::Config;
use vc_core::workspace::Workspace;
use vc_prep::codes::{load_codec, CodecOptions};

/// Existing outputs are only replaced with `--overwrite`, as everywhere else; checked before
/// any model is loaded.
fn check_output(output: &std::path::Path, overwrite: bool) -> Result<()> {
    anyhow::ensure!(
        overwrite || is_stdout(output) || !output.exists(),
        "{} already exists; pass --overwrite to replace it",
        output.display()
    );
    Ok(())
}

pub fn run(ws: &Workspace, config: &Config, cmd: &CodecCommand) -> Result<()> {
    let codec_options = CodecOptions::new(
        &config.codes.tokenizer,
        &config.model.base,
        config.codes.batch_size,
    );
    match cmd {
        CodecCommand::Encode {
            audio,
            output,
            overwrite,
            ..
        } => {
            check_output(output, *overwrite)?;
            let codec = load_codec(ws, &codec_options)?;
            let samples = audio::load_mono(audio, codec.sample_rate())?;
            anyhow::ensure!(!samples.is_empty(), "{} contains no audio", audio.display());
            let frames = frames_from_rows(&codec.encode(&samples)?)?;
            if is_stdout(output) {
                write_stdout(codes_file_text(&frames).as_bytes())?;
                eprintln!("wrote standard output: {} frames", frames.len());
            } else {
                write_codes_file(output, &frames)?;
                println!("wrote {}: {} frames", output.display(), frames.len());
            }
        }
        CodecCommand::Decode {
            codes,
            output,
            overwrite,
            ..
        } => {
            check_output(output, *overwrite)?;
            let frames = read_codes_file(codes)?;
            let codec = load_codec(ws, &codec_options)?;
            let samples = codec
                .decode(&frames)
                .with_context(|| format!("cannot decode {}", codes.display()))?;
            let rate = codec.output_sample_rate();
            let report = format!(
                "{} frames, {:.2} s at {rate} Hz",
                frames.len(),
                samples.len() as f64 / rate as f64,
            );
            if is_stdout(output) {
                write_stdout(&wav::pcm16_bytes(&samples, rate)?)?;
                eprintln!("wrote standard output: {report}");
            } else {
                wav::write_pcm16(output, &samples, rate)?;
                println!("wrote {}: {report}", output.display());
            }
        }
    }
    Ok(())
}
