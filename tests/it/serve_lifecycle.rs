//! A request's life in `voiceclone serve` under load and at shutdown (docs/serving.md): a full
//! queue answers 429 with Retry-After, a client that hangs up (mid-stream, or before its whole
//! WAV) frees its row at once, and SIGTERM during a stream finishes it (or, with
//! `--shutdown-seconds 0`, ends it cleanly) before the server exits 0. Every test here slows the
//! frame loop through the `test-hooks` build.
#![cfg(feature = "test-hooks")]

use std::time::{Duration, Instant};

use serde_json::json;

use crate::serve::{env_refs, slow_frames, speak, workspace, Conn, Server, TEXT};

#[cfg(feature = "test-hooks")]
/// Polls `/health` until `running` and `queued` are 0 (or panics after `limit`).
fn wait_idle(server: &Server, limit: Duration) {
    let t = Instant::now();
    loop {
        let h = server.health();
        if h["running"] == 0 && h["queued"] == 0 && h["streams"] == 0 {
            return;
        }
        assert!(t.elapsed() < limit, "still busy after {limit:?}: {h}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(feature = "test-hooks")]
#[test]
fn a_full_queue_is_429_and_a_client_that_hangs_up_frees_its_row() {
    let ws = workspace("\n[serve]\nmax_batch = 1\nmax_queue = 1\n");
    // Seed 7 gives 6 frames (`speech_equals_speak_…`): 4.2 s for each request at this delay.
    let delay = Duration::from_millis(700);
    let env = slow_frames(delay.as_millis() as u64);
    let server = Server::start(ws.path(), &[], &env_refs(&env));
    let long = json!({"model": "m", "input": TEXT, "voice": "default", "seed": 7,
                      "response_format": "pcm"})
    .to_string();
    let open = || {
        Conn::open(
            &server.addr,
            "POST",
            "/v1/audio/speech",
            &[("Content-Type", "application/json")],
            long.as_bytes(),
        )
    };
    // A runs (its first audio arrives), B waits in the queue, C finds the queue full.
    let mut a = open();
    assert_eq!(a.status, 200);
    assert!(a.next_chunk().unwrap().is_some());
    let b = open();
    assert_eq!(b.status, 200);
    let t = Instant::now();
    while server.health()["queued"] != 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "B never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    let c = Conn::open(
        &server.addr,
        "POST",
        "/v1/audio/speech",
        &[("Content-Type", "application/json")],
        long.as_bytes(),
    )
    .finish();
    let (s, code, msg) = c.error();
    assert_eq!((s, code.as_str()), (429, "queue_full"), "{msg}");
    assert_eq!(
        c.header("retry-after"),
        Some("2"),
        "a 429 says when to retry"
    );
    // Both clients hang up mid-stream: their rows leave the batch at the next frames (the
    // two requests would run for 12 frame steps).
    drop(a);
    drop(b);
    wait_idle(&server, delay * 7);
    assert_eq!(server.health()["status"], "ok");
}

/// A whole WAV is sent after generation; a client that hangs up before then still frees its
/// row at once (the response's future is dropped with the connection).
#[cfg(feature = "test-hooks")]
#[test]
fn a_client_that_hangs_up_before_its_whole_wav_frees_its_row() {
    use std::io::Write;
    let ws = workspace("");
    let delay = Duration::from_millis(700);
    let env = slow_frames(delay.as_millis() as u64);
    let server = Server::start(ws.path(), &[], &env_refs(&env));
    let body = json!({"model": "m", "input": TEXT, "voice": "default", "seed": 7}).to_string();
    let mut s = std::net::TcpStream::connect(&server.addr).unwrap();
    write!(
        s,
        "POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let t = Instant::now();
    while server.health()["running"] != 1 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the request never ran"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(s);
    // Seed 7 gives 6 frames: 4.2 s if the row ran to its end.
    wait_idle(&server, delay * 3);
}

#[cfg(feature = "test-hooks")]
#[test]
fn sigterm_during_a_stream_finishes_it_and_exits_0() {
    let ws = workspace("");
    let env = slow_frames(100);
    let body = json!({"model": "m", "input": TEXT, "voice": "default", "seed": 7,
                      "response_format": "pcm"})
    .to_string();
    let full = 2 * speak(ws.path(), &[TEXT, "--seed", "7"]).len();
    let open = |server: &Server| {
        let mut c = Conn::open(
            &server.addr,
            "POST",
            "/v1/audio/speech",
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        );
        assert_eq!(c.status, 200);
        let first = c.next_chunk().unwrap().unwrap();
        (c, first)
    };
    // With time to finish: the stream is completed, then the server exits 0.
    let mut server = Server::start(ws.path(), &[], &env_refs(&env));
    let (c, first) = open(&server);
    server.sigterm();
    let rest = c.finish();
    assert!(rest.complete, "the stream was cut");
    assert_eq!(first.len() + rest.body.len(), full, "the whole utterance");
    assert!(
        server.wait(Duration::from_secs(30)).success(),
        "{}",
        server.log()
    );
    // Without (--shutdown-seconds 0): the stream ends cleanly, shorter, and the server exits 0.
    let mut server = Server::start(ws.path(), &["--shutdown-seconds", "0"], &env_refs(&env));
    let (c, first) = open(&server);
    server.sigterm();
    let rest = c.finish();
    assert!(
        rest.complete,
        "the stream was not ended cleanly: {}",
        server.log()
    );
    let n = first.len() + rest.body.len();
    assert!(n < full, "{n} bytes of {full}: not ended early");
    assert!(
        server.wait(Duration::from_secs(30)).success(),
        "{}",
        server.log()
    );
}
