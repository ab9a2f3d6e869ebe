//! Helpers for the training tests: fixture workspaces with synthetic codes and x-vectors.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};

pub use crate::common::fixtures;

pub fn model_dir(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// Talker hidden size of a fixture model.
pub fn hidden(name: &str) -> usize {
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir(name).join("config.json")).unwrap(),
    )
    .unwrap();
    cfg["talker_config"]["hidden_size"].as_u64().unwrap() as usize
}

/// A tiny deterministic generator (the tests must not depend on `rand`'s algorithms).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn normal(&mut self) -> f32 {
        // Sum of uniforms: good enough for test data.
        let s: f64 = (0..12)
            .map(|_| self.next() as f64 / (1u64 << 31) as f64)
            .sum();
        (s - 6.0) as f32
    }
}

const TEXTS: &[&str] = &[
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "Good morning, how are you today?",
    "Rust makes systems programming pleasant.",
    "This is a short utterance.",
    "Numbers like 42 and 7 are spoken too.",
    "Another line of text for the voice.",
    "Training data should be clean.",
];

/// `n` manifest rows with texts and synthetic `audio_codes` of 3..=8 frames. Codes are drawn
/// from a small alphabet per codebook so that a few dozen steps can learn them.
pub fn synthetic_rows(n: usize, seed: u64) -> Vec<Value> {
    let mut r = Lcg(seed);
    (0..n)
        .map(|i| {
            let frames = 3 + r.below(6) as usize;
            let codes: Vec<Vec<u32>> = (0..frames)
                .map(|k| {
                    (0..16)
                        .map(|g| {
                            ((i * 7 + k * 3 + g * 5) % 13 + 100 * g) as u32 + r.below(2) as u32
                        })
                        .collect()
                })
                .collect();
            json!({
                "audio": format!("data/segments/{i:04}.wav"),
                "text": TEXTS[i % TEXTS.len()],
                "ref_audio": "data/ref.wav",
                "audio_codes": codes,
            })
        })
        .collect()
}

pub fn xvector(dim: usize, seed: u64) -> Vec<f32> {
    let mut r = Lcg(seed);
    (0..dim).map(|_| r.normal()).collect()
}

/// A workspace in `dir`: `voiceclone.toml` (model.base = the fixture, plus `extra_toml`),
/// `data/train.jsonl` and `data/speaker.safetensors`.
pub fn make_workspace(dir: &Path, model: &str, rows: &[Value], xvec: &[f32], extra_toml: &str) {
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let manifest: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(dir.join("data/train.jsonl"), manifest).unwrap();
    let bytes = vc_core::artifacts::speaker::to_bytes(xvec, None).unwrap();
    std::fs::write(dir.join("data/speaker.safetensors"), bytes).unwrap();
    let toml = format!(
        "[model]\nbase = {:?}\n{extra_toml}\n",
        model_dir(model).display().to_string()
    );
    std::fs::write(dir.join("voiceclone.toml"), toml).unwrap();
}

pub fn voiceclone(workdir: &Path, args: &[&str]) -> Output {
    command(workdir, args)
        .output()
        .expect("cannot run voiceclone")
}

pub fn command(workdir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_voiceclone"));
    c.arg("--workdir")
        .arg(workdir)
        .args(args)
        .env_remove("RUST_LOG");
    // A test's own processes are never ranks of some outer distributed job.
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
        "LOCAL_WORLD_SIZE",
        "VOICECLONE_LAUNCHED",
        "VOICECLONE_EMULATE_NETWORK",
    ] {
        c.env_remove(v);
    }
    c
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// All tensors of a safetensors file as raw (dtype, shape, bytes).
pub fn read_raw(path: &Path) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.iter()
        .map(|(n, v)| {
            (
                n.to_string(),
                (v.dtype().to_string(), v.shape().to_vec(), v.data().to_vec()),
            )
        })
        .collect()
}

/// A copy of fixture model `name` with every tensor stored in f32 (the fixtures are bf16) and
/// scaled by 1.001, so that its values are not bf16 numbers, in a new temporary directory; its
/// path works wherever a fixture name does.
pub fn f32_model_copy(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(model_dir(name)).unwrap() {
        let e = e.unwrap();
        // Followed links: some fixture files are links to another fixture's. Folders (the
        // speech tokenizer) are linked.
        if e.path().is_dir() {
            let target = std::fs::canonicalize(e.path()).unwrap();
            std::os::unix::fs::symlink(target, dir.path().join(e.file_name())).unwrap();
        } else if e.path().is_file() {
            std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
        }
    }
    let path = dir.path().join("model.safetensors");
    let tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    let f32s: std::collections::HashMap<String, candle_core::Tensor> = tensors
        .into_iter()
        .map(|(k, t)| {
            let t = t.to_dtype(candle_core::DType::F32).unwrap();
            (k, t.affine(1.001, 0.0).unwrap())
        })
        .collect();
    candle_core::safetensors::save(&f32s, &path).unwrap();
    dir
}

