//! The error answers of `voiceclone serve` (docs/serving.md): every bad request — no or a
//! wrong API key, a bad or oversized body, an unknown route or method, a bad voice upload — is
//! answered with OpenAI-style JSON and a message that says what is wrong, and the server keeps
//! serving after all of them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::serve::{request, wav_samples, workspace, Server, SAMPLES_PER_FRAME};
use crate::serve_voices::multipart;

/// A POST whose head declares `Content-Length: length` and which then sends no body: the
/// answer's status and JSON body (the socket gives up after 30 s).
fn declared_without_body(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    length: &str,
) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut head = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {length}\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)
        .unwrap_or_else(|e| panic!("{path}: no answer: {e}"));
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{path}: bad status line {line:?}"));
    let mut len = 0;
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[test]
fn every_error_is_openai_style_json_with_a_clear_message() {
    let ws = workspace("\n[serve]\nmax_input_chars = 60\nmax_body_mb = 0.01\n");
    let server = Server::start(ws.path(), &["--api-key", "sekrit"], &[]);
    let auth = ("Authorization", "Bearer sekrit");
    let post = |body: &[u8], headers: &[(&str, &str)]| {
        request(&server.addr, "POST", "/v1/audio/speech", headers, body)
    };
    let ok_body = json!({"model": "m", "input": "Hi.", "voice": "default", "seed": 1,
                         "max_frames": 2})
    .to_string();

    // Authentication: every endpoint but /health.
    for headers in [
        vec![],
        vec![("Authorization", "Bearer wrong")],
        vec![("Authorization", "sekrit")],
    ] {
        let r = post(ok_body.as_bytes(), &headers);
        let (status, code, msg) = r.error();
        assert_eq!(
            (status, code.as_str()),
            (401, "invalid_api_key"),
            "{headers:?}"
        );
        assert!(msg.contains("Authorization: Bearer"), "{msg}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    for path in ["/v1/models", "/v1/voices"] {
        assert_eq!(request(&server.addr, "GET", path, &[], b"").status, 401);
        assert_eq!(request(&server.addr, "GET", path, &[auth], b"").status, 200);
    }
    assert_eq!(server.health()["status"], "ok");
    let models = request(&server.addr, "GET", "/v1/models", &[auth], b"").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["object"], "model");
    let r = post(ok_body.as_bytes(), &[auth]);
    assert_eq!(r.status, 200);
    assert_eq!(wav_samples(&r.body).len(), 2 * SAMPLES_PER_FRAME);
    // The scheme is case-insensitive, the key is not.
    for scheme in ["bearer", "BEARER"] {
        let header = format!("{scheme} sekrit");
        let r = post(ok_body.as_bytes(), &[("Authorization", &header)]);
        assert_eq!(r.status, 200, "{scheme}");
    }
    let r = post(ok_body.as_bytes(), &[("Authorization", "Bearer SEKRIT")]);
    assert_eq!(r.status, 401);

    let cases: Vec<(Value, u16, &str, &str)> = vec![
        (json!("not an object"), 400, "invalid_json", "JSON object"),
        (
            json!({"model": "m", "voice": "default"}),
            400,
            "empty_input",
            "\"input\"",
        ),
        (
            json!({"model": "m", "input": "  ", "voice": "default"}),
            400,
            "empty_input",
            "empty",
        ),
        (
            json!({"model": "m", "input": "x".repeat(61), "voice": "default"}),
            400,
            "string_above_max_length",
            "at most 60",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "nobody"}),
            400,
            "voice_not_found",
            "unknown voice \"nobody\"",
        ),
        (
            json!({"model": "m", "input": "Hi."}),
            400,
            "missing_required_parameter",
            "\"voice\"",
        ),
        (
            json!({"input": "Hi.", "voice": "default"}),
            400,
            "missing_required_parameter",
            "\"model\"",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "speed": 1.5}),
            400,
            "unsupported_speed",
            "only 1.0",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "response_format": "mp3"}),
            400,
            "unsupported_response_format",
            "\"mp3\"",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "response_format": "flac"}),
            400,
            "unsupported_response_format",
            "FLAC",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "stream_format": "ws"}),
            400,
            "invalid_value",
            "\"sse\"",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "instructions": "whisper"}),
            400,
            "unsupported_parameter",
            "instructions",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "bogus": 1}),
            400,
            "unknown_parameter",
            "\"bogus\"",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "seed": "x"}),
            400,
            "invalid_type",
            "non-negative integer",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "temperature": -1}),
            400,
            "invalid_value",
            "positive",
        ),
        (
            json!({"model": "m", "input": "Hi.", "voice": "default", "language": "klingon"}),
            400,
            "invalid_request",
            "klingon",
        ),
    ];
    for (body, status, code, says) in cases {
        let r = post(body.to_string().as_bytes(), &[auth]);
        let (s, c, msg) = r.error();
        assert_eq!((s, c.as_str()), (status, code), "{body}: {msg}");
        assert!(msg.contains(says), "{body}: {msg:?} should say {says:?}");
    }
    // Not JSON at all.
    let (s, c, msg) = post(b"{\"model\": ", &[auth]).error();
    assert_eq!((s, c.as_str()), (400, "invalid_json"), "{msg}");
    // Over the body limit (0.01 MiB).
    let big = json!({"model": "m", "input": "a".repeat(20_000), "voice": "default"}).to_string();
    let (s, c, _) = post(big.as_bytes(), &[auth]).error();
    assert_eq!((s, c.as_str()), (413, "request_too_large"));
    // A declared length beyond the limit is refused at once, without waiting for a body that
    // will never come (it once waited for the 120 s body timeout, then said 408).
    for (path, content_type) in [
        ("/v1/audio/speech", "application/json"),
        ("/v1/voices", "multipart/form-data; boundary=XyZ"),
    ] {
        let started = Instant::now();
        let (status, body) = declared_without_body(
            &server.addr,
            path,
            &[auth, ("Content-Type", content_type)],
            "99999999999",
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{path}: answered after {:?}",
            started.elapsed()
        );
        assert_eq!(status, 413, "{path}: {body}");
        assert_eq!(body["error"]["code"], "request_too_large", "{path}: {body}");
    }
    // Routes and methods.
    let r = request(&server.addr, "GET", "/v1/nothing", &[auth], b"");
    assert_eq!(r.error().0, 404);
    let r = request(&server.addr, "GET", "/v1/audio/speech", &[auth], b"");
    assert_eq!(r.error().0, 405);
    // Voice uploads: not multipart, no file, not audio.
    let r = request(
        &server.addr,
        "POST",
        "/v1/voices",
        &[auth, ("Content-Type", "application/json")],
        b"{}",
    );
    assert_eq!(r.error().1, "invalid_content_type");
    let (ct, body) = multipart(&[("transcript", None, b"words")]);
    let r = request(
        &server.addr,
        "POST",
        "/v1/voices",
        &[auth, ("Content-Type", &ct)],
        &body,
    );
    assert_eq!(r.error().1, "missing_required_parameter");
    let (ct, body) = multipart(&[("file", Some("x.wav"), b"RIFF but not really audio")]);
    let r = request(
        &server.addr,
        "POST",
        "/v1/voices",
        &[auth, ("Content-Type", &ct)],
        &body,
    );
    assert_eq!(r.error().1, "invalid_audio");
    // A transcript is prompt text like "input": bounded by serve.max_input_chars (60 here).
    let long = "w".repeat(61);
    let (ct, body) = multipart(&[
        ("file", Some("x.wav"), b"RIFF"),
        ("transcript", None, long.as_bytes()),
    ]);
    let r = request(
        &server.addr,
        "POST",
        "/v1/voices",
        &[auth, ("Content-Type", &ct)],
        &body,
    );
    let (s, c, msg) = r.error();
    assert_eq!((s, c.as_str()), (400, "string_above_max_length"), "{msg}");
    assert!(
        msg.contains("transcript") && msg.contains("at most 60"),
        "{msg}"
    );
    // The server is still well after all that.
    assert_eq!(post(ok_body.as_bytes(), &[auth]).status, 200);
}
