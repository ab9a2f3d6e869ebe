//! The listening page of `voiceclone serve` (docs/serving.md §8) in a real browser: headless
//! Chromium, driven over the DevTools protocol, opens `/` on the tiny fixture model with two
//! voices. The page loads without console messages or exceptions, lists the voices
//! `GET /v1/voices` lists, plays a speech request while it streams (several chunks, audio
//! scheduled before the response ended), and its `<audio>` holds the very bytes the API returns
//! for the same request, fetched here directly; the comparison gives each voice's own audio; a
//! server with a key gets it from the user. Screenshots go to `$VOICECLONE_PAGE_SCREENSHOTS`
//! (a directory) when it is set.
//!
//! The DevTools client is our own few dozen lines: with `--remote-debugging-pipe` Chromium takes
//! the protocol's JSON messages, each ended by a NUL byte, on file descriptor 3 and answers on 4,
//! so neither a WebSocket library nor a Python helper is needed.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

use crate::common::have_tool;
use crate::serve::{
    env_refs, ref_wav, request, slow_frames, workspace, Resp, Server, SAMPLES_PER_FRAME,
};
use crate::serve_voices::multipart;

const BROWSER: &str = "/usr/bin/chromium-headless-shell";
const TEXT: &str = "The page speaks this sentence.";
const WAIT: Duration = Duration::from_secs(120);

