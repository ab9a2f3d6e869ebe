//! The event files read back with our own framing and protobuf readers: what each record
//! holds, and the resume rule through torn tails, crashes and files of other writers. The
//! files are read by TensorBoard itself in tests/it/train_tensorboard.rs.

use super::*;
use crate::metrics::SampleMetrics;

fn step(step: usize) -> StepMetrics {
    StepMetrics {
        step,
        epoch: step / 3,
        loss: 10.0 / step as f64,
        loss_talker: 7.0 / step as f64,
        loss_sub: 3.0 / step as f64,
        grad_norm: 0.5 + step as f64,
        lr: 1e-4 * step as f64,
        frames: 100 + step,
        seconds: 0.25,
        sent_within_node: None,
        sent_across_nodes: None,
    }
}

fn eval(step: usize, samples: Option<Vec<SampleMetrics>>) -> EvalMetrics {
    EvalMetrics {
        step,
        val_loss: 5.0 / step as f64,
        val_loss_talker: 3.0 / step as f64,
        val_loss_sub: 2.0 / step as f64,
        val_utterances: 2,
        seconds: 0.5,
        samples,
        score: Some(0.25),
    }
}

/// What a value holds.
#[derive(Debug, Clone, PartialEq)]
enum Held {
    Scalar(f32),
    /// rate, channels, frames, bytes, content type
    Audio(f32, i64, i64, Vec<u8>, String),
}

/// Every (tag, step, value) of the directory's files in reading order, and the file names.
fn read_back(checkpoints: &Path) -> (Vec<(String, u64, Held)>, Vec<String>) {
    let dir = checkpoints.join(TENSORBOARD_DIR);
    let mut names: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut out = Vec::new();
    for name in names.iter().filter(|n| n.ends_with(SUFFIX)) {
        let bytes = fs::read(dir.join(name)).unwrap();
        let (recs, whole) = records(&bytes);
        assert!(whole, "{name}");
        // The first record names the format's version.
        let first = fields(recs[0]).unwrap();
        assert!(
            first.contains(&(3, Wire::Len(b"brain.Event:2"))),
            "{first:?}"
        );
        for data in &recs[1..] {
            let r = Record::parse(data).unwrap().expect("a summary");
            for (tag, value) in r.values {
                let mut held = None;
                for (f, w) in fields(value).unwrap() {
                    match (f, w) {
                        (2, Wire::Fixed32(bits)) => held = Some(Held::Scalar(f32::from_bits(bits))),
                        (6, Wire::Len(audio)) => {
                            let (mut rate, mut ch, mut len, mut wav, mut ty) =
                                (0.0, 0, 0, Vec::new(), String::new());
                            for (f, w) in fields(audio).unwrap() {
                                match (f, w) {
                                    (1, Wire::Fixed32(b)) => rate = f32::from_bits(b),
                                    (2, Wire::Varint(v)) => ch = v as i64,
                                    (3, Wire::Varint(v)) => len = v as i64,
                                    (4, Wire::Len(b)) => wav = b.to_vec(),
                                    (5, Wire::Len(b)) => {
                                        ty = String::from_utf8(b.to_vec()).unwrap()
                                    }
                                    other => panic!("{other:?}"),
                                }
                            }
                            held = Some(Held::Audio(rate, ch, len, wav, ty));
                        }
                        _ => {}
                    }
                }
                out.push((tag, r.step, held.expect("a value")));
            }
        }
    }
    (out, names)
}

fn scalars_of(read: &[(String, u64, Held)], tag: &str) -> Vec<(u64, f32)> {
    read.iter()
        .filter(|(t, _, _)| t == tag)
        .map(|(_, s, h)| match h {
            Held::Scalar(v) => (*s, *v),
            other => panic!("{other:?}"),
        })
        .collect()
}

/// A 24 kHz mono 16-bit WAV of `n` frames at `path`.
fn wav(path: &Path, n: usize) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"RIFF");
    b.extend_from_slice(&(36 + 2 * n as u32).to_le_bytes());
    b.extend_from_slice(b"WAVEfmt \x10\0\0\0\x01\0\x01\0");
    b.extend_from_slice(&24_000u32.to_le_bytes());
    b.extend_from_slice(&48_000u32.to_le_bytes());
    b.extend_from_slice(b"\x02\0\x10\0data");
    b.extend_from_slice(&(2 * n as u32).to_le_bytes());
    b.extend((0..2 * n).map(|i| (i * 37) as u8));
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, &b).unwrap();
    b
}

