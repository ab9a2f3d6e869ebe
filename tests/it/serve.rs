//! `voiceclone serve` end to end on the tiny fixture model (docs/serving.md): the
//! speech endpoint returns what `voiceclone speak` writes for the same seed and voice, in every
//! format, streamed while it is generated; concurrent requests give what each gives alone;
//! registered voices persist; every error case answers OpenAI-style JSON; SIGTERM during a
//! stream ends it cleanly and the server exits 0. The README's curl and `openai` Python
//! examples are run as written (see `readme_examples_run_against_the_server`).
//!
//! The client here is a few lines of HTTP/1.1 over a `TcpStream`, so the tests see every
//! chunk as it arrives (with its time) and can hang up mid-stream.

use crate::common::{self, fixtures, stderr};

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Frames every speech request of these tests generates (the fixture model rarely stops on
/// its own): `[speak] max_frames` in the workspace, so `speak` and `serve` agree.
const FRAMES: usize = 24;
const SAMPLES_PER_FRAME: usize = 1920;

fn model(name: &str) -> String {
    fixtures().join(name).display().to_string()
}

fn ref_wav() -> PathBuf {
    fixtures().join("audio/ref24k.wav")
}

/// A workspace whose voice is `data/ref.wav` (x-vector cloning) on the tiny Base model, with
/// `extra` appended to its `voiceclone.toml`.
fn workspace(extra: &str) -> tempfile::TempDir {
    crate::speak_cli::reference_workspace(&format!("\n[speak]\nmax_frames = {FRAMES}\n{extra}\n"))
}

/// `voiceclone speak` in `ws`: the 16-bit samples it writes.
fn speak(ws: &Path, args: &[&str]) -> Vec<i16> {
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

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn health(&self) -> Value {
        let r = request(&self.addr, "GET", "/health", &[], b"");
        assert_eq!(r.status, 200);
        r.json()
    }
}

/// What the `test-hooks` tests (the slowed frame loop) use.
#[cfg(feature = "test-hooks")]
impl Server {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn sigterm(&self) {
        // SAFETY: kill(2) on the id of a child this test started and has not reaped.
        let r = unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        assert_eq!(r, 0, "kill failed");
    }

    /// Waits (at most `limit`) for the process to exit; its status.
    fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
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
    complete: bool,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
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
struct Conn {
    r: BufReader<TcpStream>,
    sent: Instant,
    status: u16,
    headers: Vec<(String, String)>,
}

impl Conn {
    fn open(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Conn {
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
    fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, String> {
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

    fn finish(mut self) -> Resp {
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
fn wav_samples(bytes: &[u8]) -> Vec<i16> {
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

const TEXT: &str = "Hello from the voiceclone server.";

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

/// `POST /v1/voices` with a multipart body of `fields` (name, filename, bytes).
fn multipart(fields: &[(&str, Option<&str>, &[u8])]) -> (String, Vec<u8>) {
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
    // The server is still well after all that.
    assert_eq!(post(ok_body.as_bytes(), &[auth]).status, 200);
}

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

/// The code blocks of the README's `voiceclone serve` section: (language, text).
fn readme_serve_blocks() -> Vec<(String, String)> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let start = readme
        .find("## `voiceclone serve")
        .expect("README has a voiceclone serve section");
    let section = &readme[start..];
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
/// (`scripts/fetch_test_assets.sh` installs it).
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
            "no Python with the openai package at {}: run scripts/fetch_test_assets.sh",
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
            "curl is missing: scripts/install_deps.sh installs it"
        );
        eprintln!("skipped: curl is missing");
    }
    ok
}

/// Acceptance 1: real clients nobody here wrote — curl and the official `openai` Python
/// package — running the README's examples; the WAV they get is `speak`'s.
#[test]
fn readme_examples_run_against_the_server() {
    let blocks = readme_serve_blocks();
    let curl = blocks
        .iter()
        .find(|(l, b)| l == "sh" && b.contains("curl "))
        .expect("a curl block")
        .1
        .clone();
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
        let o = Command::new("bash")
            .args(["-euo", "pipefail", "-c", &here(&curl)])
            .current_dir(ws.path())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "the README's curl commands failed: {}",
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
            "the README's Python failed: {}",
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
