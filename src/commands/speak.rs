//! `voiceclone speak`: choose the model and the voice, build the requests (one text or a batch
//! file), synthesise, and write 24 kHz WAVs (and optionally the codes) atomically.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use super::output::is_stdout;
use crate::cli::SpeakArgs;
use crate::voice_setup::{
    adapter_base, check_adapter_base, compute_device, decode_options, no_voice, resolve_voice,
    speak_model, speaker_paces, voice_pace, VoiceSpec,
};
use vc_core::artifacts::adapter::AdapterDir;
use vc_core::artifacts::codes::write_codes_file;
use vc_core::config::{Config, NonStreaming};
use vc_core::hub::ModelSource;
use vc_core::workspace::Workspace;
use vc_generate::runaway::GuardStop;
use vc_generate::{DecodeOptions, Request, Synthesizer, Voice};
use vc_model::files::ModelFiles;

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
    // The speakers' paces the export measured: their chunks' frame budgets (docs/model.md §7.2).
    let paces = match (&adapter, &source) {
        (Some(a), _) => speaker_paces(&a.dir),
        (None, ModelSource::Local(dir)) => speaker_paces(dir),
        (None, ModelSource::Hub { .. }) => Default::default(),
    };
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
            pace: voice_pace(&paces, &voice),
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
    let bar = vc_core::progress::Progress::new(requests.len() as u64, "texts", "speak");
    let (mut shown, mut frames_total) = (0, 0usize);
    // On a pool worker: the ~750 parallel loops of each frame then start inside the pool.
    let speech = vc_kernels::pool::on_pool(|| {
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
        vc_audio::wav::write_pcm16(&out.wav, &sp.wav, rate)?;
        if let Some(path) = &out.codes {
            write_codes_file(path, &sp.frames)?;
        }
        warn_guard_stops(&out.wav.display().to_string(), &sp.guard_stops);
        let stopped = stopped_note(&sp.eos_steps, &sp.guard_stops);
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
    let header = vc_serve::audio_out::wav_header(rate);
    let mut first_audio = None;
    let streamed = vc_kernels::pool::on_pool(|| {
        synth.stream(req, opts, |samples| {
            if first_audio.is_none() {
                write(&header)?;
                first_audio = Some(started.elapsed());
            }
            write(&vc_serve::audio_out::pcm16(samples))
        })
    })?;
    if first_audio.is_none() {
        write(&header)?;
    }
    if let Some(path) = codes {
        write_codes_file(path, &streamed.frames)?;
    }
    let audio = streamed.samples as f64 / rate as f64;
    warn_guard_stops("standard output", &streamed.guard_stops);
    let stopped = stopped_note(&streamed.eos_steps, &streamed.guard_stops);
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

/// A warning for every chunk of `output` that a runaway guard stopped (docs/model.md §7.2).
fn warn_guard_stops(output: &str, stops: &[GuardStop]) {
    for stop in stops {
        eprintln!(
            "warning: {output}: {}; --max-frames N or --no-runaway-guard lets a chunk run on",
            stop.describe()
        );
    }
}

/// What the summary line says of chunks that did not end with EOS (`eos_steps` `None`): those
/// the guards stopped (`stops`), the others the frame limit.
fn stopped_note(eos_steps: &[Option<usize>], stops: &[GuardStop]) -> &'static str {
    let unended = eos_steps.iter().filter(|e| e.is_none()).count();
    match (stops.is_empty(), unended > stops.len()) {
        (true, false) => "",
        (true, true) => " (stopped by the frame limit)",
        (false, false) => " (stopped by the runaway guard)",
        (false, true) => " (stopped by the runaway guard and the frame limit)",
    }
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
        || !vc_prep::xvectors::workspace_speakers(ws)
            .unwrap_or_default()
            .is_empty();
    if workspace_voice {
        return Ok(());
    }
    let config = source
        .file(vc_model::files::CONFIG)
        .and_then(|p| vc_model::config::Qwen3TtsConfig::from_file(&p))
        .with_context(|| format!("cannot read the model {}", source.describe()))?;
    if config.talker_config.spk_id.is_empty() {
        bail!(no_voice(ws));
    }
    Ok(())
}
