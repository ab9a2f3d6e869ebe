//! `voiceclone serve`: the loaded voice behind an OpenAI-compatible, streaming speech API
//! (docs/serving.md). HTTP/1.1 (hyper) on a small tokio runtime; the model work runs off the
//! async threads — one generation thread with the running batch ([`scheduler`]), one thread
//! decoding the frames of every open stream together ([`stream_decoding`]), and one blocking
//! worker per streamed response that carries its frames there and its audio out ([`api`]).
//! A speech request's body is read and checked in [`speech_request`], answered in the bytes of
//! [`audio_out`]; [`voices`] holds the voices registered through the API (their uploads parsed by
//! [`multipart`]); [`http`] the body types, errors and bounded reads; [`page`] the listening
//! page a browser opens at `/`.

pub mod api;
pub mod audio_out;
pub mod http;
pub mod multipart;
pub mod page;
pub mod scheduler;
pub mod speech_request;
pub mod stream_decoding;
pub mod voices;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::Device;

use vc_core::config::NonStreaming;
use vc_generate::{DecodeOptions, Synthesizer, Voice};
use vc_model::speaker::SpeakerEncoder;

/// How long a client may take to send a request head, and then its body.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
pub const BODY_TIMEOUT: Duration = Duration::from_secs(120);

/// Everything `voiceclone serve` is configured with (`[serve]`, and `[speak]` for synthesis).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    /// `None`: no authentication.
    pub api_key: Option<String>,
    pub max_batch: usize,
    pub max_queue: usize,
    pub max_input_chars: usize,
    pub max_body_bytes: usize,
    pub max_voice_seconds: f64,
    /// Voices `POST /v1/voices` may register (`serve.max_voices`).
    pub max_voices: usize,
    /// How long in-flight requests may take after SIGTERM/Ctrl-C.
    pub shutdown_grace: Duration,
    /// Decoding defaults of a request (from `[speak]`); `seed` is unused.
    pub defaults: DecodeOptions,
    pub language: String,
    pub non_streaming: NonStreaming,
    /// The id `GET /v1/models` reports.
    pub model_id: String,
    /// The measured pace (frames per text token) of the model's speakers, by lower-cased name,
    /// which sets their chunks' frame budgets (docs/model.md §7.2).
    pub speaker_paces: BTreeMap<String, f64>,
}

/// A speaker of an adapter kept beside the base model (`serve.adapters`, docs/serving.md §7).
#[derive(Debug, Clone)]
pub struct AdapterVoice {
    /// The `"voice"` a request names it by (matched case-insensitively).
    pub name: String,
    /// The adapter directory, for the server's own messages; never sent to a client
    /// (docs/serving.md §2).
    pub adapter: String,
    pub voice: Voice,
    /// The speaker's measured pace in frames per text token, from the adapter directory.
    pub pace: Option<f64>,
}

/// What the handlers share.
pub struct ServerState {
    pub synth: Arc<Synthesizer>,
    pub opts: ServeOptions,
    pub scheduler: scheduler::Scheduler,
    pub decoding: Arc<stream_decoding::StreamDecoding>,
    pub voices: voices::Registry,
    /// The workspace's voice (`"default"`), as `voiceclone speak` finds it without flags.
    pub default_voice: Option<Voice>,
    pub adapter_voices: Vec<AdapterVoice>,
    speaker_encoder: Mutex<Option<SpeakerEncoder>>,
    pub inflight: Arc<http::InFlight>,
    pub closing: AtomicBool,
}

impl ServerState {
    pub fn new(
        synth: Synthesizer,
        opts: ServeOptions,
        voices: voices::Registry,
        default_voice: Option<Voice>,
        adapter_voices: Vec<AdapterVoice>,
    ) -> Result<Self> {
        let synth = Arc::new(synth);
        let scheduler = scheduler::Scheduler::start(synth.clone(), opts.max_batch, opts.max_queue)?;
        let decoding = Arc::new(stream_decoding::StreamDecoding::start(synth.clone())?);
        Ok(ServerState {
            synth,
            opts,
            scheduler,
            decoding,
            voices,
            default_voice,
            adapter_voices,
            speaker_encoder: Mutex::new(None),
            inflight: Arc::new(http::InFlight::default()),
            closing: AtomicBool::new(false),
        })
    }

