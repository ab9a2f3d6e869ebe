//! prep's promises beyond transcription quality: re-runs do no work and leave the manifest
//! byte-identical, a new file is processed alone, and bad inputs are reported by name without
//! harming anything already written.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use vc_core::workspace::Workspace;
use vc_prep::segment::Rules;
use vc_prep::transcribe::{Transcriber, Transcript, WhisperTranscriber};
use vc_prep::{self as prep, PrepOptions};

/// The `n` smallest real-speech files of the test corpus.
fn small_speech_files(n: usize) -> Vec<PathBuf> {
    let dir = assets().join("speech/prep2");
    let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e != "tsv"))
        .map(|p| (std::fs::metadata(&p).unwrap().len(), p))
        .collect();
    files.sort();
    files.into_iter().take(n).map(|(_, p)| p).collect()
}

struct Counting {
    inner: WhisperTranscriber,
    calls: Arc<AtomicUsize>,
}

impl Transcriber for Counting {
    fn transcribe(&self, samples: &[f32], threads: usize) -> anyhow::Result<Transcript> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.transcribe(samples, threads)
    }
}

fn options(input: &Path) -> PrepOptions {
    PrepOptions {
        inputs: vec![input.to_path_buf()],
        rules: Rules {
            min_seconds: 1.0,
            max_seconds: 15.0,
            max_merge_gap: 1.5,
            max_no_speech_prob: 0.6,
            pad_seconds: 0.15,
            silence_db: -40.0,
        },
        whisper_model: whisper_model().to_string_lossy().into_owned(),
        language: "en".into(),
        jobs: 2,
        ref_audio: None,
        force: false,
    }
}

#[test]
fn rerun_does_no_work_and_new_files_are_processed_alone() {
    if !common::have_assets() {
        return;
    }
    let files = small_speech_files(3);
    let inputs = tempfile::tempdir().unwrap();
    for f in &files[..2] {
        copy(f, &inputs.path().join(f.file_name().unwrap()));
    }
    let ws_dir = tempfile::tempdir().unwrap();
    let ws = Workspace::open(ws_dir.path()).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let loads = AtomicUsize::new(0);
    let make = || -> anyhow::Result<Arc<dyn Transcriber>> {
        loads.fetch_add(1, Ordering::SeqCst);
        Ok(Arc::new(Counting {
            inner: WhisperTranscriber::load(&whisper_model(), "en")?,
            calls: calls.clone(),
        }))
    };
    let opts = options(inputs.path());

    let first = prep::run(&ws, &opts, &make).unwrap();
    assert_eq!((first.files_processed, first.files_reused), (2, 0));
    // Each recording is transcribed in one or more pieces.
    let first_calls = calls.load(Ordering::SeqCst);
    assert!(first_calls >= 2, "{first_calls} transcriptions");
    assert!(first.utterances > 0);
    let manifest = std::fs::read(ws.manifest()).unwrap();
    let segments = snapshot(&ws.segments_dir());

    let second = prep::run(&ws, &opts, &make).unwrap();
    assert_eq!((second.files_processed, second.files_reused), (0, 2));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        first_calls,
        "re-run transcribed again"
    );
    assert_eq!(
        loads.load(Ordering::SeqCst),
        1,
        "re-run loaded the Whisper model"
    );
    assert_eq!(
        std::fs::read(ws.manifest()).unwrap(),
        manifest,
        "manifest changed"
    );
    assert_eq!(snapshot(&ws.segments_dir()), segments, "segments rewritten");

    let new = &files[2];
    copy(new, &inputs.path().join(new.file_name().unwrap()));
    let third = prep::run(&ws, &opts, &make).unwrap();
    assert_eq!((third.files_processed, third.files_reused), (1, 2));
    assert!(calls.load(Ordering::SeqCst) > first_calls);
    let rows = std::fs::read_to_string(ws.manifest()).unwrap();
    let new_name = new.file_stem().unwrap().to_string_lossy().into_owned();
    assert!(
        rows.contains(&new_name),
        "new file missing from the manifest"
    );
    // The earlier rows are all still there, unchanged.
    for line in String::from_utf8(manifest).unwrap().lines() {
        assert!(rows.contains(line));
    }
    // --force redoes everything.
    let forced = prep::run(
        &ws,
        &PrepOptions {
            force: true,
            ..opts
        },
        &make,
    )
    .unwrap();
    assert_eq!(forced.files_processed, 3);
}

