//! Speech recognition behind a small trait, so the segmenter and the pipeline can be tested
//! without a Whisper model; the real implementation wraps whisper.cpp through whisper-rs.

use std::path::Path;
use std::sync::{Mutex, Once};

use anyhow::{anyhow, Context, Result};
use vc_core::workspace::Workspace;
use whisper_rs::{
    FullParams, SamplingStrategy, WhisperContext, WhisperContextParameters, WhisperState,
};

/// One recognised word with its time span in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Word {
    pub text: String,
    pub start: f64,
    pub end: f64,
}

/// One recognised segment (Whisper's unit, usually a sentence or phrase).
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    pub start: f64,
    pub end: f64,
    pub text: String,
    pub no_speech_prob: f64,
    /// Word timings inside the segment, used to split segments that are too long.
    pub words: Vec<Word>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Transcript {
    pub segments: Vec<Segment>,
    /// Whisper's full language name, e.g. "english".
    pub language: String,
}

/// Turns 16 kHz mono speech into timed text. prep calls it once per piece of a recording
/// (`super::chunk`, at most 30 s), from several threads at once.
pub trait Transcriber: Send + Sync {
    fn transcribe(&self, samples_16k: &[f32], threads: usize) -> Result<Transcript>;
}

/// Whisper's window: 30 s of audio in 1500 encoder positions of 20 ms.
const WINDOW_POSITIONS: usize = 1500;
const SAMPLES_PER_POSITION: usize = 320;
/// Encoder positions of quiet after the end of the audio (whisper.cpp pads with zeros): the
/// decoder sees that the speech has ended, as it does at the end of a 30 s training window.
/// With the rounding below the tail is 38 to 53 positions (0.76–1.06 s). tiny.en is sensitive
/// to it on the test speech: tails of 38–54 positions give the same words, while 56–70 made it
/// repeat one sentence of `speech/prep2` four times, and tails of 20–34 lost words
/// (docs/performance.md §6).
const TAIL_POSITIONS: usize = 38;
/// The window is rounded up to a multiple of this many positions: ggml's tiled matrix kernels
/// (llamafile's, docs/performance.md §6) take the attention's products only when the window
/// length is a multiple of 16; otherwise ggml computes them one dot product per element, and
/// prep takes about a quarter longer.
const WINDOW_GRANULE: usize = 16;

/// The encoder window (`audio_ctx`, in 20 ms positions) for `samples` at 16 kHz: the audio
/// plus [`TAIL_POSITIONS`], or the full window (0 = whisper.cpp's default) when that would
/// not be shorter.
pub fn audio_ctx(samples: usize) -> i32 {
    let needed =
        (samples.div_ceil(SAMPLES_PER_POSITION) + TAIL_POSITIONS).next_multiple_of(WINDOW_GRANULE);
    if needed >= WINDOW_POSITIONS {
        0
    } else {
        needed as i32
    }
}

/// whisper.cpp through whisper-rs: one shared model, and decoder states kept for reuse (one
/// per thread that transcribes at the same time), since building one allocates its caches.
pub struct WhisperTranscriber {
    context: WhisperContext,
    language: Option<String>,
    states: Mutex<Vec<WhisperState>>,
}

impl WhisperTranscriber {
    /// Loads a ggml Whisper model. `language` is "auto" or a Whisper language code.
    pub fn load(model: &Path, language: &str) -> Result<Self> {
        static HOOKS: Once = Once::new();
        // Route whisper.cpp's chatter through `tracing` (visible with -v) instead of stderr.
        HOOKS.call_once(whisper_rs::install_logging_hooks);
        let language = match language {
            "auto" => None,
            code => {
                if whisper_rs::get_lang_id(code).is_none() {
                    return Err(anyhow!(
                        "prep.language: {code:?} is not a language Whisper knows"
                    ));
                }
                Some(code.to_string())
            }
        };
        let path = model
            .to_str()
            .ok_or_else(|| anyhow!("Whisper model path {} is not valid UTF-8", model.display()))?;
        // Flash attention stays off (whisper-rs's default): on the CPU, ggml's kernel made
        // prep about 15 % slower with tiny.en on 2 cores.
        let context = WhisperContext::new_with_params(path, WhisperContextParameters::default())
            .map_err(|e| anyhow!("cannot load Whisper model {}: {e}", model.display()))?;
        tracing::info!("whisper.cpp runs {}", super::ggml_cpu::backend());
        if language.is_none() && !context.is_multilingual() {
            tracing::info!("English-only Whisper model: transcribing as English");
        }
        Ok(WhisperTranscriber {
            context,
            language,
            states: Mutex::new(Vec::new()),
        })
    }
}

/// A Whisper model loaded when it first transcribes: what training holds for its samples' WER
/// (docs/training.md §14.4), so that a run that never speaks a sample never loads it. A model
/// that fails to load fails every transcription with the same error.
pub struct LazyWhisper {
    model: std::path::PathBuf,
    language: String,
    loaded: std::sync::OnceLock<std::result::Result<WhisperTranscriber, String>>,
}

impl LazyWhisper {
    /// `model` and `language` as [`WhisperTranscriber::load`] takes them.
    pub fn new(model: &Path, language: &str) -> Self {
        LazyWhisper {
            model: model.to_path_buf(),
            language: language.to_string(),
            loaded: std::sync::OnceLock::new(),
        }
    }
}

