//! `voiceclone speak` end to end on the fixture models: seeded sampling is
//! reproducible, batches give the codes of single runs, the workspace's voice is found,
//! long texts are split, and bad requests are clear errors that write nothing.

use crate::common::{self, fixtures};

use std::path::Path;

use common::stderr;

fn model(name: &str) -> String {
    fixtures().join(name).display().to_string()
}

fn ref_wav() -> String {
    fixtures().join("audio/ref24k.wav").display().to_string()
}

/// Runs `voiceclone speak` from inside the workspace, so relative output paths land there.
fn speak(ws: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_voiceclone"))
        .current_dir(ws)
        .arg("speak")
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("cannot run the voiceclone binary")
}

fn ok(o: &std::process::Output) {
    assert!(o.status.success(), "speak failed: {}", stderr(o));
}

fn codes(path: &Path) -> Vec<Vec<u32>> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    serde_json::from_value(v["codes"].clone()).unwrap()
}

fn wav_samples(path: &Path) -> Vec<i16> {
    let mut r = hound::WavReader::open(path).unwrap();
    let spec = r.spec();
    assert_eq!(
        (spec.channels, spec.sample_rate, spec.bits_per_sample),
        (1, 24_000, 16)
    );
    r.samples::<i16>().map(|s| s.unwrap()).collect()
}

/// A workspace on the tiny Base model whose voice is `data/ref.wav`, with `extra` appended to
/// its `voiceclone.toml`.
pub(crate) fn reference_workspace(extra: &str) -> tempfile::TempDir {
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("data")).unwrap();
    std::fs::copy(ref_wav(), ws.path().join("data/ref.wav")).unwrap();
    std::fs::write(
        ws.path().join("voiceclone.toml"),
        format!("[model]\nbase = {:?}\n{extra}", model("tiny-0b6")),
    )
    .unwrap();
    ws
}

#[test]
fn seeded_sampling_repeats_and_seeds_differ() {
    let ws = tempfile::tempdir().unwrap();
    let m = model("tiny-0b6");
    let r = ref_wav();
    let run = |seed: &str, out: &str| {
        let o = speak(
            ws.path(),
            &[
                "Sampling test.",
                "-o",
                out,
                "--model",
                &m,
                "--ref-audio",
                &r,
                "--seed",
                seed,
                "--max-frames",
                "12",
                "--save-codes",
                &format!("{out}.json"),
                // The fixture's distributions are peaked (logits of magnitude ~100): at the
                // default 0.9 most draws are the mode whatever the seed, so sample wider.
                "--temperature",
                "2",
                "--sub-temperature",
                "2",
            ],
        );
        ok(&o);
        (
            std::fs::read(ws.path().join(out)).unwrap(),
            codes(&ws.path().join(format!("{out}.json"))),
        )
    };
    let (a, ca) = run("7", "a.wav");
    let (b, cb) = run("7", "b.wav");
    let (c, cc) = run("8", "c.wav");
    // Sampled, so EOS may come before the frame limit.
    assert!(!ca.is_empty() && ca.len() <= 12, "{} frames", ca.len());
    assert_eq!(ca, cb, "same seed, same codes");
    assert_eq!(a, b, "same seed, same audio bytes");
    assert_ne!(ca, cc, "another seed samples other codes");
    assert_ne!(a, c);
    assert_eq!(wav_samples(&ws.path().join("a.wav")).len(), ca.len() * 1920);
}

