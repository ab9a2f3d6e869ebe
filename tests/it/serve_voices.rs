//! Voices of `voiceclone serve` (docs/serving.md): voices registered over `POST /v1/voices`
//! speak as `voiceclone speak` does with the same clip (and transcript), persist across a
//! restart and are deleted safely, and a CustomVoice model's speakers are its voices, speaking
//! split texts exactly as `speak` does, with cloning refused. The multipart upload helpers are
//! here, shared with `serve_errors`.

use serde_json::json;

use crate::serve::{
    assert_same_samples, model, pcm_samples, ref_wav, request, speak, speech, workspace, Resp,
    Server, TEXT,
};

/// `POST /v1/voices` with a multipart body of `fields` (name, filename, bytes).
pub(crate) fn multipart(fields: &[(&str, Option<&str>, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "voicecloneTestBoundary7f3a";
    let mut body = Vec::new();
    for (name, filename, data) in fields {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match filename {
            Some(f) => body.extend_from_slice(
                format!(
                    "Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\n\
                     Content-Type: application/octet-stream\r\n\r\n"
                )
                .as_bytes(),
            ),
            None => body.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            ),
        }
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

fn register(addr: &str, fields: &[(&str, Option<&str>, &[u8])]) -> Resp {
    let (ct, body) = multipart(fields);
    request(addr, "POST", "/v1/voices", &[("Content-Type", &ct)], &body)
}

#[test]
fn registered_voices_speak_like_speak_and_survive_a_restart() {
    let ws = workspace("\n[serve]\nmax_voices = 2\n");
    let clip = std::fs::read(ref_wav()).unwrap();
    let transcript = "This is the reference transcript.";
    let ids = {
        let server = Server::start(ws.path(), &[], &[]);
        let icl = register(
            &server.addr,
            &[
                ("file", Some("clip.wav"), &clip),
                ("transcript", None, transcript.as_bytes()),
                ("name", None, b"narrator"),
            ],
        );
        assert_eq!(icl.status, 201, "{}", String::from_utf8_lossy(&icl.body));
        let icl = icl.json();
        assert_eq!(icl["mode"], "in-context");
        assert_eq!(icl["name"], "narrator");
        let xv = register(&server.addr, &[("file", Some("clip.wav"), &clip)]);
        assert_eq!(xv.status, 201);
        // serve.max_voices is 2 here: a third voice is refused until one is deleted.
        let (status, code, msg) =
            register(&server.addr, &[("file", Some("clip.wav"), &clip)]).error();
        assert_eq!((status, code.as_str()), (400, "too_many_voices"), "{msg}");
        assert!(
            msg.contains("serve.max_voices") && msg.contains("DELETE"),
            "{msg}"
        );
        let xv = xv.json();
        assert_eq!(xv["mode"], "x-vector");
        let ids = [
            icl["id"].as_str().unwrap().to_string(),
            xv["id"].as_str().unwrap().to_string(),
        ];
        assert_ne!(ids[0], ids[1]);
        // In-context cloning gives what speak gives with the same clip and transcript.
        let r = speech(
            &server.addr,
            &json!({"model": "m", "input": TEXT, "voice": ids[0], "seed": 9,
                    "response_format": "pcm"}),
        );
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let want = speak(
            ws.path(),
            &[
                TEXT,
                "--seed",
                "9",
                "--ref-audio",
                ref_wav().to_str().unwrap(),
                "--ref-text",
                transcript,
            ],
        );
        assert_same_samples(
            &pcm_samples(&r.body),
            &want,
            "registered in-context voice vs speak",
        );
        ids
    };
    // A restart keeps them (from serve/voices/ under the workspace).
    let files: Vec<_> = std::fs::read_dir(ws.path().join("serve/voices"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    let server = Server::start(ws.path(), &[], &[]);
    let list = request(&server.addr, "GET", "/v1/voices", &[], b"").json();
    let listed: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap())
        .collect();
    assert!(listed.contains(&"default"), "{list}");
    for id in &ids {
        assert!(listed.contains(&id.as_str()), "{id} not in {list}");
    }
    let r = speech(
        &server.addr,
        &json!({"model": "m", "input": TEXT, "voice": ids[1], "seed": 3, "response_format": "pcm"}),
    );
    assert_eq!(r.status, 200);
    // Deleting: the voice and its file go; a second delete, an unknown id and an id that is a
    // path are 404 and touch nothing.
    let d = request(
        &server.addr,
        "DELETE",
        &format!("/v1/voices/{}", ids[1]),
        &[],
        b"",
    );
    assert_eq!(d.status, 200, "{}", String::from_utf8_lossy(&d.body));
    assert_eq!(d.json()["deleted"], true);
    assert!(!ws
        .path()
        .join(format!("serve/voices/{}.safetensors", ids[1]))
        .exists());
    std::fs::write(ws.path().join("keep.safetensors"), b"x").unwrap();
    for path in [
        format!("/v1/voices/{}", ids[1]),
        "/v1/voices/voice_00000000000000000000".to_string(),
        "/v1/voices/../../keep".to_string(),
        "/v1/voices/..%2F..%2Fkeep".to_string(),
    ] {
        let r = request(&server.addr, "DELETE", &path, &[], b"");
        assert_eq!(r.error().0, 404, "{path}");
        assert_eq!(r.error().1, "voice_not_found", "{path}");
    }
    assert!(ws.path().join("keep.safetensors").exists());
    let r = speech(
        &server.addr,
        &json!({"model": "m", "input": TEXT, "voice": ids[1]}),
    );
    assert_eq!(r.error().1, "voice_not_found");
    assert!(ws
        .path()
        .join(format!("serve/voices/{}.safetensors", ids[0]))
        .exists());
}

/// A CustomVoice model: its speakers are the voices (case-insensitive), a long text is split
/// into chunks joined with pauses exactly as `speak` splits it, and cloning is refused.
#[test]
fn custom_voice_speakers_and_split_texts_equal_speak() {
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(
        ws.path().join("voiceclone.toml"),
        format!(
            "[model]\nbase = {:?}\n\n[speak]\nmax_frames = 6\nmax_chunk_chars = 25\n",
            model("tiny-0b6-custom")
        ),
    )
    .unwrap();
    let server = Server::start(ws.path(), &[], &[]);
    // The start-up lines speak of what serve has: a request's "voice", not speak's flags,
    // and the stored dtype by its name.
    let startup = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        startup.contains("each request names one as its \"voice\"")
            && !startup.contains("--speaker")
            && !startup.contains("Some("),
        "{startup}"
    );
    let voices = request(&server.addr, "GET", "/v1/voices", &[], b"").json();
    let ids: Vec<&str> = voices["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alice", "bob", "carol"], "{voices}");
    let text = "First sentence here. Second sentence follows. Third one ends it.";
    let mut outputs = Vec::new();
    for (voice, seed) in [("BOB", "5"), ("carol", "6")] {
        let r = speech(
            &server.addr,
            &json!({"model": "m", "input": text, "voice": voice, "seed": seed.parse::<u64>().unwrap(),
                    "response_format": "pcm"}),
        );
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let got = pcm_samples(&r.body);
        let want = speak(ws.path(), &[text, "--speaker", voice, "--seed", seed]);
        assert_same_samples(&got, &want, &format!("{voice} vs speak"));
        // Three chunks (at most 6 frames each) and two 0.12 s pauses.
        assert!(got.len() > 2 * 2880, "{voice}: {} samples", got.len());
        outputs.push(got);
    }
    assert_ne!(outputs[0], outputs[1]);
    let clip = std::fs::read(ref_wav()).unwrap();
    let r = register(&server.addr, &[("file", Some("clip.wav"), &clip)]);
    let (s, code, msg) = r.error();
    assert_eq!(
        (s, code.as_str()),
        (400, "voice_cloning_unavailable"),
        "{msg}"
    );
    let r = speech(
        &server.addr,
        &json!({"model": "m", "input": "Hi.", "voice": "default"}),
    );
    let (s, code, msg) = r.error();
    assert_eq!((s, code.as_str()), (400, "voice_not_found"), "{msg}");
    assert!(msg.contains("alice, bob, carol"), "{msg}");
}

/// What goes wrong inside the server is told to the client without the server's file paths
/// (they stay in the server's log): here a Base model whose config lacks the speaker encoder,
/// so a voice cannot be registered.
#[test]
fn server_errors_do_not_tell_clients_server_paths() {
    let ws = tempfile::tempdir().unwrap();
    let model_dir = ws.path().join("base-without-encoder");
    std::fs::create_dir_all(&model_dir).unwrap();
    let fixture = crate::common::fixtures().join("tiny-0b6");
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config.json" {
            let target = std::fs::canonicalize(entry.path()).unwrap();
            std::os::unix::fs::symlink(target, model_dir.join(entry.file_name())).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
            .unwrap();
    config
        .as_object_mut()
        .unwrap()
        .remove("speaker_encoder_config");
    std::fs::write(model_dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        ws.path().join("voiceclone.toml"),
        format!("[model]\nbase = {:?}\n", model_dir.display().to_string()),
    )
    .unwrap();
    let server = Server::start(ws.path(), &[], &[]);
    let clip = std::fs::read(ref_wav()).unwrap();
    let r = register(&server.addr, &[("file", Some("clip.wav"), &clip)]);
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    let (_, code, msg) = r.error();
    assert_eq!(code, "internal_error", "{msg}");
    let body = String::from_utf8_lossy(&r.body).into_owned();
    let root = std::fs::canonicalize(ws.path()).unwrap();
    for path in [ws.path(), root.as_path()] {
        assert!(!body.contains(path.to_str().unwrap()), "{body}");
    }
    assert!(msg.contains("x-vector"), "{msg}");
    // The operator's log has the whole story.
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("no speaker encoder"), "{log}");
}
