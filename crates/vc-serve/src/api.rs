//! The endpoints (docs/serving.md §2): routing, authentication, the voice endpoints, and the
//! per-request decode worker that turns generated frames into response bytes. A speech
//! request's body is checked in [`super::speech_request`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};

use super::audio_out::{Format, Framing, ResponseEncoder};
use super::http::{self, ApiError, ChannelBody, RespBody, StreamError};
use super::multipart;
use super::page;
use super::scheduler::{GenEvent, Job, Refused};
use super::speech_request::parse_speech;
use super::stream_decoding::{OpenStream, StreamDecoding};
use super::ServerState;
use vc_generate::runaway::GuardStop;
use vc_generate::{AudioChunks, Request as SpeechJob};

/// Every request: authentication (all but `GET /health`), then the route.
pub async fn handle(req: Request<Incoming>, state: Arc<ServerState>) -> Response<RespBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let started = std::time::Instant::now();
    let resp = match route(req, &state, &method, &path).await {
        Ok(r) => r,
        Err(e) => e.response(),
    };
    tracing::info!(
        "{method} {path} -> {} ({:.1} ms to headers)",
        resp.status().as_u16(),
        started.elapsed().as_secs_f64() * 1e3
    );
    resp
}

fn authorized(req: &Request<Incoming>, key: &str) -> bool {
    let Some(v) = req.headers().get("authorization") else {
        return false;
    };
    let Ok(v) = v.to_str() else {
        return false;
    };
    // The scheme is case-insensitive (HTTP authentication schemes are); the token is not.
    let Some((scheme, token)) = v.trim().split_once(' ') else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return false;
    }
    // Constant-time comparison.
    let (a, b) = (token.trim().as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn route(
    req: Request<Incoming>,
    state: &Arc<ServerState>,
    method: &Method,
    path: &str,
) -> Result<Response<RespBody>, ApiError> {
    // The page holds no secret: it asks the user for the key its API calls send
    // (docs/serving.md §8).
    if path != "/health" && !page::is_page(path) {
        if let Some(key) = &state.opts.api_key {
            if !authorized(&req, key) {
                return Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "invalid_request_error",
                    "invalid_api_key",
                    "missing or wrong API key: send the header \"Authorization: Bearer KEY\"",
                ));
            }
        }
    }
    let known = matches!(
        path,
        "/health" | "/v1/models" | "/v1/audio/speech" | "/v1/voices"
    ) || path.starts_with("/v1/voices/")
        || page::is_page(path);
    match (method, path) {
        (&Method::GET, p) if page::is_page(p) => Ok(page::response(state)),
        (&Method::GET, "/health") => Ok(health(state)),
        (&Method::GET, "/v1/models") => Ok(models(state)),
        (&Method::POST, "/v1/audio/speech") => speech(req, state).await,
        (&Method::POST, "/v1/voices") => register_voice(req, state).await,
        (&Method::GET, "/v1/voices") => Ok(list_voices(state)),
        (&Method::DELETE, p) if p.starts_with("/v1/voices/") => {
            delete_voice(&p["/v1/voices/".len()..], state)
        }
        _ if known => Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            format!("{method} is not allowed on {path}"),
        )),
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            format!("no endpoint {method} {path}"),
        )),
    }
}

fn health(state: &ServerState) -> Response<RespBody> {
    let (running, waiting) = state.scheduler.load();
    http::json(
        StatusCode::OK,
        &json!({
            "status": if state.closing.load(Ordering::SeqCst) { "shutting_down" } else { "ok" },
            "model": state.opts.model_id,
            "precision": state.synth.precision().name(),
            "running": running,
            "queued": waiting,
            "streams": state.inflight.count(),
            "decoding": {
                "passes": state.decoding.stats.passes.load(Ordering::Relaxed),
                "shared_passes": state.decoding.stats.shared_passes.load(Ordering::Relaxed),
                "most_streams": state.decoding.stats.most_streams.load(Ordering::Relaxed),
            },
        }),
    )
}

fn models(state: &ServerState) -> Response<RespBody> {
    http::json(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": state.opts.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "voiceclone",
        }]}),
    )
}

