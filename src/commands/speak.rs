//! `voiceclone speak`: choose the model and the voice, build the requests (one text or a batch
//! file), synthesise, and write 24 kHz WAVs (and optionally the codes) atomically.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use candle_core::Device;
use serde_json::Value;

use crate::artifacts::adapter::AdapterDir;
use crate::artifacts::{codes::write_codes_file, speaker};
use crate::cli::SpeakArgs;
use crate::config::{self, Config, NonStreaming, SpeakConfig};
use crate::generate::sampling::Sampling;
use crate::generate::{DecodeOptions, Precision, Request, Synthesizer, Voice};
use crate::hub::ModelSource;
use crate::model::files::ModelFiles;
use crate::workspace::Workspace;

pub fn run(ws: &Workspace, config: &Config, args: &SpeakArgs) -> Result<()> {
    let s = &config.speak;
    let jobs = read_jobs(args)?;
    let batch_mode = args.input.is_some();
    let to_stdout = is_stdout(&args.output);
    ensure!(
        !(to_stdout && batch_mode),
        "-o - streams one text to standard output; with --input, -o names a directory"
    );
    let outputs = plan_outputs(&jobs, args, batch_mode)?;

    let adapter = args.adapter.as_deref().map(AdapterDir::read).transpose()?;
    let source = match &adapter {
        // The base model the adapter was trained on, unless --model names another.
        Some(a) if args.model.is_none() => adapter_base(ws, a)?,
        _ => speak_model(ws, config)?,
    };
    if adapter.is_none() {
        refuse_without_a_voice(ws, &source, &jobs)?;
    }
    let load_started = std::time::Instant::now();
    let mut files = ModelFiles::resolve(&source)
        .with_context(|| format!("cannot load the model {}", source.describe()))?;
    if let Some(a) = &adapter {
        check_adapter_base(a, &files)?;
        files = files.with_adapter(a)?;
    }
    let (device, precision, why) = compute_device(s.precision, &files)?;
    let with = adapter
        .as_ref()
        .map(|a| format!(" with the adapter {}", a.dir.display()))
        .unwrap_or_default();
    eprintln!(
        "loading {}{with} (precision {precision}: {why})",
        source.describe()
    );
    let mut synth = Synthesizer::from_files(files, precision, &device)
        .with_context(|| format!("cannot load the model {}", source.describe()))?;
    eprintln!(
        "loaded in {:.2} s: {}",
        load_started.elapsed().as_secs_f64(),
        synth.describe_backend()
    );

    let mut opts = decode_options(&synth, s);
    if s.seed < 0 {
        opts.seed = rand::random::<u32>() as u64;
        if !s.greedy {
            eprintln!(
                "seed: {} (pass --seed {} to repeat this result)",
                opts.seed, opts.seed
            );
        }
    } else {
        opts.seed = s.seed as u64;
    }

    // Timed like the official generate_voice_clone call: voice preparation, generation, decode.
    let started = std::time::Instant::now();
    let mut voices = VoiceCache::default();
    let mut requests = Vec::with_capacity(jobs.len());
    for job in &jobs {
        let voice = voices.get(ws, &mut synth, &job.voice);
        let voice = if job.context.is_empty() {
            voice?
        } else {
            voice.with_context(|| job.context.clone())?
        };
        let non_streaming = job.non_streaming.unwrap_or(match s.non_streaming {
            NonStreaming::True => true,
            NonStreaming::False => false,
            // The official defaults: generate_custom_voice non-streaming,
            // generate_voice_clone streaming.
            NonStreaming::Auto => voice.custom_voice(),
        });
        requests.push(Request {
            text: job.text.clone(),
            language: job.language.clone().unwrap_or_else(|| s.language.clone()),
            voice,
            non_streaming,
        });
    }

    if to_stdout {
        return stream_to_stdout(
            &synth,
            &requests[0],
            &opts,
            outputs[0].codes.as_deref(),
            started,
        );
    }
    let bar = crate::progress::Progress::new(requests.len() as u64, "texts", "speak");
    let (mut shown, mut frames_total) = (0, 0usize);
    // On a pool worker: the ~750 parallel loops of each frame then start inside the pool.
    let speech = crate::kernels::pool::on_pool(|| {
        synth.synthesize(&requests, &opts, |done, total, frames| {
            if frames > 0 {
                frames_total += 1;
            }
            // Rows count chunks of split texts; the bar counts texts.
            let texts = done * requests.len() / total.max(1);
            if texts > shown {
                bar.inc((texts - shown) as u64);
                shown = texts;
            }
            // One step = one 80 ms frame for every text of the running batch.
            bar.set_message(format!("{frames_total} frame steps"));
        })
    })?;
    bar.finish();
    let seconds = started.elapsed().as_secs_f64();

    let rate = synth.codec.output_sample_rate();
    for (sp, out) in speech.iter().zip(&outputs) {
        crate::audio::wav::write_pcm16(&out.wav, &sp.wav, rate)?;
        if let Some(path) = &out.codes {
            write_codes_file(path, &sp.frames)?;
        }
        let stopped = if sp.eos_steps.iter().all(Option::is_some) {
            ""
        } else {
            " (stopped by the frame limit)"
        };
        println!(
            "wrote {}: {:.2} s, {} frames{stopped}",
            out.wav.display(),
            sp.wav.len() as f64 / rate as f64,
            sp.frames.len()
        );
    }
    let audio: f64 = speech.iter().map(|s| s.wav.len() as f64).sum::<f64>() / rate as f64;
    if audio > 0.0 {
        eprintln!(
            "{:.2} s of audio in {:.2} s (real-time factor {:.2}; voice preparation, generation and \
             decoding, model loading excluded)",
            audio,
            seconds,
            seconds / audio
        );
    }
    Ok(())
}

