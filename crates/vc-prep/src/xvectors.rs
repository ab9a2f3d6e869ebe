//! The speaker x-vectors of a workspace (docs/model.md §7 `create_voice_clone_prompt`,
//! docs/model.md §8): what `voiceclone embed` writes and what `train` computes when a file is
//! missing — `data/speaker.safetensors`, tensor `speaker_embedding`, shape `(enc_dim,)`, f32, or
//! with named speakers (docs/training.md §3.3) `data/speakers/NAME.safetensors`. `embed.mode =
//! "mean"` averages (in f32) the x-vectors of up to `embed.mean_clips` utterances instead of
//! taking the reference clip's. A library step, so that the command and the trainer share it;
//! commands hand it the `[embed]` section and the model spec, never the whole configuration.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Device;

use vc_core::artifacts::manifest::Manifest;
use vc_core::artifacts::speaker;
use vc_core::config::{EmbedConfig, EmbedMode};
use vc_core::workspace::Workspace;
use vc_model::speaker::SpeakerEncoder;

/// Loads the speaker encoder of the model spec `model` (`model.base`) once and writes every
/// job's x-vector file, recording `model` in its metadata, and handing `report` a line for each
/// as soon as it is written.
pub fn write_jobs(
    ws: &Workspace,
    model: &str,
    jobs: &[XVectorJob],
    mut report: impl FnMut(&str),
) -> Result<()> {
    let encoder = LoadedSpeakerEncoder::load(ws, model)?;
    for job in jobs {
        report(&encoder.run(ws, job)?);
    }
    Ok(())
}

/// The named speakers of the workspace's manifest (none without a manifest or names).
pub fn workspace_speakers(ws: &Workspace) -> Result<Vec<String>> {
    let path = ws.manifest();
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let m = Manifest::read(&path)?;
    let problems = m.speaker_problems();
    if !problems.is_empty() {
        const SHOWN: usize = 10;
        let mut msg = format!(
            "{} line(s) of {} break the speaker rules:",
            problems.len(),
            path.display()
        );
        for (line, why) in problems.iter().take(SHOWN) {
            msg.push_str(&format!("\n  {}:{line}: {why}", path.display()));
        }
        if problems.len() > SHOWN {
            msg.push_str(&format!("\n  … and {} more", problems.len() - SHOWN));
        }
        bail!(msg);
    }
    Ok(m.speakers())
}

/// One x-vector file to compute.
pub struct XVectorJob {
    pub speaker: Option<String>,
    /// The reference clip (`Ref`) or the utterances to average (`Mean`).
    pub clips: Vec<PathBuf>,
    pub mode: EmbedMode,
    pub output: PathBuf,
}

/// The job of a workspace without named speakers: `data/ref.wav`, or the average of its
/// utterances, into `data/speaker.safetensors`, as `embed` (the `[embed]` section) says.
pub fn single_speaker_job(ws: &Workspace, embed: &EmbedConfig) -> Result<XVectorJob> {
    let output = ws.speaker_file();
    match embed.mode {
        EmbedMode::Ref => {
            let path = ws.ref_wav();
            if !path.is_file() {
                bail!(
                    "no reference clip: {} does not exist in workspace {}. Run `voiceclone prep` \
                     first (it picks or copies the reference clip), or pass one: `voiceclone embed \
                     REF_AUDIO`",
                    ws.relative(&path),
                    ws.root().display()
                );
            }
            Ok(XVectorJob {
                speaker: None,
                clips: vec![path],
                mode: EmbedMode::Ref,
                output,
            })
        }
        EmbedMode::Mean => Ok(XVectorJob {
            speaker: None,
            clips: mean_clips(ws, None, embed.mean_clips)?,
            mode: EmbedMode::Mean,
            output,
        }),
    }
}

/// The job of the named speaker `name`, with the `embed.mode` of `embed` (the `[embed]` section).
pub fn speaker_job(ws: &Workspace, embed: &EmbedConfig, name: &str) -> Result<XVectorJob> {
    let output = ws.speaker_file_of(name);
    let clips = match embed.mode {
        EmbedMode::Ref => {
            let path = ws.ref_clip(name);
            if !path.is_file() {
                let quoted = vc_core::shell::quote(name);
                bail!(
                    "no reference clip for speaker {name:?}: {} does not exist; run `voiceclone \
                     prep --speaker {quoted} INPUT...` (it picks the clip), or pass one: \
                     `voiceclone embed --speaker {quoted} REF_AUDIO`",
                    ws.relative(&path)
                );
            }
            vec![path]
        }
        EmbedMode::Mean => mean_clips(ws, Some(name), embed.mean_clips)?,
    };
    Ok(XVectorJob {
        speaker: Some(name.to_string()),
        clips,
        mode: embed.mode,
        output,
    })
}

