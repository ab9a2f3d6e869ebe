//! Samples at every evaluation (docs/training.md §14.4, §14.5 and §14.6): spoken from each
//! checkpoint as its export would speak them (named speakers each in their own voice, a LoRA run
//! as its merged export), each measure checked against a computation of its own (the x-vector
//! by `voiceclone embed`, the rate and end of speech from the saved codes and the manifest, the
//! WER from a transcription and an edit distance of the test's own), the drift warnings, and the
//! report page rendered in a real browser. Switching samples on and off and choosing the
//! checkpoint by their score are tested in `train_samples_select`, which shares the workspace
//! and run helpers here.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::{have_assets, have_tool, normalize_words, whisper_model, word_errors};
use crate::dist_support::ok;
use crate::train_support::*;

pub(crate) const M: &str = "tiny-0b6";
/// The frame limit of a sample as a multiple of its reference length, and the least one.
const CAP_FACTOR: f64 = 1.5;
const MIN_CAP: usize = 4;

/// The fixture model (stored in bf16) and its copy stored in f32, with their labels.
pub(crate) fn models() -> (tempfile::TempDir, Vec<(String, &'static str)>) {
    let f32_copy = f32_model_copy(M);
    let path = f32_copy.path().to_str().unwrap().to_string();
    (f32_copy, vec![(M.to_string(), "bf16"), (path, "f32")])
}

/// A workspace of 12 synthetic utterances, a quarter held out; `whisper` names the Whisper
/// model for the WER (a missing file: none).
pub(crate) fn workspace(dir: &Path, model: &str, whisper: &Path, extra: &str) -> Vec<f32> {
    let x = xvector(hidden(M), 3);
    let toml = format!(
        "[prep]\nwhisper_model = {:?}\n[train]\nval_fraction = 0.25\n{extra}",
        whisper.display().to_string()
    );
    make_workspace(dir, model, &synthetic_rows(12, 21), &x, &toml);
    x
}

pub(crate) fn train(ws: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "train",
        "--batch-size",
        "2",
        "--grad-accum",
        "1",
        "--warmup-steps",
        "1",
        "--epochs",
        "100",
    ];
    args.extend_from_slice(extra);
    voiceclone(ws, &args)
}