#[test]
fn batch_file_gives_the_codes_of_single_runs() {
    let ws = tempfile::tempdir().unwrap();
    let m = model("tiny-1b7");
    let r = ref_wav();
    let texts = [
        "Hi.",
        "A much longer line of text to speak here.",
        "Third one!",
    ];
    let input = ws.path().join("lines.txt");
    std::fs::write(
        &input,
        format!(
            "{}\n\n{{\"text\": \"{}\", \"output\": \"long\", \"language\": \"english\"}}\n{}\n",
            texts[0], texts[1], texts[2]
        ),
    )
    .unwrap();
    let common = [
        "--model",
        &m,
        "--ref-audio",
        &r,
        "--greedy",
        "--precision",
        "f32",
        "--max-frames",
        "10",
    ];
    let mut args = vec![
        "--input",
        input.to_str().unwrap(),
        "-o",
        "out",
        "--save-codes",
        "codes",
        "--batch-size",
        "3",
    ];
    args.extend_from_slice(&common);
    ok(&speak(ws.path(), &args));
    let names = ["0001", "long", "0003"];
    for (i, (text, name)) in texts.iter().zip(names).enumerate() {
        let single = format!("single{i}.wav");
        let single_codes = format!("single{i}.json");
        let mut args = vec![*text, "-o", &single, "--save-codes", &single_codes];
        if i == 1 {
            args.extend_from_slice(&["--language", "english"]);
        }
        args.extend_from_slice(&common);
        ok(&speak(ws.path(), &args));
        let batch_codes = codes(&ws.path().join(format!("codes/{name}.codes.json")));
        assert_eq!(
            batch_codes,
            codes(&ws.path().join(&single_codes)),
            "line {}",
            i + 1
        );
        let a = wav_samples(&ws.path().join(format!("out/{name}.wav")));
        let b = wav_samples(&ws.path().join(&single));
        assert_eq!(a.len(), b.len());
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).max().unwrap();
        assert!(diff <= 2, "line {}: samples differ by {diff}", i + 1);
    }
}

#[test]
fn workspace_reference_voice_is_used_and_long_texts_are_split() {
    let ws = reference_workspace("");
    let text = "First sentence here. Second sentence follows. Third one ends it.";
    let o = speak(
        ws.path(),
        &[
            text,
            "-o",
            "split.wav",
            "--greedy",
            "--max-frames",
            "6",
            "--max-chunk-chars",
            "25",
            "--save-codes",
            "split.json",
        ],
    );
    ok(&o);
    // Three chunks of 6 frames, joined with two 0.12 s pauses.
    assert_eq!(codes(&ws.path().join("split.json")).len(), 18);
    assert_eq!(
        wav_samples(&ws.path().join("split.wav")).len(),
        18 * 1920 + 2 * 2880
    );
    let o = speak(
        ws.path(),
        &[text, "-o", "whole.wav", "--greedy", "--max-frames", "6"],
    );
    ok(&o);
    assert_eq!(wav_samples(&ws.path().join("whole.wav")).len(), 6 * 1920);
}

#[test]
fn bad_requests_are_clear_errors_and_write_nothing() {
    let ws = tempfile::tempdir().unwrap();
    let m = model("tiny-0b6");
    let r = ref_wav();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["   ", "--ref-audio", &r], "empty"),
        (
            vec!["Hello.", "--ref-audio", &r, "--language", "klingon"],
            "unknown language \"klingon\"",
        ),
        (
            vec!["Hello.", "--ref-audio", &r, "--ref-text", "  "],
            "transcript",
        ),
        (vec!["Hello.", "--speaker", "nobody"], "no named speakers"),
        (vec!["Hello."], "no voice to speak with"),
        (
            vec!["Hello.", "--ref-audio", "missing.wav"],
            "does not exist",
        ),
    ];
    for (args, want) in cases {
        let mut all = args.clone();
        all.extend_from_slice(&["-o", "out.wav", "--model", &m, "--max-frames", "4"]);
        let o = speak(ws.path(), &all);
        assert!(!o.status.success(), "{args:?} should fail");
        let err = stderr(&o);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!ws.path().join("out.wav").exists());
        if want.starts_with("no voice") {
            // Said before the model is loaded (or, for a hub model, downloaded).
            assert!(!err.contains("loading"), "{err}");
        }
    }
    // An existing output is kept unless --overwrite.
    std::fs::write(ws.path().join("mine.wav"), b"user data").unwrap();
    let o = speak(
        ws.path(),
        &["Hello.", "-o", "mine.wav", "--model", &m, "--ref-audio", &r],
    );
    assert!(stderr(&o).contains("--overwrite"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(ws.path().join("mine.wav")).unwrap(),
        b"user data"
    );
}

