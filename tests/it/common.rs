//! Shared helpers for the integration tests: test assets, running the binary, WAV inspection.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The committed fixtures (`tests/fixtures`).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Where the downloaded/converted test assets are (`scripts/assets/fetch_test_assets.sh`), or
/// `$VOICECLONE_TEST_ASSETS`.
pub fn assets() -> PathBuf {
    std::env::var_os("VOICECLONE_TEST_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".test-assets"))
}

/// Whether the test assets are there. A test that needs them returns early when they are not,
/// after saying so; with `VOICECLONE_REQUIRE_ASSETS=1` (the README's test command sets it, so CI
/// never skips) a missing asset fails the test instead.
pub fn have_assets() -> bool {
    let dir = assets();
    let present = dir.join("whisper/ggml-tiny.en.bin").is_file()
        && dir.join("speech/prep2/transcripts.tsv").is_file();
    if !present {
        let msg = format!(
            "test assets missing in {}: run scripts/assets/fetch_test_assets.sh (the README's test \
             command does)",
            dir.display()
        );
        assert!(
            std::env::var_os("VOICECLONE_REQUIRE_ASSETS").is_none_or(|v| v != "1"),
            "{msg}"
        );
        eprintln!("skipped: {msg}");
    }
    present
}

/// Whether the program at `path`, which `scripts/assets/fetch_test_assets.sh` installs (`what`), is
/// there; absent, as for [`have_assets`]: skip with a message, or fail when assets are required.
pub fn have_tool(path: &Path, what: &str) -> bool {
    if path.exists() {
        return true;
    }
    let msg = format!(
        "{} ({what}) is missing: run scripts/assets/fetch_test_assets.sh (the README's test command does)",
        path.display()
    );
    assert!(
        std::env::var_os("VOICECLONE_REQUIRE_ASSETS").is_none_or(|v| v != "1"),
        "{msg}"
    );
    eprintln!("skipped: {msg}");
    false
}

pub fn whisper_model() -> PathBuf {
    assets().join("whisper/ggml-tiny.en.bin")
}

/// Runs the voiceclone binary with `args` in workspace `workdir`.
pub fn voiceclone(workdir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_voiceclone"))
        .arg("--workdir")
        .arg(workdir)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("cannot run the voiceclone binary")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Reference transcripts: `file<TAB>text` lines.
pub fn transcripts(dir: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(dir.join("transcripts.tsv"))
        .expect("transcripts.tsv")
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(f, t)| (f.to_string(), t.to_string()))
        .collect()
}

/// Words for WER: lower case, punctuation removed (apostrophes kept inside words).
pub fn normalize_words(text: &str) -> Vec<String> {
    text.to_lowercase()
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '\'' {
                c
            } else {
                ' '
            }
        })
        .collect::<String>()
        .split_whitespace()
        .map(|w| w.trim_matches('\'').to_string())
        .filter(|w| !w.is_empty())
        .collect()
}

/// Word-level edit distance (substitutions + insertions + deletions).
pub fn word_errors(reference: &[String], hypothesis: &[String]) -> usize {
    let mut prev: Vec<usize> = (0..=hypothesis.len()).collect();
    for (i, r) in reference.iter().enumerate() {
        let mut cur = vec![i + 1; hypothesis.len() + 1];
        for (j, h) in hypothesis.iter().enumerate() {
            let sub = prev[j] + usize::from(r != h);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[hypothesis.len()]
}

/// Recursively lists files under `dir` with their sizes and modification times.
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                out.push((e.path(), m.len(), m.modified().unwrap()));
            }
        }
    }
    out.sort();
    out
}

pub fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(from, to).unwrap();
}

/// A copy of fixture model `name` in a temporary directory whose `model.safetensors` stores
/// every floating-point tensor in f32 (the same values: bf16 → f32 is exact); the other files
/// are links to the fixture's.
pub fn f32_stored_copy(name: &str) -> tempfile::TempDir {
    use candle_core::{DType, Device};
    let src = fixtures().join(name);
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        let file = entry.file_name();
        if file == "model.safetensors" {
            continue;
        }
        let target = std::fs::canonicalize(entry.path()).unwrap();
        std::os::unix::fs::symlink(target, dir.path().join(&file)).unwrap();
    }
    let tensors = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let t = if t.dtype().is_float() {
                t.to_dtype(DType::F32).unwrap()
            } else {
                t
            };
            (k, t)
        })
        .collect::<std::collections::HashMap<_, _>>();
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    dir
}

/// How many chunks a streamed response of `frames` frames goes out in when its decoder never
/// falls behind, by the rule of docs/serving.md §4.1 (the first frame alone, then each chunk a
/// quarter of the frames already sent, at least one, at most `most`), computed here on its own.
pub fn audio_chunks_by_rule(frames: usize, most: usize) -> usize {
    let (mut sent, mut chunks) = (0, 0);
    while sent < frames {
        sent += (sent / 4).max(1).min(most).min(frames - sent);
        chunks += 1;
    }
    chunks
}
