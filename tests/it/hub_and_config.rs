//! Model resolution against a Hugging Face cache built by the test (no network), and the
//! configuration layering as the binary applies it.

mod common;

use std::path::Path;

use common::*;
use voiceclone::hub::{resolve_single_file, ModelSource};

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
    // This test binary owns its environment: no other test here reads these variables.
    std::env::set_var("HF_HOME", home.path());
    std::env::set_var("HF_HUB_OFFLINE", "1");

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

#[test]
fn config_layers_and_errors_through_the_binary() {
    let ws = tempfile::tempdir().unwrap();
    let out = voiceclone(ws.path(), &["config"]);
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(
        text.contains("base = \"Qwen/Qwen3-TTS-12Hz-1.7B-Base\""),
        "{text}"
    );
    let parsed: toml::Table = text.parse().expect("`voiceclone config` prints valid TOML");
    assert_eq!(parsed["prep"]["max_seconds"].as_float(), Some(15.0));

    std::fs::write(
        ws.path().join("voiceclone.toml"),
        "[prep]\nmax_seconds = 12\n[model]\nbase = \"Qwen/Qwen3-TTS-12Hz-0.6B-Base\"\n",
    )
    .unwrap();
    let extra = ws.path().join("extra.toml");
    std::fs::write(&extra, "[prep]\nmax_seconds = 9.5\n").unwrap();
    let out = voiceclone(ws.path(), &["--config", extra.to_str().unwrap(), "config"]);
    let text = stdout(&out);
    assert!(
        text.contains("max_seconds = 9.5  # from") && text.contains("extra.toml"),
        "{text}"
    );
    assert!(
        text.contains("0.6B-Base\"  # from") && text.contains("voiceclone.toml"),
        "{text}"
    );

    std::fs::write(
        ws.path().join("voiceclone.toml"),
        "[prep]\nmax_secnds = 12\n",
    )
    .unwrap();
    let out = voiceclone(ws.path(), &["config"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("prep.max_secnds") && err.contains("voiceclone.toml"),
        "{err}"
    );

    std::fs::write(
        ws.path().join("voiceclone.toml"),
        "[prep]\njobs = \"many\"\n",
    )
    .unwrap();
    let out = voiceclone(ws.path(), &["prep", "no-such-input"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("prep.jobs") && err.contains("voiceclone.toml"),
        "{err}"
    );

    std::fs::remove_file(ws.path().join("voiceclone.toml")).unwrap();
    let out = voiceclone(ws.path(), &["prep", "no-such-input", "--min-seconds", "20"]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("prep.min_seconds") && err.contains("--min-seconds"),
        "{err}"
    );

    // Only implemented subcommands are offered.
    let help = stdout(&voiceclone(ws.path(), &["--help"]));
    assert!(help.contains("prep") && help.contains("config"));
}
