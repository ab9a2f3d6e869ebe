//! `voiceclone serve` end to end on the tiny fixture model (docs/serving.md): the speech
//! endpoint returns what `voiceclone speak` writes for the same seed and voice, in every format,
//! streamed while it is generated in the chunks of docs/serving.md §4.1, and concurrent requests
//! give what each gives alone. This module also holds what every `serve_*` test uses: the server
//! process, the HTTP client and the readers of its responses; registered voices are tested in
//! `serve_voices`, the error answers in `serve_errors`, a full queue, hang-ups and SIGTERM in
//! `serve_lifecycle`, and the examples of docs/usage.md §8 in `serve_usage_examples`.
//!
//! The client here is a few lines of HTTP/1.1 over a `TcpStream`, so the tests see every
//! chunk as it arrives (with its time) and can hang up mid-stream.

use crate::common::{fixtures, stderr};

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Frames every speech request of these tests generates (the fixture model rarely stops on
/// its own): `[speak] max_frames` in the workspace, so `speak` and `serve` agree.
const FRAMES: usize = 24;
pub(crate) const SAMPLES_PER_FRAME: usize = 1920;

pub(crate) fn model(name: &str) -> String {
    fixtures().join(name).display().to_string()
}

pub(crate) fn ref_wav() -> PathBuf {
    fixtures().join("audio/ref24k.wav")
}

/// A workspace whose voice is `data/ref.wav` (x-vector cloning) on the tiny Base model, with
/// `extra` appended to its `voiceclone.toml`.
pub(crate) fn workspace(extra: &str) -> tempfile::TempDir {
    crate::speak_cli::reference_workspace(&format!("\n[speak]\nmax_frames = {FRAMES}\n{extra}\n"))
}

/// `voiceclone speak` in `ws`: the 16-bit samples it writes.
pub(crate) fn speak(ws: &Path, args: &[&str]) -> Vec<i16> {
    let o = Command::new(env!("CARGO_BIN_EXE_voiceclone"))
        .current_dir(ws)
        .arg("speak")
        .args(args)
        .args(["-o", "speak-ref.wav", "--overwrite"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(o.status.success(), "speak failed: {}", stderr(&o));
    let mut r = hound::WavReader::open(ws.join("speak-ref.wav")).unwrap();
    r.samples::<i16>().map(|s| s.unwrap()).collect()
}

/// A running `voiceclone serve` (killed when dropped).
pub(crate) struct Server {
    child: Child,
    pub(crate) addr: String,
    pub(crate) log: PathBuf,
}

impl Server {
    pub(crate) fn start(ws: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let log = ws.join(format!("serve-{}.log", rand_suffix()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_voiceclone"));
        cmd.current_dir(ws)
            .args(["serve", "--port", "0"])
            .args(args)
            .env_remove("RUST_LOG")
            .env_remove("VOICECLONE_API_KEY")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("cannot run the voiceclone binary");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "serve did not print its address: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        };
        Server { child, addr, log }
    }

    /// The server's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub(crate) fn health(&self) -> Value {
        let r = request(&self.addr, "GET", "/health", &[], b"");
        assert_eq!(r.status, 200);
        r.json()
    }
}

/// What the `test-hooks` tests (the slowed frame loop) use.
#[cfg(feature = "test-hooks")]
impl Server {
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub(crate) fn sigterm(&self) {
        // SAFETY: kill(2) on the id of a child this test started and has not reaped.
        let r = unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        assert_eq!(r, 0, "kill failed");
    }

    /// Waits (at most `limit`) for the process to exit; its status.
    pub(crate) fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                t.elapsed() < limit,
                "serve did not exit within {limit:?}: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A response as it came: the body chunk by chunk with the time each arrived.
#[derive(Debug)]
pub(crate) struct Resp {
    pub(crate) status: u16,
    headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
    /// (time since the request was sent, bytes) of every chunk of a chunked body.
    chunks: Vec<(Duration, usize)>,
    /// The body ended as HTTP says it ends (the last chunk, or all of Content-Length).
    pub(crate) complete: bool,
}

impl Resp {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The OpenAI-style error: (status, error.code, error.message).
    pub(crate) fn error(&self) -> (u16, String, String) {
        let v = self.json();
        let e = &v["error"];
        assert!(e["type"].is_string(), "no error.type in {v}");
        (
            self.status,
            e["code"].as_str().unwrap_or("").to_string(),
            e["message"].as_str().unwrap_or("").to_string(),
        )
    }
}

/// An open connection with a request sent and the response head read.
pub(crate) struct Conn {
    r: BufReader<TcpStream>,
    sent: Instant,
    pub(crate) status: u16,
    headers: Vec<(String, String)>,
}

impl Conn {
    pub(crate) fn open(
        addr: &str,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Conn {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let sent = Instant::now();
        s.write_all(head.as_bytes()).unwrap();
        // A server may answer (413) before reading the whole body: ignore a broken pipe.
        let _ = s.write_all(body);
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .unwrap_or_else(|| panic!("bad status line {line:?}"))
            .parse()
            .unwrap();
        let mut headers = Vec::new();
        loop {
            let mut l = String::new();
            r.read_line(&mut l).unwrap();
            let l = l.trim_end();
            if l.is_empty() {
                break;
            }
            let (k, v) = l.split_once(':').unwrap();
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
        Conn {
            r,
            sent,
            status,
            headers,
        }
    }

    fn chunked(&self) -> bool {
        self.headers.iter().any(|(k, v)| {
            k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
        })
    }

    /// The next chunk of a chunked body: `Some(bytes)`, `None` at the last chunk, `Err` when
    /// the connection ends before it.
    pub(crate) fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, String> {
        let mut line = String::new();
        match self.r.read_line(&mut line) {
            Ok(0) => return Err("connection closed before the last chunk".into()),
            Ok(_) => {}
            Err(e) => return Err(e.to_string()),
        }
        let size = usize::from_str_radix(line.trim().split(';').next().unwrap(), 16)
            .map_err(|_| format!("bad chunk size line {line:?}"))?;
        let mut data = vec![0u8; size];
        self.r.read_exact(&mut data).map_err(|e| e.to_string())?;
        let mut crlf = [0u8; 2];
        self.r.read_exact(&mut crlf).map_err(|e| e.to_string())?;
        Ok((size > 0).then_some(data))
    }

    pub(crate) fn finish(mut self) -> Resp {
        let mut body = Vec::new();
        let mut chunks = Vec::new();
        let complete;
        if self.chunked() {
            loop {
                match self.next_chunk() {
                    Ok(Some(d)) => {
                        chunks.push((self.sent.elapsed(), d.len()));
                        body.extend_from_slice(&d);
                    }
                    Ok(None) => {
                        complete = true;
                        break;
                    }
                    Err(_) => {
                        complete = false;
                        break;
                    }
                }
            }
        } else {
            let len = self
                .headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                .map(|(_, v)| v.parse::<usize>().unwrap());
            match len {
                Some(n) => {
                    body.resize(n, 0);
                    complete = self.r.read_exact(&mut body).is_ok();
                }
                None => {
                    complete = self.r.read_to_end(&mut body).is_ok();
                }
            }
        }
        Resp {
            status: self.status,
            headers: self.headers,
            body,
            chunks,
            complete,
        }
    }
}

pub(crate) fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    Conn::open(addr, method, path, headers, body).finish()
}

pub(crate) fn speech(addr: &str, body: &Value) -> Resp {
    let b = body.to_string();
    request(
        addr,
        "POST",
        "/v1/audio/speech",
        &[("Content-Type", "application/json")],
        b.as_bytes(),
    )
}

pub(crate) fn pcm_samples(bytes: &[u8]) -> Vec<i16> {
    assert!(bytes.len().is_multiple_of(2));
    bytes
        .chunks_exact(2)
        .map(|b| i16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// The samples of a WAV response (a 44-byte header, then PCM).
pub(crate) fn wav_samples(bytes: &[u8]) -> Vec<i16> {
    assert!(bytes.len() >= 44, "no WAV header");
    assert_eq!(&bytes[0..4], b"RIFF");
    assert_eq!(&bytes[36..40], b"data");
    assert_eq!(
        u32::from_le_bytes(bytes[24..28].try_into().unwrap()),
        24_000
    );
    pcm_samples(&bytes[44..])
}

/// Base64 audio of OpenAI's `speech.audio.delta` events, and the `speech.audio.done` event.
fn sse_audio(body: &[u8]) -> (Vec<u8>, Value) {
    use base64::Engine;
    let text = std::str::from_utf8(body).unwrap();
    let mut audio = Vec::new();
    let mut done = Value::Null;
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event.strip_prefix("data: ").expect("an SSE data line");
        let v: Value = serde_json::from_str(data).unwrap();
        match v["type"].as_str().unwrap() {
            "speech.audio.delta" => audio.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(v["audio"].as_str().unwrap())
                    .unwrap(),
            ),
            "speech.audio.done" => done = v,
            other => panic!("unexpected event {other}: {v}"),
        }
    }
    (audio, done)
}

/// Asserts two 16-bit sample sequences are identical, naming the first difference. The stream
/// decoder gives the offline decoder's samples bit for bit (`serve_stream.rs`), so a served
/// response is `speak`'s WAV exactly.
pub(crate) fn assert_same_samples(got: &[i16], want: &[i16], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: sample counts differ");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let differing = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!(
            "{what}: {differing} of {} samples differ, the first at {i} ({} vs {})",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// The frame delay the `test-hooks` build can add to every generation step (so the tests
/// can watch audio arrive while the request is still being generated).
pub(crate) fn slow_frames(ms: u64) -> Vec<(&'static str, String)> {
    vec![("VOICECLONE_TEST_FRAME_DELAY_MS", ms.to_string())]
}

pub(crate) fn env_refs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

pub(crate) const TEXT: &str = "Hello from the voiceclone server.";

#[test]
fn speech_equals_speak_in_every_format_and_streams_while_generating() {
    let ws = workspace("");
    let want = speak(ws.path(), &[TEXT, "--seed", "7"]);
    assert!(!want.is_empty() && want.len().is_multiple_of(SAMPLES_PER_FRAME));
    let frames = want.len() / SAMPLES_PER_FRAME;
    let delay_ms = 100;
    let env = slow_frames(delay_ms);
    let server = Server::start(ws.path(), &[], &env_refs(&env));
    assert!(
        server.addr.starts_with("127.0.0.1:"),
        "serve listens on 127.0.0.1 by default, not {}",
        server.addr
    );
    let body = |format: &str, stream: &str| {
        json!({"model": "voiceclone", "input": TEXT, "voice": "default", "seed": 7,
               "response_format": format, "stream_format": stream})
    };

    let wav = speech(&server.addr, &body("wav", "audio"));
    assert_eq!(wav.status, 200, "{}", String::from_utf8_lossy(&wav.body));
    assert!(wav.complete);
    assert_eq!(wav.header("content-type"), Some("audio/wav"));
    assert_eq!(wav.header("x-voiceclone-seed"), Some("7"));
    let got = wav_samples(&wav.body);
    assert_same_samples(&got, &want, "serve's WAV vs speak's");
    // The whole WAV is sent with its real sizes (its length is known before the first byte
    // goes out): the RIFF and data chunk sizes and Content-Length agree with the body.
    let size = |at: usize| u32::from_le_bytes(wav.body[at..at + 4].try_into().unwrap()) as usize;
    assert_eq!(size(4), wav.body.len() - 8, "RIFF size");
    assert_eq!(size(40), wav.body.len() - 44, "data size");
    assert_eq!(
        wav.header("content-length"),
        Some(wav.body.len().to_string().as_str())
    );
    // ... byte for byte what `voiceclone speak` writes.
    assert!(
        wav.body == std::fs::read(ws.path().join("speak-ref.wav")).unwrap(),
        "serve's WAV is not speak's file byte for byte"
    );
    // Asked to stream ("stream": true), a WAV goes out as it is generated, its sizes the
    // 0xFFFFFFFF placeholders of an unknown length.
    let mut streamed_req = body("wav", "audio");
    streamed_req["stream"] = json!(true);
    let streamed = speech(&server.addr, &streamed_req);
    assert_eq!(streamed.status, 200);
    assert_eq!(&streamed.body[4..8], &[0xFF; 4]);
    assert_eq!(&streamed.body[40..44], &[0xFF; 4]);
    assert_eq!(streamed.header("content-length"), None);
    assert_eq!(wav_samples(&streamed.body), got);

    let pcm = speech(&server.addr, &body("pcm", "audio"));
    assert_eq!(pcm.status, 200);
    assert_eq!(pcm.header("content-type"), Some("audio/pcm"));
    assert_eq!(pcm_samples(&pcm.body), got, "pcm = the WAV's samples");

    // Audio leaves while the request is generated: the first chunk comes long before the
    // last one (each frame step takes at least `delay_ms` in the test-hooks build).
    let (first, last) = (pcm.chunks[0].0, pcm.chunks.last().unwrap().0);
    eprintln!(
        "time to first audio {:.1} ms, last chunk at {:.1} ms, {} chunks",
        first.as_secs_f64() * 1e3,
        last.as_secs_f64() * 1e3,
        pcm.chunks.len()
    );
    assert!(pcm.chunks.len() >= 2, "one chunk: nothing was streamed");
    if cfg!(feature = "test-hooks") {
        let generation = Duration::from_millis(delay_ms * frames as u64);
        assert!(
            last - first >= generation / 2,
            "the audio came all at once ({first:?} .. {last:?}) instead of while generating"
        );
    }

    let sse = speech(&server.addr, &body("pcm", "sse"));
    assert_eq!(sse.status, 200);
    assert_eq!(sse.header("content-type"), Some("text/event-stream"));
    let (audio, done) = sse_audio(&sse.body);
    assert_eq!(pcm_samples(&audio), got, "SSE carries the same audio");
    assert_eq!(done["usage"]["output_tokens"], frames);
    assert!(done["usage"]["input_tokens"].as_u64().unwrap() > 0);
}

/// A stream's audio leaves in the chunks of docs/serving.md §4.1 — the first frame alone, then
/// chunks growing to `speak.stream_chunk_frames` (from the config file, or
/// `--stream-chunk-frames`) — one SSE delta event each, and the samples are the same whatever
/// the chunks. In the `test-hooks` build each frame is slowed, so the decoder never falls
/// behind and the chunks are exactly the rule's.
#[test]
fn streamed_audio_leaves_in_growing_chunks_of_the_same_samples() {
    let ws = crate::speak_cli::reference_workspace(
        "\n[speak]\nmax_frames = 40\nstream_chunk_frames = 3\n",
    );
    let env = slow_frames(20);
    let body = json!({"model": "m", "voice": "default", "seed": 9,
        "input": "A text long enough for forty frames of speech, if the model goes on that long.",
        "response_format": "pcm", "stream_format": "sse"});
    let mut first: Option<Vec<u8>> = None;
    for (args, most) in [(&[][..], 3), (&["--stream-chunk-frames", "1"][..], 1)] {
        let server = Server::start(ws.path(), args, &env_refs(&env));
        let r = speech(&server.addr, &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let deltas = std::str::from_utf8(&r.body)
            .unwrap()
            .matches("\"speech.audio.delta\"")
            .count();
        let (audio, done) = sse_audio(&r.body);
        let frames = done["usage"]["output_tokens"].as_u64().unwrap() as usize;
        assert!(
            frames >= 12,
            "only {frames} frames: too few to tell chunkings apart"
        );
        assert_eq!(audio.len(), frames * SAMPLES_PER_FRAME * 2);
        if cfg!(feature = "test-hooks") {
            assert_eq!(
                deltas,
                crate::common::audio_chunks_by_rule(frames, most),
                "{args:?}: {frames} frames"
            );
        } else {
            assert!((1..=frames).contains(&deltas));
        }
        match &first {
            None => first = Some(audio),
            Some(a) => assert_same_samples(
                &pcm_samples(&audio),
                &pcm_samples(a),
                "chunks of 1 frame vs growing to 3",
            ),
        }
    }
}

#[test]
fn concurrent_requests_give_what_each_gives_alone() {
    concurrent_equals_alone("auto");
}

/// q8 quantizes activations per row: a row's codes do not depend on the batch either.
#[test]
fn concurrent_requests_give_what_each_gives_alone_in_q8() {
    concurrent_equals_alone("q8");
}

/// q4 shares q8's activation rows: the same holds (docs/performance.md §2.6).
#[test]
fn concurrent_requests_give_what_each_gives_alone_in_q4() {
    concurrent_equals_alone("q4");
}

fn concurrent_equals_alone(precision: &str) {
    let ws = workspace("\n[serve]\nmax_batch = 4\n");
    let env = slow_frames(40);
    let server = Server::start(ws.path(), &["--precision", precision], &env_refs(&env));
    let texts = [
        "The first request of the batch.",
        "A second one, somewhat longer than the first request was.",
        "Third.",
        "And the fourth request joins them as well.",
    ];
    let body = |i: usize| {
        json!({"model": "m", "input": texts[i], "voice": "default", "seed": 100 + i,
               "response_format": "pcm"})
    };
    let alone: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let r = speech(&server.addr, &body(i));
            assert_eq!(r.status, 200);
            r.body
        })
        .collect();
    let shared_alone = server.health()["decoding"]["shared_passes"]
        .as_u64()
        .unwrap();
    assert_eq!(
        shared_alone, 0,
        "requests one at a time shared a decoding pass"
    );
    let addr = server.addr.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (addr, stop) = (addr.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut most = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let h = request(&addr, "GET", "/health", &[], b"").json();
                most = most.max(h["running"].as_u64().unwrap());
                std::thread::sleep(Duration::from_millis(5));
            }
            most
        })
    };
    let together: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let addr = addr.clone();
            let b = body(i);
            // Staggered, so rows join a batch that is already running.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30 * i as u64));
                speech(&addr, &b)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| {
            let r = h.join().unwrap();
            assert_eq!(r.status, 200);
            r.body
        })
        .collect();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let most = watcher.join().unwrap();
    let decoding = server.health()["decoding"].clone();
    eprintln!("{precision}: at most {most} rows ran together; decoding {decoding}");
    if cfg!(feature = "test-hooks") {
        assert!(most >= 2, "the requests never shared the batch");
        // The streams' frames went through the codec decoder together (docs/serving.md §4).
        assert!(
            decoding["shared_passes"].as_u64().unwrap() > 0
                && decoding["most_streams"].as_u64().unwrap() >= 2,
            "the streams never shared a decoding pass: {decoding}"
        );
    }
    for i in 0..4 {
        assert!(!together[i].is_empty(), "request {i}");
        assert_same_samples(
            &pcm_samples(&together[i]),
            &pcm_samples(&alone[i]),
            &format!("request {i} in the batch vs alone"),
        );
    }
    assert_ne!(
        alone[0], alone[1],
        "different seeds and texts give different audio"
    );
}

/// The runaway guard in `serve` (docs/serving.md §2, docs/model.md §7.2): a whole WAV whose
/// chunks a guard stopped says which and why in `x-voiceclone-guard`, and the server log names
/// the request (its seed) and each chunk with the start of its text; the audio so far is kept.
/// A streamed response's head leaves before any stop, so it ends with the audio so far and the
/// log alone tells. A request's `max_frames` wins over the budget; `speak.runaway_guard = false`
/// turns the guards off for the server.
#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn runaway_guard_stops_are_told_in_a_header_and_the_log() {
    use crate::speak_cli::{FLOOR_FRAMES, LOOP, LOOP_STOP, NO_EOS};
    let ws = crate::speak_cli::reference_workspace("\n[speak]\nmax_chunk_chars = 14\n");
    let body = |extra: Value| {
        let mut b = json!({"model": "m", "input": "Hello there. Good night.", "voice": "default",
                           "seed": 3});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let pause = 2880;

    // No end token: both chunks stop at their budget.
    let server = Server::start(ws.path(), &[], &[NO_EOS]);
    let r = speech(&server.addr, &body(json!({})));
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-voiceclone-guard"),
        Some(
            format!(
                "chunk=1 reason=budget frames={FLOOR_FRAMES}, chunk=2 reason=budget \
                 frames={FLOOR_FRAMES}"
            )
            .as_str()
        )
    );
    assert_eq!(
        wav_samples(&r.body).len(),
        2 * FLOOR_FRAMES * SAMPLES_PER_FRAME + pause
    );
    let r = speech(&server.addr, &body(json!({"max_frames": 120})));
    assert_eq!(r.header("x-voiceclone-guard"), None, "max_frames wins");
    assert_eq!(
        wav_samples(&r.body).len(),
        2 * 120 * SAMPLES_PER_FRAME + pause
    );
    let log = std::fs::read_to_string(&server.log).unwrap();
    for want in [
        "request with seed 3: chunk 1 (\"Hello there.\"): no end of speech within its budget",
        "request with seed 3: chunk 2 (\"Good night.\"): no end of speech within its budget",
    ] {
        assert!(log.contains(want), "no {want:?} in the log: {log}");
    }
    drop(server);

    // A loop: each chunk stops once its stretch was repeated for 3 s.
    let server = Server::start(ws.path(), &[], &[NO_EOS, LOOP]);
    let r = speech(&server.addr, &body(json!({})));
    assert_eq!(
        r.header("x-voiceclone-guard"),
        Some(
            format!(
                "chunk=1 reason=loop frames={LOOP_STOP} period=5, chunk=2 reason=loop \
                 frames={LOOP_STOP} period=5"
            )
            .as_str()
        )
    );
    let whole = wav_samples(&r.body);
    assert_eq!(whole.len(), 2 * LOOP_STOP * SAMPLES_PER_FRAME + pause);
    let r = speech(&server.addr, &body(json!({"response_format": "pcm"})));
    assert_eq!(r.header("x-voiceclone-guard"), None, "a streamed head");
    assert!(r.complete);
    assert_same_samples(&pcm_samples(&r.body), &whole, "streamed after a loop stop");
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert_eq!(
        log.matches("request with seed 3: chunk 2 (\"Good night.\"): a stretch of 5 frames")
            .count(),
        2,
        "{log}"
    );
    drop(server);

    // The server honours `speak.runaway_guard = false`: the loop runs on to the frame limit.
    let ws = crate::speak_cli::reference_workspace(
        "\n[speak]\nmax_chunk_chars = 14\nmax_frames = 150\nrunaway_guard = false\n",
    );
    let server = Server::start(ws.path(), &[], &[NO_EOS, LOOP]);
    let r = speech(&server.addr, &body(json!({})));
    assert_eq!(r.header("x-voiceclone-guard"), None);
    assert_eq!(
        wav_samples(&r.body).len(),
        2 * 150 * SAMPLES_PER_FRAME + pause
    );
}
