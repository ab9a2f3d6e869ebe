//! Cutting a transcribed recording into training utterances.
//!
//! Whisper's segments are the starting point. Non-speech segments are dropped, segments longer
//! than `max_seconds` are split at word boundaries (preferring pauses and punctuation), short
//! neighbours are merged until they reach `min_seconds`, and finally each utterance's edges are
//! moved onto the audio itself: leading and trailing silence is trimmed, and a little padding
//! kept, without ever overlapping a neighbour.

use std::fmt;

use super::transcribe::{Segment, Word};
use vc_audio::analysis::frame_levels_db;

/// The knobs of [`cut`], from the `[prep]` config section.
#[derive(Debug, Clone, PartialEq)]
pub struct Rules {
    pub min_seconds: f64,
    pub max_seconds: f64,
    pub max_merge_gap: f64,
    pub max_no_speech_prob: f64,
    pub pad_seconds: f64,
    pub silence_db: f64,
}

/// One training utterance: a time span of the source file and its transcript.
#[derive(Debug, Clone, PartialEq)]
pub struct Utterance {
    pub start: f64,
    pub end: f64,
    pub text: String,
    /// The highest no-speech probability among the segments it was made of.
    pub no_speech_prob: f64,
}

impl Utterance {
    pub fn duration(&self) -> f64 {
        self.end - self.start
    }
}

/// Why a stretch of transcribed audio was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// Whisper rated it as non-speech.
    NoSpeech,
    /// No text, or only a non-speech marker such as "[BLANK_AUDIO]".
    EmptyText,
    /// Shorter than `min_seconds` even after merging with its neighbours.
    TooShort,
    /// Longer than `max_seconds` with no word timings to split it at.
    TooLong,
    /// Nothing above the silence threshold inside the segment.
    Silent,
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DropReason::NoSpeech => "no speech",
            DropReason::EmptyText => "empty transcript",
            DropReason::TooShort => "too short",
            DropReason::TooLong => "too long to split",
            DropReason::Silent => "silent",
        })
    }
}

/// A stretch of transcribed audio that was not kept (seconds of the recording), and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropped {
    pub reason: DropReason,
    pub start: f64,
    pub end: f64,
}

impl Dropped {
    fn of(reason: DropReason, start: f64, end: f64) -> Self {
        Dropped { reason, start, end }
    }

    pub fn seconds(&self) -> f64 {
        self.end - self.start
    }
}

/// The result of cutting one recording.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Cut {
    pub utterances: Vec<Utterance>,
    /// Transcribed audio dropped, with the reason: spans, so that the summary can tell every
    /// second of the recording apart (`super::accounting`).
    pub dropped: Vec<Dropped>,
}

/// Level analysis frame: 10 ms.
const FRAME_SECONDS: f64 = 0.01;
/// How far an edge may move outwards onto speech that Whisper's timestamps missed.
const EDGE_SEARCH_SECONDS: f64 = 0.25;