/// `-o -`: the WAV goes to standard output.
fn is_stdout(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// `-o -`: a WAV on standard output written as it is generated — the header of a stream of
/// unknown length (RIFF and data sizes 0xFFFFFFFF, as `serve` streams a WAV), then each frame's
/// samples as soon as they are decoded (`Synthesizer::stream`).
fn stream_to_stdout(
    synth: &Synthesizer,
    req: &Request,
    opts: &DecodeOptions,
    codes: Option<&Path>,
    started: std::time::Instant,
) -> Result<()> {
    use std::io::Write;
    let rate = synth.codec.output_sample_rate();
    let write = |bytes: &[u8]| -> Result<()> {
        let mut out = std::io::stdout().lock();
        out.write_all(bytes)
            .and_then(|()| out.flush())
            .context("cannot write to standard output")
    };
    // The header goes out with the first samples: a request that fails before them (its
    // prompt, the model) leaves standard output empty.
    let header = crate::serve::audio_out::wav_header(rate);
    let mut first_audio = None;
    let streamed = crate::kernels::pool::on_pool(|| {
        synth.stream(req, opts, |samples| {
            if first_audio.is_none() {
                write(&header)?;
                first_audio = Some(started.elapsed());
            }
            write(&crate::serve::audio_out::pcm16(samples))
        })
    })?;
    if first_audio.is_none() {
        write(&header)?;
    }
    if let Some(path) = codes {
        write_codes_file(path, &streamed.frames)?;
    }
    let audio = streamed.samples as f64 / rate as f64;
    let stopped = if streamed.eos_steps.iter().all(Option::is_some) {
        ""
    } else {
        " (stopped by the frame limit)"
    };
    eprintln!(
        "streamed to standard output: {audio:.2} s, {} frames{stopped} in {} chunks; first audio \
         after {:.0} ms, done in {:.2} s",
        streamed.frames.len(),
        streamed.audio_chunks,
        first_audio.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `speak.model`, else the workspace's exported model, else `model.base`.
pub(crate) fn speak_model(ws: &Workspace, config: &Config) -> Result<ModelSource> {
    if !config.speak.model.is_empty() {
        return ws.model_source(&config.speak.model);
    }
    let exported = ws.model_dir();
    // An export interrupted while it replaced model/ may have left it moved aside: put it
    // back rather than quietly speaking with the base model.
    for note in crate::train::export::recover(&exported)? {
        eprintln!("note: {note}");
    }
    if crate::train::export::export_kind(&exported).as_deref() == Some("adapter") {
        bail!(
            "{} holds adapters exported alone, not a model: speak with `--adapter {}`",
            ws.relative(&exported),
            ws.relative(&exported)
        );
    }
    if exported.join("config.json").is_file() {
        return Ok(ModelSource::Local(exported));
    }
    ws.model_source(&config.model.base)
}

/// The base model an adapter records it was trained on.
pub(crate) fn adapter_base(ws: &Workspace, a: &AdapterDir) -> Result<ModelSource> {
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
pub(crate) fn check_adapter_base(adapter: &AdapterDir, files: &ModelFiles) -> Result<()> {
    let Some(want) = crate::train::export::base_identity(&adapter.dir) else {
        return Ok(());
    };
    let have = crate::train::checkpoint::ModelIdentity::compute(
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
/// otherwise. `q8` runs on the CPU (a GPU present is not used for it).
pub(crate) fn compute_device(
    precision: config::PrecisionSetting,
    files: &ModelFiles,
) -> Result<(Device, Precision, String)> {
    use config::PrecisionSetting as P;
    let device = match precision {
        P::Q8 => Device::Cpu,
        _ => Device::cuda_if_available(0)?,
    };
    let stored = Precision::stored(files);
    Ok(match precision {
        P::F32 => (device, Precision::F32, "as asked".into()),
        P::Bf16Weights => (device, Precision::Bf16Weights, "as asked".into()),
        P::Bf16 => (device, Precision::Bf16, "as asked".into()),
        P::Q8 => (device, Precision::Q8, "as asked".into()),
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

/// The model's generation defaults with the `[speak]` values that are set (non-zero).
pub(crate) fn decode_options(synth: &Synthesizer, s: &SpeakConfig) -> DecodeOptions {
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
    if s.max_frames > 0 {
        o.max_frames = s.max_frames;
    }
    o.batch_size = s.batch_size;
    o.max_chunk_chars = s.max_chunk_chars;
    o.stream_chunk_frames = s.stream_chunk_frames;
    o
}

/// How one text asks for its voice (flags, or a JSONL line's fields over the flags).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct VoiceSpec {
    pub speaker: Option<String>,
    pub ref_audio: Option<PathBuf>,
    pub ref_text: Option<String>,
    pub x_vector_only: bool,
}

struct SpeakJob {
    text: String,
    language: Option<String>,
    non_streaming: Option<bool>,
    voice: VoiceSpec,
    output: Option<String>,
    /// "line N of FILE" for errors.
    context: String,
}

fn read_jobs(args: &SpeakArgs) -> Result<Vec<SpeakJob>> {
    let flags = VoiceSpec {
        speaker: args.speaker.clone(),
        ref_audio: args.ref_audio.clone(),
        ref_text: args.ref_text.clone(),
        x_vector_only: args.x_vector_only,
    };
    let Some(input) = &args.input else {
        let text = args.text.clone().unwrap_or_default();
        ensure!(!text.trim().is_empty(), "the text to speak is empty");
        return Ok(vec![SpeakJob {
            text,
            language: None,
            non_streaming: None,
            voice: flags,
            output: None,
            context: String::new(),
        }]);
    };
    let content = std::fs::read_to_string(input)
        .with_context(|| format!("cannot read {}", input.display()))?;
    let base = input.parent().unwrap_or(Path::new("."));
    let mut jobs = Vec::new();
    for (n, line) in content.lines().enumerate() {
        let context = format!("line {} of {}", n + 1, input.display());
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let job = if line.starts_with('{') {
            parse_json_line(line, &flags, base).with_context(|| context.clone())?
        } else {
            SpeakJob {
                text: line.to_string(),
                language: None,
                non_streaming: None,
                voice: flags.clone(),
                output: None,
                context: context.clone(),
            }
        };
        jobs.push(SpeakJob { context, ..job });
    }
    ensure!(!jobs.is_empty(), "{} contains no text", input.display());
    Ok(jobs)
}

fn parse_json_line(line: &str, flags: &VoiceSpec, base: &Path) -> Result<SpeakJob> {
    let v: Value = serde_json::from_str(line).context("not valid JSON")?;
    let obj = v.as_object().context("expected a JSON object")?;
    const KNOWN: &[&str] = &[
        "text",
        "output",
        "language",
        "speaker",
        "ref_audio",
        "ref_text",
        "x_vector_only",
        "non_streaming",
    ];
    if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        bail!("unknown field {k:?} (known: {})", KNOWN.join(", "));
    }
    let string = |k: &str| -> Result<Option<String>> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => bail!("field {k:?} must be a string, found {other}"),
        }
    };
    let boolean = |k: &str| -> Result<Option<bool>> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => bail!("field {k:?} must be true or false, found {other}"),
        }
    };
    let text = string("text")?.context("missing \"text\"")?;
    ensure!(!text.trim().is_empty(), "\"text\" is empty");
    let mut voice = flags.clone();
    if let Some(s) = string("speaker")? {
        voice = VoiceSpec {
            speaker: Some(s),
            ref_audio: None,
            ref_text: None,
            x_vector_only: false,
        };
    }
    if let Some(a) = string("ref_audio")? {
        voice.speaker = None;
        voice.ref_audio = Some(base.join(a));
        voice.ref_text = None;
    }
    if let Some(t) = string("ref_text")? {
        voice.ref_text = Some(t);
    }
    if let Some(x) = boolean("x_vector_only")? {
        voice.x_vector_only = x;
    }
    let output = string("output")?;
    if let Some(o) = &output {
        let p = Path::new(o);
        ensure!(
            p.components().count() == 1 && !o.starts_with('.'),
            "\"output\" must be a plain file name inside the output directory, not {o:?}"
        );
    }
    Ok(SpeakJob {
        text,
        language: string("language")?,
        non_streaming: boolean("non_streaming")?,
        voice,
        output,
        context: String::new(),
    })
}

struct Output {
    wav: PathBuf,
    codes: Option<PathBuf>,
}

/// Output paths, checked before any work: existing files are only replaced with --overwrite.
fn plan_outputs(jobs: &[SpeakJob], args: &SpeakArgs, batch: bool) -> Result<Vec<Output>> {
    let mut outputs = Vec::with_capacity(jobs.len());
    if !batch {
        outputs.push(Output {
            wav: args.output.clone(),
            codes: args.save_codes.clone(),
        });
    } else {
        ensure!(
            !args.output.is_file(),
            "with --input, -o names a directory, but {} is a file",
            args.output.display()
        );
        if let Some(c) = &args.save_codes {
            ensure!(
                !c.is_file(),
                "with --input, --save-codes names a directory, but {} is a file",
                c.display()
            );
        }
        let width = jobs.len().to_string().len().max(4);
        for (i, job) in jobs.iter().enumerate() {
            let name = match &job.output {
                Some(o) if o.to_lowercase().ends_with(".wav") => o.clone(),
                Some(o) => format!("{o}.wav"),
                None => format!("{:0width$}.wav", i + 1),
            };
            let stem = name[..name.len() - 4].to_string();
            outputs.push(Output {
                wav: args.output.join(&name),
                codes: args
                    .save_codes
                    .as_ref()
                    .map(|d| d.join(format!("{stem}.codes.json"))),
            });
        }
        let mut seen = std::collections::HashSet::new();
        for o in &outputs {
            ensure!(
                seen.insert(o.wav.clone()),
                "two lines write the same output file {}",
                o.wav.display()
            );
        }
        std::fs::create_dir_all(&args.output)
            .with_context(|| format!("cannot create {}", args.output.display()))?;
        if let Some(c) = &args.save_codes {
            std::fs::create_dir_all(c).with_context(|| format!("cannot create {}", c.display()))?;
        }
    }
    if !args.overwrite {
        for o in &outputs {
            let wav = Some(&o.wav).filter(|w| !is_stdout(w));
            for p in wav.into_iter().chain(o.codes.as_ref()) {
                ensure!(
                    !p.exists(),
                    "{} already exists; pass --overwrite to replace it",
                    p.display()
                );
            }
        }
    }
    Ok(outputs)
}

/// Voices computed once per distinct spec (a batch file usually repeats one reference).
#[derive(Default)]
struct VoiceCache(HashMap<VoiceSpec, Voice>);

impl VoiceCache {
    fn get(&mut self, ws: &Workspace, synth: &mut Synthesizer, spec: &VoiceSpec) -> Result<Voice> {
        if let Some(v) = self.0.get(spec) {
            return Ok(v.clone());
        }
        let voice = resolve_voice(ws, synth, spec)?;
        self.0.insert(spec.clone(), voice.clone());
        Ok(voice)
    }
}

/// No voice was asked for and several are there: the caller says how to choose one (`speak`'s
/// `--speaker`, a request's `voice`).
#[derive(Debug)]
pub(crate) struct SeveralSpeakers {
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

pub(crate) fn resolve_voice(
    ws: &Workspace,
    synth: &mut Synthesizer,
    spec: &VoiceSpec,
) -> Result<Voice> {
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
    let named = super::embed::workspace_speakers(ws).unwrap_or_default();
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

fn no_voice(ws: &Workspace) -> String {
    format!(
        "no voice to speak with: pass --ref-audio (and --ref-text for in-context cloning) or \
         --speaker, or run `voiceclone prep` in workspace {} first",
        ws.root().display()
    )
}

/// Before any weight is downloaded or loaded: a text that asks for no voice needs one from the
/// workspace (a reference clip, an x-vector, named speakers) or from the model itself (its
/// speakers, read from its config.json alone).
fn refuse_without_a_voice(ws: &Workspace, source: &ModelSource, jobs: &[SpeakJob]) -> Result<()> {
    let asks_none = |v: &VoiceSpec| v.speaker.is_none() && v.ref_audio.is_none();
    if !jobs.iter().any(|j| asks_none(&j.voice)) {
        return Ok(());
    }
    let workspace_voice = ws.ref_wav().is_file()
        || ws.speaker_file().is_file()
        || !super::embed::workspace_speakers(ws)
            .unwrap_or_default()
            .is_empty();
    if workspace_voice {
        return Ok(());
    }
    let config = source
        .file(crate::model::files::CONFIG)
        .and_then(|p| crate::model::config::Qwen3TtsConfig::from_file(&p))
        .with_context(|| format!("cannot read the model {}", source.describe()))?;
    if config.talker_config.spk_id.is_empty() {
        bail!(no_voice(ws));
    }
    Ok(())
}

fn clone_from_file(synth: &mut Synthesizer, path: &Path, ref_text: Option<&str>) -> Result<Voice> {
    let cfg = synth.config();
    if cfg.tts_model_type != "base" {
        bail!(
            "{} is a {} model: it speaks with its own speakers ({}), it cannot clone a voice from              a reference clip (use a Base model such as Qwen/Qwen3-TTS-12Hz-1.7B-Base for that)",
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
    let wav = crate::audio::load_mono(path, crate::audio::OUTPUT_RATE)?;
    ensure!(
        !wav.is_empty(),
        "reference audio {} is empty",
        path.display()
    );
    synth
        .clone_voice(&wav, ref_text)
        .with_context(|| format!("cannot clone the voice of {}", path.display()))
}
