//! The model, device and voice that `speak` and `serve` both resolve from the configuration and
//! the workspace: which model speaks (`speak.model`, the workspace's export, `model.base`), an
//! adapter's base model, the device and precision, the decoding options, and the voice a request
//! asks for. Library code of the binary, not a command: it needs the trainer's export markers and
//! the synthesizer together, which no crate below sees both of.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use candle_core::Device;

use vc_core::artifacts::adapter::AdapterDir;
use vc_core::artifacts::speaker;
use vc_core::config::{self, Config, SpeakConfig};
use vc_core::hub::ModelSource;
use vc_core::workspace::Workspace;
use vc_generate::runaway::RunawayGuard;
use vc_generate::sampling::Sampling;
use vc_generate::{DecodeOptions, Precision, Synthesizer, Voice};
use vc_model::files::ModelFiles;

/// `speak.model`, else the workspace's exported model, else `model.base`.
pub fn speak_model(ws: &Workspace, config: &Config) -> Result<ModelSource> {
    if !config.speak.model.is_empty() {
        return ws.model_source(&config.speak.model);
    }
    let exported = ws.model_dir();
    // An export interrupted while it replaced model/ may have left it moved aside: put it
    // back rather than quietly speaking with the base model.
    for note in vc_train::export::recover(&exported)? {
        eprintln!("note: {note}");
    }
    if vc_train::export::export_kind(&exported).as_deref() == Some("adapter") {
        bail!(
            "{} holds adapters exported alone, not a model: speak with `--adapter {}`",
            ws.relative(&exported),
            vc_core::shell::quote(&ws.relative(&exported))
        );
    }
    if exported.join("config.json").is_file() {
        return Ok(ModelSource::Local(exported));
    }
    ws.model_source(&config.model.base)
}

/// The base model an adapter records it was trained on.
pub fn adapter_base(ws: &Workspace, a: &AdapterDir) -> Result<ModelSource> {
    if a.base_model.is_empty() {
        bail!(
            "the adapter {} does not say which base model it goes on; pass it with --model",
            a.dir.display()
        );
    }
    ws.model_source(&a.base_model).with_context(|| {
        format!(
            "the adapter {} was trained on {}, which cannot be found; pass it with --model",
            a.dir.display(),
            a.base_model
        )
    })
}

/// Refuses an adapter on another base model than the one it was trained on (the export's
/// marker records the base's identity, docs/training.md §7.3).
pub fn check_adapter_base(adapter: &AdapterDir, files: &ModelFiles) -> Result<()> {
    let Some(want) = vc_train::export::base_identity(&adapter.dir) else {
        return Ok(());
    };
    let have = vc_train::checkpoint::ModelIdentity::compute(
        &want.base,
        &files.config_path,
        &files.checkpoint.shards,
    )?;
    if have != want {
        bail!(
            "the adapter {} was trained on another base model ({}) than {}",
            adapter.dir.display(),
            want.base,
            files.source.describe()
        );
    }
    Ok(())
}

/// A CUDA device when built with `cuda` and one is present, else the CPU, and the precision
/// with the reason it was chosen. `auto` never lowers what the checkpoint stores
/// ([`Precision::auto`]): bf16 on a GPU; on a CPU bf16-weights for bf16-stored matrices and f32
/// otherwise. `q8` and `q4` run on the CPU (a GPU present is not used for them).
pub fn compute_device(
    precision: config::PrecisionSetting,
    files: &ModelFiles,
) -> Result<(Device, Precision, String)> {
    use config::PrecisionSetting as P;
    let device = match precision {
        P::Q8 | P::Q4 => Device::Cpu,
        _ => Device::cuda_if_available(0)?,
    };
    let stored = Precision::stored(files);
    Ok(match precision {
        P::F32 => (device, Precision::F32, "as asked".into()),
        P::Bf16Weights => (device, Precision::Bf16Weights, "as asked".into()),
        P::Bf16 => (device, Precision::Bf16, "as asked".into()),
        P::Q8 => (device, Precision::Q8, "as asked".into()),
        P::Q4 => (device, Precision::Q4, "as asked".into()),
        P::Auto => {
            let p = Precision::auto(stored, device.is_cuda());
            let why = match (device.is_cuda(), stored) {
                (true, _) => "auto, on a GPU".to_string(),
                (false, Some(d)) => format!("auto, the checkpoint stores {d:?}"),
                (false, None) => "auto".to_string(),
            };
            (device, p, why)
        }
    })
}

