//! Model-directory resolution and loading on broken copies of the fixture models: every failure
//! must name the file and the problem. Each test starts from a copy that resolves and loads
//! cleanly (checked by `intact_fixtures_resolve_and_load`), then breaks one thing.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use vc_core::hub::ModelSource;
use vc_model::files::ModelFiles;
use vc_model::ops::Numerics;
use vc_model::talker::Talker;
use vc_model::text::TextTokenizer;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Copies a fixture model directory, following the symlinks `tiny-1b7` uses to share files.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    fn copy_dir(src: &Path, dst: &Path) {
        std::fs::create_dir_all(dst).unwrap();
        for entry in std::fs::read_dir(src).unwrap() {
            let path = entry.unwrap().path();
            let target = dst.join(path.file_name().unwrap());
            if std::fs::metadata(&path).unwrap().is_dir() {
                copy_dir(&path, &target);
            } else {
                std::fs::copy(&path, &target).unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture(name), dir.path());
    dir
}

fn source(dir: &Path) -> ModelSource {
    ModelSource::parse(dir.to_str().unwrap()).unwrap()
}

fn resolve_err(dir: &Path) -> String {
    format!(
        "{:#}",
        ModelFiles::resolve(&source(dir)).expect_err("the broken model resolved")
    )
}

/// Loads the talker exactly as synthesis does: all checkpoint tensors, then `Talker::load`.
fn load_talker(files: &[PathBuf], config: &Path) -> anyhow::Result<Talker> {
    let config = vc_model::config::Qwen3TtsConfig::from_file(config)?;
    let weights = vc_model::weights::Weights::load(files, DType::F32, &Device::Cpu, |_| true)?;
    Talker::load(&weights, &config, Numerics::default())
}

/// Rewrites `model.safetensors` with `edit` applied to its tensor list.
fn rewrite_checkpoint(dir: &Path, edit: impl FnOnce(&mut Vec<(String, TensorView<'_>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, TensorView<'_>)> = st.tensors();
    edit(&mut tensors);
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
}

#[test]
fn intact_fixtures_resolve_and_load() {
    for name in ["tiny-0b6", "tiny-1b7"] {
        let dir = copy_fixture(name);
        let files = ModelFiles::resolve(&source(dir.path())).unwrap();
        assert_eq!(files.config.tts_model_type, "base");
        // The fixture's generation_config.json has the shipped values (docs/model.md §2).
        assert_eq!(files.generation.max_new_tokens, 8192);
        assert_eq!(files.generation.top_k, 50);
        assert_eq!(
            files.checkpoint.shards,
            vec![dir.path().join("model.safetensors")]
        );
        let tok = files.text_tokenizer().unwrap();
        assert_eq!(
            tok.encode("<|im_start|>assistant\n").unwrap(),
            vec![151644, 77091, 198]
        );
        let speech = files.speech_tokenizer().unwrap();
        assert!(speech.config.ends_with("speech_tokenizer/config.json"));
        assert!(speech
            .checkpoint
            .tensor_names()
            .any(|n| n.starts_with("decoder.")));
        load_talker(&files.checkpoint.shards, &files.config_path).unwrap();
    }
}

#[test]
fn missing_generation_config_takes_the_wrapper_fallbacks() {
    let dir = copy_fixture("tiny-0b6");
    std::fs::remove_file(dir.path().join("generation_config.json")).unwrap();
    let files = ModelFiles::resolve(&source(dir.path())).unwrap();
    assert_eq!(files.generation.max_new_tokens, 2048);
    assert_eq!(files.generation.temperature, 0.9);

    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"top_k": -3}"#,
    )
    .unwrap();
    let err = resolve_err(dir.path());
    assert!(
        err.contains("generation_config.json") && err.contains("top_k"),
        "{err}"
    );
}

#[test]
fn tensor_with_a_wrong_shape() {
    let dir = copy_fixture("tiny-0b6");
    let name = "talker.model.codec_embedding.weight"; // [3072, 8] bf16
    rewrite_checkpoint(dir.path(), |tensors| {
        let (_, view) = tensors.iter_mut().find(|(n, _)| n == name).unwrap();
        let data = &view.data()[..3071 * 8 * 2];
        *view = TensorView::new(view.dtype(), vec![3071, 8], data).unwrap();
    });
    let err = resolve_err(dir.path());
    for needle in [
        "model.safetensors",
        name,
        "[3071, 8]",
        "[3072, 8]",
        "config.json",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in: {err}");
    }
    // The load path reports it the same way.
    let err = format!(
        "{:#}",
        load_talker(
            &[dir.path().join("model.safetensors")],
            &dir.path().join("config.json")
        )
        .unwrap_err()
    );
    for needle in ["model.safetensors", name, "[3071, 8]", "[3072, 8]"] {
        assert!(err.contains(needle), "missing {needle:?} in: {err}");
    }
}

#[test]
fn missing_tensor() {
    let dir = copy_fixture("tiny-1b7");
    let name = "talker.code_predictor.small_to_mtp_projection.weight";
    rewrite_checkpoint(dir.path(), |tensors| tensors.retain(|(n, _)| n != name));
    let err = resolve_err(dir.path());
    for needle in ["model.safetensors", name, "no tensor", "config.json"] {
        assert!(err.contains(needle), "missing {needle:?} in: {err}");
    }
    let err = format!(
        "{:#}",
        load_talker(
            &[dir.path().join("model.safetensors")],
            &dir.path().join("config.json")
        )
        .unwrap_err()
    );
    assert!(
        err.contains(name) && err.contains("model.safetensors"),
        "{err}"
    );
}