/// A headless Chromium with one page, attached over the DevTools pipe (killed when dropped).
struct Browser {
    child: Child,
    commands: std::io::PipeWriter,
    replies: mpsc::Receiver<Value>,
    next_id: u64,
    session: String,
    /// Protocol events not yet looked at.
    events: Vec<Value>,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn launch() -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let (to_browser, commands) = std::io::pipe().unwrap();
        let (replies_reader, from_browser) = std::io::pipe().unwrap();
        let (fd_in, fd_out) = (to_browser.as_raw_fd(), from_browser.as_raw_fd());
        let mut cmd = Command::new(BROWSER);
        cmd.args([
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            // The page's player starts from a click; the test's clicks are scripted.
            "--autoplay-policy=no-user-gesture-required",
            "--no-first-run",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // SAFETY: between fork and exec only async-signal-safe calls (fcntl, dup2). The pipe
        // ends are first moved above 10 so that placing one on 3 cannot overwrite the other;
        // dup2 to a new number clears close-on-exec, so fds 3 and 4 reach the browser.
        unsafe {
            cmd.pre_exec(move || {
                let a = libc::fcntl(fd_in, libc::F_DUPFD, 10);
                let b = libc::fcntl(fd_out, libc::F_DUPFD, 10);
                if a < 0 || b < 0 || libc::dup2(a, 3) < 0 || libc::dup2(b, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("cannot start chromium-headless-shell");
        drop((to_browser, from_browser));
        let (tx, replies) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(replies_reader);
            loop {
                let mut msg = Vec::new();
                match r.read_until(0, &mut msg) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                msg.pop_if(|b| *b == 0);
                let v: Value = serde_json::from_slice(&msg).expect("a DevTools message");
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        let mut b = Browser {
            child,
            commands,
            replies,
            next_id: 0,
            session: String::new(),
            events: Vec::new(),
            _profile: profile,
        };
        let target = b.send(None, "Target.createTarget", json!({"url": "about:blank"}));
        let attached = b.send(
            None,
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        );
        b.session = attached["sessionId"].as_str().unwrap().to_string();
        for domain in ["Runtime.enable", "Log.enable", "Page.enable"] {
            b.call(domain, json!({}));
        }
        b
    }

    /// One command; its result (a protocol error fails the test). Events met on the way are kept.
    fn send(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(0);
        self.commands.write_all(&bytes).unwrap();
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .replies
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no answer to {method}: {e}"));
            if v["id"] == json!(id) {
                assert!(v["error"].is_null(), "{method} failed: {}", v["error"]);
                return v["result"].clone();
            }
            self.events.push(v);
        }
    }

    /// A command to the page.
    fn call(&mut self, method: &str, params: Value) -> Value {
        let session = self.session.clone();
        self.send(Some(&session), method, params)
    }

    /// The value of `js` in the page (awaited if it is a promise), run as a user gesture; an
    /// exception fails the test.
    fn eval(&mut self, js: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": js, "awaitPromise": true, "returnByValue": true,
                   "userGesture": true}),
        );
        assert!(
            r["exceptionDetails"].is_null(),
            "{js}\nthrew: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    /// Waits until `js` is true in the page.
    fn wait_for(&mut self, js: &str) {
        let deadline = Instant::now() + WAIT;
        while self.eval(js) != json!(true) {
            assert!(
                Instant::now() < deadline,
                "still not true after {WAIT:?}: {js}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn open(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
        self.wait_for("document.readyState === 'complete'");
    }

    /// Enter pressed on the focused element (trusted events, as a user's); `modifiers` as the
    /// protocol counts them (2: Ctrl).
    fn press_enter(&mut self, modifiers: u32) {
        for (kind, text) in [("keyDown", "\r"), ("keyUp", "")] {
            self.call(
                "Input.dispatchKeyEvent",
                json!({"type": kind, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13,
                       "text": text, "modifiers": modifiers}),
            );
        }
    }

    /// Types `text` into the focused element.
    fn type_text(&mut self, text: &str) {
        self.call("Input.insertText", json!({"text": text}));
    }

    /// What the page logged since the last look: console calls, uncaught exceptions, and log
    /// entries of level warning or error; those `allowed` (by their text) are left out.
    fn problems(&mut self, allowed: &dyn Fn(&str) -> bool) -> Vec<String> {
        self.events.extend(self.replies.try_iter());
        let mut out = Vec::new();
        for e in self.events.drain(..) {
            let p = &e["params"];
            let text = match e["method"].as_str().unwrap_or_default() {
                "Runtime.consoleAPICalled" => format!("console.{}: {}", p["type"], p["args"]),
                "Runtime.exceptionThrown" => format!("exception: {}", p["exceptionDetails"]),
                "Log.entryAdded"
                    if matches!(p["entry"]["level"].as_str(), Some("error" | "warning")) =>
                {
                    format!("log {}: {}", p["entry"]["source"], p["entry"]["text"])
                }
                _ => continue,
            };
            if !allowed(&text) {
                out.push(text);
            }
        }
        out
    }

    fn assert_quiet(&mut self, when: &str) {
        let problems = self.problems(&|_| false);
        assert!(problems.is_empty(), "{when}: {problems:#?}");
    }

    /// A PNG of the whole page at `width` CSS pixels (a phone's width with `mobile`).
    fn screenshot(&mut self, width: u32, mobile: bool) -> Vec<u8> {
        let metrics = json!({"width": width, "height": 800, "deviceScaleFactor": 1,
                             "mobile": mobile});
        self.call("Emulation.setDeviceMetricsOverride", metrics);
        let height = self
            .eval("document.documentElement.scrollHeight")
            .as_u64()
            .unwrap();
        let metrics = json!({"width": width, "height": height, "deviceScaleFactor": 1,
                             "mobile": mobile});
        self.call("Emulation.setDeviceMetricsOverride", metrics);
        let shot = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
        let png_width = u32::from_be_bytes(png[16..20].try_into().unwrap());
        assert_eq!(png_width, width, "the screenshot's width");
        png
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Keeps a screenshot for a look by eye when `$VOICECLONE_PAGE_SCREENSHOTS` names a directory.
fn keep_screenshot(png: &[u8], name: &str) {
    if let Some(dir) = std::env::var_os("VOICECLONE_PAGE_SCREENSHOTS").map(PathBuf::from) {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), png).unwrap();
    }
}

/// `s` as a JavaScript string literal.
fn js_str(s: &str) -> String {
    json!(s).to_string()
}

/// Sets a form control's value as typing would (the page listens to `input`/`change`).
fn set_value(b: &mut Browser, id: &str, value: &str) {
    b.eval(&format!(
        "(() => {{ const e = document.getElementById({}); e.value = {};
           e.dispatchEvent(new Event('input', {{bubbles: true}}));
           e.dispatchEvent(new Event('change', {{bubbles: true}})); }})()",
        js_str(id),
        js_str(value)
    ));
}

/// The `<audio>` of a column: the bytes behind its blob URL, fetched in the page.
fn audio_bytes(b: &mut Browser, column: &str) -> Vec<u8> {
    let js = format!(
        "(async () => {{
           const a = document.querySelector('#{column} .result audio');
           const blob = await (await fetch(a.src)).blob();
           const url = await new Promise((ok) => {{
             const r = new FileReader(); r.onload = () => ok(r.result); r.readAsDataURL(blob); }});
           return url.slice(url.indexOf(',') + 1);
         }})()"
    );
    let b64 = b.eval(&js);
    base64::engine::general_purpose::STANDARD
        .decode(b64.as_str().unwrap())
        .unwrap()
}

