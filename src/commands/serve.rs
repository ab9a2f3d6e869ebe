//! `voiceclone serve`: load the model and the workspace's voice once, then serve the HTTP API
//! (`vc_serve`, docs/serving.md) until SIGTERM or Ctrl-C.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use crate::voice_setup::{
    adapter_base, check_adapter_base, decode_options, resolve_voice, speak_model, speaker_paces,
    VoiceSpec,
};
use vc_core::artifacts::adapter::AdapterDir;
use vc_core::config;
use vc_core::hub::ModelSource;
use vc_core::workspace::Workspace;
use vc_generate::{Precision, Synthesizer, Voice};
use vc_model::files::ModelFiles;
use vc_serve::{self as serve, voices::Registry, AdapterVoice, ServeOptions, ServerState};

pub fn run(ws: &Workspace, resolved: &config::Resolved) -> Result<()> {
    let config = &resolved.config;
    let s = &config.serve;
    let adapters_from = resolved
        .sources
        .get("serve.adapters")
        .map(ToString::to_string)
        .unwrap_or_default();
    let adapters = s
        .adapters
        .iter()
        .map(|entry| {
            let (name, dir) = config::adapter_entry(entry, |p| ws.config_path(p).exists())
                .map_err(|why| {
                    anyhow::anyhow!(
                        "invalid value for `serve.adapters` (set in {adapters_from}): {why}"
                    )
                })?;
            let a = AdapterDir::read(&ws.config_path(dir))
                .with_context(|| format!("serve.adapters entry {entry:?}"))?;
            Ok((name.map(String::from), a))
        })
        .collect::<Result<Vec<_>>>()?;
    // Without serve.model, adapters go on the base model they were trained on.
    let source = match adapters.first() {
        _ if !s.model.is_empty() => ws.model_source(&s.model)?,
        Some((_, a)) => adapter_base(ws, a)?,
        None => speak_model(ws, config)?,
    };
    let started = std::time::Instant::now();
    let files = ModelFiles::resolve(&source)
        .with_context(|| format!("cannot load the model {}", source.describe()))?;
    // The server runs the talker on the row inference path (continuous batching with per-row
    // caches, docs/serving.md §3).
    let stored = Precision::stored(&files);
    use config::PrecisionSetting as P;
    let (precision, why) = match config.speak.precision {
        P::Auto => (
            Precision::auto(stored, false),
            match stored {
                Some(d) => format!("auto, the checkpoint stores {d:?}"),
                None => "auto".to_string(),
            },
        ),
        P::F32 => (Precision::F32, "as asked".into()),
        P::Bf16Weights => (Precision::Bf16Weights, "as asked".into()),
        P::Q8 => (Precision::Q8, "as asked".into()),
        P::Q4 => (Precision::Q4, "as asked".into()),
        P::Bf16 => bail!(
            "voiceclone serve runs on the row inference path: precision bf16 (the GPU path) is \
             not available; use auto, f32, bf16-weights, q8 or q4 (speak.precision / \
             --precision)"
        ),
    };
    eprintln!(
        "loading {} (precision {precision}: {why})",
        source.describe()
    );
    let mut synth = Synthesizer::from_files(files, precision, &Device::Cpu)
        .with_context(|| format!("cannot load the model {}", source.describe()))?;
    eprintln!(
        "loaded in {:.2} s: {}",
        started.elapsed().as_secs_f64(),
        synth.describe_backend()
    );
    let adapter_voices = put_on_adapters(&mut synth, adapters)?;
    let default_voice = match resolve_voice(ws, &mut synth, &VoiceSpec::default()) {
        Ok(v) => Some(v),
        Err(e) => {
            match e.downcast_ref::<crate::voice_setup::SeveralSpeakers>() {
                Some(s) => eprintln!(
                    "no \"default\" voice: {}; each request names one as its \"voice\"",
                    s.which()
                ),
                None => eprintln!("no \"default\" voice: {e:#}"),
            }
            None
        }
    };
    let speakers = synth.speakers();
    refuse_duplicate_names(default_voice.is_some(), &speakers, &adapter_voices)?;
    let hidden = synth.config().talker_config.hidden_size;
    let model_id = match &synth.files.source {
        ModelSource::Local(p) => p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string()),
        ModelSource::Hub { repo } => repo.clone(),
    };
    let voices = Registry::open(ws, &synth.files.source.describe(), hidden)?;
    let mut defaults = decode_options(&synth, &config.speak);
    defaults.seed = 0;
    let opts = ServeOptions {
        host: s.host.clone(),
        port: s.port,
        api_key: (!s.api_key.is_empty()).then(|| s.api_key.clone()),
        max_batch: s.max_batch,
        max_queue: s.max_queue,
        max_input_chars: s.max_input_chars,
        max_body_bytes: (s.max_body_mb * 1024.0 * 1024.0) as usize,
        max_voice_seconds: s.max_voice_seconds,
        max_voices: s.max_voices,
        shutdown_grace: Duration::from_secs_f64(s.shutdown_seconds),
        defaults,
        language: config.speak.language.clone(),
        non_streaming: config.speak.non_streaming,
        model_id,
        // Its speakers' chunks get frame budgets from their measured pace (docs/model.md §7.2).
        speaker_paces: match &synth.files.source {
            ModelSource::Local(dir) => speaker_paces(dir),
            ModelSource::Hub { .. } => Default::default(),
        },
    };
    let voice_list = {
        let mut v = Vec::new();
        if default_voice.is_some() {
            v.push("default".to_string());
        }
        v.extend(speakers);
        v.extend(adapter_voices.iter().map(|a| a.name.clone()));
        let n = voices.list().len();
        if n > 0 {
            v.push(format!("{n} registered"));
        }
        v
    };
    let auth = opts.api_key.is_some();
    let state = ServerState::new(synth, opts, voices, default_voice, adapter_voices)?;
    serve::run(state, |addr| {
        println!(
            "voiceclone serve: listening on http://{addr} (voices: {}; {}); the listening page: \
             http://{addr}/",
            if voice_list.is_empty() {
                "none yet, register one with POST /v1/voices".to_string()
            } else {
                voice_list.join(", ")
            },
            if auth {
                "API key required"
            } else {
                "no API key"
            }
        );
        let _ = std::io::stdout().flush();
    })
}

