//! Model resolution through a Hugging Face cache the test builds, with the hub offline (no
//! network): model files, a single-file Whisper reference, and the tokenizer. This binary owns
//! its process environment (`HF_HOME`, `HF_HUB_OFFLINE`), so it is separate from `tests/it/`,
//! and its one test sets the variables before anything reads them.

#[path = "it/common.rs"]
mod common;

use std::path::Path;

use common::*;
use vc_core::hub::{resolve_single_file, ModelSource};
use vc_model::text::TextTokenizer;

/// Lays out `HF_HOME/hub/models--{owner}--{name}` as hf-hub's cache does.
fn cached_repo(hf_home: &Path, repo: &str, files: &[(&str, &[u8])]) {
    let base = hf_home
        .join("hub")
        .join(format!("models--{}", repo.replace('/', "--")));
    let commit = "0123456789abcdef0123456789abcdef01234567";
    std::fs::create_dir_all(base.join("refs")).unwrap();
    std::fs::write(base.join("refs/main"), commit).unwrap();
    for (name, bytes) in files {
        let path = base.join("snapshots").join(commit).join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

/// The tokenizer of the fixture model, loaded through the cache, encodes like the local one.
fn tokenizer_through_the_cache(home: &Path) {
    // hf-hub's cache layout: refs/main names the snapshot holding the files.
    let repo = home.join("hub/models--Qwen--Tiny-TTS-Tokenizer");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    for f in ["vocab.json", "merges.txt", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join("tiny-0b6").join(f), snapshot.join(f)).unwrap();
    }
    let source = ModelSource::parse("Qwen/Tiny-TTS-Tokenizer").unwrap();
    assert!(matches!(source, ModelSource::Hub { .. }));
    let hub = TextTokenizer::from_model(&source).unwrap();
    let local =
        TextTokenizer::from_model(&ModelSource::Local(fixtures().join("tiny-0b6"))).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("refs/tokenizer_cases.json")).unwrap(),
    )
    .unwrap();
    assert!(!cases.is_empty());
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            hub.encode(text).unwrap(),
            local.encode(text).unwrap(),
            "{text:?} through the hub cache"
        );
    }
}

#[test]
fn hub_cache_resolution_offline() {
    let home = tempfile::tempdir().unwrap();
    cached_repo(
        home.path(),
        "Qwen/Tiny-TTS",
        &[
            ("config.json", b"{}"),
            ("speech_tokenizer/config.json", b"{}"),
        ],
    );
    // This binary owns its environment, and this is its only test.
    std::env::set_var("HF_HOME", home.path());
    std::env::set_var("HF_HUB_OFFLINE", "1");
    tokenizer_through_the_cache(home.path());

    let src = ModelSource::parse("Qwen/Tiny-TTS").unwrap();
    assert_eq!(
        src,
        ModelSource::Hub {
            repo: "Qwen/Tiny-TTS".into()
        }
    );
    assert!(src.file("config.json").unwrap().ends_with("config.json"));
    assert!(src.file("speech_tokenizer/config.json").unwrap().is_file());
    let err = format!("{:#}", src.file("model.safetensors").unwrap_err());
    assert!(
        err.contains("model.safetensors")
            && err.contains("Qwen/Tiny-TTS")
            && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
    assert_eq!(src.optional_file("tokenizer.json").unwrap(), None);

    // Files that are only not cached are not said to be missing from the repository: the
    // message says the cache lacks them, the hub cannot be reached, and what to do.
    let not_cached = |err: String, files: &[&str]| {
        assert!(!err.contains("has neither"), "{err}");
        assert!(
            err.contains("not in the local Hugging Face cache")
                && err.contains("HF_HUB_OFFLINE")
                && err.contains("HF_HOME")
                && err.contains("local")
                && files.iter().all(|f| err.contains(f)),
            "{err}"
        );
    };
    let uncached = ModelSource::parse("Qwen/Not-Cached-TTS").unwrap();
    not_cached(
        format!("{:#}", vc_model::codec::Codec::load(&uncached).unwrap_err()),
        &["speech_tokenizer/config.json", "Qwen/Not-Cached-TTS"],
    );
    not_cached(
        format!(
            "{:#}",
            vc_model::files::Checkpoint::resolve(&src).unwrap_err()
        ),
        &["model.safetensors", "Qwen/Tiny-TTS"],
    );

    let err = format!(
        "{:#}",
        resolve_single_file("ggerganov/whisper.cpp/ggml-base.bin").unwrap_err()
    );
    assert!(
        err.contains("ggml-base.bin") && err.contains("ggerganov/whisper.cpp"),
        "{err}"
    );

    // A local directory takes the same path.
    let local = ModelSource::parse(home.path().to_str().unwrap()).unwrap();
    assert!(matches!(local, ModelSource::Local(_)));
    let err = format!("{:#}", local.file("nope.json").unwrap_err());
    assert!(err.contains("nope.json"), "{err}");

    // The binary resolves prep.whisper_model through the same cache.
    if !have_assets() {
        return;
    }
    let model = std::fs::read(whisper_model()).unwrap();
    cached_repo(
        home.path(),
        "someone/whisper-test",
        &[("models/ggml-tiny.en.bin", &model)],
    );
    let ws = tempfile::tempdir().unwrap();
    let clip = assets().join("speech/prep2");
    let first_clip = std::fs::read_dir(&clip)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wav"))
        .min()
        .unwrap();
    let out = voiceclone(
        ws.path(),
        &[
            "prep",
            first_clip.to_str().unwrap(),
            "--whisper-model",
            "someone/whisper-test/models/ggml-tiny.en.bin",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = voiceclone(
        ws.path(),
        &[
            "prep",
            first_clip.to_str().unwrap(),
            "--whisper-model",
            "someone/whisper-test/missing.bin",
            "--force",
        ],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("missing.bin"), "{}", stderr(&out));
}
