//! `vc-prep`: the data steps that turn recordings into training inputs — `prep` (recordings in,
//! 24 kHz utterances and a training manifest out; this module), the audio codes of a manifest
//! ([`codes`]) and the speaker x-vectors ([`xvectors`]).
//!
//! `prep`: decode (symphonia) -> resample (rubato) -> split the 16 kHz signal at pauses (`chunk`) ->
//! transcribe each piece (Whisper) -> cut at segment boundaries -> write `data/segments/*.wav`
//! (24 kHz mono 16-bit) and `data/train.jsonl`.
//!
//! Each source gets a record under `data/prep/sources/` keyed by its path, size, modification
//! time and the prep settings; a re-run reuses the records and does no decoding or
//! transcription for unchanged sources, and rewrites the manifest (atomically) from them.
//!
//! Inputs are found before anything is created; a clip too short for an utterance is never
//! transcribed; an exact duplicate of another source is used once ([`duplicates`]); every second
//! of the audio is accounted for in the summary ([`accounting`]); a write into the workspace
//! that fails stops the run with the file's name (the recording is not to blame). The Whisper
//! model a run used is recorded for training's samples (`data/prep/whisper.json`).

pub mod accounting;
pub mod chunk;
pub mod codes;
pub mod duplicates;
pub mod ggml_cpu;
pub mod records;
pub mod segment;
pub mod sources;
pub mod speakers;
pub mod transcribe;
pub mod xvectors;

#[cfg(test)]
mod run_tests;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use records::{round_ms, SourceRecord, UtteranceRecord};
use segment::{DropReason, Rules};
use sources::SourceFile;
use transcribe::{Transcriber, Transcript};
use vc_audio::{self as audio, OUTPUT_RATE, WHISPER_RATE};
use vc_core::artifacts::{manifest, manifest::ManifestRow};
use vc_core::fsutil::write_atomic;
use vc_core::progress::Progress;
use vc_core::workspace::Workspace;

/// Bumped whenever prep's output for the same input and settings changes.
/// 2: transcription in pieces split at pauses (`chunk`), exact-phase resampling.
/// 3: encoder windows rounded up to a multiple of 16 positions (`transcribe::audio_ctx`).
/// 4: records carry the decoded audio's digest (`duplicates`) and account for every second
///    (`accounting`); clips shorter than `min_seconds` are not transcribed.
const PREP_FORMAT_VERSION: u32 = 4;

/// What the seconds of a recording that were not kept count as in the summary, besides the
/// reasons of `segment::DropReason` (docs/usage.md §2 lists them all).
const TRIMMED: &str = "trimmed silence around utterances";
const NOTHING_HEARD: &str = "no words heard by Whisper";
const NOT_TRANSCRIBED: &str = "silence (not transcribed)";
const DUPLICATE: &str = "duplicate of another recording";

/// Reference clip length the automatic choice aims for (seconds).
const REF_MIN_SECONDS: f64 = 3.0;
const REF_MAX_SECONDS: f64 = 10.0;

#[derive(Debug, Clone)]
pub struct PrepOptions {
    pub inputs: Vec<PathBuf>,
    pub rules: Rules,
    /// Whisper model: local path or `owner/repo/file`.
    pub whisper_model: String,
    /// "auto" or a Whisper language code.
    pub language: String,
    /// Files processed at once; 0 = one per core.
    pub jobs: usize,
    /// Force this clip as the reference.
    pub ref_audio: Option<PathBuf>,
    /// Redo every source even if a record exists.
    pub force: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub files_found: usize,
    pub files_reused: usize,
    pub files_processed: usize,
    /// Sources that failed, with the reason.
    pub files_failed: Vec<(String, String)>,
    /// Seconds of audio of the sources that could be used (those that failed are not known).
    pub source_seconds: f64,
    pub kept_seconds: f64,
    pub utterances: usize,
    /// Every other second of `source_seconds`, by reason: kept and dropped add up to it.
    pub dropped: BTreeMap<String, f64>,
    pub ref_audio: String,
    pub manifest: PathBuf,
    pub warnings: Vec<String>,
}

