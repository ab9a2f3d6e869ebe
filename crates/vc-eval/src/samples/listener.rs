//! Which Whisper model transcribes the samples for their WER (docs/training.md §14.4): the one
//! `prep.whisper_model` names in a config file or flag, else the one `prep` used (its record,
//! `data/prep/whisper.json`), else the built-in default. Only a local file or one in the Hugging
//! Face cache is used — training never downloads it — and it is loaded when a sample is first
//! transcribed.

use std::sync::Arc;

use vc_core::artifacts::prep_whisper;
use vc_core::config::PrepConfig;
use vc_core::workspace::Workspace;
use vc_prep::transcribe::{resolve_whisper_spec, LazyWhisper};

use super::Listener;

/// The Whisper model for the samples, and where that choice came from (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WhisperChoice {
    /// A local path or a hub reference `owner/repo/file`.
    pub spec: String,
    pub origin: String,
}

/// The model of the precedence above. A record that cannot be read counts as none (the
/// samples' WER is a measure, not a reason to stop a run).
pub fn choose(ws: &Workspace, prep: &PrepConfig) -> WhisperChoice {
    let configured = || WhisperChoice {
        spec: resolve_whisper_spec(ws, &prep.whisper_model),
        origin: "prep.whisper_model".into(),
    };
    if prep.whisper_model_set {
        return configured();
    }
    let record = ws.prep_whisper();
    match prep_whisper::read(&record) {
        Ok(Some(used)) => WhisperChoice {
            spec: used.model,
            origin: format!("the model `prep` used, {}", ws.relative(&record)),
        },
        Ok(None) => configured(),
        Err(e) => WhisperChoice {
            origin: format!("prep.whisper_model, as {e:#}"),
            ..configured()
        },
    }
}

/// What transcribes the samples of a run in `ws`: [`choose`]'s model when it is at hand.
pub fn for_workspace(ws: &Workspace, prep: &PrepConfig) -> Listener {
    let choice = choose(ws, prep);
    match vc_core::hub::cached_single_file(&choice.spec) {
        Some(path) => Listener::Whisper(Arc::new(LazyWhisper::new(&path, &prep.language))),
        None => Listener::Missing(format!(
            "the Whisper model {} ({}) is neither a local file nor in the Hugging Face cache; \
             `voiceclone prep` downloads it",
            choice.spec, choice.origin
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vc_core::artifacts::prep_whisper::PrepWhisper;

    fn defaults() -> PrepConfig {
        vc_core::config::resolve_layers(vec![]).unwrap().config.prep
    }

    #[test]
    fn the_configured_model_then_the_one_prep_used_then_the_default() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open(dir.path()).unwrap();
        let default_spec = defaults().whisper_model;
        // Nothing recorded, nothing configured: the default, which is not at hand here.
        assert_eq!(choose(&ws, &defaults()).spec, default_spec);

        // prep ran with --whisper-model FILE: its record decides, and the file is used.
        let used = dir.path().join("elsewhere/ggml-tiny.en.bin");
        std::fs::create_dir_all(used.parent().unwrap()).unwrap();
        std::fs::write(&used, b"weights").unwrap();
        prep_whisper::write(
            &ws.prep_whisper(),
            &PrepWhisper {
                model: used.to_string_lossy().into_owned(),
            },
        )
        .unwrap();
        let choice = choose(&ws, &defaults());
        assert_eq!(choice.spec, used.to_string_lossy());
        assert!(
            choice.origin.contains("data/prep/whisper.json"),
            "{choice:?}"
        );
        assert!(matches!(
            for_workspace(&ws, &defaults()),
            Listener::Whisper(_)
        ));

        // A model named in a config file or flag wins, even the default's own name.
        let configured = PrepConfig {
            whisper_model_set: true,
            ..defaults()
        };
        let choice = choose(&ws, &configured);
        assert_eq!(choice.spec, default_spec);
        assert_eq!(choice.origin, "prep.whisper_model");
        let absent = PrepConfig {
            whisper_model: "nobody/nothing/ggml-none.bin".into(),
            whisper_model_set: true,
            ..defaults()
        };
        match for_workspace(&ws, &absent) {
            Listener::Missing(why) => assert!(
                why.contains("nobody/nothing/ggml-none.bin") && why.contains("prep.whisper_model"),
                "{why}"
            ),
            Listener::Whisper(_) => panic!("the configured model is not at hand"),
        }
    }
}
