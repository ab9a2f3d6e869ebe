//! Loading a checkpoint with the real 0.6B shapes (docs/model.md §2, §4.3, §5.3): it must load
//! through the normal path, and peak memory must stay within 1.3x the f32 size of the loaded
//! weights (bf16 on disk is converted tensor by tensor and the mapped pages are released as we go).
//!
//! The checkpoint is `.big-fixtures/qwen3-tts-0.6b-random/` when `scripts/reference/make_fixtures.py
//! --full-size` made one; otherwise this test writes an equivalent random bf16 checkpoint into a
//! temporary directory. The load runs in a child process so its peak RSS is its own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device};
use vc_model::config::Qwen3TtsConfig;
use vc_model::ops::Numerics;
use vc_model::talker::Talker;
use vc_model::weights::Weights;

const CHILD_ENV: &str = "VOICECLONE_FULL_LOAD_DIR";

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every talker and code-predictor tensor of a Base checkpoint with `cfg`'s shapes.
fn talker_shapes(cfg: &Qwen3TtsConfig) -> Vec<(String, Vec<usize>)> {
    let t = &cfg.talker_config;
    let cp = &t.code_predictor_config;
    let mut out: Vec<(String, Vec<usize>)> = vec![
        (
            "talker.model.text_embedding.weight".into(),
            vec![t.text_vocab_size, t.text_hidden_size],
        ),
        (
            "talker.model.codec_embedding.weight".into(),
            vec![t.vocab_size, t.hidden_size],
        ),
        ("talker.model.norm.weight".into(), vec![t.hidden_size]),
        (
            "talker.codec_head.weight".into(),
            vec![t.vocab_size, t.hidden_size],
        ),
        (
            "talker.text_projection.linear_fc1.weight".into(),
            vec![t.text_hidden_size, t.text_hidden_size],
        ),
        (
            "talker.text_projection.linear_fc1.bias".into(),
            vec![t.text_hidden_size],
        ),
        (
            "talker.text_projection.linear_fc2.weight".into(),
            vec![t.hidden_size, t.text_hidden_size],
        ),
        (
            "talker.text_projection.linear_fc2.bias".into(),
            vec![t.hidden_size],
        ),
        (
            "talker.code_predictor.model.norm.weight".into(),
            vec![cp.hidden_size],
        ),
    ];
    let layer = |prefix: String, h: usize, heads: usize, kv: usize, hd: usize, inter: usize| {
        vec![
            (
                format!("{prefix}.self_attn.q_proj.weight"),
                vec![heads * hd, h],
            ),
            (
                format!("{prefix}.self_attn.k_proj.weight"),
                vec![kv * hd, h],
            ),
            (
                format!("{prefix}.self_attn.v_proj.weight"),
                vec![kv * hd, h],
            ),
            (
                format!("{prefix}.self_attn.o_proj.weight"),
                vec![h, heads * hd],
            ),
            (format!("{prefix}.self_attn.q_norm.weight"), vec![hd]),
            (format!("{prefix}.self_attn.k_norm.weight"), vec![hd]),
            (format!("{prefix}.mlp.gate_proj.weight"), vec![inter, h]),
            (format!("{prefix}.mlp.up_proj.weight"), vec![inter, h]),
            (format!("{prefix}.mlp.down_proj.weight"), vec![h, inter]),
            (format!("{prefix}.input_layernorm.weight"), vec![h]),
            (format!("{prefix}.post_attention_layernorm.weight"), vec![h]),
        ]
    };
    for i in 0..t.num_hidden_layers {
        out.extend(layer(
            format!("talker.model.layers.{i}"),
            t.hidden_size,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            t.intermediate_size,
        ));
    }
    for i in 0..cp.num_hidden_layers {
        out.extend(layer(
            format!("talker.code_predictor.model.layers.{i}"),
            cp.hidden_size,
            cp.num_attention_heads,
            cp.num_key_value_heads,
            cp.head_dim,
            cp.intermediate_size,
        ));
    }
    for j in 0..t.num_code_groups - 1 {
        out.push((
            format!("talker.code_predictor.model.codec_embedding.{j}.weight"),
            vec![cp.vocab_size, t.hidden_size],
        ));
        out.push((
            format!("talker.code_predictor.lm_head.{j}.weight"),
            vec![cp.vocab_size, cp.hidden_size],
        ));
    }
    if t.hidden_size != cp.hidden_size {
        out.push((
            "talker.code_predictor.small_to_mtp_projection.weight".into(),
            vec![cp.hidden_size, t.hidden_size],
        ));
        out.push((
            "talker.code_predictor.small_to_mtp_projection.bias".into(),
            vec![cp.hidden_size],
        ));
    }
    out
}