/// Up to `n` utterances of `speaker` (every row when `None`), spread evenly over its manifest
/// lines (row `⌊i·len/k⌋` for i < k), so that different recordings and sessions are averaged.
fn mean_clips(ws: &Workspace, speaker: Option<&str>, n: usize) -> Result<Vec<PathBuf>> {
    let path = ws.manifest();
    if !path.is_file() {
        bail!(
            "embed.mode = \"mean\" averages the utterances of {}, which does not exist; run \
             `voiceclone prep` first",
            ws.relative(&path)
        );
    }
    let m = Manifest::read(&path)?;
    let rows: Vec<(usize, &str)> = m
        .rows()
        .filter(|(_, r)| speaker.is_none() || r.speaker.as_deref() == speaker)
        .filter_map(|(line, r)| r.audio.as_deref().map(|a| (line, a)))
        .collect();
    if rows.is_empty() {
        bail!(
            "{} has no utterance (a line with \"audio\"){} to average",
            ws.relative(&path),
            speaker
                .map(|s| format!(" of speaker {s:?}"))
                .unwrap_or_default()
        );
    }
    let k = n.min(rows.len());
    (0..k)
        .map(|i| {
            let (line, audio) = rows[i * rows.len() / k];
            let clip = ws.resolve(audio);
            if !clip.is_file() {
                bail!(
                    "{}:{line}: the utterance {} does not exist",
                    ws.relative(&path),
                    clip.display()
                );
            }
            Ok(clip)
        })
        .collect()
}

/// The speaker encoder of a model spec (`model.base`), loaded once for any number of jobs.
struct LoadedSpeakerEncoder {
    encoder: SpeakerEncoder,
    /// The spec it was loaded from, as the written files' metadata records it.
    model: String,
}

impl LoadedSpeakerEncoder {
    fn load(ws: &Workspace, model: &str) -> Result<Self> {
        let source = ws.model_source(model)?;
        let encoder = SpeakerEncoder::from_model(&source, &Device::Cpu)
            .with_context(|| format!("cannot load the speaker encoder of {}", source.describe()))?;
        Ok(Self {
            encoder,
            model: model.to_string(),
        })
    }

    fn embed_clip(&self, clip: &Path) -> Result<Vec<f32>> {
        let rate = self.encoder.config.sample_rate;
        let wav = vc_audio::load_mono(clip, rate)?;
        self.encoder
            .embed(&wav, rate)
            .with_context(|| format!("cannot compute the speaker embedding of {}", clip.display()))
    }

    /// Computes and writes `job`'s x-vector file; returns the line that reports it.
    fn run(&self, ws: &Workspace, job: &XVectorJob) -> Result<String> {
        let vectors = job
            .clips
            .iter()
            .map(|c| self.embed_clip(c))
            .collect::<Result<Vec<_>>>()?;
        let embedding = match job.mode {
            EmbedMode::Ref => vectors.into_iter().next().context("no reference clip")?,
            EmbedMode::Mean => speaker::mean(&vectors)?,
        };
        let mut metadata = HashMap::from([
            (
                "format".to_string(),
                "voiceclone speaker embedding".to_string(),
            ),
            ("model".to_string(), self.model.clone()),
            ("mode".to_string(), job.mode.name().to_string()),
        ]);
        match job.mode {
            EmbedMode::Ref => {
                metadata.insert("ref_audio".into(), job.clips[0].display().to_string());
            }
            EmbedMode::Mean => {
                metadata.insert("clips".into(), job.clips.len().to_string());
            }
        }
        if let Some(name) = &job.speaker {
            metadata.insert("speaker".into(), name.clone());
        }
        speaker::write(&job.output, &embedding, Some(metadata))?;
        let of = match (&job.speaker, job.mode) {
            (Some(n), EmbedMode::Mean) => {
                format!("speaker {n}, mean of {} utterances", job.clips.len())
            }
            (None, EmbedMode::Mean) => format!("the mean of {} utterances", job.clips.len()),
            (Some(n), EmbedMode::Ref) => format!("speaker {n}, {}", ws.display(&job.clips[0])),
            (None, EmbedMode::Ref) => ws.display(&job.clips[0]),
        };
        Ok(format!(
            "wrote {}: {}-dimensional speaker embedding of {of}",
            ws.display(&job.output),
            embedding.len(),
        ))
    }
}