/// Loads the transcriber lazily: a run with nothing new to transcribe never loads a model.
pub type TranscriberFactory<'a> = dyn Fn() -> Result<Arc<dyn Transcriber>> + 'a;

/// Runs prep over `opts.inputs` into the workspace: one unnamed speaker, the manifest replaced.
/// Named speakers are [`speakers::run`]'s.
pub fn run(
    ws: &Workspace,
    opts: &PrepOptions,
    make_transcriber: &TranscriberFactory,
) -> Result<Summary> {
    speakers::refuse_unnamed_run(ws)?;
    let collected = collect(ws, opts, make_transcriber)?;
    let mut summary = collected.summary.clone();
    let utterances = collected.utterances();
    if utterances.is_empty() {
        bail!("{}", nothing_usable_message(&summary));
    }

    let ref_rel = write_reference(ws, &ws.ref_wav(), opts.ref_audio.as_deref(), &utterances)?;
    let rows: Vec<ManifestRow> = utterances
        .iter()
        .map(|(source, u)| u.to_row(source, &ref_rel))
        .collect();
    manifest::write_rows(&ws.manifest(), &rows)?;
    record_whisper_model(ws, opts)?;
    summary.ref_audio = ref_rel;
    summary.manifest = ws.manifest();
    Ok(summary)
}

/// Records the Whisper model whose transcripts the manifest now holds (a local file as an
/// absolute path), for the samples' WER when the configuration names none
/// (docs/training.md §14.4).
pub(crate) fn record_whisper_model(ws: &Workspace, opts: &PrepOptions) -> Result<()> {
    let model = transcribe::resolve_whisper_spec(ws, &opts.whisper_model);
    let model = if Path::new(&model).exists() {
        std::path::absolute(&model)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or(model)
    } else {
        model
    };
    vc_core::artifacts::prep_whisper::write(
        &ws.prep_whisper(),
        &vc_core::artifacts::prep_whisper::PrepWhisper { model },
    )
}

