//! The body of `POST /v1/audio/speech` (docs/serving.md §2): its fields as a serde type that
//! refuses unknown ones, then each checked — types, ranges, the server's voices and limits —
//! into the [`SpeechParams`] a request runs with. Fields are kept as the JSON values sent, so a
//! wrong type is reported with the field's name (serde's own message would give a column).

use serde::Deserialize;
use serde_json::Value;

use super::audio_out::{Format, Framing};
use super::http::ApiError;
use super::ServerState;
use vc_generate::sampling::Sampling;
use vc_generate::{DecodeOptions, Voice};

/// The fields a speech request may have, as sent (serde reads `null` as absent). `model`,
/// `input`, `voice`, `response_format`, `speed`, `stream_format` and `instructions` are
/// OpenAI's; the rest are ours.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SpeechBody {
    model: Option<Value>,
    input: Option<Value>,
    voice: Option<Value>,
    response_format: Option<Value>,
    speed: Option<Value>,
    stream_format: Option<Value>,
    instructions: Option<Value>,
    language: Option<Value>,
    seed: Option<Value>,
    greedy: Option<Value>,
    temperature: Option<Value>,
    top_k: Option<Value>,
    top_p: Option<Value>,
    repetition_penalty: Option<Value>,
    sub_temperature: Option<Value>,
    sub_top_k: Option<Value>,
    sub_top_p: Option<Value>,
    max_frames: Option<Value>,
    non_streaming: Option<Value>,
    stream: Option<Value>,
}

/// The refusal of a field [`SpeechBody`] does not have, from serde's message ("unknown field
/// `x`, expected one of `a`, `b`"): the only error a body that is a JSON object can give it.
fn unknown_field(serde_message: &str) -> ApiError {
    let mut quoted = serde_message.split('`').skip(1).step_by(2);
    let field = quoted.next().unwrap_or_default().to_string();
    let known: Vec<&str> = quoted.collect();
    ApiError::invalid(
        Some(&field),
        "unknown_parameter",
        format!("unknown field {field:?} (known: {})", known.join(", ")),
    )
}

fn field_type(param: &str, want: &str) -> ApiError {
    ApiError::invalid(
        Some(param),
        "invalid_type",
        format!("{param:?} must be {want}"),
    )
}

/// A speech request, validated.
pub struct SpeechParams {
    pub input: String,
    pub voice: Voice,
    pub format: Format,
    pub framing: Framing,
    pub language: Option<String>,
    pub seed: Option<u64>,
    pub non_streaming: Option<bool>,
    /// Our `stream` field: a WAV sent as it is generated (placeholder sizes) instead of whole.
    pub stream: bool,
    pub opts: DecodeOptions,
}