/// The manifest's frames per audio path.
fn recording_frames(ws: &Path) -> std::collections::BTreeMap<String, usize> {
    std::fs::read_to_string(ws.join("data/train.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|r| {
            (
                r["audio"].as_str().unwrap().to_string(),
                r["audio_codes"].as_array().unwrap().len(),
            )
        })
        .collect()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

/// The score of docs/training.md §14.5, computed here from a metrics line's samples.
pub(crate) fn score_of(samples: &[Value]) -> f64 {
    let each = samples.iter().map(|s| {
        let wer = s["wer"].as_f64().map_or(0.0, |w| w.min(1.0));
        let eos = if s["eos"].as_bool().unwrap() {
            0.0
        } else {
            0.5
        };
        f(&s["similarity"]) - f(&s["rate_ratio"]).log2().abs() - wer - eos
    });
    each.sum::<f64>() / samples.len() as f64
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let n = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

fn read_wav(path: &Path) -> (Vec<f32>, u32) {
    let mut r = hound::WavReader::open(path).unwrap();
    let rate = r.spec().sample_rate;
    let v = r
        .samples::<i16>()
        .map(|s| s.unwrap() as f32 / 32768.0)
        .collect();
    (v, rate)
}

#[test]
fn samples_are_measured_as_independent_computations_find_them() {
    let whisper = have_assets()
        .then(|| vc_prep::transcribe::WhisperTranscriber::load(&whisper_model(), "en").unwrap());
    let whisper_file = if whisper.is_some() {
        whisper_model()
    } else {
        PathBuf::from("/nonexistent/ggml.bin")
    };
    let (_keep, models) = models();
    let mut runs: Vec<(String, &str, &str, Option<&str>)> = Vec::new();
    for (model, stored) in &models {
        for backend in ["kernels", "autograd"] {
            runs.push((format!("{stored} {backend}"), model, backend, None));
        }
    }
    runs.push((
        "bf16 kernels, 2 ranks".into(),
        &models[0].0,
        "kernels",
        Some("2"),
    ));
    for (tag, model, backend, ranks) in &runs {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path();
        let x = workspace(ws, model, &whisper_file, "save_every = 2\n");
        // A reference clip, for the report to play beside the samples.
        std::fs::copy(
            crate::common::fixtures().join("audio/ref24k.wav"),
            ws.join("data/ref.wav"),
        )
        .unwrap();
        let mut flags = vec!["--max-steps", "4", "--lr", "5e-2", "--backend", backend];
        if let Some(n) = ranks {
            flags.extend(["--cpu-ranks", n]);
        }
        let o = train(ws, &flags);
        ok(&o);
        let out = text(&o);
        assert!(
            out.contains("samples: 2 at each evaluation"),
            "{tag}: {out}"
        );
        let recordings = recording_frames(ws);
        let evals = evals(ws);
        assert_eq!(
            evals
                .iter()
                .map(|e| e["step"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            [2, 4],
            "{tag}"
        );
        for e in &evals {
            let step = e["step"].as_u64().unwrap();
            let name = format!("step-{step:07}");
            let samples = e["samples"]
                .as_array()
                .unwrap_or_else(|| panic!("{tag}: {e}"));
            assert_eq!(samples.len(), 2, "{tag}");
            let mut problems = 0;
            for (i, s) in samples.iter().enumerate() {
                let wav = ws.join(s["wav"].as_str().unwrap());
                assert_eq!(
                    wav,
                    ws.join(format!("checkpoints/{name}/samples/{:02}.wav", i + 1)),
                    "{tag}"
                );
                // Rate and end of speech from the saved codes and the held-out recording.
                let codes: Value = serde_json::from_str(
                    &std::fs::read_to_string(ws.join(s["codes"].as_str().unwrap())).unwrap(),
                )
                .unwrap();
                let frames = codes["codes"].as_array().unwrap().len();
                assert_eq!(s["frames"], frames, "{tag}");
                let recorded = recordings[s["recording"].as_str().unwrap()];
                let cap = ((CAP_FACTOR * recorded as f64).ceil() as usize).max(MIN_CAP);
                assert_eq!(s["cap"], cap, "{tag}");
                let eos = s["eos"].as_bool().unwrap();
                assert_eq!(eos, frames < cap, "{tag}: {s}");
                let ratio = recorded as f64 / frames as f64;
                assert!(
                    (f(&s["rate_ratio"]) - ratio).abs() <= 1e-12 * ratio,
                    "{tag}: {s}"
                );
                if !(0.8..=1.25).contains(&ratio) {
                    problems += 1;
                }
                if !eos {
                    problems += 1;
                }
                // Similarity: `voiceclone embed` on the sample against the speaker's x-vector.
                let xv = ws.join(format!("x-{step}-{i}.safetensors"));
                ok(&voiceclone(
                    ws,
                    &["embed", wav.to_str().unwrap(), "-o", xv.to_str().unwrap()],
                ));
                let sample_x = vc_core::artifacts::speaker::read(&xv).unwrap();
                let want = cosine(&sample_x, &x);
                assert!(
                    (f(&s["similarity"]) - want).abs() < 1e-6,
                    "{tag}: similarity {} against embed's {want}",
                    s["similarity"]
                );
                // WER: the sample transcribed here, words counted with the test's own rules.
                match &whisper {
                    Some(w) => {
                        let (audio, rate) = read_wav(&wav);
                        let audio16 = vc_audio::resample::resample(&audio, rate, 16_000).unwrap();
                        let heard: Vec<String> =
                            vc_prep::transcribe::Transcriber::transcribe(w, &audio16, 2)
                                .unwrap()
                                .segments
                                .iter()
                                .map(|seg| seg.text.trim().to_string())
                                .filter(|t| !t.is_empty())
                                .collect();
                        let heard = heard.join(" ");
                        assert_eq!(s["transcript"], heard.as_str(), "{tag}");
                        let reference = normalize_words(s["text"].as_str().unwrap());
                        let errors = word_errors(&reference, &normalize_words(&heard));
                        let want = errors as f64 / reference.len() as f64;
                        assert!((f(&s["wer"]) - want).abs() < 1e-12, "{tag}: {s}");
                    }
                    None => assert!(s["wer"].is_null(), "{tag}"),
                }
            }
            // The score and its record in the checkpoint's index.
            assert!((f(&e["score"]) - score_of(samples)).abs() < 1e-12, "{tag}");
            // One warning per drifted measure, naming the checkpoint.
            let warned = out
                .lines()
                .filter(|l| l.starts_with(&format!("warning: {name}: sample")))
                .count();
            assert_eq!(warned, problems, "{tag} {name}: {out}");
        }
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(ws.join("checkpoints/step-0000004/index.json")).unwrap(),
        )
        .unwrap();
        let scores: Vec<f64> = evals.iter().map(|e| f(&e["score"])).collect();
        let best = if scores[1] > scores[0] { 4 } else { 2 };
        assert_eq!(index["selection"]["best_score_step"], best, "{tag}");
        if *tag == "bf16 kernels" {
            speaking_the_export_gives_the_samples(ws, &evals[0]);
            the_report_renders_in_a_browser(ws, &evals);
        }
    }
}

/// On a bf16-stored base the samples are `voiceclone speak` on the checkpoint's export, bit for
/// bit, each in its voice.
fn speaking_the_export_gives_the_samples(ws: &Path, eval: &Value) {
    let step = eval["step"].as_u64().unwrap();
    let exported = ws.join("exported");
    let checkpoint = ws.join(format!("checkpoints/step-{step:07}"));
    ok(&voiceclone(
        ws,
        &[
            "export",
            "--checkpoint",
            checkpoint.to_str().unwrap(),
            "-o",
            exported.to_str().unwrap(),
        ],
    ));
    for (i, s) in eval["samples"].as_array().unwrap().iter().enumerate() {
        let out = ws.join(format!("spoken-{i}.wav"));
        let cap = s["cap"].to_string();
        ok(&voiceclone(
            ws,
            &[
                "speak",
                "--model",
                exported.to_str().unwrap(),
                "--speaker",
                s["voice"].as_str().unwrap(),
                "--greedy",
                "--max-frames",
                &cap,
                "--max-chunk-chars",
                "0",
                "-o",
                out.to_str().unwrap(),
                s["text"].as_str().unwrap(),
            ],
        ));
        assert!(
            std::fs::read(&out).unwrap()
                == std::fs::read(ws.join(s["wav"].as_str().unwrap())).unwrap(),
            "sample {} of step {step} differs from speak on the export",
            i + 1
        );
    }
}

/// The report: opened in headless Chromium it shows something and logs nothing to the
/// console; every number in its tables is a value of metrics.jsonl; every player's file is
/// there.
fn the_report_renders_in_a_browser(ws: &Path, evals: &[Value]) {
    let page = ws.join("checkpoints/report.html");
    let html = std::fs::read_to_string(&page).unwrap();
    let cells: Vec<f64> = html
        .split("data-v=\"")
        .skip(1)
        .map(|rest| rest.split('"').next().unwrap().parse::<f64>().unwrap())
        .collect();
    // The numbers in the order the tables show them: each evaluation's six, then per sample
    // (newest evaluation first) similarity, rate ratio, frames per token, frames, frame limit
    // and (with Whisper) the WER.
    let mut want: Vec<f64> = Vec::new();
    for e in evals {
        for k in [
            "val_loss",
            "val_loss_talker",
            "val_loss_sub",
            "val_utterances",
            "score",
        ] {
            want.push(f(&e[k]));
        }
        want.push(f(&e["seconds"]));
    }
    for e in evals.iter().rev() {
        for s in e["samples"].as_array().unwrap() {
            for k in [
                "similarity",
                "rate_ratio",
                "frames_per_token",
                "frames",
                "cap",
            ] {
                want.push(f(&s[k]));
            }
            if !s["wer"].is_null() {
                want.push(f(&s["wer"]));
            }
        }
    }
    assert_eq!(cells, want, "the report's numbers, against metrics.jsonl");
    for src in html.split("src=\"").skip(1) {
        let link = src.split('"').next().unwrap();
        assert!(!link.starts_with("http"), "{link}");
        let file = ws.join("checkpoints").join(link);
        assert!(file.is_file(), "the player's {link} is not there");
    }
    assert!(!html.contains("<script"), "the page runs no script");
    assert!(
        html.contains("speaker <audio controls preload=\"none\" src=\"../data/ref.wav\">"),
        "the reference clip's player"
    );
    let chosen = std::fs::read_to_string(ws.join("checkpoints/best")).unwrap();
    let chosen_step: u64 = chosen.trim().trim_start_matches("step-").parse().unwrap();
    assert!(html.contains(&format!("<b>★ step {chosen_step}</b>")));

    let browser = Path::new("/usr/bin/chromium-headless-shell");
    if !have_tool(browser, "Debian package chromium-headless-shell") {
        return;
    }
    let shot = ws.join("report.png");
    let o = std::process::Command::new(browser)
        .args([
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1300,2200",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{log}");
    let console: Vec<&str> = log.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(console.is_empty(), "console messages: {console:?}");
    let (width, height, pixels) = decode_png(&std::fs::read(&shot).unwrap());
    assert_eq!((width, height), (1300, 2200));
    let white = pixels.iter().filter(|p| **p == [255, 255, 255]).count();
    let mut colors: Vec<[u8; 3]> = pixels.clone();
    colors.sort();
    colors.dedup();
    assert!(
        white < pixels.len() * 97 / 100 && colors.len() > 50,
        "the screenshot looks blank: {white} of {} pixels white, {} colours",
        pixels.len(),
        colors.len()
    );
    // Kept for a look by eye, beside the page.
    let keep = std::env::var_os("VOICECLONE_REPORT_SCREENSHOT").map(PathBuf::from);
    if let Some(dest) = keep {
        std::fs::copy(&shot, dest).unwrap();
    }
}

/// An 8-bit RGB or RGBA PNG (what Chromium writes) as its size and RGB pixels.
fn decode_png(png: &[u8]) -> (usize, usize, Vec<[u8; 3]>) {
    use std::io::Read;
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let (mut width, mut height, mut channels) = (0, 0, 0);
    let mut data = Vec::new();
    let mut at = 8;
    while at + 8 <= png.len() {
        let len = u32::from_be_bytes(png[at..at + 4].try_into().unwrap()) as usize;
        let kind = &png[at + 4..at + 8];
        let body = &png[at + 8..at + 8 + len];
        match kind {
            b"IHDR" => {
                width = u32::from_be_bytes(body[0..4].try_into().unwrap()) as usize;
                height = u32::from_be_bytes(body[4..8].try_into().unwrap()) as usize;
                assert_eq!(body[8], 8, "8-bit samples");
                channels = match body[9] {
                    2 => 3,
                    6 => 4,
                    t => panic!("PNG colour type {t}"),
                };
                assert_eq!(body[12], 0, "not interlaced");
            }
            b"IDAT" => data.extend_from_slice(body),
            _ => {}
        }
        at += 12 + len;
    }
    let mut raw = Vec::new();
    flate2::read::ZlibDecoder::new(&data[..])
        .read_to_end(&mut raw)
        .unwrap();
    let stride = width * channels;
    assert_eq!(raw.len(), height * (stride + 1));
    let mut prev = vec![0u8; stride];
    let mut pixels = Vec::with_capacity(width * height);
    for row in raw.chunks(stride + 1) {
        let (filter, line) = (row[0], &row[1..]);
        let mut cur = vec![0u8; stride];
        for i in 0..stride {
            let a = if i >= channels { cur[i - channels] } else { 0 } as i16;
            let b = prev[i] as i16;
            let c = if i >= channels { prev[i - channels] } else { 0 } as i16;
            let predicted = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => (a + b) / 2,
                4 => {
                    let p = a + b - c;
                    let (pa, pb, pc) = ((p - a).abs(), (p - b).abs(), (p - c).abs());
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    }
                }
                f => panic!("PNG filter {f}"),
            };
            cur[i] = line[i].wrapping_add(predicted as u8);
        }
        pixels.extend(cur.chunks(channels).map(|p| [p[0], p[1], p[2]]));
        prev = cur;
    }
    (width, height, pixels)
}

/// The WER the samples get is the WER of what Whisper hears: on real speech with its known
/// transcript it is near 0, and a wrong text makes it high.
#[test]
fn the_wer_of_real_speech_is_low_against_its_text_and_high_against_another() {
    if !have_assets() {
        return;
    }
    let whisper = vc_prep::transcribe::WhisperTranscriber::load(&whisper_model(), "en").unwrap();
    let dir = crate::common::assets().join("speech/prep2");
    let (file, text) = crate::common::transcripts(&dir)
        .into_iter()
        .find(|(f, _)| f.starts_with("02_"))
        .unwrap();
    let audio = vc_audio::load_mono(&dir.join(&file), 24_000).unwrap();
    let (wer, heard) = vc_eval::samples::intelligibility(&whisper, &audio, 24_000, &text).unwrap();
    let wer = wer.unwrap();
    assert!(wer <= 0.15, "WER {wer}: heard {heard:?} for {text:?}");
    let reference = normalize_words(&text);
    let want = word_errors(&reference, &normalize_words(&heard)) as f64 / reference.len() as f64;
    assert!((wer - want).abs() < 1e-12);
    let (other, _) = vc_eval::samples::intelligibility(
        &whisper,
        &audio,
        24_000,
        "a completely different sentence about the weather",
    )
    .unwrap();
    assert!(other.unwrap() >= 0.8, "{other:?}");
    // Silence is heard as nothing: every word missed.
    let (silent, heard) =
        vc_eval::samples::intelligibility(&whisper, &[], 24_000, "two words").unwrap();
    assert_eq!((silent, heard.as_str()), (Some(1.0), ""));
}

/// Named speakers: one sample per speaker, each in its own voice, measured against its own
/// x-vector, and spoken as `voiceclone speak --speaker NAME` on the export speaks it; and a LoRA
/// run's samples are its merged export spoken.
#[test]
fn every_named_speaker_and_a_lora_run_speak_their_samples_as_their_export() {
    let none = Path::new("/nonexistent/ggml.bin");
    // Two named speakers, 8 utterances each, a quarter of each held out.
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    let mut rows = synthetic_rows(16, 5);
    let names = ["Alice", "bob"];
    for (i, r) in rows.iter_mut().enumerate() {
        r["speaker"] = Value::from(names[i % 2]);
    }
    let toml = format!(
        "[prep]\nwhisper_model = {:?}\n[train]\nval_fraction = 0.25\nsave_every = 2\n",
        none.display().to_string()
    );
    make_workspace(ws, M, &rows, &xvector(hidden(M), 3), &toml);
    std::fs::create_dir_all(ws.join("data/speakers")).unwrap();
    let mut vectors = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let x = xvector(hidden(M), 10 + i as u64);
        let bytes = vc_core::artifacts::speaker::to_bytes(&x, None).unwrap();
        std::fs::write(ws.join(format!("data/speakers/{name}.safetensors")), bytes).unwrap();
        vectors.push(x);
    }
    ok(&train(ws, &["--max-steps", "2", "--lr", "5e-2"]));
    let e = &evals(ws)[0];
    let samples = e["samples"].as_array().unwrap();
    let voices: Vec<&str> = samples
        .iter()
        .map(|s| s["voice"].as_str().unwrap())
        .collect();
    assert_eq!(voices, ["alice", "bob"]);
    for (s, x) in samples.iter().zip(&vectors) {
        let wav = ws.join(s["wav"].as_str().unwrap());
        let xv = ws.join(format!("x-{}.safetensors", s["voice"].as_str().unwrap()));
        ok(&voiceclone(
            ws,
            &["embed", wav.to_str().unwrap(), "-o", xv.to_str().unwrap()],
        ));
        let want = cosine(&vc_core::artifacts::speaker::read(&xv).unwrap(), x);
        assert!((f(&s["similarity"]) - want).abs() < 1e-6, "{s}");
    }
    speaking_the_export_gives_the_samples(ws, e);

    // LoRA: the adapters merged as the export merges them.
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path();
    workspace(ws, M, none, "save_every = 2\n");
    ok(&train(
        ws,
        &["--max-steps", "2", "--lr", "5e-2", "--lora-rank", "4"],
    ));
    speaking_the_export_gives_the_samples(ws, &evals(ws)[0]);
}
