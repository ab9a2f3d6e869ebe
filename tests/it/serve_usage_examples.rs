//! The `voiceclone serve` examples of docs/usage.md §8 run as written against a running server
//! (docs/serving.md): its curl commands and its `openai` Python code, real clients nobody here
//! wrote, get the WAV (and PCM) that `voiceclone speak` writes; each client is skipped with a
//! message when absent, unless `VOICECLONE_REQUIRE_ASSETS=1`.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::common::{self, stderr};
use crate::serve::{
    assert_same_samples, pcm_samples, ref_wav, speak, wav_samples, workspace, Server,
};

/// The code blocks of the `voiceclone serve` section of docs/usage.md: (language, text).
fn serve_blocks() -> Vec<(String, String)> {
    let usage =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/usage.md"))
            .unwrap();
    // Its heading: `## 8. ` and the command line in backquotes.
    let start = usage
        .match_indices("\n## ")
        .map(|(i, _)| i + 1)
        .find(|&i| {
            let line = usage[i..].lines().next().unwrap_or("");
            line.contains(". `voiceclone serve")
        })
        .expect("docs/usage.md has a voiceclone serve section");
    let section = &usage[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let mut blocks = Vec::new();
    let mut rest = section;
    while let Some(i) = rest.find("```") {
        let after = &rest[i + 3..];
        let (lang, body) = after.split_once('\n').unwrap();
        let end = body.find("```").expect("closed code block");
        blocks.push((lang.trim().to_string(), body[..end].to_string()));
        rest = &body[end + 3..];
    }
    blocks
}

/// The Python of the test assets' venv, if it has the `openai` package
/// (`scripts/assets/fetch_test_assets.sh` installs it).
fn openai_python() -> Option<PathBuf> {
    let py = common::assets().join("venv/bin/python");
    let ok = py.is_file()
        && Command::new(&py)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success());
    let required = std::env::var_os("VOICECLONE_REQUIRE_ASSETS").is_some_and(|v| v == "1");
    if !ok {
        let msg = format!(
            "no Python with the openai package at {}: run scripts/assets/fetch_test_assets.sh",
            py.display()
        );
        assert!(!required, "{msg}");
        eprintln!("skipped: {msg}");
        return None;
    }
    Some(py)
}

fn have_curl() -> bool {
    let ok = Command::new("curl")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("VOICECLONE_REQUIRE_ASSETS").is_none_or(|v| v != "1"),
            "curl is missing: scripts/ci/install_deps.sh installs it"
        );
        eprintln!("skipped: curl is missing");
    }
    ok
}

/// The section's shell block with `curl` that holds `what`.
fn curl_block(blocks: &[(String, String)], what: &str) -> String {
    blocks
        .iter()
        .find(|(l, b)| l == "sh" && b.contains("curl ") && b.contains(what))
        .unwrap_or_else(|| panic!("a curl block with {what}"))
        .1
        .clone()
}

/// Runs one of its shell blocks as written (in `ws`, against `server`).
fn run_block(block: &str, server: &Server, ws: &Path) -> std::process::Output {
    let here = block.replace("http://127.0.0.1:8000", &server.url());
    Command::new("bash")
        .args(["-euo", "pipefail", "-c", &here])
        .current_dir(ws)
        .output()
        .unwrap()
}