fn sample(voice: &str, wav: &str, similarity: Option<f64>, wer: Option<f64>) -> SampleMetrics {
    SampleMetrics {
        text: "Hello.".into(),
        voice: voice.into(),
        wav: wav.into(),
        codes: "x.codes.json".into(),
        frames: 5,
        cap: 8,
        eos: true,
        similarity,
        frames_per_token: 1.0,
        rate_ratio: 1.25,
        recording: None,
        wer,
        transcript: None,
    }
}

#[test]
fn steps_and_evaluations_become_tagged_scalars_and_audio() {
    let ws = tempfile::tempdir().unwrap();
    let checkpoints = ws.path().join("checkpoints");
    let a = wav(
        &ws.path().join("checkpoints/step-0000002/samples/01.wav"),
        7,
    );
    let b = wav(
        &ws.path().join("checkpoints/step-0000002/samples/02.wav"),
        3,
    );
    let c = wav(
        &ws.path().join("checkpoints/step-0000002/samples/03.wav"),
        4,
    );
    let log = TensorBoardLog::open(&checkpoints, 0).unwrap();
    let mut sharded = step(1);
    sharded.sent_within_node = Some(1 << 20);
    sharded.sent_across_nodes = Some(0);
    log.append_step(&sharded).unwrap();
    log.append_step(&step(2)).unwrap();
    let samples = vec![
        sample(
            "anna",
            "checkpoints/step-0000002/samples/01.wav",
            Some(0.5),
            None,
        ),
        sample(
            "ben",
            "checkpoints/step-0000002/samples/02.wav",
            None,
            Some(0.0),
        ),
        sample(
            "anna",
            "checkpoints/step-0000002/samples/03.wav",
            Some(0.75),
            Some(0.5),
        ),
    ];
    log.append_eval(&eval(2, Some(samples))).unwrap();
    let (read, names) = read_back(&checkpoints);
    assert_eq!(names.len(), 1);
    assert!(
        names[0].starts_with(PREFIX) && log.path().ends_with(&names[0]),
        "{names:?}"
    );
    assert_eq!(scalars_of(&read, "train/loss"), [(1, 10.0), (2, 5.0)]);
    assert_eq!(
        scalars_of(&read, "train/frames_per_second"),
        [(1, 404.0), (2, 408.0)]
    );
    assert_eq!(scalars_of(&read, "train/lr"), [(1, 1e-4), (2, 2e-4)]);
    assert_eq!(
        scalars_of(&read, "train/sent_bytes_within_node"),
        [(1, 1048576.0)]
    );
    assert_eq!(
        scalars_of(&read, "train/sent_bytes_across_nodes"),
        [(1, 0.0)]
    );
    assert_eq!(scalars_of(&read, "eval/val_loss"), [(2, 2.5)]);
    assert_eq!(scalars_of(&read, "eval/score"), [(2, 0.25)]);
    assert_eq!(scalars_of(&read, "samples/anna/01/similarity"), [(2, 0.5)]);
    assert_eq!(scalars_of(&read, "samples/anna/02/similarity"), [(2, 0.75)]);
    assert_eq!(scalars_of(&read, "samples/anna/02/wer"), [(2, 0.5)]);
    assert_eq!(scalars_of(&read, "samples/ben/01/rate_ratio"), [(2, 1.25)]);
    assert_eq!(scalars_of(&read, "samples/ben/01/wer"), [(2, 0.0)]);
    // Measures that were not taken are absent, not zero.
    assert!(scalars_of(&read, "samples/ben/01/similarity").is_empty());
    assert!(scalars_of(&read, "samples/anna/01/wer").is_empty());
    let audio: Vec<(&str, &Held)> = read
        .iter()
        .filter(|(t, _, _)| t.ends_with("/audio"))
        .map(|(t, _, h)| (t.as_str(), h))
        .collect();
    let want = |bytes: &Vec<u8>, frames| {
        Held::Audio(24_000.0, 1, frames, bytes.clone(), "audio/wav".into())
    };
    assert_eq!(
        audio,
        [
            ("samples/anna/01/audio", &want(&a, 7)),
            ("samples/ben/01/audio", &want(&b, 3)),
            ("samples/anna/02/audio", &want(&c, 4)),
        ]
    );
}