/// Keeps every adapter beside the loaded base model (docs/serving.md §7), after checking it was
/// trained on this base, and returns their voices.
fn put_on_adapters(
    synth: &mut Synthesizer,
    adapters: Vec<(Option<String>, AdapterDir)>,
) -> Result<Vec<AdapterVoice>> {
    let mut out = Vec::new();
    let names = |voices: &[(String, Voice, Option<f64>)]| {
        voices
            .iter()
            .map(|(n, _, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (name, a) in adapters {
        check_adapter_base(&a, &synth.files)?;
        let (dir, rank, matrices) = (a.dir.clone(), a.rank, a.factors.len());
        // What the talker will hold: the factors move into it (f32).
        let values: usize = a
            .factors
            .values()
            .map(|f| f.a.data.len() + f.b.data.len())
            .sum();
        let paces = speaker_paces(&dir);
        let mut voices: Vec<(String, Voice, Option<f64>)> = synth
            .add_adapter(a)?
            .into_iter()
            .map(|(n, v)| {
                let pace = paces.get(&n.to_lowercase()).copied();
                (n, v, pace)
            })
            .collect();
        if let Some(name) = name {
            if voices.len() != 1 {
                bail!(
                    "serve.adapters: {name}={} names one voice, but the adapter holds {} \
                     speakers ({}); give the directory alone to serve them under their names",
                    dir.display(),
                    voices.len(),
                    names(&voices)
                );
            }
            voices[0].0 = name;
        }
        eprintln!(
            "adapter {} (rank {rank}, {matrices} matrices, {:.1} MB beside the base): voice {}",
            dir.display(),
            4.0 * values as f64 / 1e6,
            names(&voices)
        );
        out.extend(voices.into_iter().map(|(name, voice, pace)| AdapterVoice {
            name,
            adapter: dir.display().to_string(),
            voice,
            pace,
        }));
    }
    Ok(out)
}

/// Every voice a request can name must be one voice: the workspace's `default`, the model's
/// speakers and the adapters' voices may not share a name (compared as requests are, ignoring
/// case).
fn refuse_duplicate_names(
    default: bool,
    speakers: &[String],
    adapters: &[AdapterVoice],
) -> Result<()> {
    let mut seen: std::collections::BTreeMap<String, String> = Default::default();
    if default {
        seen.insert("default".into(), "the workspace's voice".into());
    }
    for s in speakers {
        seen.insert(s.to_lowercase(), "a speaker of the model".into());
    }
    for a in adapters {
        let what = format!("the adapter {}", a.adapter);
        if let Some(other) = seen.insert(a.name.to_lowercase(), what.clone()) {
            bail!(
                "two voices are named {:?}: {other} and {what}; name one with \
                 serve.adapters = [\"NAME=DIR\"] (--adapter NAME=DIR) or export it with \
                 `voiceclone export --adapter-only --speaker-name NAME`",
                a.name
            );
        }
    }
    Ok(())
}