/// prep writes `data/` of the workspace: find out before any transcription whether it can,
/// rather than after (and then blaming the input).
fn ensure_writable(ws: &Workspace) -> Result<()> {
    let fail = |path: &std::path::Path, e: std::io::Error| {
        anyhow::anyhow!(
            "cannot write into the workspace {}: {}: {e}; prep writes its results under data/ \
             there (use --workdir to choose another workspace)",
            ws.root().display(),
            path.display()
        )
    };
    for dir in [ws.segments_dir(), ws.prep_records_dir()] {
        std::fs::create_dir_all(&dir).map_err(|e| fail(&dir, e))?;
    }
    let probe = ws
        .data_dir()
        .join(format!(".voiceclone-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| fail(&probe, e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// What one prep pass over a set of inputs produced: a record per current source, and the
/// summary without the reference clip and manifest (which the caller writes).
pub(crate) struct Collected {
    pub records: BTreeMap<SourceFile, SourceRecord>,
    /// Sources whose audio an earlier source has, with that source: not used.
    pub duplicates: BTreeMap<SourceFile, SourceFile>,
    pub summary: Summary,
}

impl Collected {
    /// Every utterance of every current source but duplicates, in source order, with its source.
    pub fn utterances(&self) -> Vec<(&str, &UtteranceRecord)> {
        self.records
            .iter()
            .filter(|(file, _)| !self.duplicates.contains_key(*file))
            .flat_map(|(_, r)| r.utterances.iter().map(|u| (r.source.as_str(), u)))
            .collect()
    }
}

/// Decodes, transcribes and cuts every new or changed source of `opts.inputs` (reusing the
/// records of unchanged ones); writes segments and records, not the manifest. Inputs without
/// any audio file give an empty result with nothing created in the workspace.
pub(crate) fn collect(
    ws: &Workspace,
    opts: &PrepOptions,
    make_transcriber: &TranscriberFactory,
) -> Result<Collected> {
    for input in &opts.inputs {
        if let Ok(dir) = input.canonicalize() {
            if dir.is_dir() && ws.root().starts_with(&dir) {
                bail!(
                    "the workspace {} lies inside the input folder {}; prep never writes into your \
                     recordings, so run it from another directory (or pass --workdir)",
                    ws.root().display(),
                    input.display()
                );
            }
        }
    }
    // The inputs first: nothing is created for inputs that hold no audio (or do not exist).
    let discovery = sources::discover(&opts.inputs, ws.root(), &ws.data_dir());
    let progress = Progress::new(discovery.files.len() as u64, "files", "prep");
    for w in &discovery.warnings {
        progress.warn(w.clone());
    }
    if discovery.files.is_empty() {
        progress.finish();
        return Ok(Collected {
            records: BTreeMap::new(),
            duplicates: BTreeMap::new(),
            summary: Summary {
                warnings: progress.warnings(),
                ..Default::default()
            },
        });
    }
    ensure_writable(ws)?;

    let settings = settings_digest(opts);
    let mut records: BTreeMap<SourceFile, SourceRecord> = BTreeMap::new();
    let mut todo: Vec<(SourceFile, String)> = Vec::new();
    for file in &discovery.files {
        let key = file.key(&settings);
        match reusable_record(ws, &key, opts.force) {
            Some(record) => {
                records.insert(file.clone(), record);
            }
            None => todo.push((file.clone(), key)),
        }
    }
    let mut summary = Summary {
        files_found: discovery.files.len(),
        files_reused: records.len(),
        ..Default::default()
    };
    progress.inc(records.len() as u64);

    if !todo.is_empty() {
        let transcriber = make_transcriber()?;
        let jobs = effective_jobs(opts.jobs, todo.len());
        let ctx = JobContext {
            ws,
            rules: &opts.rules,
            transcriber: transcriber.as_ref(),
            cores: available_cores(),
            busy_workers: AtomicUsize::new(jobs),
        };
        let (tx, rx) = mpsc::channel();
        let next = AtomicUsize::new(0);
        // Set when the workspace cannot take a result: no worker starts another file.
        let stop = AtomicBool::new(false);
        let mut cannot_write: Option<anyhow::Error> = None;
        let mut audio_seconds = 0.0;
        std::thread::scope(|scope| -> Result<()> {
            for _ in 0..jobs {
                let tx = tx.clone();
                let (next, todo, ctx, stop) = (&next, &todo, &ctx, &stop);
                scope.spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some((file, key)) = todo.get(i) else {
                            break;
                        };
                        let result = process_source(ctx, file, key);
                        if matches!(result, Err(SourceError::Workspace(_))) {
                            stop.store(true, Ordering::Relaxed);
                        }
                        if tx.send((file.clone(), result)).is_err() {
                            break;
                        }
                    }
                    // The workers still busy get this one's cores for their next pieces.
                    ctx.busy_workers.fetch_sub(1, Ordering::Relaxed);
                });
            }
            drop(tx);
            for (file, result) in rx {
                progress.inc(1);
                match result {
                    Ok((record, warning)) => {
                        if let Some(w) = warning {
                            progress.warn(format!("{}: {w}", file.path.display()));
                        }
                        audio_seconds += record.duration;
                        summary.files_processed += 1;
                        records.insert(file, record);
                    }
                    Err(SourceError::Input(reason)) => {
                        let shown = file.path.display().to_string();
                        progress.warn(format!("skipping {shown}: {reason}"));
                        summary.files_failed.push((shown, reason));
                    }
                    Err(SourceError::Workspace(e)) => {
                        cannot_write.get_or_insert(e.context(format!(
                            "prep stopped while preparing {}: it cannot write its results into \
                             the workspace {} (what it finished is kept for the next run)",
                            file.path.display(),
                            ws.root().display()
                        )));
                    }
                }
                progress.set_message(format!("{audio_seconds:.0} s of audio transcribed"));
            }
            Ok(())
        })?;
        if let Some(e) = cannot_write {
            progress.finish();
            return Err(e);
        }
    }

    let duplicates = duplicates::find(&records);
    for (copy, original) in &duplicates {
        progress.warn(format!(
            "{} and {} are the same recording (identical decoded audio); only {} is used",
            original.path.display(),
            copy.path.display(),
            original.path.display()
        ));
    }
    progress.finish();

    for (file, record) in &records {
        summary.source_seconds += record.duration;
        if duplicates.contains_key(file) {
            *summary.dropped.entry(DUPLICATE.to_string()).or_default() += record.duration;
            continue;
        }
        for (reason, secs) in &record.dropped {
            *summary.dropped.entry(reason.clone()).or_default() += secs;
        }
        for u in &record.utterances {
            summary.kept_seconds += u.duration;
            summary.utterances += 1;
        }
    }
    summary.warnings = progress.warnings();
    Ok(Collected {
        records,
        duplicates,
        summary,
    })
}