#[test]
fn bad_inputs_are_reported_by_name_and_harm_nothing() {
    if !common::have_assets() {
        return;
    }
    let good = &small_speech_files(1)[0];
    let inputs = tempfile::tempdir().unwrap();
    let dir = inputs.path();
    copy(good, &dir.join("good").join(good.file_name().unwrap()));
    let ws = tempfile::tempdir().unwrap();
    let model = whisper_model();
    let prep_args = |extra: &[&str]| {
        let mut a = vec![
            "prep",
            "--whisper-model",
            model.to_str().unwrap(),
            "--language",
            "en",
        ];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |extra: &[&str]| {
        let args = prep_args(extra);
        voiceclone(
            ws.path(),
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    };
    let good_dir = dir.join("good");
    let first = run(&[good_dir.to_str().unwrap()]);
    assert!(first.status.success(), "{}", stderr(&first));
    // prep records the Whisper model it used, for the WER of training's samples.
    let used: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ws.path().join("data/prep/whisper.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(used["model"], model.to_str().unwrap(), "{used}");
    let manifest = std::fs::read(ws.path().join("data/train.jsonl")).unwrap();
    let outputs = snapshot(&ws.path().join("data/segments"));
    let reference = std::fs::read(ws.path().join("data/ref.wav")).unwrap();

    // Every kind of bad input next to the good file.
    let bad = dir.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("empty.wav"), b"").unwrap();
    std::fs::write(bad.join("notes.mp3"), "not audio at all\n".repeat(100)).unwrap();
    let flac = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/audio/tone-44100.flac"),
    )
    .unwrap();
    std::fs::write(bad.join("truncated.flac"), &flac[..flac.len() / 2]).unwrap();
    // Cut after 0.2 s of its audio: readable, but shorter than prep.min_seconds.
    std::fs::write(bad.join("cut-short.flac"), &flac[..flac.len() * 4 / 5]).unwrap();
    std::fs::write(
        bad.join("corrupt.m4a"),
        [&b"\x00\x00\x00\x18ftypM4A "[..], &[0x5a; 4000][..]].concat(),
    )
    .unwrap();
    std::os::unix::fs::symlink(dir.join("nowhere.wav"), bad.join("unreadable.wav")).unwrap();
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    hound::WavWriter::create(bad.join("zero-samples.wav"), spec)
        .unwrap()
        .finalize()
        .unwrap();
    let empty_dir = dir.join("no-audio-here");
    std::fs::create_dir_all(&empty_dir).unwrap();
    std::fs::write(empty_dir.join("readme.txt"), b"nothing").unwrap();

    let second = run(&[
        good_dir.to_str().unwrap(),
        bad.to_str().unwrap(),
        empty_dir.to_str().unwrap(),
    ]);
    let err = stderr(&second);
    assert!(
        second.status.success(),
        "bad inputs must not fail the run:\n{err}"
    );
    for (name, reason) in [
        ("empty.wav", "empty file"),
        ("notes.mp3", "not a recognised audio format"),
        ("truncated.flac", "truncated"),
        ("cut-short.flac", "shorter than prep.min_seconds"),
        ("corrupt.m4a", ""),
        ("unreadable.wav", "cannot open"),
        ("zero-samples.wav", "no audio samples"),
        ("no-audio-here", "no audio files"),
    ] {
        let line = err
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no warning names {name}:\n{err}"));
        assert!(
            line.starts_with("warning:") && line.contains(reason),
            "{line}"
        );
    }
    // The good file's results are untouched, and still the whole manifest.
    assert_eq!(
        std::fs::read(ws.path().join("data/train.jsonl")).unwrap(),
        manifest
    );
    assert_eq!(snapshot(&ws.path().join("data/segments")), outputs);
    assert_eq!(
        std::fs::read(ws.path().join("data/ref.wav")).unwrap(),
        reference
    );
    assert!(stdout(&second).contains("7 failed"), "{}", stdout(&second));

    // Only bad inputs: a non-zero exit that says why; earlier outputs still intact.
    let third = run(&[bad.to_str().unwrap()]);
    assert!(!third.status.success());
    assert!(
        stderr(&third).contains("error: no usable utterance"),
        "{}",
        stderr(&third)
    );
    assert_eq!(
        std::fs::read(ws.path().join("data/train.jsonl")).unwrap(),
        manifest
    );
    let none = run(&[empty_dir.to_str().unwrap()]);
    assert!(!none.status.success());
    assert!(
        stderr(&none).contains("no audio files found"),
        "{}",
        stderr(&none)
    );
}

/// The first `fraction` of the bytes of `from`, written to `to`.
fn cut_copy(from: &Path, to: &Path, fraction: f64) {
    let bytes = std::fs::read(from).unwrap();
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::write(to, &bytes[..(bytes.len() as f64 * fraction) as usize]).unwrap();
}

#[test]
fn truncated_recordings_give_their_readable_part_with_a_warning() {
    // Real speech in FLAC, MP3 and WAV, each cut off after 60 % of its bytes, as when a
    // recorder dies mid-take.
    let dir = assets().join("speech/prep2");
    let refs: std::collections::BTreeMap<String, String> = transcripts(&dir).into_iter().collect();
    let inputs = tempfile::tempdir().unwrap();
    let names = [
        "13_mix_flac22k.flac",
        "05_mix_mp3-44k.mp3",
        "01_mix_wav16k.wav",
    ];
    for name in names {
        cut_copy(&dir.join(name), &inputs.path().join(name), 0.6);
    }
    let ws = tempfile::tempdir().unwrap();
    let model = whisper_model();
    let out = voiceclone(
        ws.path(),
        &[
            "prep",
            inputs.path().to_str().unwrap(),
            "--whisper-model",
            model.to_str().unwrap(),
            "--language",
            "en",
        ],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(stdout(&out).contains("3 processed"), "{}", stdout(&out));
    let manifest = std::fs::read_to_string(ws.path().join("data/train.jsonl")).unwrap();
    for name in names {
        let line = err
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no warning names {name}:\n{err}"));
        assert!(
            line.starts_with("warning:")
                && line.contains("truncated")
                && line.contains("using the"),
            "{line}"
        );
        // The warning says how much was used; every utterance lies inside it.
        let used: f64 = line
            .split("using the ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no duration in {line}"));
        let full = vc_audio::decode::decode_file(&dir.join(name))
            .unwrap()
            .duration_seconds();
        assert!(
            used > 0.4 * full && used < 0.8 * full,
            "{name}: {used} of {full} s"
        );
        let rows: Vec<serde_json::Value> = manifest
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|r: &serde_json::Value| r["source"].as_str().unwrap().ends_with(name))
            .collect();
        assert!(!rows.is_empty(), "{name}: no utterances");
        let mut words = Vec::new();
        for row in &rows {
            assert!(row["end"].as_f64().unwrap() <= used + 0.05, "{name}: {row}");
            words.extend(normalize_words(row["text"].as_str().unwrap()));
        }
        // What was heard is the start of the recording's transcript: some prefix of it
        // matches with few errors (the last word heard may be cut off).
        let reference = normalize_words(&refs[name]);
        let (errors, k) = (1..=reference.len())
            .map(|k| (word_errors(&reference[..k], &words), k))
            .min()
            .unwrap();
        assert!(
            k < reference.len() && errors <= 2 + words.len() / 10,
            "{name}: {errors} errors against the first {k} of {} reference words\n  hyp: {}",
            reference.len(),
            words.join(" ")
        );
    }
}