    /// The measured pace of `voice` in frames per text token (docs/model.md §7.2): a speaker
    /// of the model or an adapter voice whose export measured it; `None` for the others.
    pub fn pace_of(&self, voice: &Voice) -> Option<f64> {
        match voice {
            Voice::Speaker(name) => self.opts.speaker_paces.get(&name.to_lowercase()).copied(),
            Voice::Adapter { adapter, xvector } => self
                .adapter_voices
                .iter()
                .find(|a| {
                    matches!(&a.voice, Voice::Adapter { adapter: id, xvector: x }
                        if id == adapter && x == xvector)
                })
                .and_then(|a| a.pace),
            Voice::XVector(_) | Voice::Icl { .. } => None,
        }
    }

    /// The x-vector of a 24 kHz clip (the speaker encoder is loaded on first use).
    pub fn xvector(&self, wav24: &[f32]) -> Result<Vec<f32>> {
        let mut enc = self
            .speaker_encoder
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if enc.is_none() {
            *enc = Some(SpeakerEncoder::from_model(
                &self.synth.files.source,
                &Device::Cpu,
            )?);
        }
        enc.as_ref().expect("loaded above").embed(wav24, 24_000)
    }
}

/// Serves until SIGTERM or Ctrl-C, then lets in-flight requests finish (at most
/// `shutdown_grace`), ends what is left cleanly and returns. `ready` is called with the bound
/// address once the server accepts connections.
pub fn run(state: ServerState, ready: impl FnOnce(SocketAddr)) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("voiceclone-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let state = Arc::new(state);
    let result = rt.block_on(serve(state.clone(), ready));
    state.scheduler.end_all();
    state.scheduler.join();
    rt.shutdown_timeout(Duration::from_secs(2));
    result
}

async fn serve(state: Arc<ServerState>, ready: impl FnOnce(SocketAddr)) -> Result<()> {
    use hyper::server::conn::http1;
    use hyper_util::rt::TokioIo;
    use tokio::signal::unix::{signal, SignalKind};

    let addr = format!("{}:{}", state.opts.host, state.opts.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    let mut term = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    ready(local);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut open = 0usize;
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let st = state.clone();
                let mut stop = stop_rx.clone();
                let done = done_tx.clone();
                open += 1;
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, std::convert::Infallible>(api::handle(req, st).await) }
                    });
                    // A client that never finishes its request head is dropped after
                    // HEADER_TIMEOUT (its body is bounded in time by `api`).
                    let conn = http1::Builder::new()
                        .timer(hyper_util::rt::TokioTimer::new())
                        .header_read_timeout(HEADER_TIMEOUT)
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), service);
                    let mut conn = std::pin::pin!(conn);
                    tokio::select! {
                        r = conn.as_mut() => { if let Err(e) = r { tracing::debug!("connection: {e}"); } }
                        _ = stop.changed() => {
                            conn.as_mut().graceful_shutdown();
                            if let Err(e) = conn.await { tracing::debug!("connection: {e}"); }
                        }
                    }
                    let _ = done.send(());
                });
            }
            Some(()) = done_rx.recv() => { open -= 1; }
            _ = term.recv() => { eprintln!("SIGTERM: finishing in-flight requests"); break; }
            _ = int.recv() => { eprintln!("interrupted: finishing in-flight requests"); break; }
        }
    }
    drop(listener);
    state.closing.store(true, Ordering::SeqCst);
    state.scheduler.close();
    let _ = stop_tx.send(true);
    let deadline = Instant::now() + state.opts.shutdown_grace;
    let mut ended = false;
    while open > 0 {
        let now = Instant::now();
        if now >= deadline && !ended {
            let n = state.inflight.count();
            eprintln!("shutdown: ending {n} stream(s) still running");
            state.scheduler.end_all();
            ended = true;
        }
        let wait = if ended {
            Duration::from_secs(5)
        } else {
            deadline - now
        };
        match tokio::time::timeout(wait, done_rx.recv()).await {
            Ok(Some(())) => open -= 1,
            Ok(None) => break,
            Err(_) if ended => {
                eprintln!("shutdown: {open} connection(s) did not close; leaving them");
                break;
            }
            Err(_) => {}
        }
    }
    eprintln!("voiceclone serve stopped");
    Ok(())
}