/// Why a source gave no record.
enum SourceError {
    /// The recording cannot be used (a reason for the user); the run goes on without it.
    Input(String),
    /// The workspace cannot take its results (a full disk): the run stops.
    Workspace(anyhow::Error),
}

struct JobContext<'a> {
    ws: &'a Workspace,
    rules: &'a Rules,
    transcriber: &'a dyn Transcriber,
    cores: usize,
    /// Workers still processing files; each Whisper call gets an equal share of the cores, so
    /// threads are split between the workers, never multiplied, and the last file gets every
    /// core once the others are done.
    busy_workers: AtomicUsize,
}

impl JobContext<'_> {
    fn threads(&self) -> usize {
        (self.cores / self.busy_workers.load(Ordering::Relaxed).max(1)).max(1)
    }
}

/// Decodes, transcribes and cuts one source; the optional string is a warning about damage
/// that was worked around.
fn process_source(
    ctx: &JobContext,
    file: &SourceFile,
    key: &str,
) -> std::result::Result<(SourceRecord, Option<String>), SourceError> {
    let t_start = Instant::now();
    let decoded =
        audio::decode::decode_file(&file.path).map_err(|e| SourceError::Input(e.to_string()))?;
    let warning = match &decoded.damage {
        Some(damage) if decoded.duration_seconds() < ctx.rules.min_seconds => {
            return Err(SourceError::Input(format!(
                "{damage}; the {:.2} s that could be decoded are shorter than prep.min_seconds \
                 ({} s)",
                decoded.duration_seconds(),
                ctx.rules.min_seconds
            )));
        }
        Some(damage) => Some(format!(
            "{damage}; using the {:.1} s that could be decoded",
            decoded.duration_seconds()
        )),
        None => None,
    };
    let duration = decoded.duration_seconds();
    let mut record = SourceRecord {
        key: key.to_string(),
        source: ctx.ws.relative(&file.path),
        duration: round_ms(duration),
        audio_sha256: duplicates::audio_digest(&decoded.samples, decoded.sample_rate),
        utterances: Vec::new(),
        dropped: Vec::new(),
    };
    // No utterance can be longer than its recording: a clip shorter than one is not worth
    // transcribing (thousands of them took minutes of Whisper to be dropped afterwards).
    if duration < ctx.rules.min_seconds {
        record.dropped = vec![(DropReason::TooShort.to_string(), record.duration)];
        write_record(ctx, key, &record)?;
        return Ok((record, warning));
    }
    let t_decoded = Instant::now();
    let for_whisper: Cow<[f32]> = if decoded.sample_rate == WHISPER_RATE {
        Cow::Borrowed(&decoded.samples)
    } else {
        Cow::Owned(
            audio::resample::resample(&decoded.samples, decoded.sample_rate, WHISPER_RATE)
                .map_err(|e| SourceError::Input(format!("{e:#}")))?,
        )
    };
    let t_resampled = Instant::now();
    let pieces = chunk::plan(&for_whisper, WHISPER_RATE, ctx.rules.silence_db);
    let transcript = transcribe_pieces(ctx, &for_whisper, &pieces).map_err(SourceError::Input)?;
    let t_transcribed = Instant::now();
    drop(for_whisper);
    let output = audio::resample::resample(&decoded.samples, decoded.sample_rate, OUTPUT_RATE)
        .map_err(|e| SourceError::Input(format!("{e:#}")))?;
    let cut = segment::cut(&transcript.segments, &output, OUTPUT_RATE, ctx.rules);

    let stem = file.safe_stem();
    for (i, u) in cut.utterances.iter().enumerate() {
        let a = (u.start * OUTPUT_RATE as f64).round() as usize;
        let b = ((u.end * OUTPUT_RATE as f64).round() as usize).min(output.len());
        let path = ctx.ws.segment(&format!("{stem}-{}-{i:03}.wav", &key[..8]));
        audio::wav::write_pcm16(&path, &output[a..b], OUTPUT_RATE)
            .map_err(SourceError::Workspace)?;
        record.utterances.push(UtteranceRecord {
            audio: ctx.ws.relative(&path),
            text: u.text.clone(),
            duration: round_ms((b - a) as f64 / OUTPUT_RATE as f64),
            start: round_ms(u.start),
            end: round_ms(u.end),
            language: transcript.language.clone(),
            no_speech_prob: u.no_speech_prob,
        });
    }
    record.dropped = where_the_rest_went(duration, &cut, &transcript, &pieces);
    write_record(ctx, key, &record)?;
    let t_done = Instant::now();
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1000.0;
    tracing::debug!(
        "{}: {:.1} s of audio: decode {:.0} ms, 16 kHz {:.0} ms, transcription {:.0} ms, \
         24 kHz + cutting + writing {:.0} ms",
        file.path.display(),
        duration,
        ms(t_start, t_decoded),
        ms(t_decoded, t_resampled),
        ms(t_resampled, t_transcribed),
        ms(t_transcribed, t_done),
    );
    Ok((record, warning))
}

