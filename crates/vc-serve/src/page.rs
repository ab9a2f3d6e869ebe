//! The listening page at `GET /` (docs/serving.md §8): one self-contained HTML file
//! (`page.html`: markup, style and script, nothing loaded from elsewhere) that lists the voices,
//! speaks through the public speech API like any client and compares two voices. It is served
//! without the API key (it holds no secret; its API calls carry the key the user enters). What
//! it must know before its first call — whether a key is needed, the request defaults, the
//! languages, the sample rate — is written into it as it is served, from the values the request
//! parser uses, so the page keeps no copy of them.

use hyper::{Response, StatusCode};
use serde_json::{json, Value};

use super::http::{self, RespBody};
use super::speech_request::field_defaults;
use super::ServerState;

const TEMPLATE: &str = include_str!("page.html");
const CONFIG_SLOT: &str = "{{VOICECLONE_PAGE_CONFIG}}";

/// The browser may run the page's own inline script and style, call this server and play the
/// audio it assembled, nothing else: a remote resource would be refused even if one slipped in.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; \
     style-src 'unsafe-inline'; connect-src 'self' blob:; media-src blob:; img-src data:; \
     base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Whether `path` is the page.
pub fn is_page(path: &str) -> bool {
    matches!(path, "/" | "/index.html")
}

/// What the page is told when it is served.
fn config(state: &ServerState) -> Value {
    let languages: Vec<&String> = state
        .synth
        .config()
        .talker_config
        .codec_language_id
        .keys()
        .collect();
    json!({
        "auth": state.opts.api_key.is_some(),
        "model": state.opts.model_id,
        "sample_rate": state.synth.codec.output_sample_rate(),
        "max_input_chars": state.opts.max_input_chars,
        "languages": languages,
        "defaults": field_defaults(&state.opts),
    })
}

/// The page with `config` in its JSON slot. `<`, `>` and `&` are escaped so no value (a model
/// directory's name) can close the script element it sits in.
fn render(config: &Value) -> String {
    let json = config
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    TEMPLATE.replacen(CONFIG_SLOT, &json, 1)
}

/// `GET /`: the page.
pub fn response(state: &ServerState) -> Response<RespBody> {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/html; charset=utf-8")
        .header("cache-control", "no-cache")
        .header("content-security-policy", CONTENT_SECURITY_POLICY)
        .header("x-content-type-options", "nosniff")
        .header("referrer-policy", "no-referrer")
        .body(http::full(render(&config(state))))
        .expect("static response parts")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_has_one_config_slot_in_a_json_script() {
        assert_eq!(TEMPLATE.matches(CONFIG_SLOT).count(), 1);
        assert!(TEMPLATE.contains(&format!(
            "<script type=\"application/json\" id=\"vc-config\">{CONFIG_SLOT}</script>"
        )));
    }

    /// Self-contained: no address of another host anywhere, no external script, style, font or
    /// image (the browser test checks the page works; this keeps it from reaching out).
    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        let lower = TEMPLATE.to_ascii_lowercase();
        for needle in ["http://", "https://", "//cdn", "<link rel=\"stylesheet"] {
            assert!(!lower.contains(needle), "the page contains {needle:?}");
        }
        let style = lower.split("<style>").nth(1).unwrap();
        let style = style.split("</style>").next().unwrap();
        for needle in ["@import", "url(", "@font-face"] {
            assert!(!style.contains(needle), "the style has {needle:?}");
        }
        for attr in ["src=\"", "href=\""] {
            for value in lower.split(attr).skip(1) {
                let v = value.split('"').next().unwrap_or_default();
                assert!(v.starts_with("data:"), "{attr}{v}\" loads a resource");
            }
        }
    }

    #[test]
    fn config_values_cannot_end_the_script_element() {
        let page = render(&json!({"model": "</script><script>alert(1)</script>&"}));
        let slot = page
            .split("id=\"vc-config\">")
            .nth(1)
            .and_then(|s| s.split("</script>").next())
            .unwrap();
        assert!(!slot.contains('<') && !slot.contains('&'), "{slot}");
        let back: Value = serde_json::from_str(slot).unwrap();
        assert_eq!(back["model"], "</script><script>alert(1)</script>&");
    }
}