/// In-process training options for a workspace made by [`make_workspace`] in `dir` on the
/// fixture `model` (rows' audio paths relative to tests/fixtures; never read, codes are given).
pub fn train_options(
    dir: &Path,
    model: &str,
    config: vc_core::config::TrainConfig,
    backend: vc_train::Backend,
) -> vc_train::TrainOptions {
    use vc_core::hub::ModelSource;
    use vc_model::files::ModelFiles;
    let files = ModelFiles::resolve(&ModelSource::Local(model_dir(model))).unwrap();
    vc_train::TrainOptions {
        files,
        model_spec: model.into(),
        manifest: dir.join("data/train.jsonl"),
        base_dir: fixtures(),
        speaker: dir.join("data/speaker.safetensors"),
        checkpoints: dir.join("checkpoints"),
        config,
        device: candle_core::Device::Cpu,
        backend,
        hooks: std::sync::Arc::new(vc_train::hooks::NoHooks),
        evaluator: evaluator(),
    }
}

/// A trainer on a fresh workspace in `dir` on fixture `model`: 6 synthetic utterances in
/// unshuffled batches of 3, one micro-batch per step, at the constant learning rate `lr` (no
/// warm-up or decay), with the configuration otherwise the defaults changed by `tweak`.
pub fn constant_lr_trainer(
    model: &str,
    dir: &Path,
    backend: vc_train::Backend,
    lr: f64,
    tweak: impl FnOnce(&mut vc_core::config::TrainConfig),
) -> vc_train::Trainer {
    make_workspace(
        dir,
        model,
        &synthetic_rows(6, 5),
        &xvector(hidden(model), 3),
        "",
    );
    let mut config = vc_core::config::resolve_layers(vec![])
        .unwrap()
        .config
        .train;
    config.batch_size = 3;
    config.grad_accum = 1;
    config.shuffle = false;
    config.epochs = 1000;
    config.lr = lr;
    tweak(&mut config);
    let opts = train_options(dir, model, config, backend);
    let mut t = vc_train::Trainer::new(opts, false).unwrap();
    t.run.schedule = vc_train::optim::Schedule {
        peak: lr,
        warmup: 0,
        total: usize::MAX / 2,
    };
    t
}

/// The evaluation lines of the workspace's `checkpoints/metrics.jsonl` (docs/training.md §14.2).
pub fn evals(ws: &Path) -> Vec<Value> {
    std::fs::read_to_string(ws.join("checkpoints/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v.get("val_loss").is_some())
        .collect()
}

/// Where the early stop of docs/training.md §14.3 ends a run over its evaluations `(step,
/// value)`, with the best step then: the first evaluation that is the `patience`-th in a row
/// whose value is not `better` than the best before it (`a < b` for losses, `a > b` for
/// scores).
pub fn early_stop_of(
    evals: &[(u64, f64)],
    patience: usize,
    better: impl Fn(f64, f64) -> bool,
) -> Option<(u64, u64)> {
    let (mut best, mut best_step, mut since) = (None, 0, 0);
    for &(step, value) in evals {
        if best.is_none_or(|b| better(value, b)) {
            (best, best_step, since) = (Some(value), step, 0);
        } else {
            since += 1;
            if since >= patience {
                return Some((step, best_step));
            }
        }
    }
    None
}

/// The step of the checkpoint an export directory was made from (its marker).
pub fn export_step(dir: &Path) -> u64 {
    let marker: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("voiceclone-export.json")).unwrap())
            .unwrap();
    marker["step"].as_u64().unwrap()
}

/// The checkpoint directories of the workspace, sorted.
pub fn step_dirs(ws: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(ws.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    names
}

/// A checkpoint directory's name.
pub fn step_name(step: u64) -> String {
    format!("step-{step:07}")
}

/// The evaluation `voiceclone train` runs, with no Whisper model: samples and pages, no WER.
pub fn evaluator() -> Option<std::sync::Arc<dyn vc_train::evaluation::Evaluator>> {
    Some(std::sync::Arc::new(vc_eval::Evaluation {
        listener: vc_eval::samples::Listener::Missing("not in this test".into()),
        references: Vec::new(),
    }))
}