/// Writes the source's record; a failure is the workspace's, not the recording's.
fn write_record(
    ctx: &JobContext,
    key: &str,
    record: &SourceRecord,
) -> std::result::Result<(), SourceError> {
    records::write_record(&ctx.ws.prep_record(key), record).map_err(SourceError::Workspace)
}

/// Every second of a recording of `duration` s that is not in an utterance, by reason
/// ([`accounting`]): the stretches `cut` dropped, then what Whisper heard but trimming left out,
/// then what was transcribed without a word heard, and the silence that was never transcribed.
fn where_the_rest_went(
    duration: f64,
    cut: &segment::Cut,
    transcript: &Transcript,
    pieces: &[chunk::Chunk],
) -> Vec<(String, f64)> {
    const KEPT: &str = "kept";
    let mut layers: Vec<(String, Vec<(f64, f64)>)> = vec![(
        KEPT.to_string(),
        cut.utterances.iter().map(|u| (u.start, u.end)).collect(),
    )];
    let mut reasons: Vec<DropReason> = cut.dropped.iter().map(|d| d.reason).collect();
    reasons.sort();
    reasons.dedup();
    for reason in reasons {
        let spans = cut
            .dropped
            .iter()
            .filter(|d| d.reason == reason)
            .map(|d| (d.start, d.end))
            .collect();
        layers.push((reason.to_string(), spans));
    }
    layers.push((
        TRIMMED.to_string(),
        transcript
            .segments
            .iter()
            .map(|s| (s.start, s.end))
            .collect(),
    ));
    let seconds = |i: usize| i as f64 / WHISPER_RATE as f64;
    layers.push((
        NOTHING_HEARD.to_string(),
        pieces
            .iter()
            .map(|p| (seconds(p.start), seconds(p.end)))
            .collect(),
    ));
    accounting::account(duration, &layers, NOT_TRANSCRIBED)
        .into_iter()
        .filter(|(label, _)| label != KEPT)
        .map(|(label, secs)| (label, round_ms(secs)))
        .collect()
}

