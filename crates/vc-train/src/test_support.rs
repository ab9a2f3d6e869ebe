//! Unit-test fixtures of the trainer: a workspace on a committed fixture model
//! (`tests/fixtures/`) with synthetic codes and an x-vector, and the options to train on it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;

use crate::{Backend, TrainOptions};
use vc_core::hub::ModelSource;
use vc_model::files::ModelFiles;

/// A committed fixture model directory (`tiny-0b6`, `tiny-1b7`).
pub fn model_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// A small deterministic generator (the fixtures must not depend on `rand`'s algorithms).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Writes `data/train.jsonl` (`rows` utterances of 3–8 frames of synthetic codes) and
/// `data/speaker.safetensors` into `ws` for model `model`.
pub fn workspace(ws: &Path, model: &str, rows: usize) {
    const TEXTS: &[&str] = &[
        "Hello world.",
        "The quick brown fox jumps over the lazy dog.",
        "Good morning, how are you today?",
        "Numbers like 42 and 7 are spoken too.",
    ];
    let mut r = Lcg(17);
    let mut manifest = String::new();
    for i in 0..rows {
        let frames = 3 + (r.next() % 6) as usize;
        let codes: Vec<Vec<u32>> = (0..frames)
            .map(|k| {
                (0..16)
                    .map(|g| ((i * 7 + k * 3 + g * 5) % 13 + 100 * g) as u32)
                    .collect()
            })
            .collect();
        let row = json!({
            "audio": format!("data/segments/{i:04}.wav"),
            "text": TEXTS[i % TEXTS.len()],
            "ref_audio": "data/ref.wav",
            "audio_codes": codes,
        });
        manifest.push_str(&format!("{row}\n"));
    }
    std::fs::create_dir_all(ws.join("data")).expect("test workspace");
    std::fs::write(ws.join("data/train.jsonl"), manifest).expect("test manifest");
    let files = ModelFiles::resolve(&ModelSource::Local(model_dir(model))).expect("fixture");
    let hidden = files.config.talker_config.hidden_size;
    let x: Vec<f32> = (0..hidden)
        .map(|_| (r.next() % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    let bytes = vc_core::artifacts::speaker::to_bytes(&x, None).expect("x-vector");
    std::fs::write(ws.join("data/speaker.safetensors"), bytes).expect("test x-vector");
}

/// Options to train `model` in the workspace `ws` (made by [`workspace`]): micro-batches of 2,
/// `grad_accum` of them per step, a learning rate that moves the weights visibly.
pub fn options(ws: &Path, model: &str, backend: Backend, grad_accum: usize) -> TrainOptions {
    let files = ModelFiles::resolve(&ModelSource::Local(model_dir(model))).expect("fixture");
    let mut config = vc_core::config::resolve_layers(vec![])
        .expect("defaults")
        .config
        .train;
    config.batch_size = 2;
    config.grad_accum = grad_accum;
    config.lr = 5e-3;
    config.warmup_steps = 1;
    config.epochs = 100;
    TrainOptions {
        files,
        model_spec: model.into(),
        manifest: ws.join("data/train.jsonl"),
        base_dir: ws.to_path_buf(),
        speaker: ws.join("data/speaker.safetensors"),
        checkpoints: ws.join("checkpoints"),
        config,
        device: candle_core::Device::Cpu,
        backend,
        hooks: Arc::new(crate::hooks::NoHooks),
        evaluator: None,
    }
}