/// Links inside the recordings folder — two that loop back to it and one into the workspace —
/// give exactly the utterances of the same folder without them, on the first run and on every
/// re-run (prep once followed them without end, and read the workspace's own segments back in).
#[test]
fn links_that_loop_or_lead_into_the_workspace_change_nothing() {
    if !common::have_assets() {
        return;
    }
    let files = small_speech_files(2);
    let root = tempfile::tempdir().unwrap();
    let rec = root.path().join("rec");
    std::fs::create_dir_all(rec.join("sub")).unwrap();
    copy(&files[0], &rec.join(files[0].file_name().unwrap()));
    copy(
        &files[1],
        &rec.join("sub").join(files[1].file_name().unwrap()),
    );
    let manifest_of = |ws: &Path| {
        let started = std::time::Instant::now();
        let o = voiceclone(
            ws,
            &[
                "prep",
                rec.to_str().unwrap(),
                "--whisper-model",
                whisper_model().to_str().unwrap(),
                "--language",
                "en",
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        (
            std::fs::read_to_string(ws.join("data/train.jsonl")).unwrap(),
            started.elapsed(),
            stderr(&o),
        )
    };
    let plain_ws = root.path().join("plain");
    std::fs::create_dir_all(&plain_ws).unwrap();
    let (plain, plain_took, _) = manifest_of(&plain_ws);
    assert!(!plain.is_empty());

    let ws = root.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::os::unix::fs::symlink(".", rec.join("sub/loop")).unwrap();
    std::os::unix::fs::symlink("..", rec.join("sub/up")).unwrap();
    std::os::unix::fs::symlink(&ws, rec.join("workspace")).unwrap();
    for run in 0..3 {
        let (linked, took, err) = manifest_of(&ws);
        assert_eq!(linked, plain, "run {run}: the links changed the utterances");
        assert!(err.contains("this is the workspace"), "{err}");
        eprintln!("run {run}: {took:?} with the links, {plain_took:?} without");
    }
}

/// A workspace prep cannot write into is refused before any transcription, naming the
/// workspace (it used to transcribe everything first, then call the input unreadable).
#[test]
fn an_unwritable_workspace_is_refused_before_any_work() {
    if !common::have_assets() {
        return;
    }
    let files = small_speech_files(1);
    let inputs = tempfile::tempdir().unwrap();
    copy(
        &files[0],
        &inputs.path().join(files[0].file_name().unwrap()),
    );
    let ws_dir = tempfile::tempdir().unwrap();
    // `data` is a file: nothing can be created under it (root ignores permission bits, so a
    // read-only directory would not stop a test run as root).
    std::fs::write(ws_dir.path().join("data"), b"not a folder").unwrap();
    let ws = Workspace::open(ws_dir.path()).unwrap();
    let loads = AtomicUsize::new(0);
    let make = || -> anyhow::Result<Arc<dyn Transcriber>> {
        loads.fetch_add(1, Ordering::SeqCst);
        Ok(Arc::new(WhisperTranscriber::load(&whisper_model(), "en")?))
    };
    let e = prep::run(&ws, &options(inputs.path()), &make).unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("cannot write into the workspace")
            && msg.contains(&ws_dir.path().display().to_string()),
        "{msg}"
    );
    assert_eq!(
        loads.load(Ordering::SeqCst),
        0,
        "Whisper was loaded before the refusal"
    );
    assert_eq!(
        std::fs::read(ws_dir.path().join("data")).unwrap(),
        b"not a folder"
    );
}

/// A write into the workspace that fails (a full disk; here a file-size limit, which fails the
/// same writes) stops prep with the file it could not write, instead of blaming the recording
/// and going on to transcribe the others.
#[test]
fn a_failed_write_stops_prep_naming_the_file() {
    use std::os::unix::process::CommandExt;
    if !common::have_assets() {
        return;
    }
    let files = small_speech_files(2);
    let inputs = tempfile::tempdir().unwrap();
    for f in &files {
        copy(f, &inputs.path().join(f.file_name().unwrap()));
    }
    let ws = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_voiceclone"));
    cmd.arg("--workdir")
        .arg(ws.path())
        .args(["prep", "--language", "en", "--jobs", "1", "--whisper-model"])
        .arg(whisper_model())
        .arg(inputs.path())
        .env_remove("RUST_LOG");
    // SAFETY: only async-signal-safe calls (setrlimit, signal) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            // 16 KiB: less than a third of a second of 24 kHz audio; SIGXFSZ ignored, so the
            // write fails with an error as on a full disk instead of killing the process.
            let limit = libc::rlimit {
                rlim_cur: 16 * 1024,
                rlim_max: 16 * 1024,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    let error = err
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line:\n{err}"));
    let segments = ws.path().join("data/segments").display().to_string();
    assert!(
        error.contains("cannot write") && error.contains(&segments) && error.contains("too large"),
        "{err}"
    );
    assert!(!err.contains("could not be read"), "{err}");
}