fn list_voices(state: &ServerState) -> Response<RespBody> {
    let mut data: Vec<Value> = Vec::new();
    if state.default_voice.is_some() {
        data.push(
            json!({"id": "default", "object": "voice", "name": "default",
            "mode": "workspace"}),
        );
    }
    for s in state.synth.speakers() {
        data.push(json!({"id": s, "object": "voice", "name": s, "mode": "speaker"}));
    }
    // By name and kind only: where the server keeps an adapter is none of a client's
    // business (docs/serving.md §2).
    for a in &state.adapter_voices {
        data.push(json!({"id": a.name, "object": "voice", "name": a.name, "mode": "adapter"}));
    }
    data.extend(state.voices.list().iter().map(|e| e.to_json()));
    http::json(StatusCode::OK, &json!({"object": "list", "data": data}))
}

fn delete_voice(id: &str, state: &ServerState) -> Result<Response<RespBody>, ApiError> {
    let not_found = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "voice_not_found",
            format!("no registered voice {id:?}"),
        )
    };
    if state.voices.get(id).is_none() {
        return Err(not_found());
    }
    match state.voices.remove(id) {
        Ok(true) => Ok(http::json(
            StatusCode::OK,
            &json!({"id": id, "object": "voice", "deleted": true}),
        )),
        Ok(false) => Err(not_found()),
        Err(e) => Err(ApiError::internal_logged(
            "cannot delete the voice",
            format!("{e:#}"),
        )),
    }
}

async fn speech(
    req: Request<Incoming>,
    state: &Arc<ServerState>,
) -> Result<Response<RespBody>, ApiError> {
    if state.closing.load(Ordering::SeqCst) {
        return Err(shutting_down());
    }
    let received = std::time::Instant::now();
    let body = http::read_body(req.into_body(), state.opts.max_body_bytes).await?;
    let p = parse_speech(state, &body)?;
    let seed = p.seed.unwrap_or_else(|| rand::random::<u32>() as u64);
    let non_streaming = p.non_streaming.unwrap_or(match state.opts.non_streaming {
        vc_core::config::NonStreaming::True => true,
        vc_core::config::NonStreaming::False => false,
        // The official defaults: non-streaming text for named speakers, streaming for cloning.
        vc_core::config::NonStreaming::Auto => p.voice.custom_voice(),
    });
    let job_req = SpeechJob {
        text: p.input,
        language: p.language.unwrap_or_else(|| state.opts.language.clone()),
        pace: state.pace_of(&p.voice),
        voice: p.voice,
        non_streaming,
    };
    let opts = p.opts;
    // Tokenizing and embedding the prompt is model work: off the async threads.
    let synth = state.synth.clone();
    let plan = tokio::task::spawn_blocking(move || {
        let rows = synth.row_plans(&job_req, &opts);
        (rows, synth.loop_options(&opts))
    })
    .await
    .map_err(|e| ApiError::internal(format!("prompt preparation failed: {e}")))?;
    let (rows, loop_opts) = (
        plan.0.map_err(|e| {
            let msg = format!("{e:#}");
            let param = if msg.contains("language") {
                Some("language")
            } else {
                None
            };
            ApiError::invalid(param, "invalid_request", msg)
        })?,
        plan.1,
    );
    let input_tokens: usize = rows.iter().map(|r| r.text_tokens).sum();
    let (events_tx, events_rx) = mpsc::channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        rows,
        opts: loop_opts,
        seed,
        events: events_tx,
        cancel: cancel.clone(),
    };
    match state.scheduler.submit(job) {
        Ok(()) => {}
        Err(Refused::QueueFull) => {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "queue_full",
                format!(
                    "the server is busy: {} requests are already waiting for the running \
                     batch; retry later",
                    state.opts.max_queue
                ),
            ))
        }
        Err(Refused::ShuttingDown) => return Err(shutting_down()),
    }
    let encoder = ResponseEncoder::new(p.format, p.framing, state.synth.codec.output_sample_rate());
    let content_type = encoder.content_type();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, StreamError>>(64);
    let synth = state.synth.clone();
    let decoding = state.decoding.clone();
    let worker_cancel = cancel.clone();
    let chunk_frames = state.opts.defaults.stream_chunk_frames;
    // The chunks a runaway guard stopped, for the header of a whole WAV.
    let stops = Arc::new(Mutex::new(Vec::new()));
    let worker_stops = stops.clone();
    tokio::task::spawn_blocking(move || {
        decode_worker(
            &synth,
            &decoding,
            events_rx,
            tx,
            encoder,
            input_tokens,
            &worker_cancel,
            received,
            chunk_frames,
            &worker_stops,
        )
    });
    let body = ChannelBody::new(rx, cancel, state.inflight.clone());
    let response = Response::builder()
        .status(StatusCode::OK)
        .header("content-type", content_type)
        .header("x-voiceclone-seed", seed.to_string())
        .header("cache-control", "no-cache");
    if p.format == Format::Wav && p.framing == Framing::Audio && !p.stream {
        // A whole WAV, its sizes filled in (docs/serving.md §2): generated first, then sent
        // with its length. A client that hangs up meanwhile drops this future and with it the
        // body, which cancels the generation.
        let bytes = http_body_util::BodyExt::collect(body)
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .to_bytes();
        let wav = Bytes::from(with_sizes(bytes.to_vec()));
        // Known now that the whole WAV is made (docs/serving.md §2).
        let stops = stops.lock().unwrap_or_else(|e| e.into_inner());
        let response = if stops.is_empty() {
            response
        } else {
            let value: Vec<String> = stops.iter().map(GuardStop::header_value).collect();
            response.header("x-voiceclone-guard", value.join(", "))
        };
        return Ok(response
            .body(http::full(wav))
            .expect("static response parts"));
    }
    Ok(response
        .body(http_body_util::BodyExt::boxed(body))
        .expect("static response parts"))
}