/// A column's record of its last request (the `data-*` attributes the page writes).
fn column_record(b: &mut Browser, column: &str) -> Value {
    b.eval(&format!(
        "Object.assign({{}}, document.getElementById('{column}').dataset)"
    ))
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no number {key} in {v}"))
}

/// The speech API's whole WAV for `body`, asked for here directly.
fn api_wav(addr: &str, body: &Value, auth: &[(&str, &str)]) -> Vec<u8> {
    let mut headers = vec![("Content-Type", "application/json")];
    headers.extend_from_slice(auth);
    let r = request(
        addr,
        "POST",
        "/v1/audio/speech",
        &headers,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.body
}

/// The voices `GET /v1/voices` lists, as (id, mode).
fn api_voices(addr: &str, auth: &[(&str, &str)]) -> Vec<(String, String)> {
    let r = request(addr, "GET", "/v1/voices", auth, b"");
    assert_eq!(r.status, 200);
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            let s = |k: &str| v[k].as_str().unwrap().to_string();
            (s("id"), s("mode"))
        })
        .collect()
}

/// The voices a column's picker offers, as (id, mode), and the table's rows.
fn page_voices(b: &mut Browser, select: &str) -> (Vec<(String, String)>, usize) {
    let v = b.eval(&format!(
        "[[...document.querySelectorAll('#{select} option')].map((o) => [o.value, o.dataset.mode]),
          document.querySelectorAll('#voice-table tr').length]"
    ));
    let options = v[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o[0].as_str().unwrap().to_string(),
                o[1].as_str().unwrap().to_string(),
            )
        })
        .collect();
    (options, v[1].as_u64().unwrap() as usize)
}

fn wait_done(b: &mut Browser, columns: &[&str]) {
    let cond = columns
        .iter()
        .map(|c| {
            format!("['done', 'error'].includes(document.getElementById('{c}').dataset.state)")
        })
        .collect::<Vec<_>>()
        .join(" && ");
    b.wait_for(&cond);
    for c in columns {
        let state = b.eval(&format!(
            "document.getElementById('{c}').dataset.state + ': ' + \
             document.querySelector('#{c} .error').textContent"
        ));
        assert_eq!(state, json!("done: "), "{c}");
    }
}

fn register_voice(addr: &str) -> Resp {
    let clip = std::fs::read(ref_wav()).unwrap();
    let (ct, body) = multipart(&[
        ("file", Some("clip.wav"), &clip),
        ("transcript", None, b"This is the reference transcript."),
        ("name", None, b"narrator"),
    ]);
    request(addr, "POST", "/v1/voices", &[("Content-Type", &ct)], &body)
}

