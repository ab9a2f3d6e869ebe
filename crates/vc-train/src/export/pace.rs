//! The speaking pace of each exported speaker (docs/model.md §7.2): frames per text token over
//! its utterances in the training manifest. The export records it in its marker
//! (`voiceclone-export.json`, field [`FIELD`]: `{NAME: {"frames_per_token", "utterances"}}` by
//! lower-cased speaker name); `speak` and `serve` read it back to size each chunk's frame
//! budget. This module owns the field: what it holds, how it is measured, how it is read.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use vc_core::artifacts::manifest::Manifest;
use vc_core::artifacts::speaker::name_key;
use vc_model::text::TextTokenizer;

/// The marker's field.
pub const FIELD: &str = "speaking_pace";

/// One speaker's pace.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpeakingPace {
    /// Frames of all its utterances over their text tokens (the tokens of the text inside its
    /// prompt, as a chunk's are counted when it is spoken).
    pub frames_per_token: f64,
    /// How many utterances it was measured on.
    pub utterances: usize,
}

/// The pace of every speaker of `manifest` (lower-cased names; `None`: the one unnamed
/// speaker), over its lines with a text and codes.
pub fn measure(
    manifest: &Path,
    tokenizer: &TextTokenizer,
) -> Result<BTreeMap<Option<String>, SpeakingPace>> {
    // (frames, tokens, utterances) per speaker
    let mut sums: BTreeMap<Option<String>, (usize, usize, usize)> = BTreeMap::new();
    for (line, row) in Manifest::read(manifest)?.rows() {
        let (Some(text), Some(frames)) = (
            row.text.as_deref().map(str::trim).filter(|t| !t.is_empty()),
            row.audio_codes.as_ref().and_then(|c| c.frames()),
        ) else {
            continue;
        };
        let tokens = tokenizer
            .assistant_prompt(text)
            .with_context(|| format!("{}:{line}: cannot tokenize the text", manifest.display()))?
            .text()
            .len();
        let sum = sums
            .entry(row.speaker.as_deref().map(name_key))
            .or_default();
        *sum = (sum.0 + frames.len(), sum.1 + tokens, sum.2 + 1);
    }
    Ok(sums
        .into_iter()
        .filter(|(_, (_, tokens, _))| *tokens > 0)
        .map(|(speaker, (frames, tokens, utterances))| {
            let pace = SpeakingPace {
                frames_per_token: frames as f64 / tokens as f64,
                utterances,
            };
            (speaker, pace)
        })
        .collect())
}

/// The paces an export in `dir` records, by lower-cased speaker name; empty when it records
/// none (an export made before the field existed, a hub model) or cannot be read.
pub fn read(dir: &Path) -> BTreeMap<String, SpeakingPace> {
    super::marker::read_marker(dir)
        .and_then(|m| serde_json::from_value(m.get(FIELD)?.clone()).ok())
        .unwrap_or_default()
}

/// The paces of the exported `speakers` (lower-cased names, in row order) from `measured`: the
/// one unnamed speaker's when the export has one speaker and the manifest names none.
pub fn of_speakers(
    measured: &BTreeMap<Option<String>, SpeakingPace>,
    speakers: &[String],
) -> BTreeMap<String, SpeakingPace> {
    speakers
        .iter()
        .filter_map(|name| {
            let own = measured.get(&Some(name.clone()));
            let unnamed = (speakers.len() == 1).then(|| measured.get(&None)).flatten();
            own.or(unnamed).map(|p| (name.clone(), *p))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> TextTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-0b6");
        TextTokenizer::from_model(&vc_core::hub::ModelSource::Local(dir)).unwrap()
    }

    fn line(text: &str, frames: usize, speaker: Option<&str>) -> String {
        let codes = vec![vec![1u32; 16]; frames];
        let mut v = serde_json::json!({"audio": "a.wav", "text": text, "audio_codes": codes});
        if let Some(s) = speaker {
            v["speaker"] = s.into();
        }
        v.to_string()
    }

    #[test]
    fn each_speaker_is_measured_over_its_own_lines() {
        let t = tokenizer();
        let tokens = |s: &str| t.assistant_prompt(s).unwrap().text().len();
        let (a, b, c) = ("Hello there.", "A longer line of text to speak.", "Hi.");
        let dir = tempfile::tempdir().unwrap();
        let manifest = dir.path().join("train.jsonl");
        let lines = [
            line(a, 20, Some("Alice")),
            line(b, 50, Some("alice")),
            line(c, 9, Some("Bob")),
            // No codes yet, or no text: not measured.
            serde_json::json!({"audio": "x.wav", "text": a, "speaker": "Bob"}).to_string(),
            line("", 30, Some("Bob")),
        ];
        std::fs::write(&manifest, lines.join("\n") + "\n").unwrap();
        let got = measure(&manifest, &t).unwrap();
        let alice = got[&Some("alice".to_string())];
        assert_eq!(alice.utterances, 2);
        assert_eq!(
            alice.frames_per_token,
            70.0 / (tokens(a) + tokens(b)) as f64
        );
        let bob = got[&Some("bob".to_string())];
        assert_eq!(
            (bob.utterances, bob.frames_per_token),
            (1, 9.0 / tokens(c) as f64)
        );
        assert_eq!(got.len(), 2);

        // The exported speakers take their own; an unnamed speaker's is used for the one
        // speaker of its export, under the exported name.
        let picked = of_speakers(&got, &["bob".into(), "carol".into()]);
        assert_eq!(picked.keys().collect::<Vec<_>>(), ["bob"]);
        let unnamed = BTreeMap::from([(None, alice)]);
        assert_eq!(of_speakers(&unnamed, &["speaker".into()])["speaker"], alice);
        assert!(of_speakers(&unnamed, &["a".into(), "b".into()]).is_empty());
    }
}