/// A complete streamed WAV (44-byte header with placeholder sizes, then the samples) with its
/// RIFF and data sizes filled in.
fn with_sizes(mut wav: Vec<u8>) -> Vec<u8> {
    if let (Ok(data), Ok(riff)) = (u32::try_from(wav.len() - 44), u32::try_from(wav.len() - 8)) {
        wav[4..8].copy_from_slice(&riff.to_le_bytes());
        wav[40..44].copy_from_slice(&data.to_le_bytes());
    }
    wav
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "shutting_down",
        "the server is shutting down and takes no new requests",
    )
}

/// Turns a request's generated frames into response chunks as they come (docs/serving.md §4):
/// one open stream of the decoding thread per row, the pause between the chunks of a split
/// text, the response framing. Ends when the request is done, failed, or the client is gone.
/// The chunks a runaway guard stopped go to `stops`.
#[allow(clippy::too_many_arguments)]
fn decode_worker(
    synth: &vc_generate::Synthesizer,
    decoding: &StreamDecoding,
    events: mpsc::Receiver<GenEvent>,
    out: tokio::sync::mpsc::Sender<Result<Bytes, StreamError>>,
    encoder: ResponseEncoder,
    input_tokens: usize,
    cancel: &AtomicBool,
    received: std::time::Instant,
    chunk_frames: usize,
    stops: &Mutex<Vec<GuardStop>>,
) {
    let send = |b: Bytes| out.blocking_send(Ok(b)).is_ok();
    let mut first_audio: Option<std::time::Duration> = None;
    let mut samples_out = 0usize;
    let gone = |cancel: &AtomicBool| {
        cancel.store(true, Ordering::SeqCst);
    };
    if let Some(h) = encoder.start() {
        if !send(h) {
            return gone(cancel);
        }
    }
    let mut stream: Option<OpenStream> = None;
    let mut pending: Vec<[u32; 16]> = Vec::new();
    let mut chunks = AudioChunks::new(chunk_frames);
    loop {
        let ev = match events.recv() {
            Ok(ev) => ev,
            Err(_) => {
                let _ = out.blocking_send(Err(StreamError(
                    "the generation thread stopped before the request was done".into(),
                )));
                return;
            }
        };
        // Frames wait until they make a chunk and are then decoded together: the stream
        // decoder's samples do not depend on how the frames are grouped (docs/serving.md §4),
        // and one pass over its weights for several frames is cheaper; the decoding thread
        // adds the other streams' frames to the same pass.
        let mut next = Some(ev);
        while let Some(GenEvent::Frame(f)) = next {
            pending.push(f.0);
            next = events.try_recv().ok();
        }
        // A chunk of audio is ready when it has the frames `chunks` asks for, or when what
        // comes next ends the text chunk (docs/serving.md §4.1).
        if !pending.is_empty() && (next.is_some() || chunks.ready(pending.len())) {
            let Some(s) = stream.as_ref() else {
                let _ = out.blocking_send(Err(StreamError("a frame before its row".into())));
                return;
            };
            chunks.sent(pending.len());
            let decoded = s.push(std::mem::take(&mut pending));
            match decoded {
                Ok(samples) => {
                    first_audio.get_or_insert_with(|| received.elapsed());
                    samples_out += samples.len();
                    if !send(encoder.samples(&samples)) {
                        return gone(cancel);
                    }
                }
                Err(e) => {
                    return fail(&out, &encoder, format!("decoding failed: {e:#}"));
                }
            }
            pending.clear();
        }
        match next {
            None | Some(GenEvent::Frame(_)) => {}
            Some(GenEvent::ChunkStart { chunk, ref_codes }) => {
                if chunk > 0 && !send(encoder.samples(&vec![0.0; synth.chunk_pause_samples()])) {
                    return gone(cancel);
                }
                // The previous chunk's stream is closed first (no pass waits for it).
                drop(stream.take());
                let prime = ref_codes.map(|r| r.into_iter().map(|f| f.0).collect());
                match decoding.open(prime) {
                    Ok(s) => stream = Some(s),
                    Err(e) => return fail(&out, &encoder, format!("decoding failed: {e:#}")),
                }
            }
            Some(GenEvent::ChunkEnd { stopped, .. }) => {
                stream = None;
                if let Some(stop) = stopped {
                    stops.lock().unwrap_or_else(|e| e.into_inner()).push(stop);
                }
            }
            Some(GenEvent::Done { frames }) => {
                if let Some(b) = encoder.done(input_tokens, frames) {
                    send(b);
                }
                // Time to first audio: from the request's arrival to its first samples
                // handed to the connection (docs/serving.md §4).
                let total = received.elapsed().as_secs_f64();
                let audio = samples_out as f64 / synth.codec.output_sample_rate() as f64;
                eprintln!(
                    "speech: {frames} frames ({audio:.2} s of audio), first audio after {:.0} \
                     ms, done in {total:.2} s (real-time factor {:.2})",
                    first_audio.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
                    if audio > 0.0 { total / audio } else { f64::NAN }
                );
                return;
            }
            Some(GenEvent::Ended(why)) => {
                tracing::warn!("{why}");
                return;
            }
            Some(GenEvent::Failed(why)) => return fail(&out, &encoder, why),
        }
    }
}