#[test]
fn the_page_lists_the_voices_streams_speech_and_compares_two_voices() {
    if !have_tool(Path::new(BROWSER), "Debian package chromium-headless-shell") {
        return;
    }
    let started = Instant::now();
    let ws = workspace("");
    // Each frame step slowed (test-hooks build), so the audio arrives over about a second.
    let env = slow_frames(40);
    let server = Server::start(ws.path(), &[], &env_refs(&env));
    let registered = register_voice(&server.addr);
    assert_eq!(registered.status, 201);
    let narrator = registered.json()["id"].as_str().unwrap().to_string();
    let voices = api_voices(&server.addr, &[]);
    assert_eq!(voices.len(), 2, "{voices:?}");

    let mut b = Browser::launch();
    b.open(&format!("{}/", server.url()));
    b.wait_for("document.body.dataset.voices === 'loaded'");
    b.assert_quiet("loading the page");
    // The voices: both pickers offer what the API lists, in its order, with each one's kind.
    for select in ["voice-a", "voice-b"] {
        let (options, rows) = page_voices(&mut b, select);
        assert_eq!(options, voices, "{select}");
        assert_eq!(rows, voices.len(), "the voice table");
    }
    assert_eq!(
        b.eval("document.getElementById('key-section').hidden"),
        json!(true),
        "no key asked for: the server has none"
    );

    // The settings shown are the parser's defaults: sent explicitly they change nothing, while
    // one of them changed does change the sampled audio (on the fixture the code-0 sampler is
    // all but certain of its pick; the sub-code sampler is where a change shows).
    let shown = b.eval(
        "Object.fromEntries(['temperature', 'top_k', 'top_p', 'repetition_penalty',
           'sub_temperature', 'sub_top_k', 'sub_top_p']
           .map((f) => [f, Number(document.getElementById('set-' + f).value)]))",
    );
    let plain = json!({"model": "m", "input": TEXT, "voice": "default", "seed": 7});
    let want = api_wav(&server.addr, &plain, &[]);
    let mut explicit = plain.clone();
    explicit
        .as_object_mut()
        .unwrap()
        .extend(shown.as_object().unwrap().clone());
    assert!(
        api_wav(&server.addr, &explicit, &[]) == want,
        "the page's default settings {shown} are not the server's"
    );
    let mut hotter = explicit.clone();
    hotter["sub_temperature"] = json!(shown["sub_temperature"].as_f64().unwrap() * 3.0);
    assert!(
        api_wav(&server.addr, &hotter, &[]) != want,
        "the sub-code temperature changes nothing: the comparison above proves nothing"
    );

    // Speak, from the keyboard (Ctrl+Enter in the text).
    set_value(&mut b, "text", TEXT);
    set_value(&mut b, "set-seed", "7");
    set_value(&mut b, "voice-a", "default");
    b.eval("document.getElementById('text').focus()");
    b.press_enter(2);
    wait_done(&mut b, &["col-a"]);
    let rec = column_record(&mut b, "col-a");
    eprintln!("the page's speech: {rec}");
    // It streamed: several chunks reached the page, and the first was scheduled for playing
    // long before the last one arrived (each frame step takes at least 40 ms in the test-hooks
    // build; without it the tiny model's whole answer may come in one read).
    assert!(
        num(&rec, "scheduled") >= 1.0,
        "nothing was scheduled ({rec})"
    );
    if cfg!(feature = "test-hooks") {
        let frames = (want.len() - 44) / (2 * SAMPLES_PER_FRAME);
        let generation = (40 * frames) as f64;
        assert!(
            num(&rec, "chunks") > 1.0 && num(&rec, "scheduled") > 1.0,
            "one chunk: nothing streamed ({rec})"
        );
        assert!(
            num(&rec, "lastChunkMs") - num(&rec, "firstScheduledMs") >= generation / 2.0,
            "audio was scheduled only as the response ended ({rec})"
        );
    }
    // The audio clock ran: headless Chromium plays to a silent output.
    let clock = b.eval("[audioCtx.state, audioCtx.currentTime]");
    assert_eq!(clock[0], "running", "{clock}");
    assert!(clock[1].as_f64().unwrap() > 0.0, "{clock}");
    assert_eq!(rec["seed"], "7");
    // The page's <audio> and download hold exactly the API's bytes for the same request.
    let got = audio_bytes(&mut b, "col-a");
    assert!(
        got == want,
        "the page's WAV ({} bytes) is not the API's ({} bytes)",
        got.len(),
        want.len()
    );
    assert_eq!(num(&rec, "bytes") as usize, want.len() - 44);
    let link = b.eval(
        "[document.querySelector('#col-a .result a').href === \
          document.querySelector('#col-a .result audio').src,
          document.querySelector('#col-a .result a').download,
          document.querySelector('#col-a .stats').textContent]",
    );
    assert_eq!(link[0], true, "the download is the player's file");
    assert_eq!(link[1], "voiceclone-default-seed7.wav");
    let stats = link[2].as_str().unwrap();
    assert!(
        stats.starts_with("First audio after ") && stats.ends_with("seed 7"),
        "{stats}"
    );
    b.assert_quiet("speaking");
    b.eval("document.getElementById('settings').open = true");
    let shot = b.screenshot(1200, false);
    keep_screenshot(&shot, "page-speak.png");
    b.eval("document.getElementById('settings').open = false");

    // Compare: two voices, one click, each column its own voice's audio.
    b.eval("document.querySelector('input[name=mode][value=compare]').click()");
    assert_eq!(
        b.eval("document.getElementById('col-b').hidden"),
        json!(false)
    );
    set_value(&mut b, "voice-b", &narrator);
    b.eval("document.getElementById('speak').click()");
    wait_done(&mut b, &["col-a", "col-b"]);
    let a = audio_bytes(&mut b, "col-a");
    let bb = audio_bytes(&mut b, "col-b");
    assert!(
        a == want,
        "column A is not the API's audio of the default voice"
    );
    let mut narrator_body = plain.clone();
    narrator_body["voice"] = json!(narrator);
    assert!(
        bb == api_wav(&server.addr, &narrator_body, &[]),
        "column B is not the API's audio of the registered voice"
    );
    assert!(a != bb, "the two voices gave the same audio");
    b.assert_quiet("comparing");
    let shot = b.screenshot(1200, false);
    keep_screenshot(&shot, "page-compare.png");
    let shot = b.screenshot(390, true);
    keep_screenshot(&shot, "page-compare-phone.png");
    b.call("Emulation.clearDeviceMetricsOverride", json!({}));

    // An error is the API's own message.
    b.eval("document.querySelector('input[name=mode][value=one]').click()");
    set_value(&mut b, "text", "   ");
    b.eval("document.getElementById('speak').click()");
    b.wait_for("document.getElementById('col-a').dataset.state === 'error'");
    let shown = b.eval("document.querySelector('#col-a .error').textContent");
    let direct = request(
        &server.addr,
        "POST",
        "/v1/audio/speech",
        &[("Content-Type", "application/json")],
        json!({"model": "m", "input": "   ", "voice": "default"})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(direct.status, 400);
    assert_eq!(shown.as_str().unwrap(), direct.error().2);
    // Chromium logs the failed request itself; nothing else may appear.
    let problems = b.problems(&|t| t.contains("status of 400"));
    assert!(problems.is_empty(), "{problems:#?}");
    eprintln!(
        "the page test took {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn the_page_asks_for_the_api_key_and_works_once_it_is_given() {
    if !have_tool(Path::new(BROWSER), "Debian package chromium-headless-shell") {
        return;
    }
    let ws = workspace("");
    let server = Server::start(ws.path(), &["--api-key", "sekrit"], &[]);
    let auth = [("Authorization", "Bearer sekrit")];
    // The page itself needs no key, and holds none.
    let page = request(&server.addr, "GET", "/", &[], b"");
    assert_eq!(page.status, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert!(!String::from_utf8_lossy(&page.body).contains("sekrit"));
    assert_eq!(
        request(&server.addr, "GET", "/v1/voices", &[], b"").status,
        401
    );

    let mut b = Browser::launch();
    b.open(&format!("{}/", server.url()));
    b.wait_for("!document.getElementById('key-section').hidden");
    // It asks first (no refused request on the way) and the key field has the focus.
    assert_eq!(b.eval("document.activeElement.id"), "api-key");
    b.assert_quiet("loading the page");

    // A wrong key: the API's refusal is shown.
    b.type_text("wrong");
    b.press_enter(0);
    b.wait_for("document.getElementById('key-error').textContent !== ''");
    let refusal = request(
        &server.addr,
        "GET",
        "/v1/voices",
        &[("Authorization", "Bearer wrong")],
        b"",
    )
    .error()
    .2;
    assert_eq!(
        b.eval("document.getElementById('key-error').textContent"),
        json!(format!("The server refused the key: {refusal}"))
    );
    let problems = b.problems(&|t| t.contains("status of 401"));
    assert!(problems.is_empty(), "{problems:#?}");

    // The right one: the voices appear and speech works, with the key on every call.
    b.eval("document.getElementById('api-key').focus()");
    b.type_text("sekrit");
    b.press_enter(0);
    b.wait_for("document.body.dataset.voices === 'loaded'");
    let (options, _) = page_voices(&mut b, "voice-a");
    assert_eq!(options, api_voices(&server.addr, &auth));
    set_value(&mut b, "text", TEXT);
    set_value(&mut b, "set-seed", "3");
    set_value(&mut b, "set-max_frames", "4");
    b.eval("document.getElementById('speak').click()");
    wait_done(&mut b, &["col-a"]);
    let want = api_wav(
        &server.addr,
        &json!({"model": "m", "input": TEXT, "voice": "default", "seed": 3, "max_frames": 4}),
        &auth,
    );
    assert!(audio_bytes(&mut b, "col-a") == want);
    assert_eq!(want.len(), 44 + 4 * 2 * SAMPLES_PER_FRAME);
    // Kept for this tab only: a reload goes straight to the voices.
    assert_eq!(
        b.eval("sessionStorage.getItem('voiceclone.apiKey')"),
        "sekrit"
    );
    b.open(&format!("{}/", server.url()));
    b.wait_for("document.body.dataset.voices === 'loaded'");
    b.assert_quiet("speaking with the key");
}