/// Reads and checks the JSON body of `POST /v1/audio/speech` against the server's voices and
/// limits; every refusal names the field (`param`) and says what was wrong.
pub fn parse_speech(state: &ServerState, body: &[u8]) -> Result<SpeechParams, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            None,
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    if !v.is_object() {
        return Err(ApiError::invalid(
            None,
            "invalid_json",
            "the request body must be a JSON object",
        ));
    }
    let body: SpeechBody = serde_json::from_value(v).map_err(|e| unknown_field(&e.to_string()))?;
    let string = |k: &str, v: &Option<Value>| -> Result<Option<String>, ApiError> {
        match v {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(field_type(k, "a string")),
        }
    };
    let number = |k: &str, v: &Option<Value>| -> Result<Option<f64>, ApiError> {
        match v {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(_) => Err(field_type(k, "a number")),
        }
    };
    let count = |k: &str, v: &Option<Value>| -> Result<Option<u64>, ApiError> {
        match v {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_u64()
                .map(Some)
                .ok_or_else(|| field_type(k, "a non-negative integer")),
            Some(_) => Err(field_type(k, "a non-negative integer")),
        }
    };
    let boolean = |k: &str, v: &Option<Value>| -> Result<Option<bool>, ApiError> {
        match v {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(field_type(k, "true or false")),
        }
    };

    match string("model", &body.model)? {
        Some(m) if !m.trim().is_empty() => {}
        _ => {
            return Err(ApiError::invalid(
                Some("model"),
                "missing_required_parameter",
                format!(
                    "\"model\" is required (this server has one model, {:?}; any name is accepted)",
                    state.opts.model_id
                ),
            ))
        }
    }
    let input = string("input", &body.input)?.unwrap_or_default();
    if input.trim().is_empty() {
        return Err(ApiError::invalid(
            Some("input"),
            "empty_input",
            "\"input\" is missing or empty: give the text to speak",
        ));
    }
    let chars = input.chars().count();
    if chars > state.opts.max_input_chars {
        return Err(ApiError::invalid(
            Some("input"),
            "string_above_max_length",
            format!(
                "\"input\" has {chars} characters; this server takes at most {}",
                state.opts.max_input_chars
            ),
        ));
    }
    let voice_name = string("voice", &body.voice)?.ok_or_else(|| {
        ApiError::invalid(
            Some("voice"),
            "missing_required_parameter",
            format!(
                "\"voice\" is required: one of {} or a registered voice id",
                voice_names(state).join(", ")
            ),
        )
    })?;
    let voice = resolve_voice(state, &voice_name)?;
    let format = match string("response_format", &body.response_format)?.as_deref() {
        None | Some("wav") => Format::Wav,
        Some("pcm") => Format::Pcm,
        Some("flac") => {
            return Err(ApiError::invalid(
                Some("response_format"),
                "unsupported_response_format",
                "response_format \"flac\" is not available: this build has no FLAC encoder; \
                 use \"wav\" or \"pcm\"",
            ))
        }
        Some(other) => {
            return Err(ApiError::invalid(
                Some("response_format"),
                "unsupported_response_format",
                format!(
                    "response_format {other:?} is not supported: use \"wav\" (the default) or \
                     \"pcm\" (16-bit little-endian, 24 kHz, mono)"
                ),
            ))
        }
    };
    if let Some(speed) = number("speed", &body.speed)? {
        if speed != 1.0 {
            return Err(ApiError::invalid(
                Some("speed"),
                "unsupported_speed",
                format!(
                    "speed {speed} is not supported: the model speaks at its own pace, only 1.0 \
                     is accepted"
                ),
            ));
        }
    }
    let framing = match string("stream_format", &body.stream_format)?.as_deref() {
        None | Some("audio") => Framing::Audio,
        Some("sse") => Framing::Sse,
        Some(other) => {
            return Err(ApiError::invalid(
                Some("stream_format"),
                "invalid_value",
                format!("stream_format {other:?} is not \"audio\" or \"sse\""),
            ))
        }
    };
    if let Some(i) = string("instructions", &body.instructions)? {
        if !i.trim().is_empty() {
            return Err(ApiError::invalid(
                Some("instructions"),
                "unsupported_parameter",
                "\"instructions\" are not supported: this model speaks in the voice it was \
                 trained or cloned with, without style instructions",
            ));
        }
    }
    let mut opts = state.opts.defaults.clone();
    let positive = |k: &str, v: Option<f64>| -> Result<Option<f64>, ApiError> {
        match v {
            Some(x) if !(x > 0.0 && x.is_finite()) => Err(ApiError::invalid(
                Some(k),
                "invalid_value",
                format!("{k:?} must be a positive number, not {x}"),
            )),
            other => Ok(other),
        }
    };
    let unit = |k: &str, v: Option<f64>| -> Result<Option<f64>, ApiError> {
        match v {
            Some(x) if !(x > 0.0 && x <= 1.0) => Err(ApiError::invalid(
                Some(k),
                "invalid_value",
                format!("{k:?} must be in (0, 1], not {x}"),
            )),
            other => Ok(other),
        }
    };
    if let Some(t) = positive("temperature", number("temperature", &body.temperature)?)? {
        opts.code0.temperature = t;
    }
    if let Some(t) = positive(
        "sub_temperature",
        number("sub_temperature", &body.sub_temperature)?,
    )? {
        opts.sub_codes.temperature = t;
    }
    if let Some(p) = unit("top_p", number("top_p", &body.top_p)?)? {
        opts.code0.top_p = p;
    }
    if let Some(p) = unit("sub_top_p", number("sub_top_p", &body.sub_top_p)?)? {
        opts.sub_codes.top_p = p;
    }
    if let Some(p) = positive(
        "repetition_penalty",
        number("repetition_penalty", &body.repetition_penalty)?,
    )? {
        opts.repetition_penalty = p;
    }
    if let Some(k) = count("top_k", &body.top_k)? {
        opts.code0.top_k = k as usize;
    }
    if let Some(k) = count("sub_top_k", &body.sub_top_k)? {
        opts.sub_codes.top_k = k as usize;
    }
    if boolean("greedy", &body.greedy)? == Some(true) {
        opts.code0 = Sampling::GREEDY;
        opts.sub_codes = Sampling::GREEDY;
    }
    if let Some(m) = count("max_frames", &body.max_frames)? {
        if m == 0 || m > state.opts.defaults.max_frames as u64 {
            return Err(ApiError::invalid(
                Some("max_frames"),
                "invalid_value",
                format!(
                    "\"max_frames\" must be between 1 and {} (the model's limit)",
                    state.opts.defaults.max_frames
                ),
            ));
        }
        opts.max_frames = m as usize;
        // The request's limit wins over the runaway guard's budget (docs/model.md §7.2).
        opts.runaway.budget = false;
    }
    let seed = count("seed", &body.seed)?;
    Ok(SpeechParams {
        input,
        voice,
        format,
        framing,
        language: string("language", &body.language)?,
        seed,
        non_streaming: boolean("non_streaming", &body.non_streaming)?,
        stream: boolean("stream", &body.stream)?.unwrap_or(false),
        opts,
    })
}

