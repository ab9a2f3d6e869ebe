use std::sync::Arc;

use anyhow::Result;

use crate::cli::PrepArgs;
use vc_core::config::Config;
use vc_core::workspace::Workspace;
use vc_prep::segment::Rules;
use vc_prep::speakers::{self, SpeakerInputs};
use vc_prep::transcribe::{resolve_whisper_spec, Transcriber, WhisperTranscriber};
use vc_prep::{self as prep, PrepOptions};

pub fn run(ws: &Workspace, config: &Config, args: &PrepArgs) -> Result<()> {
    let p = &config.prep;
    let opts = PrepOptions {
        inputs: args.inputs.clone(),
        rules: Rules {
            min_seconds: p.min_seconds,
            max_seconds: p.max_seconds,
            max_merge_gap: p.max_merge_gap,
            max_no_speech_prob: p.max_no_speech_prob,
            pad_seconds: p.pad_seconds,
            silence_db: p.silence_db,
        },
        whisper_model: p.whisper_model.clone(),
        language: p.language.clone(),
        jobs: p.jobs,
        ref_audio: (!p.ref_audio.trim().is_empty()).then(|| ws.config_path(&p.ref_audio)),
        force: args.force,
    };
    let make = || -> Result<Arc<dyn Transcriber>> {
        let spec = resolve_whisper_spec(ws, &p.whisper_model);
        let model = vc_core::hub::resolve_single_file(&spec)
            .map_err(|e| e.context("cannot find the Whisper model (prep.whisper_model)"))?;
        Ok(Arc::new(WhisperTranscriber::load(&model, &p.language)?))
    };
    let speakers = match (&args.speaker, &args.speakers_from_dirs) {
        (None, None) => {
            let summary = prep::run(ws, &opts, &make)?;
            print!("{}", summary.render());
            return Ok(());
        }
        (Some(name), _) => vec![SpeakerInputs {
            name: name.clone(),
            inputs: args.inputs.clone(),
        }],
        (None, Some(parent)) => {
            let (speakers, warnings) = speakers::from_dirs(parent)?;
            for w in warnings {
                eprintln!("warning: {w}");
            }
            speakers
        }
    };
    let summaries = speakers::run(ws, &opts, &speakers, &make)?;
    for (name, summary) in &summaries {
        println!("speaker {name}:");
        print!("{}", summary.render());
    }
    Ok(())
}