/// Transcribes the 16 kHz signal piece by piece (`pieces`, from `chunk::plan`), with segment
/// times moved to the whole recording's clock. The language is the one Whisper found in most of
/// the audio.
fn transcribe_pieces(
    ctx: &JobContext,
    samples: &[f32],
    pieces: &[chunk::Chunk],
) -> std::result::Result<Transcript, String> {
    let mut segments = Vec::new();
    let mut languages: BTreeMap<String, usize> = BTreeMap::new();
    for piece in pieces {
        let part = ctx
            .transcriber
            .transcribe(&samples[piece.start..piece.end], ctx.threads())
            .map_err(|e| format!("transcription failed: {e:#}"))?;
        let offset = piece.start as f64 / WHISPER_RATE as f64;
        *languages.entry(part.language).or_default() += piece.len();
        segments.extend(part.segments.into_iter().map(|mut s| {
            s.start += offset;
            s.end += offset;
            for w in &mut s.words {
                w.start += offset;
                w.end += offset;
            }
            s
        }));
    }
    let language = languages
        .into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
        .map(|(language, _)| language)
        .unwrap_or_else(|| "english".to_string());
    Ok(Transcript { segments, language })
}

/// The record for `key`, if it exists and all of its utterance files are still there.
fn reusable_record(ws: &Workspace, key: &str, force: bool) -> Option<SourceRecord> {
    if force {
        return None;
    }
    let record = records::read_record(&ws.prep_record(key)).ok()?;
    let complete = record.key == key
        && record
            .utterances
            .iter()
            .all(|u| ws.resolve(&u.audio).is_file());
    complete.then_some(record)
}

fn settings_digest(opts: &PrepOptions) -> String {
    #[derive(Serialize)]
    struct Settings<'a> {
        version: u32,
        whisper_model: &'a str,
        language: &'a str,
        min_seconds: f64,
        max_seconds: f64,
        max_merge_gap: f64,
        max_no_speech_prob: f64,
        pad_seconds: f64,
        silence_db: f64,
    }
    let r = &opts.rules;
    sources::digest_of(&Settings {
        version: PREP_FORMAT_VERSION,
        whisper_model: &opts.whisper_model,
        language: &opts.language,
        min_seconds: r.min_seconds,
        max_seconds: r.max_seconds,
        max_merge_gap: r.max_merge_gap,
        max_no_speech_prob: r.max_no_speech_prob,
        pad_seconds: r.pad_seconds,
        silence_db: r.silence_db,
    })
}

fn available_cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn effective_jobs(configured: usize, files: usize) -> usize {
    let jobs = if configured == 0 {
        available_cores()
    } else {
        configured
    };
    jobs.clamp(1, files.max(1))
}

/// Writes the reference clip `dest` (`data/ref.wav`, or `data/ref/NAME.wav` of a named speaker):
/// the forced clip (decoded and resampled to 24 kHz), or the best utterance (a clean one of
/// 3-10 s, closest to 6 s). Returns its workspace-relative path.
pub(crate) fn write_reference(
    ws: &Workspace,
    dest: &Path,
    forced: Option<&Path>,
    utterances: &[(&str, &UtteranceRecord)],
) -> Result<String> {
    let dest = dest.to_path_buf();
    match forced {
        Some(path) => {
            let samples = audio::load_mono(path, OUTPUT_RATE)
                .with_context(|| format!("prep.ref_audio {} cannot be used", path.display()))?;
            audio::wav::write_pcm16(&dest, &samples, OUTPUT_RATE)?;
        }
        None => {
            let best = choose_reference(utterances.iter().map(|(_, u)| *u))
                .context("no utterance to use as the reference clip")?;
            let src = ws.resolve(&best.audio);
            let bytes =
                std::fs::read(&src).with_context(|| format!("cannot read {}", src.display()))?;
            write_atomic(&dest, &bytes)
                .with_context(|| format!("cannot write the reference clip {}", dest.display()))?;
        }
    }
    Ok(ws.relative(&dest))
}