/// The real 0.6B config (docs/model.md §2), written over the tiny fixture's complete config.json.
fn full_size_config() -> serde_json::Value {
    let text = std::fs::read_to_string(manifest_dir().join("tests/fixtures/tiny-0b6/config.json"))
        .unwrap();
    let mut c: serde_json::Value = serde_json::from_str(&text).unwrap();
    let t = &mut c["talker_config"];
    for (k, v) in [
        ("hidden_size", 1024),
        ("num_hidden_layers", 28),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 8),
        ("head_dim", 128),
        ("intermediate_size", 3072),
        ("text_hidden_size", 2048),
    ] {
        t[k] = v.into();
    }
    t["rope_scaling"]["mrope_section"] = serde_json::json!([24, 20, 20]);
    let cp = &mut t["code_predictor_config"];
    for (k, v) in [
        ("hidden_size", 1024),
        ("num_hidden_layers", 5),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 8),
        ("head_dim", 128),
        ("intermediate_size", 3072),
    ] {
        cp[k] = v.into();
    }
    c["speaker_encoder_config"]["enc_dim"] = 1024.into();
    c["speaker_encoder_config"]["enc_channels"] = serde_json::json!([512, 512, 512, 512, 1536]);
    c["speaker_encoder_config"]["enc_attention_channels"] = 128.into();
    c["speaker_encoder_config"]["enc_se_channels"] = 128.into();
    c
}

/// Writes `config.json` and a random bf16 `model.safetensors` (talker + code predictor).
fn write_random_checkpoint(dir: &Path) {
    let config = full_size_config();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    let cfg = Qwen3TtsConfig::from_file(&dir.join("config.json")).unwrap();
    let shapes = talker_shapes(&cfg);
    // One random block, laid end to end through every tensor: the load's memory does not
    // depend on the values, and drawing 0.9 G of them would take most of the test's time.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let block: Vec<u8> = (0..1 << 20)
        .flat_map(|_| {
            // xorshift64*: cheap, deterministic values in [-0.05, 0.05).
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let u = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            half::bf16::from_f32((u - 0.5) * 0.1).to_le_bytes()
        })
        .collect();
    let mut at = 0usize;
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(_, shape)| {
            let want = 2 * shape.iter().product::<usize>();
            let mut bytes = Vec::with_capacity(want);
            while bytes.len() < want {
                let from = at % block.len();
                let take = (want - bytes.len()).min(block.len() - from);
                bytes.extend_from_slice(&block[from..from + take]);
                at += take;
            }
            bytes
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = shapes
        .iter()
        .zip(&data)
        .map(|((name, shape), bytes)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::BF16,
                    shape.clone(),
                    bytes,
                )
                .unwrap(),
            )
        })
        .collect();
    let bytes: usize = data.iter().map(Vec::len).sum();
    let path = dir.join("model.safetensors");
    if let Err(e) = safetensors::serialize_to_file(views, None, &path) {
        panic!(
            "writing the random {:.1} GB checkpoint {}: {e} (the test needs that much free disk \
             where TMPDIR points)",
            bytes as f64 / 1e9,
            path.display()
        );
    }
}

fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// Runs in the child process: load and report.
#[test]
#[ignore = "run by full_size_0b6_checkpoint_loads_within_memory_bound in a child process"]
fn child_load_full_size() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let start = Instant::now();
    let cfg = Qwen3TtsConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::load(
        &[dir.join("model.safetensors")],
        DType::F32,
        &Device::Cpu,
        |n| n.starts_with("talker."),
    )
    .unwrap();
    let talker = Talker::load(&weights, &cfg, Numerics::Fused).unwrap();
    drop(weights);
    let seconds = start.elapsed().as_secs_f64();
    let params: usize = talker_shapes(&cfg)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    println!(
        "RESULT {{\"load_seconds\": {seconds:.2}, \"peak_rss\": {}, \"f32_bytes\": {}}}",
        peak_rss_bytes(),
        params * 4
    );
    drop(talker);
}

#[test]
fn full_size_0b6_checkpoint_loads_within_memory_bound() {
    let made = manifest_dir().join(".big-fixtures/qwen3-tts-0.6b-random");
    let tmp = tempfile::tempdir().unwrap();
    let dir = if made.join("model.safetensors").is_file() {
        made
    } else {
        write_random_checkpoint(tmp.path());
        tmp.path().to_path_buf()
    };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "model_full_size_load::child_load_full_size",
            "--include-ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = stdout
        .lines()
        .find_map(|l| l.split_once("RESULT ").map(|(_, json)| json))
        .unwrap_or_else(|| panic!("no result from the child:\n{stdout}"));
    let r: serde_json::Value = serde_json::from_str(json).unwrap();
    let (peak, f32_bytes) = (
        r["peak_rss"].as_f64().unwrap(),
        r["f32_bytes"].as_f64().unwrap(),
    );
    eprintln!(
        "0.6B talker+predictor from {}: {:.2} s, peak RSS {:.2} GB = {:.3}x the f32 weights ({:.2} GB)",
        dir.display(),
        r["load_seconds"].as_f64().unwrap(),
        peak / 1e9,
        peak / f32_bytes,
        f32_bytes / 1e9
    );
    assert!(
        f32_bytes > 3.5e9,
        "not a 0.6B-sized model: {f32_bytes} bytes"
    );
    assert!(
        peak <= 1.3 * f32_bytes,
        "peak RSS {peak} exceeds 1.3x the f32 weights {f32_bytes}"
    );
}