#[test]
fn truncated_checkpoint() {
    let dir = copy_fixture("tiny-0b6");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = resolve_err(dir.path());
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
    // Loading it directly also names the file.
    let err = format!(
        "{:#}",
        load_talker(std::slice::from_ref(&path), &dir.path().join("config.json")).unwrap_err()
    );
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn missing_tokenizer_files() {
    for file in ["vocab.json", "merges.txt", "tokenizer_config.json"] {
        let dir = copy_fixture("tiny-0b6");
        std::fs::remove_file(dir.path().join(file)).unwrap();
        let err = resolve_err(dir.path());
        assert!(
            err.contains(file) && err.contains("tokenizer") && err.contains("missing"),
            "{file}: {err}"
        );
        let err = format!(
            "{:#}",
            TextTokenizer::from_model(&source(dir.path())).unwrap_err()
        );
        assert!(err.contains(file), "{file}: {err}");
    }
}

#[test]
fn corrupt_tokenizer_files() {
    let dir = copy_fixture("tiny-0b6");
    std::fs::write(
        dir.path().join("merges.txt"),
        "#version: 0.2\nĠ t\nthree parts here\n",
    )
    .unwrap();
    let err = format!(
        "{:#}",
        TextTokenizer::from_model(&source(dir.path())).unwrap_err()
    );
    assert!(err.contains("merges.txt:3"), "{err}");

    let dir = copy_fixture("tiny-0b6");
    std::fs::write(dir.path().join("vocab.json"), "{\"a\": 0,").unwrap();
    let err = format!(
        "{:#}",
        TextTokenizer::from_model(&source(dir.path())).unwrap_err()
    );
    assert!(err.contains("vocab.json"), "{err}");
}

#[test]
fn unknown_model_type() {
    let dir = copy_fixture("tiny-0b6");
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = "llama".into();
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    let err = resolve_err(dir.path());
    assert!(
        err.contains("config.json") && err.contains("\"llama\"") && err.contains("not supported"),
        "{err}"
    );
}

#[test]
fn tokenizer_larger_than_the_text_embedding() {
    // A consistent model whose text embedding is too small for the tokenizer's ids.
    let dir = copy_fixture("tiny-0b6");
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["talker_config"]["text_vocab_size"] = 151_000.into();
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    let name = "talker.model.text_embedding.weight"; // [151936, 4] bf16
    let err = resolve_err(dir.path());
    assert!(err.contains(name) && err.contains("[151000, 4]"), "{err}");
    rewrite_checkpoint(dir.path(), |tensors| {
        let (_, view) = tensors.iter_mut().find(|(n, _)| n == name).unwrap();
        *view = TensorView::new(
            view.dtype(),
            vec![151_000, 4],
            &view.data()[..151_000 * 4 * 2],
        )
        .unwrap();
    });
    let files = ModelFiles::resolve(&source(dir.path())).unwrap();
    let err = format!("{:#}", files.text_tokenizer().unwrap_err());
    assert!(
        err.contains("151675")
            && err.contains("text_vocab_size 151000")
            && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn sharded_checkpoint() {
    let dir = copy_fixture("tiny-0b6");
    let single = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&single).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (talker, rest): (Vec<_>, Vec<_>) = st
        .tensors()
        .into_iter()
        .partition(|(n, _)| n.starts_with("talker."));
    let mut weight_map = serde_json::Map::new();
    for (shard, tensors) in [
        ("model-00001-of-00002.safetensors", talker),
        ("model-00002-of-00002.safetensors", rest),
    ] {
        for (name, _) in &tensors {
            weight_map.insert(name.clone(), shard.into());
        }
        safetensors::serialize_to_file(tensors, None, &dir.path().join(shard)).unwrap();
    }
    std::fs::remove_file(&single).unwrap();
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let files = ModelFiles::resolve(&source(dir.path())).unwrap();
    assert_eq!(files.checkpoint.shards.len(), 2);
    load_talker(&files.checkpoint.shards, &files.config_path).unwrap();
    let weights = files
        .load_weights(DType::F32, &Device::Cpu, |n| {
            n.starts_with("speaker_encoder.")
        })
        .unwrap();
    assert!(weights.contains("speaker_encoder.fc.bias"));

    // A shard the index names but the directory lacks.
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let err = resolve_err(dir.path());
    assert!(
        err.contains("model-00002-of-00002.safetensors")
            && err.contains("model.safetensors.index.json"),
        "{err}"
    );

    // No checkpoint at all.
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let err = resolve_err(dir.path());
    assert!(
        err.contains("model.safetensors") && err.contains("neither"),
        "{err}"
    );
}

#[test]
fn speech_tokenizer_is_resolved_lazily() {
    let dir = copy_fixture("tiny-0b6");
    std::fs::remove_file(dir.path().join("speech_tokenizer/model.safetensors")).unwrap();
    let files = ModelFiles::resolve(&source(dir.path())).unwrap();
    let err = format!("{:#}", files.speech_tokenizer().unwrap_err());
    assert!(err.contains("speech_tokenizer/model.safetensors"), "{err}");

    let path = dir.path().join("speech_tokenizer/config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = "qwen3_tts_tokenizer_25hz".into();
    std::fs::write(&path, config.to_string()).unwrap();
    let err = format!("{:#}", files.speech_tokenizer().unwrap_err());
    assert!(
        err.contains("speech_tokenizer/config.json") && err.contains("qwen3_tts_tokenizer_25hz"),
        "{err}"
    );
}