/// The measured paces (frames per text token) that an export in `dir` (a model or an adapter
/// directory) records for its speakers, by lower-cased name: what sizes their chunks' frame
/// budgets (docs/model.md §7.2). Empty for a directory without them (a hub model, an older
/// export); those voices take the default pace.
pub fn speaker_paces(dir: &Path) -> BTreeMap<String, f64> {
    vc_train::export::pace::read(dir)
        .into_iter()
        .map(|(name, p)| (name, p.frames_per_token))
        .collect()
}

/// The pace of `voice` among `paces` ([`speaker_paces`]): only named speakers have one.
pub fn voice_pace(paces: &BTreeMap<String, f64>, voice: &Voice) -> Option<f64> {
    match voice {
        Voice::Speaker(name) => paces.get(&name.to_lowercase()).copied(),
        _ => None,
    }
}

/// The model's generation defaults with the `[speak]` values that are set (non-zero).
pub fn decode_options(synth: &Synthesizer, s: &SpeakConfig) -> DecodeOptions {
    let mut o = DecodeOptions::from_generation_config(&synth.files.generation);
    let set = |v: f64, d: &mut f64| {
        if v > 0.0 {
            *d = v
        }
    };
    set(s.temperature, &mut o.code0.temperature);
    set(s.top_p, &mut o.code0.top_p);
    set(s.repetition_penalty, &mut o.repetition_penalty);
    set(s.sub_temperature, &mut o.sub_codes.temperature);
    set(s.sub_top_p, &mut o.sub_codes.top_p);
    if s.top_k > 0 {
        o.code0.top_k = s.top_k;
    }
    if s.sub_top_k > 0 {
        o.sub_codes.top_k = s.sub_top_k;
    }
    if s.greedy {
        o.code0 = Sampling::GREEDY;
        o.sub_codes = Sampling::GREEDY;
    }
    // An explicit frame limit wins over the runaway guard's budget (docs/model.md §7.2).
    if s.max_frames > 0 {
        o.max_frames = s.max_frames;
        o.runaway.budget = false;
    }
    if !s.runaway_guard {
        o.runaway = RunawayGuard::OFF;
    }
    o.batch_size = s.batch_size;
    o.max_chunk_chars = s.max_chunk_chars;
    o.stream_chunk_frames = s.stream_chunk_frames;
    o
}

/// How one text asks for its voice (flags, or a JSONL line's fields over the flags).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct VoiceSpec {
    pub speaker: Option<String>,
    pub ref_audio: Option<PathBuf>,
    pub ref_text: Option<String>,
    pub x_vector_only: bool,
}

/// No voice was asked for and several are there: the caller says how to choose one (`speak`'s
/// `--speaker`, a request's `voice`).
#[derive(Debug)]
pub struct SeveralSpeakers {
    pub of: &'static str,
    pub names: Vec<String>,
}

impl SeveralSpeakers {
    /// "this model has several speakers (a, b)".
    pub fn which(&self) -> String {
        format!("{} ({})", self.of, self.names.join(", "))
    }
}

impl std::fmt::Display for SeveralSpeakers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}; choose one with --speaker", self.which())
    }
}

impl std::error::Error for SeveralSpeakers {}

