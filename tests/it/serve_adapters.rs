//! `voiceclone serve` with adapter voices on one shared base model (docs/serving.md §7): two
//! adapters, trained apart, served together beside one base, each answer exactly as `speak
//! --adapter` speaks with that adapter merged at load, also while they share the running batch;
//! names are checked at start-up, and adapters that replace whole modules are refused.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::dist_support::{ok, train};
use crate::serve::{
    assert_same_samples, env_refs, pcm_samples, request, slow_frames, speech, Server,
};
use crate::train_support::{f32_model_copy, hidden, make_workspace, text, voiceclone, xvector};

const FRAMES: usize = 24;

/// A training workspace on `model` whose `[speak]` settings the server and `speak` share.
fn workspace(model: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    make_workspace(
        dir.path(),
        model,
        &crate::train_support::synthetic_rows(7, 21),
        &xvector(hidden(model), 3),
        &format!("\n[speak]\nmax_frames = {FRAMES}\ngreedy = true\n"),
    );
    dir
}

/// Trains adapters of rank 4 in `ws` (`extra` added) and exports them alone into `ws/adapter`
/// with the speaker named `speaker`.
fn adapter(ws: &Path, extra: &[&str], speaker: &str) -> std::path::PathBuf {
    let mut args = vec!["--lora-rank", "4", "--max-steps", "3"];
    args.extend(extra);
    ok(&train(ws, &args));
    let out = ws.join("adapter");
    ok(&voiceclone(
        ws,
        &[
            "export",
            "--adapter-only",
            "--speaker-name",
            speaker,
            "-o",
            out.to_str().unwrap(),
        ],
    ));
    out
}

/// `speak --adapter DIR` of `text` in f32: its 16-bit samples.
fn speak_with(ws: &Path, adapter: &Path, speaker: &str, text: &str) -> Vec<i16> {
    let wav = ws.join(format!("speak-{speaker}.wav"));
    let o = voiceclone(
        ws,
        &[
            "speak",
            text,
            "--adapter",
            adapter.to_str().unwrap(),
            "--speaker",
            speaker,
            "--precision",
            "f32",
            "-o",
            wav.to_str().unwrap(),
            "--overwrite",
        ],
    );
    ok(&o);
    let mut r = hound::WavReader::open(&wav).unwrap();
    r.samples::<i16>().map(|s| s.unwrap()).collect()
}

/// Sends `bodies` staggered by 40 ms, so that later rows join a running batch, and returns
/// each response's samples; asserts the rows did share the batch.
fn together(server: &Server, bodies: Vec<Value>) -> Vec<Vec<i16>> {
    let handles: Vec<_> = bodies
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            let addr = server.addr.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(40 * i as u64));
                speech(&addr, &b)
            })
        })
        .collect();
    let mut most = 0;
    while !handles.iter().all(|h| h.is_finished()) {
        let h = request(&server.addr, "GET", "/health", &[], b"").json();
        most = most.max(h["running"].as_u64().unwrap());
        std::thread::sleep(Duration::from_millis(5));
    }
    // Only the `test-hooks` build slows the frames enough for the rows to meet.
    if cfg!(feature = "test-hooks") {
        assert!(most >= 2, "the requests never shared the batch");
    }
    handles
        .into_iter()
        .map(|h| {
            let r = h.join().unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            pcm_samples(&r.body)
        })
        .collect()
}

/// The resident set of a process, in MB.
fn rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb / 1024.0
}