/// What each optional sampling field of a speech request is when the request leaves it out:
/// the server's defaults from `[speak]` and the model (`ServeOptions::defaults`), named as
/// [`parse_speech`] reads them, for the listening page (docs/serving.md §8) — so the page shows
/// the numbers the parser uses and keeps no copy of its own. `greedy` is true when neither
/// code sampler samples (then the sampling fields change nothing).
pub fn field_defaults(opts: &super::ServeOptions) -> Value {
    let d = &opts.defaults;
    serde_json::json!({
        "language": opts.language,
        "greedy": !d.code0.do_sample && !d.sub_codes.do_sample,
        "temperature": d.code0.temperature,
        "top_k": d.code0.top_k,
        "top_p": d.code0.top_p,
        "repetition_penalty": d.repetition_penalty,
        "sub_temperature": d.sub_codes.temperature,
        "sub_top_k": d.sub_codes.top_k,
        "sub_top_p": d.sub_codes.top_p,
        "max_frames": d.max_frames,
        "non_streaming": match opts.non_streaming {
            vc_core::config::NonStreaming::True => "true",
            vc_core::config::NonStreaming::False => "false",
            vc_core::config::NonStreaming::Auto => "auto",
        },
    })
}

/// The voices a speech request may name.
fn voice_names(state: &ServerState) -> Vec<String> {
    let mut names = Vec::new();
    if state.default_voice.is_some() {
        names.push("default".to_string());
    }
    names.extend(state.synth.speakers());
    names.extend(state.adapter_voices.iter().map(|a| a.name.clone()));
    names
}

/// The voice a request names: a registered voice id, `default`, one of the model's speakers or
/// an adapter's voice (names compared without case).
fn resolve_voice(state: &ServerState, name: &str) -> Result<Voice, ApiError> {
    if let Some(e) = state.voices.get(name) {
        return Ok(e.voice());
    }
    if name == "default" {
        if let Some(v) = &state.default_voice {
            return Ok(v.clone());
        }
    }
    if let Some(s) = state
        .synth
        .speakers()
        .into_iter()
        .find(|s| s.eq_ignore_ascii_case(name))
    {
        return Ok(Voice::Speaker(s));
    }
    if let Some(a) = state
        .adapter_voices
        .iter()
        .find(|a| a.name.eq_ignore_ascii_case(name))
    {
        return Ok(a.voice.clone());
    }
    let names = voice_names(state);
    Err(ApiError::invalid(
        Some("voice"),
        "voice_not_found",
        format!(
            "unknown voice {name:?}: this server has {}{}",
            if names.is_empty() {
                "no named voice".to_string()
            } else {
                names.join(", ")
            },
            match state.voices.list().len() {
                0 => String::new(),
                n => format!(" and {n} registered voice id(s) (GET /v1/voices)"),
            }
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The accessors above have no arm for `null`: serde must read it as an absent field.
    #[test]
    fn null_fields_read_as_absent() {
        let v = serde_json::json!({"model": null, "seed": null, "input": "Hi."});
        let body: SpeechBody = serde_json::from_value(v).unwrap();
        assert!(body.model.is_none() && body.seed.is_none());
        assert_eq!(body.input, Some(Value::String("Hi.".into())));
    }

    /// The page fills its settings from these and sends them back under the same names: each
    /// must be a field a request may have.
    #[test]
    fn field_defaults_are_named_as_request_fields() {
        let gen = vc_model::files::GenerationConfig::default();
        let opts = super::super::ServeOptions {
            host: "127.0.0.1".into(),
            port: 0,
            api_key: None,
            max_batch: 1,
            max_queue: 1,
            max_input_chars: 10,
            max_body_bytes: 10,
            max_voice_seconds: 1.0,
            max_voices: 1,
            shutdown_grace: std::time::Duration::ZERO,
            defaults: DecodeOptions::from_generation_config(&gen),
            language: "auto".into(),
            non_streaming: vc_core::config::NonStreaming::Auto,
            model_id: "m".into(),
            speaker_paces: Default::default(),
        };
        let d = field_defaults(&opts);
        assert_eq!(d["temperature"], gen.temperature);
        assert_eq!(d["sub_top_k"], gen.subtalker_top_k);
        assert_eq!(d["greedy"], false);
        let mut body = d.as_object().unwrap().clone();
        body.insert("model".into(), "m".into());
        let parsed = serde_json::from_value::<SpeechBody>(Value::Object(body));
        assert!(parsed.is_ok(), "{:?}", parsed.err());
    }

    #[test]
    fn an_unknown_field_is_named_with_the_known_ones() {
        let v = serde_json::json!({"model": "m", "bogus": 1});
        let Err(e) = serde_json::from_value::<SpeechBody>(v) else {
            panic!("an unknown field was accepted");
        };
        let err = unknown_field(&e.to_string());
        assert_eq!(err.param.as_deref(), Some("bogus"));
        assert_eq!(err.code, Some("unknown_parameter"));
        let msg = err.message;
        assert!(
            msg.starts_with("unknown field \"bogus\" (known: model, input, voice,"),
            "{msg}"
        );
        assert!(msg.ends_with("non_streaming, stream)"), "{msg}");
    }
}
