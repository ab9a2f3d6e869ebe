//! One number per evaluation from its samples, for `train.select = "score"`, and the drift
//! alarm (docs/training.md §14.5).
//!
//! Each sample scores `similarity − |log2(rate_ratio)| − min(WER, 1) − 0.5·[no end of
//! speech]` (the WER term only when a Whisper model measured it; a sample without similarity
//! counts −1); the evaluation's score is the mean over its samples. A perfect sample scores its similarity; speaking at double or half the
//! speaker's pace costs 1, as does a transcript with every word wrong.

use super::SampleMetrics;

/// Speaking-rate ratios outside this range (sample pace over the speaker's own) raise the
/// drift alarm.
pub const RATE_RANGE: (f64, f64) = (0.8, 1.25);
/// What a sample loses for running into its frame limit instead of ending.
const NO_EOS_PENALTY: f64 = 0.5;

/// The score of one sample (higher is better). A sample without a similarity (no audio, or an
/// x-vector of zeros) counts as the least similar, −1.
pub fn sample_score(s: &SampleMetrics) -> f64 {
    let similarity = s.similarity.filter(|v| v.is_finite()).unwrap_or(-1.0);
    let rate = s.rate_ratio.log2().abs();
    let wer = s.wer.map_or(0.0, |w| w.min(1.0));
    let eos = if s.eos { 0.0 } else { NO_EOS_PENALTY };
    similarity - rate - wer - eos
}

/// The mean score of an evaluation's samples; NaN when there are none.
pub fn score(samples: &[SampleMetrics]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.iter().map(sample_score).sum::<f64>() / samples.len() as f64
}

/// What is wrong with the samples' pace and endings, one phrase per sample that drifted:
/// a rate ratio outside [`RATE_RANGE`], or no end of speech within the frame limit.
pub fn drift(samples: &[SampleMetrics]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, s) in samples.iter().enumerate() {
        let which = format!("sample {} ({})", i + 1, s.voice);
        let (lo, hi) = RATE_RANGE;
        if !(lo..=hi).contains(&s.rate_ratio) {
            let how = if s.rate_ratio > hi {
                "faster"
            } else {
                "slower"
            };
            out.push(format!(
                "{which} speaks {how} than the speaker: rate ratio {:.2} (outside {lo}–{hi})",
                s.rate_ratio
            ));
        }
        if !s.eos {
            out.push(format!(
                "{which} did not reach end of speech within {} frames",
                s.frames
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(similarity: f64, rate_ratio: f64, wer: Option<f64>, eos: bool) -> SampleMetrics {
        SampleMetrics {
            text: "a".into(),
            voice: "v".into(),
            wav: "x.wav".into(),
            codes: "x.codes.json".into(),
            frames: 10,
            cap: 15,
            eos,
            similarity: Some(similarity),
            frames_per_token: 2.0,
            rate_ratio,
            recording: None,
            wer,
            transcript: None,
        }
    }

    #[test]
    fn the_score_follows_its_formula() {
        assert_eq!(sample_score(&sample(0.75, 1.0, Some(0.0), true)), 0.75);
        assert_eq!(sample_score(&sample(0.75, 2.0, None, true)), -0.25);
        assert_eq!(sample_score(&sample(0.75, 0.5, Some(3.0), false)), -1.75);
        assert_eq!(
            score(&[
                sample(0.5, 1.0, None, true),
                sample(0.25, 1.0, Some(0.5), true)
            ]),
            (0.5 + -0.25) / 2.0
        );
        assert!(score(&[]).is_nan());
        let mut missing = sample(0.5, 1.0, None, true);
        missing.similarity = None;
        assert_eq!(score(&[missing.clone()]), -1.0);
        missing.similarity = Some(f64::NAN);
        assert_eq!(score(&[missing]), -1.0);
    }

    #[test]
    fn drift_names_the_pace_and_the_missing_end() {
        assert!(drift(&[sample(0.5, 1.2, None, true), sample(0.5, 0.81, None, true)]).is_empty());
        let d = drift(&[sample(0.5, 1.3, None, true), sample(0.5, 0.7, None, false)]);
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(d[0].contains("sample 1") && d[0].contains("faster") && d[0].contains("1.30"));
        assert!(d[1].contains("sample 2") && d[1].contains("slower"));
        assert!(d[2].contains("end of speech"));
    }
}
