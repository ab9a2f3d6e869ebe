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