/// Cuts `segments` (times in seconds of `audio`, sampled at `rate`) into utterances.
pub fn cut(segments: &[Segment], audio: &[f32], rate: u32, rules: &Rules) -> Cut {
    let total = audio.len() as f64 / rate as f64;
    let mut out = Cut::default();

    // 1. Keep speech with text, clamped to the recording.
    let mut spans: Vec<Span> = Vec::new();
    for s in segments {
        let (start, end) = (s.start.clamp(0.0, total), s.end.clamp(0.0, total));
        let dur = (end - start).max(0.0);
        if s.no_speech_prob > rules.max_no_speech_prob {
            out.dropped
                .push(Dropped::of(DropReason::NoSpeech, start, start + dur));
        } else if is_non_speech_text(&s.text) {
            out.dropped
                .push(Dropped::of(DropReason::EmptyText, start, start + dur));
        } else if dur > 0.0 {
            let words = s
                .words
                .iter()
                .filter(|w| !w.text.trim().is_empty())
                .map(|w| Word {
                    text: w.text.trim().to_string(),
                    start: w.start.clamp(start, end),
                    end: w.end.clamp(start, end),
                })
                .collect();
            spans.push(Span {
                start,
                end,
                text: s.text.trim().to_string(),
                no_speech_prob: s.no_speech_prob,
                words,
            });
        }
    }

    // 2. Split what is too long.
    let mut split: Vec<Span> = Vec::new();
    for span in spans {
        split_long(span, rules, &mut split, &mut out.dropped);
    }

    // 3. Merge short neighbours.
    let merged = merge_short(split, rules);

    // 4. Move edges onto the audio and enforce the duration bounds.
    let levels = frame_levels_db(
        audio,
        ((rate as f64) * FRAME_SECONDS).round().max(1.0) as usize,
    );
    let peak = levels.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let threshold = peak + rules.silence_db;
    for i in 0..merged.len() {
        let span = &merged[i];
        if span.duration() < rules.min_seconds {
            out.dropped
                .push(Dropped::of(DropReason::TooShort, span.start, span.end));
            continue;
        }
        // Never reach past the middle of the gap to a neighbour.
        let lower = if i > 0 {
            (merged[i - 1].end + span.start) / 2.0
        } else {
            0.0
        };
        let upper = if i + 1 < merged.len() {
            (span.end + merged[i + 1].start) / 2.0
        } else {
            total
        };
        let lower = lower.max(span.start - EDGE_SEARCH_SECONDS);
        let upper = upper.min(span.end + EDGE_SEARCH_SECONDS);
        let Some((voiced_start, voiced_end)) = voiced_range(&levels, threshold, lower, upper)
        else {
            out.dropped
                .push(Dropped::of(DropReason::Silent, span.start, span.end));
            continue;
        };
        let mut start = (voiced_start - rules.pad_seconds).max(lower);
        let mut end = (voiced_end + rules.pad_seconds).min(upper);
        if end - start > rules.max_seconds {
            // Only the padding and the outward search can push past the limit: give it back,
            // symmetrically, keeping the voiced part.
            let excess = end - start - rules.max_seconds;
            let take_start = (excess / 2.0).min(voiced_start - start);
            start += take_start;
            end -= excess - take_start;
        }
        let utterance = Utterance {
            start,
            end,
            text: span.text.clone(),
            no_speech_prob: span.no_speech_prob,
        };
        if utterance.duration() < rules.min_seconds {
            out.dropped
                .push(Dropped::of(DropReason::TooShort, span.start, span.end));
        } else {
            out.utterances.push(utterance);
        }
    }
    out
}

/// True for empty text and for Whisper's non-speech annotations: "[BLANK_AUDIO]", "(music)",
/// "*applause*", "♪♪".
pub fn is_non_speech_text(text: &str) -> bool {
    let t = text.trim();
    if t.is_empty() || !t.chars().any(|c| c.is_alphanumeric()) {
        return true;
    }
    let bracketed = |open: char, close: char| t.starts_with(open) && t.ends_with(close);
    bracketed('[', ']') || bracketed('(', ')') || bracketed('*', '*') || bracketed('♪', '♪')
}

#[derive(Debug, Clone)]
struct Span {
    start: f64,
    end: f64,
    text: String,
    no_speech_prob: f64,
    words: Vec<Word>,
}

impl Span {
    fn duration(&self) -> f64 {
        self.end - self.start
    }
}

fn split_long(span: Span, rules: &Rules, out: &mut Vec<Span>, dropped: &mut Vec<Dropped>) {
    if span.duration() <= rules.max_seconds {
        out.push(span);
        return;
    }
    let Some(k) = best_split(&span, rules) else {
        dropped.push(Dropped::of(DropReason::TooLong, span.start, span.end));
        return;
    };
    let at = (span.words[k - 1].end + span.words[k].start) / 2.0;
    let (left_words, right_words) = span.words.split_at(k);
    let part = |words: &[Word], start: f64, end: f64| Span {
        start,
        end,
        text: join_words(words),
        no_speech_prob: span.no_speech_prob,
        words: words.to_vec(),
    };
    let left = part(left_words, span.start, at);
    let right = part(right_words, at, span.end);
    split_long(left, rules, out, dropped);
    split_long(right, rules, out, dropped);
}