fn fail(
    out: &tokio::sync::mpsc::Sender<Result<Bytes, StreamError>>,
    encoder: &ResponseEncoder,
    why: String,
) {
    tracing::error!("{why}");
    match encoder.error(&why) {
        Some(b) => {
            let _ = out.blocking_send(Ok(b));
        }
        None => {
            let _ = out.blocking_send(Err(StreamError(why)));
        }
    }
}

fn too_many_voices(full: &super::voices::Full) -> ApiError {
    ApiError::invalid(None, "too_many_voices", full.to_string())
}

async fn register_voice(
    req: Request<Incoming>,
    state: &Arc<ServerState>,
) -> Result<Response<RespBody>, ApiError> {
    if state.synth.config().tts_model_type != "base" {
        return Err(ApiError::invalid(
            None,
            "voice_cloning_unavailable",
            format!(
                "this server's model is a {} model: it speaks with its own speakers ({}) and \
                 cannot clone a voice; serve a Base model to register voices",
                state.synth.config().tts_model_type,
                state.synth.speakers().join(", ")
            ),
        ));
    }
    // Refused before the upload is read and decoded; checked again when it is added.
    if state.voices.len() >= state.opts.max_voices {
        return Err(too_many_voices(&super::voices::Full(state.opts.max_voices)));
    }
    let boundary = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .and_then(multipart::boundary)
        .ok_or_else(|| {
            ApiError::invalid(
                None,
                "invalid_content_type",
                "POST /v1/voices takes multipart/form-data: a \"file\" field with the audio, \
                 optional \"transcript\" and \"name\"",
            )
        })?;
    let body = http::read_body(req.into_body(), state.opts.max_body_bytes).await?;
    let parts = multipart::parse(body, boundary)
        .await
        .map_err(|e| ApiError::invalid(None, "invalid_multipart", e))?;
    let mut file = None;
    let mut transcript = None;
    let mut name = None;
    for p in parts {
        let text = |p: &multipart::Part| {
            String::from_utf8(p.data.to_vec()).map_err(|_| {
                ApiError::invalid(
                    Some(&p.name),
                    "invalid_value",
                    format!("{:?} is not UTF-8 text", p.name),
                )
            })
        };
        match p.name.as_str() {
            "file" | "audio" => file = Some(p),
            "transcript" | "ref_text" => transcript = Some(text(&p)?),
            "name" => name = Some(text(&p)?),
            other => {
                return Err(ApiError::invalid(
                    Some(other),
                    "unknown_parameter",
                    format!("unknown field {other:?} (known: file, transcript, name)"),
                ))
            }
        }
    }
    let file = file.ok_or_else(|| {
        ApiError::invalid(
            Some("file"),
            "missing_required_parameter",
            "the \"file\" field with the reference audio is missing",
        )
    })?;
    let transcript = transcript.filter(|t| !t.trim().is_empty());
    let name = name.unwrap_or_default();
    if name.chars().count() > 64 || name.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            Some("name"),
            "invalid_value",
            "\"name\" must be at most 64 printable characters",
        ));
    }
    // A transcript is prompt text of every request of the voice, as "input" is.
    let max_chars = state.opts.max_input_chars;
    if transcript
        .as_ref()
        .is_some_and(|t| t.chars().count() > max_chars)
    {
        return Err(ApiError::invalid(
            Some("transcript"),
            "string_above_max_length",
            format!(
                "\"transcript\" must be at most {max_chars} characters (serve.max_input_chars)"
            ),
        ));
    }
    let ext = file
        .filename
        .as_deref()
        .and_then(|f| f.rsplit_once('.'))
        .map(|(_, e)| e.to_ascii_lowercase())
        .filter(|e| e.len() <= 5 && e.chars().all(|c| c.is_ascii_alphanumeric()));
    let state2 = state.clone();
    let max_seconds = state.opts.max_voice_seconds;
    let max_voices = state.opts.max_voices;
    let entry = tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
        let audio =
            vc_audio::decode::decode_bytes(file.data.into(), ext.as_deref()).map_err(|e| {
                ApiError::invalid(
                    Some("file"),
                    "invalid_audio",
                    format!("cannot read the audio: {e}"),
                )
            })?;
        let seconds = audio.duration_seconds();
        if !(0.5..=max_seconds).contains(&seconds) {
            return Err(ApiError::invalid(
                Some("file"),
                "invalid_audio",
                format!(
                    "the reference clip is {seconds:.2} s long; it must be between 0.5 and \
                     {max_seconds} s (3-10 s of clean speech works best)"
                ),
            ));
        }
        // Failures from here on may name the model's or the workspace's files: logged, and
        // the client told what failed (docs/serving.md §2).
        let wav = vc_audio::resample::resample(&audio.samples, audio.sample_rate, 24_000)
            .map_err(|e| ApiError::internal_logged("cannot resample the clip", format!("{e:#}")))?;
        let xvector = state2.xvector(&wav).map_err(|e| {
            ApiError::internal_logged("cannot compute the x-vector", format!("{e:#}"))
        })?;
        let ref_codes = match &transcript {
            Some(_) => Some(
                state2
                    .synth
                    .codec
                    .encode(&wav)
                    .and_then(|c| vc_core::artifacts::codes::frames_from_rows(&c))
                    .map_err(|e| {
                        ApiError::internal_logged("cannot encode the clip", format!("{e:#}"))
                    })?,
            ),
            None => None,
        };
        state2
            .voices
            .add(name, transcript, xvector, ref_codes, max_voices)
            .map_err(|e| match e.downcast_ref::<super::voices::Full>() {
                Some(full) => too_many_voices(full),
                None => ApiError::internal_logged("cannot register the voice", format!("{e:#}")),
            })
    })
    .await
    .map_err(|e| ApiError::internal(format!("voice registration failed: {e}")))??;
    Ok(http::json(StatusCode::CREATED, &entry.to_json()))
}
