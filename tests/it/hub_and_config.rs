//! The configuration layering as the binary applies it (model resolution through a Hugging
//! Face cache is tested in `tests/hub_offline.rs`, which owns its process environment).

use crate::common;

use common::*;

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

    // Secrets are not printed: the key is shown as set, the output stays valid TOML.
    std::fs::write(
        ws.path().join("voiceclone.toml"),
        "[serve]\napi_key = \"sekrit-key-123\"\n",
    )
    .unwrap();
    let out = voiceclone(ws.path(), &["config"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(!text.contains("sekrit-key-123"), "{text}");
    let parsed: toml::Table = text.parse().expect("`voiceclone config` prints valid TOML");
    let shown = parsed["serve"]["api_key"].as_str().unwrap();
    assert!(!shown.is_empty() && shown != "sekrit-key-123", "{text}");
    assert!(
        text.contains("api_key = ") && text.contains("voiceclone.toml"),
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

/// `--version` names the commit this binary was built from, its features, what this CPU has and
/// what whisper.cpp was compiled for (docs/architecture.md §9.3); `-V` the version only.
#[test]
fn version_tells_the_commit_the_features_and_the_cpu_paths() {
    let ws = tempfile::tempdir().unwrap();
    let long = stdout(&voiceclone(ws.path(), &["--version"]));
    let lines: Vec<&str> = long.lines().collect();
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        lines[0],
        format!("voiceclone {version} (commit {commit})"),
        "{long}"
    );
    let features = if cfg!(feature = "cuda") {
        "features: cuda"
    } else {
        "features: none (CPU only)"
    };
    assert!(lines[1].starts_with(features), "{long}");
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        let yes = if avx2 { "yes" } else { "no" };
        assert!(
            lines[2].starts_with(&format!("cpu: avx2+fma+f16c {yes},")),
            "{long}"
        );
    }
    let ggml = match option_env!("GGML_NATIVE") {
        Some(v) if v.eq_ignore_ascii_case("off") => "SSE4.2 AVX AVX2 FMA F16C BMI2",
        _ => "native (-march=native of the build machine)",
    };
    assert_eq!(
        lines[lines.len() - 2],
        format!("whisper.cpp (ggml) compiled for: {ggml}"),
        "{long}"
    );
    // The test build has no AVX-512 copy of ggml's CPU backend (only scripts/release/release.sh's
    // build does; scripts/ci/check_static.sh checks it).
    assert_eq!(
        lines.last().unwrap(),
        &"whisper.cpp runs: the portable build (no AVX-512 copy in this binary)",
        "{long}"
    );
    let short = stdout(&voiceclone(ws.path(), &["-V"]));
    assert_eq!(short.trim_end(), format!("voiceclone {version}"));
}
