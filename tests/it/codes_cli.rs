//! `voiceclone codes` on a workspace made by `prep` from real speech, with the fixture model's
//! speech tokenizer; and `voiceclone codec encode/decode` round trips.

use crate::common;

use std::path::Path;

use common::*;
use serde_json::Value;
use vc_core::hub::ModelSource;
use vc_model::codec::Codec;

fn fixture_model() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiny-0b6")
        .to_string_lossy()
        .into_owned()
}

fn rows(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn codes_fills_a_prepped_manifest_resumes_and_reports_bad_lines() {
    if !common::have_assets() {
        return;
    }
    // A small prep workspace from two real-speech files.
    let mut files: Vec<_> = std::fs::read_dir(assets().join("speech/prep2"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e != "tsv"))
        .collect();
    files.sort();
    let inputs = tempfile::tempdir().unwrap();
    for f in files.iter().take(2) {
        copy(f, &inputs.path().join(f.file_name().unwrap()));
    }
    let ws = tempfile::tempdir().unwrap();
    let model = whisper_model();
    let prep = voiceclone(
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
    assert!(prep.status.success(), "{}", stderr(&prep));
    let manifest = ws.path().join("data/train.jsonl");
    let before = rows(&manifest);
    assert!(before.len() >= 2);

    let out = voiceclone(ws.path(), &["codes", "--model", &fixture_model()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let codec = Codec::load(&ModelSource::parse(&fixture_model()).unwrap()).unwrap();
    let coded = rows(&manifest);
    assert_eq!(coded.len(), before.len());
    for (line, original) in coded.iter().zip(&before) {
        let row: Value = serde_json::from_str(line).unwrap();
        let old: Value = serde_json::from_str(original).unwrap();
        // Every prep field kept, in order, with codes appended.
        let keys: Vec<&String> = row.as_object().unwrap().keys().collect();
        let old_keys: Vec<&String> = old.as_object().unwrap().keys().collect();
        assert_eq!(&keys[..old_keys.len()], &old_keys[..]);
        assert_eq!(keys.last().unwrap().as_str(), "audio_codes");
        let codes = row["audio_codes"].as_array().unwrap();
        let wav =
            vc_audio::load_mono(&ws.path().join(row["audio"].as_str().unwrap()), 24000).unwrap();
        assert_eq!(codes.len(), wav.len().div_ceil(1920), "frame count");
        // The codes are the codec's own for that clip.
        let expected = codec.encode(&wav).unwrap();
        for (frame, want) in codes.iter().zip(&expected) {
            let got: Vec<u32> = frame
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(&got, want);
        }
    }

    // Re-running does no work and changes nothing.
    let again = voiceclone(ws.path(), &["codes", "--model", &fixture_model()]);
    assert!(again.status.success());
    assert!(stdout(&again).contains(" 0 coded"), "{}", stdout(&again));
    assert_eq!(rows(&manifest), coded);

    // Broken lines are reported with their numbers and kept as they are; the rest is coded.
    std::fs::write(ws.path().join("data/notes.wav"), "not audio\n".repeat(200)).unwrap();
    let first: Value = serde_json::from_str(&before[0]).unwrap();
    let mut fresh = first.clone();
    fresh["text"] = "a second copy to code".into();
    let bad = [
        r#"{"audio": "data/segments/x.wav", "text": oops"#.to_string(),
        r#"{"audio":"data/segments/missing.wav","text":"gone"}"#.to_string(),
        r#"{"audio":"data/notes.wav","text":"not audio"}"#.to_string(),
        serde_json::to_string(&fresh).unwrap(),
    ];
    let mut mixed = coded.clone();
    mixed.extend(bad.iter().cloned());
    std::fs::write(&manifest, mixed.join("\n") + "\n").unwrap();
    let n = coded.len();
    let out = voiceclone(ws.path(), &["codes", "--model", &fixture_model()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    for (k, what) in [
        (n + 1, "not a valid JSON"),
        (n + 2, "does not exist"),
        (n + 3, "notes.wav"),
    ] {
        assert!(
            err.contains(&format!("train.jsonl:{k}: ")) && err.contains(what),
            "line {k} not reported:\n{err}"
        );
    }
    let result = rows(&manifest);
    assert_eq!(&result[..n], &coded[..]);
    assert_eq!(&result[n..n + 3], &bad[..3]);
    let last: Value = serde_json::from_str(&result[n + 3]).unwrap();
    assert!(last["audio_codes"].is_array());
}

/// `voiceclone ARGS` run from `dir` (its workspace too), so that a relative output lands there.
fn in_dir(dir: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_voiceclone"))
        .current_dir(dir)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// Commands whose `-o` names a directory or a safetensors file refuse `-` up front instead of
/// creating something named `-` (only a WAV or a JSON stream fits standard output).
#[test]
fn dash_output_is_refused_where_no_stream_fits() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["embed", "clip.wav", "-o", "-"][..],
        &["export", "-o", "-"],
        &["train", "-o", "-"],
    ] {
        let out = in_dir(dir.path(), args);
        assert!(!out.status.success(), "{args:?}");
        let err = stderr(&out);
        assert!(
            err.contains("standard output") && err.contains("./-"),
            "{args:?}: {err}"
        );
        assert!(!dir.path().join("-").exists(), "{args:?} made -");
    }
}

/// `voiceclone codec VERB INPUT -o OUTPUT` with the fixture model's speech tokenizer.
fn codec(dir: &Path, verb: &str, input: &Path, output: &Path) -> std::process::Output {
    let model = fixture_model();
    voiceclone(
        dir,
        &[
            "codec",
            verb,
            input.to_str().unwrap(),
            "-o",
            output.to_str().unwrap(),
            "--model",
            &model,
        ],
    )
}

#[test]
fn codec_encode_decode_files() {
    let dir = tempfile::tempdir().unwrap();
    let clip = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/audio/codec-clip1.wav");
    let json = dir.path().join("codes.json");
    let out = codec(dir.path(), "encode", &clip, &json);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let frames = doc["codes"].as_array().unwrap();
    assert_eq!(frames.len(), 40800usize.div_ceil(1920));
    assert!(frames.iter().all(|f| f.as_array().unwrap().len() == 16));

    let wav = dir.path().join("out.wav");
    let out = codec(dir.path(), "decode", &json, &wav);
    assert!(out.status.success(), "{}", stderr(&out));
    let reader = hound::WavReader::open(&wav).unwrap();
    let spec = reader.spec();
    assert_eq!(
        (spec.sample_rate, spec.channels, spec.bits_per_sample),
        (24000, 1, 16)
    );
    assert_eq!(reader.duration() as usize, frames.len() * 1920);

    // `-o -` is standard output, as for `speak`: the same bytes as the file, no file named -.
    for (verb, input, file) in [("encode", &clip, &json), ("decode", &json, &wav)] {
        let out = in_dir(
            dir.path(),
            &[
                "codec",
                verb,
                input.to_str().unwrap(),
                "-o",
                "-",
                "--model",
                &fixture_model(),
            ],
        );
        assert!(out.status.success(), "{verb}: {}", stderr(&out));
        assert!(
            out.stdout == std::fs::read(file).unwrap(),
            "{verb}: stdout differs from -o FILE"
        );
        assert!(
            !dir.path().join("-").exists(),
            "{verb} wrote a file named -"
        );
    }

    // Existing outputs are replaced only with --overwrite, as everywhere else.
    let before = std::fs::read(&json).unwrap();
    for (verb, input, output) in [("encode", &clip, &json), ("decode", &json, &wav)] {
        let out = codec(dir.path(), verb, input, output);
        assert!(!out.status.success(), "{verb} replaced its output");
        assert!(
            stderr(&out).contains("pass --overwrite"),
            "{}",
            stderr(&out)
        );
    }
    assert_eq!(std::fs::read(&json).unwrap(), before);
    let model = fixture_model();
    let out = voiceclone(
        dir.path(),
        &[
            "codec",
            "encode",
            clip.to_str().unwrap(),
            "-o",
            json.to_str().unwrap(),
            "--overwrite",
            "--model",
            &model,
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));

    std::fs::write(&json, r#"{"codes": [[1, 2, 3]]}"#).unwrap();
    let out = codec(dir.path(), "decode", &json, &dir.path().join("bad.wav"));
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("16 non-negative ints"),
        "{}",
        stderr(&out)
    );
}