/// Acceptance 1: real clients nobody here wrote — curl and the official `openai` Python
/// package — running the examples; the WAV they get is `speak`'s.
#[test]
fn the_examples_run_against_the_server() {
    let blocks = serve_blocks();
    let curl = format!(
        "{}\n{}",
        curl_block(&blocks, "/v1/audio/speech"),
        curl_block(&blocks, "/v1/voices")
    );
    let python = blocks
        .iter()
        .find(|(l, _)| l == "python")
        .expect("a python block")
        .1
        .clone();
    let ws = workspace("");
    let text = "Hello from my own voice.";
    let want = speak(ws.path(), &[text, "--seed", "7"]);
    std::fs::copy(ref_wav(), ws.path().join("my-clip.wav")).unwrap();
    let server = Server::start(ws.path(), &[], &[]);
    let here = |s: &str| s.replace("http://127.0.0.1:8000", &server.url());
    let file = |name: &str| std::fs::read(ws.path().join(name)).unwrap();

    if have_curl() {
        let o = run_block(&curl, &server, ws.path());
        assert!(
            o.status.success(),
            "the documented curl commands failed: {}",
            stderr(&o)
        );
        let got = wav_samples(&file("hello.wav"));
        assert_same_samples(&got, &want, "curl's WAV vs speak's");
        assert_eq!(pcm_samples(&file("hello.pcm")), got);
        let voice: Value = serde_json::from_slice(&file("voice.json")).unwrap();
        assert_eq!(voice["mode"], "in-context", "{voice}");
        let voices: Value = serde_json::from_slice(&file("voices.json")).unwrap();
        assert!(voices["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["id"] == voice["id"]));
    }
    if let Some(py) = openai_python() {
        let o = Command::new(&py)
            .args(["-c", &here(&python)])
            .current_dir(ws.path())
            .env_remove("OPENAI_API_KEY")
            .env_remove("OPENAI_BASE_URL")
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "the documented Python failed: {}",
            stderr(&o)
        );
        let got = wav_samples(&file("hello-openai.wav"));
        assert_same_samples(&got, &want, "the openai client's WAV vs speak's");
        assert_eq!(pcm_samples(&file("hello-openai.pcm")), got);
        // Python's wave module reads the file the client wrote with its true length (it
        // once read 2,147,483,647 frames from the placeholder sizes).
        let o = Command::new(py)
            .args([
                "-c",
                "import wave,sys; w=wave.open(sys.argv[1]); print(w.getnframes())",
            ])
            .arg(ws.path().join("hello-openai.wav"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim(),
            got.len().to_string(),
            "frames by Python's wave"
        );
    }
}

/// A fine-tuned workspace (`model/` in the CustomVoice layout with its one speaker, as `train`
/// exports it): the documented speech commands run as written and give `speak`'s WAV; its voice
/// registration, which needs a Base model, fails visibly (curl exits non-zero, the error's JSON
/// in the output file) instead of writing the error into `voice.json` and exiting 0.
#[test]
fn the_curl_examples_on_a_fine_tuned_workspace() {
    if !have_curl() {
        return;
    }
    let blocks = serve_blocks();
    let ws = tempfile::tempdir().unwrap();
    let model_dir = ws.path().join("model");
    std::fs::create_dir_all(&model_dir).unwrap();
    let fixture = common::fixtures().join("tiny-0b6-custom");
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config.json" {
            let target = std::fs::canonicalize(entry.path()).unwrap();
            std::os::unix::fs::symlink(target, model_dir.join(entry.file_name())).unwrap();
        }
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
            .unwrap();
    config["talker_config"]["spk_id"] = serde_json::json!({"alice": 3000});
    config["talker_config"]["spk_is_dialect"] = serde_json::json!({"alice": false});
    std::fs::write(model_dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        ws.path().join("voiceclone.toml"),
        "[speak]\nmax_frames = 24\n",
    )
    .unwrap();
    std::fs::copy(ref_wav(), ws.path().join("my-clip.wav")).unwrap();
    let want = speak(ws.path(), &["Hello from my own voice.", "--seed", "7"]);
    let server = Server::start(ws.path(), &[], &[]);

    let o = run_block(&curl_block(&blocks, "/v1/audio/speech"), &server, ws.path());
    assert!(
        o.status.success(),
        "the documented speech commands failed on a fine-tuned workspace: {}",
        stderr(&o)
    );
    let got = wav_samples(&std::fs::read(ws.path().join("hello.wav")).unwrap());
    assert_same_samples(&got, &want, "curl's WAV vs speak's on the fine-tuned model");

    let o = run_block(&curl_block(&blocks, "/v1/voices"), &server, ws.path());
    assert!(
        !o.status.success(),
        "registering a voice on a CustomVoice model failed silently: {}",
        stderr(&o)
    );
    let answer: Value =
        serde_json::from_slice(&std::fs::read(ws.path().join("voice.json")).unwrap()).unwrap();
    assert_eq!(
        answer["error"]["code"], "voice_cloning_unavailable",
        "{answer}"
    );
}
