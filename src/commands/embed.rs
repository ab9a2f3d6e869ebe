//! `voiceclone embed`: the speaker x-vectors of the workspace, or of one reference clip given on
//! the command line (`vc_prep::xvectors`, which the trainer also calls).

use std::path::Path;

use anyhow::{bail, Result};

use crate::cli::EmbedArgs;
use vc_core::artifacts::speaker;
use vc_core::config::{Config, EmbedMode};
use vc_core::workspace::Workspace;
use vc_prep::xvectors::{
    single_speaker_job, speaker_job, workspace_speakers, write_jobs, XVectorJob,
};

pub fn run(ws: &Workspace, config: &Config, args: &EmbedArgs) -> Result<()> {
    let named = workspace_speakers(ws)?;
    if let Some(name) = &args.speaker {
        speaker::check_name(name).map_err(|e| anyhow::anyhow!(e))?;
        if !named.contains(name) {
            bail!(
                "speaker {name:?} has no utterances in {}{}; prepare it first with `voiceclone \
                 prep --speaker {} INPUT...`",
                ws.relative(&ws.manifest()),
                if named.is_empty() {
                    String::new()
                } else {
                    format!(" (its speakers: {})", named.join(", "))
                },
                vc_core::shell::quote(name)
            );
        }
    }
    if let Some(path) = &args.ref_audio {
        if !path.is_file() {
            bail!(
                "reference audio {} does not exist or is not a file",
                path.display()
            );
        }
        let output = match (&args.output, &args.speaker) {
            (Some(o), _) => o.clone(),
            (None, Some(name)) => ws.speaker_file_of(name),
            (None, None) => ws.speaker_file(),
        };
        if same_file(&output, path) {
            bail!(
                "output {} is the reference audio itself; choose another -o path",
                output.display()
            );
        }
        let job = XVectorJob {
            speaker: args.speaker.clone(),
            clips: vec![path.clone()],
            mode: EmbedMode::Ref,
            output,
        };
        return write_jobs(ws, &config.model.base, &[job], |line| println!("{line}"));
    }
    let names: Vec<String> = match &args.speaker {
        Some(name) => vec![name.clone()],
        None => named,
    };
    if names.len() > 1 && args.output.is_some() {
        bail!(
            "-o names one file, but the workspace has {} speakers ({}); pass --speaker NAME",
            names.len(),
            names.join(", ")
        );
    }
    let jobs = if names.is_empty() {
        let mut job = single_speaker_job(ws, &config.embed)?;
        if let Some(o) = &args.output {
            job.output = o.clone();
        }
        vec![job]
    } else {
        let mut jobs = names
            .iter()
            .map(|n| speaker_job(ws, &config.embed, n))
            .collect::<Result<Vec<_>>>()?;
        if let (Some(o), [job]) = (&args.output, jobs.as_mut_slice()) {
            job.output = o.clone();
        }
        jobs
    };
    write_jobs(ws, &config.model.base, &jobs, |line| println!("{line}"))
}

/// Whether two paths name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}