/// Two adapters trained apart on one f32-stored base (a different seed each), served together:
/// each voice answers what `speak --adapter` gives with that adapter alone (greedy, f32: the
/// same codes, so the same samples), alone and while the two share the batch; the two voices
/// differ, so the rows do compute with their own adapters.
#[test]
fn two_adapter_voices_on_one_base_each_speak_as_speak_adapter() {
    let base = f32_model_copy("tiny-0b6");
    let base = base.path().to_str().unwrap().to_string();
    let ws_a = workspace(&base);
    let ws_b = workspace(&base);
    let a = adapter(ws_a.path(), &[], "alice");
    let b = adapter(ws_b.path(), &["--seed", "7"], "speaker");
    let texts = [
        ("alice", "The first adapter voice speaks here."),
        ("bob", "And the second one answers it."),
    ];
    let want_a = speak_with(ws_a.path(), &a, "alice", texts[0].1);
    let want_b = speak_with(ws_b.path(), &b, "speaker", texts[1].1);
    let cross = speak_with(ws_b.path(), &b, "speaker", texts[0].1);
    assert_ne!(
        want_a, cross,
        "the two adapters speak alike: the test shows nothing"
    );

    // Voice "alice" under its own name, the other adapter's one speaker named "bob".
    let bob = format!("bob={}", b.display());
    let env = slow_frames(30);
    let server = Server::start(
        ws_a.path(),
        &[
            "--precision",
            "f32",
            "--max-batch",
            "4",
            "--adapter",
            a.to_str().unwrap(),
            "--adapter",
            &bob,
        ],
        &env_refs(&env),
    );
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.contains("voice alice") && log.contains("voice bob"),
        "{log}"
    );
    let voices = request(&server.addr, "GET", "/v1/voices", &[], b"").json();
    let listed: Vec<(&str, &str)> = voices["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["id"].as_str().unwrap(), v["mode"].as_str().unwrap()))
        .collect();
    assert_eq!(
        listed,
        [
            ("default", "workspace"),
            ("alice", "adapter"),
            ("bob", "adapter")
        ],
        "{voices}"
    );
    // Voices are listed by name and kind: no client learns where the server keeps a file.
    for dir in [&a, &b, &ws_a.path().to_path_buf()] {
        let dir = dir.to_str().unwrap();
        assert!(!voices.to_string().contains(dir), "{dir} in {voices}");
    }
    let body = |i: usize| -> Value {
        json!({"model": "m", "input": texts[i].1, "voice": texts[i].0, "response_format": "pcm"})
    };
    let alone: Vec<Vec<i16>> = (0..2)
        .map(|i| {
            let r = speech(&server.addr, &body(i));
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            pcm_samples(&r.body)
        })
        .collect();
    assert_same_samples(&alone[0], &want_a, "alice vs speak --adapter");
    assert_same_samples(&alone[1], &want_b, "bob vs speak --adapter");
    let default_body =
        json!({"model": "m", "input": texts[0].1, "voice": "default", "response_format": "pcm"});
    let default_alone = pcm_samples(&speech(&server.addr, &default_body).body);
    // Together, with the base model's own voice between them in the batch.
    let mut bodies: Vec<Value> = (0..2).map(body).collect();
    bodies.insert(1, default_body);
    let together = together(&server, bodies);
    assert_same_samples(&together[0], &want_a, "alice in the batch");
    assert_same_samples(&together[2], &want_b, "bob in the batch");
    // The base model's own row between them computes with no adapter.
    assert_same_samples(&together[1], &default_alone, "the base voice in the batch");
    eprintln!(
        "serve with two adapter voices: {:.0} MB resident (tiny fixture)",
        rss_mb(server.pid())
    );
}

