//! `prep` as a whole on small synthetic recordings, with a scripted transcriber instead of
//! Whisper: what is checked before anything is written, what is never transcribed, exact
//! duplicates, and the summary's account of every second.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;

use super::segment::Rules;
use super::transcribe::{Segment, Transcriber, Transcript, Word};
use super::{collect, run, PrepOptions};
use vc_audio::analysis::sine;
use vc_core::workspace::Workspace;

/// Hears one segment over the first `heard` seconds of every piece (all of it when `None`),
/// speech in a loud piece and non-speech in a quiet one, and counts its calls.
struct Scripted {
    calls: AtomicUsize,
    heard: Option<f64>,
}

impl Scripted {
    fn new(heard: Option<f64>) -> Arc<Self> {
        Arc::new(Scripted {
            calls: AtomicUsize::new(0),
            heard,
        })
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Transcriber for Scripted {
    fn transcribe(&self, samples: &[f32], _threads: usize) -> Result<Transcript> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let len = samples.len() as f64 / 16_000.0;
        let end = self.heard.map_or(len, |h| h.min(len));
        let loud = vc_audio::analysis::rms_db(samples) > -20.0;
        let words: Vec<Word> = (0..4)
            .map(|i| Word {
                text: format!("word{i}"),
                start: end * i as f64 / 4.0,
                end: end * (i as f64 + 0.8) / 4.0,
            })
            .collect();
        Ok(Transcript {
            segments: vec![Segment {
                start: 0.0,
                end,
                text: "word0 word1 word2 word3".into(),
                no_speech_prob: if loud { 0.0 } else { 0.9 },
                words,
            }],
            language: "english".into(),
        })
    }
}

fn options(inputs: Vec<PathBuf>) -> PrepOptions {
    PrepOptions {
        inputs,
        rules: Rules {
            min_seconds: 1.0,
            max_seconds: 15.0,
            max_merge_gap: 1.5,
            max_no_speech_prob: 0.6,
            pad_seconds: 0.15,
            silence_db: -40.0,
        },
        whisper_model: "scripted".into(),
        language: "en".into(),
        jobs: 2,
        ref_audio: None,
        force: false,
    }
}

const RATE: u32 = 16_000;

fn tone(seconds: f64, freq: f64) -> Vec<f32> {
    sine(freq, 0.5, RATE, (seconds * RATE as f64) as usize)
}

fn write16(path: &Path, samples: &[f32]) {
    vc_audio::wav::write_pcm16(path, samples, RATE).unwrap();
}

/// The same samples as [`write16`] writes, in a 24-bit WAV: other bytes, the same decoded audio.
fn write24(path: &Path, samples: &[f32]) {
    let data: Vec<u8> = samples
        .iter()
        .flat_map(|&s| {
            let v = i32::from(vc_audio::wav::to_i16(s)) << 8;
            [v as u8, (v >> 8) as u8, (v >> 16) as u8]
        })
        .collect();
    let mut out = Vec::new();
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&RATE.to_le_bytes());
    out.extend_from_slice(&(RATE * 3).to_le_bytes());
    out.extend_from_slice(&3u16.to_le_bytes());
    out.extend_from_slice(&24u16.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

/// `(inputs, workspace)` folders; the workspace is a subfolder of its own temporary directory.
fn dirs() -> (tempfile::TempDir, tempfile::TempDir, Workspace) {
    let inputs = tempfile::tempdir().unwrap();
    let ws_dir = tempfile::tempdir().unwrap();
    let ws = Workspace::open(ws_dir.path()).unwrap();
    (inputs, ws_dir, ws)
}

#[test]
fn inputs_are_checked_before_anything_is_created() {
    let (inputs, _keep, ws) = dirs();
    let loads = AtomicUsize::new(0);
    let make = || -> Result<Arc<dyn Transcriber>> {
        loads.fetch_add(1, Ordering::SeqCst);
        Ok(Scripted::new(None))
    };
    std::fs::write(inputs.path().join("notes.txt"), "no audio").unwrap();
    for input in [inputs.path().join("missing"), inputs.path().to_path_buf()] {
        let e = run(&ws, &options(vec![input.clone()]), &make).unwrap_err();
        assert!(
            format!("{e:#}").contains("no audio files found"),
            "{input:?}: {e:#}"
        );
        assert!(
            !ws.data_dir().exists(),
            "{input:?}: prep created {} before finding no input",
            ws.data_dir().display()
        );
    }
    assert_eq!(loads.load(Ordering::SeqCst), 0);
}

#[test]
fn clips_shorter_than_an_utterance_are_never_transcribed() {
    let (inputs, _keep, ws) = dirs();
    for i in 0..5 {
        write16(
            &inputs.path().join(format!("short{i}.wav")),
            &tone(0.5, 200.0 + 10.0 * i as f64),
        );
    }
    let whisper = Scripted::new(None);
    let make = || -> Result<Arc<dyn Transcriber>> { Ok(whisper.clone()) };
    let c = collect(&ws, &options(vec![inputs.path().into()]), &make).unwrap();
    assert_eq!(whisper.calls(), 0, "short clips were transcribed");
    assert_eq!(c.summary.files_processed, 5);
    assert_eq!(c.summary.utterances, 0);
    let short = c.summary.dropped.get("too short").copied().unwrap_or(0.0);
    assert!((short - 2.5).abs() < 1e-6, "{:?}", c.summary.dropped);
}

#[test]
fn an_exact_duplicate_is_used_once_with_a_warning_naming_both() {
    let (inputs, _keep, ws) = dirs();
    let take = tone(2.5, 220.0);
    let (a, b, c) = (
        inputs.path().join("a-take.wav"),
        inputs.path().join("b-copy-24bit.wav"),
        inputs.path().join("c-other.wav"),
    );
    write16(&a, &take);
    // The same decoded audio in other bytes (a 24-bit file of the same samples).
    write24(&b, &take);
    assert_ne!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    // One sample different: not a duplicate.
    let mut other = take.clone();
    other[100] = 0.25;
    write16(&c, &other);
    let whisper = Scripted::new(None);
    let make = || -> Result<Arc<dyn Transcriber>> { Ok(whisper.clone()) };
    let summary = run(&ws, &options(vec![inputs.path().into()]), &make).unwrap();
    let manifest = std::fs::read_to_string(ws.manifest()).unwrap();
    let sources: std::collections::BTreeSet<String> = manifest
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["source"].to_string())
        .collect();
    assert_eq!(
        sources.len(),
        2,
        "{manifest}\n{}{:?}",
        summary.render(),
        summary.warnings
    );
    assert!(!manifest.contains("b-copy-24bit"), "{manifest}");
    let warning = summary
        .warnings
        .iter()
        .find(|w| w.contains("a-take.wav") && w.contains("b-copy-24bit.wav"))
        .unwrap_or_else(|| panic!("no warning names both: {:?}", summary.warnings));
    assert!(!warning.contains("c-other"), "{warning}");
    let duplicate: f64 = summary
        .dropped
        .iter()
        .filter(|(why, _)| why.contains("duplicate"))
        .map(|(_, s)| s)
        .sum();
    assert!((duplicate - 2.5).abs() < 1e-6, "{:?}", summary.dropped);
}

#[test]
fn the_summary_accounts_for_every_second() {
    let (inputs, _keep, ws) = dirs();
    // 20 s of dither (quiet noise: loud enough to be transcribed), then 10 s of digital
    // silence (never transcribed); Whisper hears only non-speech in the first 5 s.
    let mut x: Vec<f32> = (0..20 * RATE as usize)
        .map(|i| 1e-3 * (((i * 7919) % 13) as f32 - 6.0))
        .collect();
    x.extend(vec![0.0; 10 * RATE as usize]);
    write16(&inputs.path().join("hiss.wav"), &x);
    // Beside it a recording with speech, so that there is a manifest to write.
    let mut speech = vec![0.0; RATE as usize];
    speech.extend(tone(4.0, 300.0));
    speech.extend(vec![0.0; RATE as usize]);
    write16(&inputs.path().join("speech.wav"), &speech);
    let whisper = Scripted::new(Some(5.0));
    let make = || -> Result<Arc<dyn Transcriber>> { Ok(whisper.clone()) };
    let e = run(&ws, &options(vec![inputs.path().join("hiss.wav")]), &make).unwrap_err();
    let msg = format!("{e:#}");
    let hiss = collect(&ws, &options(vec![inputs.path().join("hiss.wav")]), &make)
        .unwrap()
        .summary;
    assert!((hiss.source_seconds - 30.0).abs() < 1e-3);
    assert_eq!(hiss.utterances, 0);
    let dropped: f64 = hiss.dropped.values().sum();
    assert!(
        (dropped - 30.0).abs() < 0.01,
        "{dropped} s of 30 accounted for: {:?}",
        hiss.dropped
    );
    // The error of a run with nothing usable names every part.
    for (why, secs) in &hiss.dropped {
        assert!(
            msg.contains(&format!("{secs:.1} s {why}")),
            "{why} missing: {msg}"
        );
    }
    assert!(msg.contains("30.0 s"), "{msg}");
    // With speech kept, the parts still add up, and the report names each.
    let both = run(
        &ws,
        &options(vec![
            inputs.path().join("hiss.wav"),
            inputs.path().join("speech.wav"),
        ]),
        &make,
    )
    .unwrap();
    let total: f64 = both.kept_seconds + both.dropped.values().sum::<f64>();
    assert!(
        (total - both.source_seconds).abs() < 0.01,
        "{total} of {}: {:?}",
        both.source_seconds,
        both.dropped
    );
    let report = both.render();
    for why in both.dropped.keys() {
        assert!(report.contains(why.as_str()), "{why} missing: {report}");
    }
}