#[test]
fn a_resume_keeps_each_step_once_and_touches_only_our_files() {
    let ws = tempfile::tempdir().unwrap();
    let checkpoints = ws.path().join("checkpoints");
    let dir = checkpoints.join(TENSORBOARD_DIR);
    fs::create_dir_all(&dir).unwrap();
    // Another writer's event file and a note of the user's.
    let other = dir.join("events.out.tfevents.1700000000.host");
    fs::write(&other, frame(b"not ours")).unwrap();
    fs::write(dir.join("notes.txt"), "mine").unwrap();
    // What a run killed while writing its new file left.
    let stale = dir.join(format!("{TEMP_PREFIX}4194305"));
    fs::write(&stale, b"half").unwrap();

    let log = TensorBoardLog::open(&checkpoints, 0).unwrap();
    assert!(!stale.exists());
    for s in 1..=5 {
        log.append_step(&step(s)).unwrap();
        if s % 2 == 0 {
            log.append_eval(&eval(s, None)).unwrap();
        }
    }
    let first = log.path().to_path_buf();
    drop(log);
    // A killed run's torn last record.
    let mut f = OpenOptions::new().append(true).open(&first).unwrap();
    f.write_all(&frame(&summaries::event(1.0, 6, [&b"x"[..]]))[..20])
        .unwrap();
    drop(f);

    // Resumed after step 3: steps 4 and 5, the evaluation at 4 and the torn tail go.
    let log = TensorBoardLog::open(&checkpoints, 3).unwrap();
    assert_ne!(log.path(), first);
    assert!(!first.exists());
    for s in 4..=6 {
        log.append_step(&step(s)).unwrap();
    }
    log.append_eval(&eval(6, None)).unwrap();
    let (read, names) = read_back(&checkpoints);
    let steps = |tag| {
        scalars_of(&read, tag)
            .iter()
            .map(|p| p.0)
            .collect::<Vec<_>>()
    };
    assert_eq!(steps("train/loss"), [1, 2, 3, 4, 5, 6]);
    assert_eq!(steps("eval/val_loss"), [2, 6]);
    assert_eq!(names.iter().filter(|n| n.ends_with(SUFFIX)).count(), 1);
    assert_eq!(fs::read(&other).unwrap(), frame(b"not ours"));
    assert_eq!(fs::read_to_string(dir.join("notes.txt")).unwrap(), "mine");

    // A resume with nothing to drop appends to the same file.
    let path = log.path().to_path_buf();
    drop(log);
    let log = TensorBoardLog::open(&checkpoints, 6).unwrap();
    assert_eq!(log.path(), path);
    log.append_step(&step(7)).unwrap();
    let (read, _) = read_back(&checkpoints);
    assert_eq!(scalars_of(&read, "train/loss").len(), 7);

    // A crash between writing the new file and removing the old one leaves both: the next
    // open keeps each (tag, step) once, and its file sorts after both.
    drop(log);
    let copy = dir.join(format!("{PREFIX}{}.copy{SUFFIX}", now() as u64 + 1000));
    fs::copy(&path, &copy).unwrap();
    let log = TensorBoardLog::open(&checkpoints, 5).unwrap();
    assert!(log.path() > copy.as_path() && !copy.exists());
    let (read, names) = read_back(&checkpoints);
    assert_eq!(names.iter().filter(|n| n.ends_with(SUFFIX)).count(), 1);
    let steps = |tag| {
        scalars_of(&read, tag)
            .iter()
            .map(|p| p.0)
            .collect::<Vec<_>>()
    };
    assert_eq!(steps("train/loss"), [1, 2, 3, 4, 5]);
    assert_eq!(steps("eval/val_loss"), [2]);
    // The values are the ones first written.
    assert_eq!(scalars_of(&read, "train/grad_norm")[4], (5, 5.5));

    // A new run (no checkpoint) keeps nothing.
    drop(log);
    let log = TensorBoardLog::open(&checkpoints, 0).unwrap();
    let (read, _) = read_back(&checkpoints);
    assert!(read.is_empty());
    assert!(log.path().exists());
    assert!(other.exists());
}