impl Transcriber for LazyWhisper {
    fn transcribe(&self, samples_16k: &[f32], threads: usize) -> Result<Transcript> {
        let loaded = self.loaded.get_or_init(|| {
            WhisperTranscriber::load(&self.model, &self.language).map_err(|e| format!("{e:#}"))
        });
        match loaded {
            Ok(w) => w.transcribe(samples_16k, threads),
            Err(e) => Err(anyhow!("{e}")),
        }
    }
}

impl Transcriber for WhisperTranscriber {
    fn transcribe(&self, samples_16k: &[f32], threads: usize) -> Result<Transcript> {
        // A panic elsewhere cannot leave a pooled state half-used: states are only ever
        // pushed after a finished call, so a poisoned pool is still a good pool.
        let pooled = self
            .states
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .pop();
        let mut state = match pooled {
            Some(state) => state,
            None => self
                .context
                .create_state()
                .map_err(|e| anyhow!("cannot create a Whisper decoder state: {e}"))?,
        };
        let result = self.run(&mut state, samples_16k, threads);
        self.states
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(state);
        result
    }
}

impl WhisperTranscriber {
    fn run(
        &self,
        state: &mut WhisperState,
        samples_16k: &[f32],
        threads: usize,
    ) -> Result<Transcript> {
        let mut params = FullParams::new(SamplingStrategy::Greedy { best_of: 1 });
        params.set_n_threads(threads.max(1) as i32);
        params.set_audio_ctx(audio_ctx(samples_16k.len()));
        let language = match (&self.language, self.context.is_multilingual()) {
            (Some(code), _) => Some(code.as_str()),
            (None, true) => Some("auto"),
            (None, false) => Some("en"),
        };
        params.set_language(language);
        params.set_print_special(false);
        params.set_print_progress(false);
        params.set_print_realtime(false);
        params.set_print_timestamps(false);
        params.set_suppress_blank(true);
        params.set_token_timestamps(true);
        state
            .full(params, samples_16k)
            .map_err(|e| anyhow!("Whisper failed: {e}"))?;

        let lang_id = state.full_lang_id_from_state();
        let language = whisper_rs::get_lang_str_full(lang_id)
            .unwrap_or("english")
            .to_string();
        let mut segments = Vec::new();
        for segment in state.as_iter() {
            let text = segment
                .to_str_lossy()
                .context("cannot read a Whisper segment")?
                .trim()
                .to_string();
            let mut words: Vec<Word> = Vec::new();
            for t in 0..segment.n_tokens() {
                let Some(token) = segment.get_token(t) else {
                    continue;
                };
                let piece = token.to_str_lossy().unwrap_or_default().into_owned();
                // Special tokens ([_BEG_], [_TT_123], <|endoftext|>) carry no text.
                if piece.starts_with("[_") || piece.starts_with("<|") {
                    continue;
                }
                let data = token.token_data();
                let (t0, t1) = (data.t0 as f64 / 100.0, data.t1 as f64 / 100.0);
                // A leading space starts a new word; other pieces continue the current one.
                match words.last_mut() {
                    Some(w) if !piece.starts_with(' ') => {
                        w.text.push_str(&piece);
                        w.end = w.end.max(t1);
                    }
                    _ => {
                        if piece.trim().is_empty() {
                            continue;
                        }
                        words.push(Word {
                            text: piece.trim_start().to_string(),
                            start: t0,
                            end: t1.max(t0),
                        })
                    }
                }
            }
            segments.push(Segment {
                start: segment.start_timestamp() as f64 / 100.0,
                end: segment.end_timestamp() as f64 / 100.0,
                text,
                no_speech_prob: segment.no_speech_probability() as f64,
                words,
            });
        }
        Ok(Transcript { segments, language })
    }
}

/// A relative Whisper path that exists in the workspace is local; anything else is passed on
/// (absolute paths, and hub references like owner/repo/file).
pub fn resolve_whisper_spec(ws: &Workspace, spec: &str) -> String {
    let local = ws.config_path(spec);
    if local.exists() {
        local.to_string_lossy().into_owned()
    } else {
        spec.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoder_window_follows_the_audio_up_to_the_full_window() {
        // 10 s = 500 positions, plus the quiet tail, rounded up to the kernels' granule.
        for (samples, positions) in [(160_000, 500), (1, 1), (160_000 + 5 * 320, 505)] {
            let window = audio_ctx(samples) as usize;
            assert_eq!(window % WINDOW_GRANULE, 0, "{samples} samples");
            assert!(window >= positions + TAIL_POSITIONS, "{samples} samples");
            assert!(window < positions + TAIL_POSITIONS + WINDOW_GRANULE);
        }
        // 29.5 s + tail would not fit: whisper.cpp's full 30 s window.
        assert_eq!(audio_ctx(29 * 16_000 + 8_000), 0);
        assert_eq!(audio_ctx(60 * 16_000), 0);
        // The longest piece prep cuts still gets a window of its own.
        let longest = (super::super::chunk::MAX_CHUNK_SECONDS * 16_000.0) as usize;
        assert!(audio_ctx(longest) > 0);
    }
}