/// On a bf16-stored base, in bf16-weights, q8 and q4, an adapter row's samples do not depend on
/// what else is in the batch (each row's correction is its own), and the two adapters differ.
/// (`speak --adapter` merges into the stored bf16, so there the served voice differs from it by
/// that rounding, docs/serving.md §7.)
#[test]
fn adapter_voices_on_a_bf16_base_do_not_depend_on_the_batch() {
    let ws_a = workspace("tiny-0b6");
    let ws_b = workspace("tiny-0b6");
    let a = adapter(ws_a.path(), &[], "alice");
    let b = adapter(ws_b.path(), &["--seed", "7"], "bob");
    let text = "Both adapters say the same words.";
    for precision in ["bf16-weights", "q8", "q4"] {
        let env = slow_frames(30);
        let server = Server::start(
            ws_a.path(),
            &[
                "--precision",
                precision,
                "--adapter",
                a.to_str().unwrap(),
                "--adapter",
                b.to_str().unwrap(),
            ],
            &env_refs(&env),
        );
        let body = |voice: &str| -> Value {
            json!({"model": "m", "input": text, "voice": voice, "response_format": "pcm"})
        };
        let alone: Vec<Vec<i16>> = ["alice", "bob"]
            .iter()
            .map(|v| pcm_samples(&speech(&server.addr, &body(v)).body))
            .collect();
        assert_ne!(alone[0], alone[1], "{precision}: the adapters speak alike");
        let base = pcm_samples(&speech(&server.addr, &body("default")).body);
        let both = together(&server, vec![body("bob"), body("default"), body("alice")]);
        assert_same_samples(
            &both[1],
            &base,
            &format!("{precision}: the base voice in the batch"),
        );
        assert_same_samples(
            &both[2],
            &alone[0],
            &format!("{precision}: alice in the batch"),
        );
        assert_same_samples(
            &both[0],
            &alone[1],
            &format!("{precision}: bob in the batch"),
        );
    }
}

/// Start-up refuses two voices of one name (naming the way out) and adapters that replace
/// whole modules (train.lora_full), which one shared base cannot hold per voice.
#[test]
fn serve_refuses_clashing_names_and_modules_saved_whole() {
    let ws = workspace("tiny-0b6");
    let a = adapter(ws.path(), &[], "speaker");
    let a = a.to_str().unwrap();
    let o = voiceclone(
        ws.path(),
        &["serve", "--port", "0", "--adapter", a, "--adapter", a],
    );
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("two voices are named \"speaker\"") && t.contains("NAME=DIR"),
        "{t}"
    );
    let named = format!("default={a}");
    let o = voiceclone(ws.path(), &["serve", "--port", "0", "--adapter", &named]);
    assert!(!o.status.success());
    assert!(text(&o).contains("the workspace's voice"), "{}", text(&o));

    let full = workspace("tiny-0b6");
    let mut args = vec!["--lora-full", "talker.codec_head.weight"];
    args.extend(["--lora-rank", "4", "--max-steps", "1"]);
    ok(&train(full.path(), &args));
    ok(&voiceclone(full.path(), &["export", "--adapter-only"]));
    let o = voiceclone(
        full.path(),
        &["serve", "--port", "0", "--adapter", "adapter"],
    );
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("talker.codec_head.weight") && t.contains("train.lora_full"),
        "{t}"
    );
}

/// `--adapter NAME=DIR` whose NAME is no voice name is refused before anything loads, saying
/// what is wrong with the name and where it was set, instead of reading a directory named
/// `=dir` or `<script>=dir`.
#[test]
fn adapter_voice_names_are_checked_up_front() {
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("dir")).unwrap();
    let long = format!("{}=dir", "a".repeat(65));
    for (entry, says) in [
        ("=dir", "is empty"),
        ("<script>=dir", "letters, digits"),
        (long.as_str(), "longer than 64"),
    ] {
        let o =
            crate::train_support::command(ws.path(), &["serve", "--port", "0", "--adapter", entry])
                .current_dir(ws.path())
                .output()
                .unwrap();
        assert!(!o.status.success(), "{entry}");
        let t = text(&o);
        assert!(
            t.contains("voice name")
                && t.contains(says)
                && t.contains(&format!("{entry:?}"))
                && t.contains("--adapter")
                && !t.contains("adapter_config.json"),
            "{t}"
        );
    }
    // From the config file: the file is named.
    std::fs::write(
        ws.path().join("voiceclone.toml"),
        "[serve]\nadapters = [\"two words=dir\"]\n",
    )
    .unwrap();
    let o = voiceclone(ws.path(), &["serve", "--port", "0"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("voiceclone.toml") && t.contains("\"two words\""),
        "{t}"
    );
}