/// The most reference-worthy utterance: inside 3-10 s if any is, then the lowest no-speech
/// probability, then closest to 6 s; ties broken by path for determinism.
pub fn choose_reference<'a>(
    utterances: impl Iterator<Item = &'a UtteranceRecord>,
) -> Option<&'a UtteranceRecord> {
    let outside = |d: f64| (REF_MIN_SECONDS - d).max(d - REF_MAX_SECONDS).max(0.0);
    let ideal = (REF_MIN_SECONDS + REF_MAX_SECONDS) / 2.0 - 0.5;
    utterances.min_by(|a, b| {
        let key = |u: &UtteranceRecord| {
            (
                outside(u.duration),
                u.no_speech_prob + (u.duration - ideal).abs() / 20.0,
            )
        };
        let (ka, kb) = (key(a), key(b));
        ka.0.total_cmp(&kb.0)
            .then(ka.1.total_cmp(&kb.1))
            .then_with(|| a.audio.cmp(&b.audio))
    })
}

pub(crate) fn nothing_usable_message(s: &Summary) -> String {
    if s.files_found == 0 {
        return "no audio files found in the inputs".into();
    }
    let mut msg = format!(
        "no usable utterance came out of {} file(s) ({:.1} s of audio)",
        s.files_found, s.source_seconds
    );
    if !s.files_failed.is_empty() {
        msg.push_str(&format!(
            "; {} could not be read (see warnings above)",
            s.files_failed.len()
        ));
    }
    if !s.dropped.is_empty() {
        let parts: Vec<String> = s
            .dropped_by_size()
            .iter()
            .map(|(r, secs)| format!("{secs:.1} s {r}"))
            .collect();
        msg.push_str(&format!("; dropped: {}", parts.join(", ")));
    }
    msg
}

impl Summary {
    /// The reasons of `dropped`, the most seconds first.
    fn dropped_by_size(&self) -> Vec<(&str, f64)> {
        let mut parts: Vec<(&str, f64)> =
            self.dropped.iter().map(|(r, s)| (r.as_str(), *s)).collect();
        parts.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
        parts
    }

    /// The human-readable report printed at the end of `prep`.
    pub fn render(&self) -> String {
        let h = |s: f64| format!("{:.2} h ({s:.1} s)", s / 3600.0);
        let mut out = format!(
            "prep: {} file(s) found, {} processed, {} unchanged and reused, {} failed\n",
            self.files_found,
            self.files_processed,
            self.files_reused,
            self.files_failed.len()
        );
        out.push_str(&format!(
            "  audio: {} in sources, {} kept in {} utterance(s)\n",
            h(self.source_seconds),
            h(self.kept_seconds),
            self.utterances
        ));
        // Kept and dropped add up to the sources' audio (`accounting`).
        let dropped: Vec<String> = self
            .dropped_by_size()
            .iter()
            .map(|(reason, secs)| format!("{} {reason}", h(*secs)))
            .collect();
        if dropped.is_empty() {
            out.push_str("  dropped: nothing\n");
        } else {
            out.push_str(&format!("  dropped: {}\n", dropped.join(", ")));
        }
        for (file, reason) in &self.files_failed {
            out.push_str(&format!("  failed: {file}: {reason}\n"));
        }
        out.push_str(&format!(
            "  manifest: {}\n  reference clip: {}\n",
            self.manifest.display(),
            self.ref_audio
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utt(audio: &str, duration: f64, nsp: f64) -> UtteranceRecord {
        UtteranceRecord {
            audio: audio.into(),
            text: "t".into(),
            duration,
            start: 0.0,
            end: duration,
            language: "english".into(),
            no_speech_prob: nsp,
        }
    }

    #[test]
    fn reference_prefers_clean_clips_of_three_to_ten_seconds() {
        let list = [
            utt("a", 12.0, 0.0),
            utt("b", 2.0, 0.0),
            utt("c", 4.0, 0.3),
            utt("d", 7.0, 0.01),
        ];
        assert_eq!(choose_reference(list.iter()).unwrap().audio, "d");
        // Nothing in range: the closest to it.
        let list = [utt("a", 14.0, 0.0), utt("b", 1.5, 0.0), utt("c", 11.0, 0.2)];
        assert_eq!(choose_reference(list.iter()).unwrap().audio, "c");
        assert!(choose_reference([].iter()).is_none());
    }
}