/// The word index to split before: the longest pause, with a bonus after punctuation, among
/// the boundaries that leave both halves at least `min_seconds` long and closest to halving.
fn best_split(span: &Span, rules: &Rules) -> Option<usize> {
    let n = span.words.len();
    if n < 2 {
        return None;
    }
    let mut best: Option<(f64, usize)> = None;
    for k in 1..n {
        let at = (span.words[k - 1].end + span.words[k].start) / 2.0;
        let (left, right) = (at - span.start, span.end - at);
        if left < rules.min_seconds || right < rules.min_seconds {
            continue;
        }
        let pause = (span.words[k].start - span.words[k - 1].end).max(0.0);
        let punct = span.words[k - 1]
            .text
            .ends_with(|c: char| ".,;:!?".contains(c));
        // Balance matters most (fewer recursive splits), pauses and punctuation break ties.
        let imbalance = (left - right).abs() / span.duration();
        let score = pause + if punct { 0.3 } else { 0.0 } - imbalance;
        if best.is_none_or(|(s, _)| score > s) {
            best = Some((score, k));
        }
    }
    best.map(|(_, k)| k)
}

fn join_words(words: &[Word]) -> String {
    words
        .iter()
        .map(|w| w.text.as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

fn merge_short(spans: Vec<Span>, rules: &Rules) -> Vec<Span> {
    let mut out: Vec<Span> = Vec::new();
    for span in spans {
        if let Some(current) = out.last_mut() {
            let gap = span.start - current.end;
            let short =
                current.duration() < rules.min_seconds || span.duration() < rules.min_seconds;
            let fits = span.end - current.start <= rules.max_seconds;
            if short && fits && gap <= rules.max_merge_gap {
                current.end = span.end;
                current.text = format!("{} {}", current.text, span.text);
                current.no_speech_prob = current.no_speech_prob.max(span.no_speech_prob);
                current.words.extend(span.words);
                continue;
            }
        }
        out.push(span);
    }
    out
}

/// First and last 10 ms frame above `threshold` inside [lower, upper], as times.
fn voiced_range(levels: &[f64], threshold: f64, lower: f64, upper: f64) -> Option<(f64, f64)> {
    let first = (lower / FRAME_SECONDS).floor().max(0.0) as usize;
    let last = ((upper / FRAME_SECONDS).ceil() as usize).min(levels.len());
    let voiced = |i: &usize| levels[*i] >= threshold;
    let a = (first..last).find(voiced)?;
    let b = (first..last).rev().find(voiced)?;
    Some((
        (a as f64 * FRAME_SECONDS).max(lower),
        ((b + 1) as f64 * FRAME_SECONDS).min(upper),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vc_audio::analysis::sine;

    const RATE: u32 = 16000;

    fn rules() -> Rules {
        Rules {
            min_seconds: 1.0,
            max_seconds: 15.0,
            max_merge_gap: 1.5,
            max_no_speech_prob: 0.6,
            pad_seconds: 0.1,
            silence_db: -40.0,
        }
    }

    /// Silence with a tone burst over each of `spans` (seconds).
    fn audio(total: f64, spans: &[(f64, f64)]) -> Vec<f32> {
        let mut x = vec![0f32; (total * RATE as f64) as usize];
        let tone = sine(300.0, 0.5, RATE, x.len());
        for &(a, b) in spans {
            let (a, b) = ((a * RATE as f64) as usize, (b * RATE as f64) as usize);
            x[a..b].copy_from_slice(&tone[a..b]);
        }
        x
    }

    fn seg(start: f64, end: f64, text: &str) -> Segment {
        // Words spread evenly over the segment, with small pauses between them.
        let words: Vec<&str> = text.split_whitespace().collect();
        let step = (end - start) / words.len().max(1) as f64;
        Segment {
            start,
            end,
            text: text.to_string(),
            no_speech_prob: 0.01,
            words: words
                .iter()
                .enumerate()
                .map(|(i, w)| Word {
                    text: w.to_string(),
                    start: start + i as f64 * step,
                    end: start + (i as f64 + 0.8) * step,
                })
                .collect(),
        }
    }

    #[test]
    fn non_speech_markers_are_recognised() {
        for t in [
            "",
            "  ",
            "[BLANK_AUDIO]",
            "(music)",
            "*laughs*",
            "♪ ♪",
            "...",
        ] {
            assert!(is_non_speech_text(t), "{t:?}");
        }
        for t in ["Hello.", "(It) works", "42"] {
            assert!(!is_non_speech_text(t), "{t:?}");
        }
    }

    #[test]
    fn drops_non_speech_and_merges_short_neighbours() {
        let x = audio(10.0, &[(0.5, 1.0), (1.2, 1.6), (3.0, 6.0), (7.0, 9.0)]);
        let mut noisy = seg(7.0, 9.0, "hallucinated words");
        noisy.no_speech_prob = 0.9;
        let segments = vec![
            seg(0.5, 1.0, "Hi"),
            seg(1.2, 1.6, "there."),
            seg(3.0, 6.0, "A complete sentence here."),
            seg(6.5, 6.9, "[BLANK_AUDIO]"),
            noisy,
        ];
        let cut = cut(&segments, &x, RATE, &rules());
        let texts: Vec<&str> = cut.utterances.iter().map(|u| u.text.as_str()).collect();
        // "Hi" is too short alone and merges with its neighbour; the 1.6 s result is then long
        // enough, so the full sentence stays separate.
        assert_eq!(texts, ["Hi there.", "A complete sentence here."]);
        let reasons: Vec<DropReason> = cut.dropped.iter().map(|d| d.reason).collect();
        assert!(reasons.contains(&DropReason::NoSpeech));
        assert!(reasons.contains(&DropReason::EmptyText));
        // Edges snap to the tone bursts with the padding kept.
        let u = &cut.utterances[1];
        assert!(
            (u.start - 2.9).abs() < 0.02 && (u.end - 6.1).abs() < 0.02,
            "{u:?}"
        );
        let u = &cut.utterances[0];
        assert!(
            (u.start - 0.4).abs() < 0.02 && (u.end - 1.7).abs() < 0.02,
            "{u:?}"
        );
    }

    #[test]
    fn long_segments_split_at_word_boundaries_within_bounds() {
        let text = (0..60)
            .map(|i| format!("w{i}"))
            .collect::<Vec<_>>()
            .join(" ");
        let x = audio(42.0, &[(1.0, 41.0)]);
        let cut = cut(&[seg(1.0, 41.0, &text)], &x, RATE, &rules());
        assert!(cut.utterances.len() >= 3, "{:?}", cut.utterances);
        let mut words = Vec::new();
        for u in &cut.utterances {
            assert!(u.duration() >= 1.0 && u.duration() <= 15.0, "{u:?}");
            words.extend(u.text.split(' ').map(str::to_string));
        }
        // No word lost or duplicated, order kept.
        assert_eq!(words.join(" "), text);
        for pair in cut.utterances.windows(2) {
            assert!(pair[0].end <= pair[1].start + 1e-9, "overlap: {pair:?}");
        }
    }

    #[test]
    fn unsplittable_long_segment_and_isolated_short_one_are_dropped() {
        let x = audio(30.0, &[(1.0, 18.0), (25.0, 25.5)]);
        let mut long = seg(1.0, 18.0, "x");
        long.words.clear();
        let cut = cut(&[long, seg(25.0, 25.5, "Yes.")], &x, RATE, &rules());
        assert!(cut.utterances.is_empty());
        let reasons: Vec<DropReason> = cut.dropped.iter().map(|d| d.reason).collect();
        assert_eq!(reasons, [DropReason::TooLong, DropReason::TooShort]);
    }

    #[test]
    fn silent_segment_is_dropped() {
        let x = audio(6.0, &[(4.0, 5.5)]);
        let cut = cut(
            &[seg(0.5, 3.0, "ghost words"), seg(4.0, 5.5, "Real speech.")],
            &x,
            RATE,
            &rules(),
        );
        assert_eq!(cut.utterances.len(), 1);
        assert_eq!(cut.dropped, vec![Dropped::of(DropReason::Silent, 0.5, 3.0)]);
    }
}
