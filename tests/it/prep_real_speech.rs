//! `voiceclone prep` on real speech (Asterisk prompts, one speaker) in a mix of formats and
//! sample rates: format and duration of every utterance, a valid manifest, and transcripts
//! within 20 % word error rate of the packages' own transcripts.

use crate::common;

use std::collections::BTreeMap;

use common::*;
use serde_json::Value;

#[test]
fn wer_helper_counts_edits() {
    let w = |s: &str| normalize_words(s);
    assert_eq!(word_errors(&w("the cat sat"), &w("The cat, sat!")), 0);
    assert_eq!(word_errors(&w("the cat sat"), &w("a cat sat down")), 2);
    assert_eq!(word_errors(&w("one two"), &w("")), 2);
}

#[test]
fn prep_on_mixed_real_speech() {
    if !common::have_assets() {
        return;
    }
    let input = assets().join("speech/prep2");
    let refs = transcripts(&input);
    let before = snapshot(&input);
    let ws = tempfile::tempdir().unwrap();
    let model = whisper_model();
    let out = voiceclone(
        ws.path(),
        &[
            "prep",
            input.to_str().unwrap(),
            "--whisper-model",
            model.to_str().unwrap(),
            "--language",
            "en",
        ],
    );
    assert!(out.status.success(), "prep failed:\n{}", stderr(&out));
    assert_eq!(snapshot(&input), before, "prep wrote into the input folder");

    let manifest = std::fs::read_to_string(ws.path().join("data/train.jsonl")).unwrap();
    let rows: Vec<Value> = manifest
        .lines()
        .map(|l| serde_json::from_str(l).expect("manifest line is JSON"))
        .collect();
    assert!(rows.len() >= 10, "only {} utterances", rows.len());

    let mut hypotheses: BTreeMap<String, Vec<(f64, String)>> = BTreeMap::new();
    let mut total = 0.0;
    for row in &rows {
        for key in ["audio", "text", "ref_audio", "source", "language"] {
            assert!(row[key].is_string(), "field {key} missing in {row}");
        }
        for key in ["duration", "start", "end"] {
            assert!(row[key].is_number(), "field {key} missing in {row}");
        }
        assert_eq!(row["ref_audio"], "data/ref.wav");
        let wav = ws.path().join(row["audio"].as_str().unwrap());
        let reader =
            hound::WavReader::open(&wav).unwrap_or_else(|e| panic!("{}: {e}", wav.display()));
        let spec = reader.spec();
        assert_eq!(
            (spec.sample_rate, spec.channels, spec.bits_per_sample),
            (24000, 1, 16),
            "{}",
            wav.display()
        );
        assert_eq!(spec.sample_format, hound::SampleFormat::Int);
        let secs = reader.duration() as f64 / 24000.0;
        assert!((1.0..=15.0).contains(&secs), "{}: {secs} s", wav.display());
        assert!((secs - row["duration"].as_f64().unwrap()).abs() < 0.002);
        total += secs;
        let source = row["source"].as_str().unwrap();
        let name = std::path::Path::new(source)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        hypotheses.entry(name).or_default().push((
            row["start"].as_f64().unwrap(),
            row["text"].as_str().unwrap().to_string(),
        ));
    }
    let ref_wav = hound::WavReader::open(ws.path().join("data/ref.wav")).unwrap();
    let ref_secs = ref_wav.duration() as f64 / 24000.0;
    assert!(
        (3.0..=10.0).contains(&ref_secs),
        "reference clip lasts {ref_secs} s"
    );

    // Word error rate over every source file, against the package transcripts.
    let (mut errors, mut words) = (0, 0);
    for (file, text) in &refs {
        let reference = normalize_words(text);
        let mut parts = hypotheses.remove(file).unwrap_or_default();
        parts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let hyp: Vec<String> = parts.iter().flat_map(|(_, t)| normalize_words(t)).collect();
        let e = word_errors(&reference, &hyp);
        if e * 3 > reference.len() {
            eprintln!(
                "{file}: {e} errors\n  ref: {}\n  hyp: {}",
                reference.join(" "),
                hyp.join(" ")
            );
        }
        errors += e;
        words += reference.len();
    }
    assert!(
        hypotheses.is_empty(),
        "utterances from unknown sources: {:?}",
        hypotheses.keys()
    );
    let wer = errors as f64 / words as f64;
    eprintln!(
        "{} utterances, {total:.1} s kept, WER {:.1} % ({errors}/{words})",
        rows.len(),
        wer * 100.0
    );
    assert!(
        wer <= 0.20,
        "word error rate {:.1} % exceeds 20 %",
        wer * 100.0
    );
}