/// The voice `spec` asks for: a named speaker (of the model, or of the workspace through its
/// x-vector), a reference clip, or else the workspace's own voice.
pub fn resolve_voice(ws: &Workspace, synth: &mut Synthesizer, spec: &VoiceSpec) -> Result<Voice> {
    if let Some(name) = &spec.speaker {
        ensure!(
            spec.ref_audio.is_none(),
            "choose either a named speaker or a reference clip, not both"
        );
        // A Base model has no named speakers: a named speaker of the workspace
        // (docs/training.md §3.3) is cloned from its x-vector.
        if synth.speakers().is_empty() && speaker::check_name(name).is_ok() {
            let file = ws.speaker_file_of(name);
            if file.is_file() {
                let h = synth.config().talker_config.hidden_size;
                return Ok(Voice::XVector(speaker::read_for_model(&file, h)?));
            }
        }
        return Ok(Voice::Speaker(name.clone()));
    }
    let ref_text = if spec.x_vector_only {
        None
    } else {
        spec.ref_text.as_deref()
    };
    if let Some(path) = &spec.ref_audio {
        return clone_from_file(synth, path, ref_text);
    }
    let speakers = synth.speakers();
    if ref_text.is_none() && !speakers.is_empty() {
        return match speakers.as_slice() {
            [only] => Ok(Voice::Speaker(only.clone())),
            many => Err(SeveralSpeakers {
                of: "this model has several speakers",
                names: many.to_vec(),
            }
            .into()),
        };
    }
    // The workspace's reference voice; with named speakers, one of them must be chosen.
    let named = vc_prep::xvectors::workspace_speakers(ws).unwrap_or_default();
    match named.as_slice() {
        [] => {}
        [only] if ws.speaker_file_of(only).is_file() => {
            let h = synth.config().talker_config.hidden_size;
            return Ok(Voice::XVector(speaker::read_for_model(
                &ws.speaker_file_of(only),
                h,
            )?));
        }
        many => {
            return Err(SeveralSpeakers {
                of: "this workspace has named speakers",
                names: many.to_vec(),
            }
            .into())
        }
    }
    let ref_wav = ws.ref_wav();
    if ref_text.is_some() {
        ensure!(
            ref_wav.is_file(),
            "--ref-text needs the clip it transcribes: pass --ref-audio"
        );
        return clone_from_file(synth, &ref_wav, ref_text);
    }
    let embedding = ws.speaker_file();
    if embedding.is_file() {
        let h = synth.config().talker_config.hidden_size;
        return Ok(Voice::XVector(speaker::read_for_model(&embedding, h)?));
    }
    if ref_wav.is_file() {
        return clone_from_file(synth, &ref_wav, None);
    }
    bail!(no_voice(ws))
}

/// The error of a request that names no voice where none can be found.
pub fn no_voice(ws: &Workspace) -> String {
    format!(
        "no voice to speak with: pass --ref-audio (and --ref-text for in-context cloning) or \
         --speaker, or run `voiceclone prep` in workspace {} first",
        ws.root().display()
    )
}

/// A voice cloned from the reference clip at `path` (in-context with `ref_text`).
pub fn clone_from_file(
    synth: &mut Synthesizer,
    path: &Path,
    ref_text: Option<&str>,
) -> Result<Voice> {
    let cfg = synth.config();
    if cfg.tts_model_type != "base" {
        bail!(
            "{} is a {} model: it speaks with its own speakers ({}), it cannot clone a voice from \
             a reference clip (use a Base model such as Qwen/Qwen3-TTS-12Hz-1.7B-Base for that)",
            synth.files.source.describe(),
            cfg.tts_model_type,
            synth.speakers().join(", ")
        );
    }
    ensure!(
        path.is_file(),
        "reference audio {} does not exist or is not a file",
        path.display()
    );
    if let Some(t) = ref_text {
        ensure!(
            !t.trim().is_empty(),
            "the reference transcript (--ref-text) is empty"
        );
    }
    let wav = vc_audio::load_mono(path, vc_audio::OUTPUT_RATE)?;
    ensure!(
        !wav.is_empty(),
        "reference audio {} is empty",
        path.display()
    );
    synth
        .clone_voice(&wav, ref_text)
        .with_context(|| format!("cannot clone the voice of {}", path.display()))
}