#[test]
fn custom_voice_model_speaks_with_its_speakers() {
    let dir = fixtures().join("tiny-0b6-custom");
    let ws = tempfile::tempdir().unwrap();
    let m = dir.display().to_string();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let speakers: Vec<String> = cfg["talker_config"]["spk_id"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert!(speakers.len() >= 2);
    let mut outputs = Vec::new();
    for (i, name) in speakers.iter().enumerate() {
        let out = format!("spk{i}.json");
        let o = speak(
            ws.path(),
            &[
                "Hello there.",
                "-o",
                &format!("spk{i}.wav"),
                "--model",
                &m,
                "--speaker",
                &name.to_uppercase(),
                "--greedy",
                "--max-frames",
                "8",
                "--save-codes",
                &out,
            ],
        );
        ok(&o);
        outputs.push(codes(&ws.path().join(out)));
    }
    assert_ne!(outputs[0], outputs[1], "speakers differ");
    // Several speakers and none chosen: the error lists them.
    let o = speak(ws.path(), &["Hello.", "-o", "x.wav", "--model", &m]);
    assert!(stderr(&o).contains(&speakers[0]), "{}", stderr(&o));
    // No speaker encoder: cloning is refused with the reason.
    let o = speak(
        ws.path(),
        &[
            "Hello.",
            "-o",
            "x.wav",
            "--model",
            &m,
            "--ref-audio",
            &ref_wav(),
        ],
    );
    assert!(
        stderr(&o).contains("custom_voice model") && stderr(&o).contains("cannot clone"),
        "{}",
        stderr(&o)
    );
    assert!(!ws.path().join("x.wav").exists());
}

/// The `loading … (precision P: WHY)` and `loaded in … s: DESCRIPTION` lines of a run.
fn precision_lines(o: &std::process::Output) -> (String, String) {
    let err = stderr(o);
    let find = |prefix: &str| {
        err.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in: {err}"))
            .to_string()
    };
    (find("loading "), find("loaded in "))
}

/// Bytes of the per-frame matrices the synthesizer reports having loaded.
fn matrix_bytes(loaded: &str) -> u64 {
    let head = loaded
        .rsplit_once(" bytes)")
        .unwrap_or_else(|| panic!("no byte count in {loaded:?}"))
        .0;
    head.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn every_precision_reaches_the_synthesizer() {
    let ws = tempfile::tempdir().unwrap();
    let m = model("tiny-0b6");
    let r = ref_wav();
    let run = |precision: &str| {
        let out = format!("{precision}.wav");
        let o = speak(
            ws.path(),
            &[
                "Precision test.",
                "-o",
                &out,
                "--model",
                &m,
                "--ref-audio",
                &r,
                "--greedy",
                "--max-frames",
                "3",
                "--precision",
                precision,
            ],
        );
        ok(&o);
        precision_lines(&o)
    };
    let mut bytes = std::collections::HashMap::new();
    let mut lines = std::collections::HashMap::new();
    for (flag, backend) in [
        ("f32", "f32 on the CPU ("),
        ("bf16-weights", "bf16-weights on the CPU ("),
        ("q8", "q8 on the CPU ("),
        ("q4", "q4 on the CPU ("),
        ("bf16", "bf16 on Cpu (candle)"),
    ] {
        let (loading, loaded) = run(flag);
        assert!(
            loading.ends_with(&format!("(precision {flag}: as asked)")),
            "{flag}: {loading}"
        );
        assert!(loaded.contains(backend), "{flag}: {loaded}");
        if flag != "bf16" {
            bytes.insert(flag, matrix_bytes(&loaded));
        }
        lines.insert(flag, loaded);
    }
    // What was loaded differs as the format says: f32 over this bf16-stored checkpoint reads the
    // stored values in place and widens them in registers (exact, no converted copy), as
    // bf16-weights does, so both hold the bytes of bf16 and say so; the 8-bit blocks hold yet
    // another amount (1 byte + 1/16 of an f16 scale per weight, but rows padded to 32 and tiles
    // to 16 rows: on this tiny model more than bf16, on real shapes ~0.53×).
    assert_eq!(bytes["f32"], bytes["bf16-weights"], "{bytes:?}");
    for flag in ["f32", "bf16-weights"] {
        assert!(
            lines[flag].contains("bf16 matrices widened to f32 in registers"),
            "{lines:?}"
        );
    }
    assert!(!lines["q8"].contains("widened"), "{lines:?}");
    assert!(!lines["q4"].contains("widened"), "{lines:?}");
    // The same products over the same stored values: the same audio, sample for sample.
    let samples = |flag: &str| std::fs::read(ws.path().join(format!("{flag}.wav"))).unwrap();
    assert!(
        samples("f32") == samples("bf16-weights"),
        "f32 and bf16-weights differ on a bf16-stored checkpoint"
    );
    assert!(
        bytes["q8"] != bytes["bf16-weights"] && bytes["q8"] != bytes["f32"],
        "{bytes:?}"
    );
    // auto on a bf16-stored checkpoint: its own values, f32 arithmetic.
    let (loading, loaded) = run("auto");
    assert!(
        loading.ends_with("(precision bf16-weights: auto, the checkpoint stores BF16)"),
        "{loading}"
    );
    assert_eq!(matrix_bytes(&loaded), bytes["bf16-weights"]);
    // A value that is none of them is refused before anything loads.
    let o = speak(
        ws.path(),
        &[
            "x",
            "-o",
            "bad.wav",
            "--model",
            &m,
            "--ref-audio",
            &r,
            "--precision",
            "q3",
        ],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("speak.precision") && err.contains("auto, f32, bf16-weights, bf16, q8, q4"),
        "{err}"
    );
    assert!(!ws.path().join("bad.wav").exists());
}

#[test]
fn auto_keeps_an_f32_checkpoint_in_f32() {
    let ws = tempfile::tempdir().unwrap();
    let f32_model = common::f32_stored_copy("tiny-0b6");
    let m = f32_model.path().display().to_string();
    let r = ref_wav();
    let run = |extra: &[&str], out: &str| {
        let mut args = vec![
            "Exactness test.",
            "-o",
            out,
            "--model",
            &m,
            "--ref-audio",
            &r,
            "--greedy",
            "--max-frames",
            "6",
            "--save-codes",
        ];
        let codes_path = format!("{out}.json");
        args.push(&codes_path);
        args.extend_from_slice(extra);
        let o = speak(ws.path(), &args);
        ok(&o);
        (precision_lines(&o), codes(&ws.path().join(&codes_path)))
    };
    let ((loading, loaded), auto_codes) = run(&[], "auto.wav");
    assert!(
        loading.ends_with("(precision f32: auto, the checkpoint stores F32)"),
        "{loading}"
    );
    assert!(loaded.contains("f32 on the CPU ("), "{loaded}");
    // f32-stored matrices are held as f32, not widened from anything.
    assert!(!loaded.contains("widened"), "{loaded}");
    let (_, f32_codes) = run(&["--precision", "f32"], "f32.wav");
    assert_eq!(auto_codes, f32_codes, "auto is exactly f32 here");
    assert!(!auto_codes.is_empty());
}

/// `speak -o -` sends its first frame alone and then chunks that grow to
/// `speak.stream_chunk_frames` (docs/serving.md §4.1), from the config file or
/// `--stream-chunk-frames`; the samples are those of `speak -o FILE` whatever the chunks. In the
/// `test-hooks` build each frame is slowed, so the decoder never falls behind and the chunks
/// are exactly the rule's.
#[test]
fn speak_to_standard_output_sends_growing_chunks_of_the_same_samples() {
    let ws = reference_workspace(
        "[speak]\nmax_frames = 40\nmax_chunk_chars = 0\nstream_chunk_frames = 3\n",
    );
    let text = "A text long enough for forty frames of speech, if the model goes on that long.";
    ok(&speak(ws.path(), &[text, "--seed", "11", "-o", "file.wav"]));
    let want = wav_samples(&ws.path().join("file.wav"));
    let frames = want.len() / 1920;
    assert!(
        frames >= 12,
        "only {frames} frames: too few to tell chunkings apart"
    );
    let streamed = |flags: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_voiceclone"))
            .current_dir(ws.path())
            .args(["speak", text, "--seed", "11", "-o", "-"])
            .args(flags)
            .env_remove("RUST_LOG")
            .env("VOICECLONE_TEST_FRAME_DELAY_MS", "20")
            .output()
            .unwrap();
        ok(&o);
        let samples: Vec<i16> = o.stdout[44..]
            .chunks_exact(2)
            .map(|b| i16::from_le_bytes([b[0], b[1]]))
            .collect();
        let summary = stderr(&o);
        let before = |word: &str| -> usize {
            let end = summary
                .find(word)
                .unwrap_or_else(|| panic!("no {word:?}: {summary}"));
            let digits = summary[..end].trim_end();
            let start = digits.rfind(|c: char| !c.is_ascii_digit()).unwrap() + 1;
            digits[start..].parse().unwrap()
        };
        assert_eq!(before(" frames"), frames, "{summary}");
        (samples, before(" chunks"))
    };
    for (flags, most) in [(&[][..], 3), (&["--stream-chunk-frames", "1"][..], 1)] {
        let (samples, chunks) = streamed(flags);
        assert!(
            samples == want,
            "{flags:?}: the streamed samples are not the file's"
        );
        if cfg!(feature = "test-hooks") {
            assert_eq!(
                chunks,
                common::audio_chunks_by_rule(frames, most),
                "{flags:?}: {frames} frames"
            );
        } else {
            assert!((1..=frames).contains(&chunks));
        }
    }
    let o = speak(ws.path(), &[text, "-o", "-", "--stream-chunk-frames", "0"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("speak.stream_chunk_frames") && stderr(&o).contains("at least 1"),
        "{}",
        stderr(&o)
    );
}

/// `speak -o -` writes a WAV to standard output as it is generated: the 44-byte header of a
/// stream of unknown length, then exactly the samples `speak -o FILE` writes for the same seed —
/// also for a split text (its pauses) and with the codes saved beside it. In the `test-hooks`
/// build, with every frame slowed, the first samples are read while the process still runs.
#[test]
fn speak_to_standard_output_streams_the_wav_of_speak() {
    use std::io::Read;
    let ws = reference_workspace("[speak]\nmax_frames = 8\nmax_chunk_chars = 25\n");
    let text = "First sentence here. Second sentence follows.";
    ok(&speak(
        ws.path(),
        &[
            text,
            "--seed",
            "5",
            "-o",
            "file.wav",
            "--save-codes",
            "file.json",
        ],
    ));
    let want = wav_samples(&ws.path().join("file.wav"));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_voiceclone"))
        .current_dir(ws.path())
        .args(["speak", text, "--seed", "5", "-o", "-"])
        .args(["--save-codes", "stdout.json"])
        .env_remove("RUST_LOG")
        .env("VOICECLONE_TEST_FRAME_DELAY_MS", "150")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut header = [0u8; 44];
    stdout.read_exact(&mut header).unwrap();
    assert_eq!(&header[0..4], b"RIFF");
    assert_eq!(&header[8..16], b"WAVEfmt ");
    assert_eq!(&header[36..40], b"data");
    assert_eq!(
        u32::from_le_bytes(header[4..8].try_into().unwrap()),
        u32::MAX
    );
    assert_eq!(
        u32::from_le_bytes(header[24..28].try_into().unwrap()),
        24_000
    );
    let mut first = [0u8; 2 * 1920];
    stdout.read_exact(&mut first).unwrap();
    if cfg!(feature = "test-hooks") {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the first frame's samples came only once speak was done"
        );
    }
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    ok(&o);
    assert!(
        stderr(&o).contains("streamed to standard output"),
        "{}",
        stderr(&o)
    );
    let got: Vec<i16> = first
        .iter()
        .chain(&rest)
        .copied()
        .collect::<Vec<u8>>()
        .chunks_exact(2)
        .map(|b| i16::from_le_bytes([b[0], b[1]]))
        .collect();
    assert!(
        got == want,
        "{} samples streamed, {} in the file",
        got.len(),
        want.len()
    );
    // Two chunks, one 0.12 s pause between them.
    let frames = codes(&ws.path().join("file.json")).len();
    assert_eq!(want.len(), frames * 1920 + 2880, "the text was not split");
    assert_eq!(
        codes(&ws.path().join("stdout.json")),
        codes(&ws.path().join("file.json"))
    );
    let list = ws.path().join("texts.txt");
    std::fs::write(&list, "One.\nTwo.\n").unwrap();
    let o = speak(ws.path(), &["--input", list.to_str().unwrap(), "-o", "-"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("-o - streams one text"),
        "{}",
        stderr(&o)
    );
}

/// What the runaway guard's tests force through the `test-hooks` seams (docs/model.md §7.2):
/// a missing end token, and code 0 replaying 5 codes over and over from step 4 on.
pub(crate) const NO_EOS: (&str, &str) = ("VOICECLONE_TEST_SUPPRESS_EOS", "1");
pub(crate) const LOOP: (&str, &str) = ("VOICECLONE_TEST_LOOP_CODES", "4:101,202,303,404,505");
/// The frame budget of a chunk of a few tokens: the guard's floor of 8 s of 80 ms frames
/// (three times the default pace of 6 frames per token is less for 5 tokens or fewer).
pub(crate) const FLOOR_FRAMES: usize = 100;
/// Where the forced loop stops: after the 4 frames before it, its first 5 codes, and 3 s (38
/// frames) of their repeats.
pub(crate) const LOOP_STOP: usize = 4 + 5 + 38;
// Early: before the budget would stop it.
const _: () = assert!(LOOP_STOP < FLOOR_FRAMES);

/// `voiceclone speak` in `ws` with the seams of `env`.
fn speak_with(ws: &Path, env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_voiceclone"));
    cmd.current_dir(ws)
        .arg("speak")
        .args(args)
        .env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("cannot run the voiceclone binary")
}

/// A chunk whose end token never comes stops at its frame budget instead of the model's 8191
/// frames, and the warning names the chunk (its number and the start of its text); the audio
/// so far is kept. `--max-frames` wins over the budget, `--no-runaway-guard` turns it off.
#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn runaway_guard_stops_a_chunk_without_end_at_its_budget() {
    let ws = reference_workspace("");
    let text = "Hello there. Good night.";
    let o = speak_with(
        ws.path(),
        &[NO_EOS],
        &[
            text,
            "-o",
            "budget.wav",
            "--seed",
            "3",
            "--max-chunk-chars",
            "14",
            "--save-codes",
            "budget.json",
        ],
    );
    ok(&o);
    let err = stderr(&o);
    // Two chunks, each stopped at the floor, joined with a 0.12 s pause.
    assert_eq!(
        codes(&ws.path().join("budget.json")).len(),
        2 * FLOOR_FRAMES
    );
    assert_eq!(
        wav_samples(&ws.path().join("budget.wav")).len(),
        2 * FLOOR_FRAMES * 1920 + 2880
    );
    for (chunk, start) in [(1, "Hello there."), (2, "Good night.")] {
        let want = format!("chunk {chunk} ({start:?}): no end of speech within its budget of {FLOOR_FRAMES} frames");
        assert!(err.contains(&want), "no warning {want:?} in: {err}");
    }
    assert!(
        common::stdout(&o).contains("(stopped by the runaway guard)"),
        "{}",
        common::stdout(&o)
    );

    // An explicit limit wins over the budget; without the guard only the limit stops it.
    for (flags, name) in [
        (&["--max-frames", "150"][..], "limit"),
        (&["--max-frames", "150", "--no-runaway-guard"][..], "off"),
    ] {
        let (wav, codes_file) = (format!("{name}.wav"), format!("{name}.json"));
        let mut args = vec!["Hello there.", "-o", &wav, "--seed", "3"];
        args.extend_from_slice(&["--save-codes", &codes_file]);
        args.extend_from_slice(flags);
        let o = speak_with(ws.path(), &[NO_EOS], &args);
        ok(&o);
        assert_eq!(codes(&ws.path().join(&codes_file)).len(), 150, "{name}");
        assert!(!stderr(&o).contains("warning"), "{name}: {}", stderr(&o));
        assert!(common::stdout(&o).contains("(stopped by the frame limit)"));
    }
}

/// A chunk whose code 0 loops stops once the stretch has been repeated for 3 s, well before
/// its budget, with a warning naming it; the frames so far are kept. Streamed (`-o -`) the
/// same.
#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn runaway_guard_stops_a_loop_early() {
    let ws = reference_workspace("");
    for out in ["loop.wav", "-"] {
        let o = speak_with(
            ws.path(),
            &[NO_EOS, LOOP],
            &[
                "Hello there.",
                "-o",
                out,
                "--seed",
                "5",
                "--save-codes",
                "loop.json",
                "--overwrite",
            ],
        );
        ok(&o);
        let frames = codes(&ws.path().join("loop.json"));
        assert_eq!(frames.len(), LOOP_STOP, "-o {out}");
        let code0: Vec<u32> = frames.iter().map(|f| f[0]).collect();
        assert_eq!(code0[4..9], [101, 202, 303, 404, 505], "the forced loop");
        let err = stderr(&o);
        let want = "chunk 1 (\"Hello there.\"): a stretch of 5 frames (0.40 s) repeated for 3.4 s";
        assert!(
            err.contains(want),
            "-o {out}: no warning {want:?} in: {err}"
        );
    }
    let samples = wav_samples(&ws.path().join("loop.wav"));
    assert_eq!(samples.len(), LOOP_STOP * 1920);
}
