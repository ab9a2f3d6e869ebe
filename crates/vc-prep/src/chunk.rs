//! Splitting a recording into the pieces Whisper transcribes one at a time.
//!
//! Whisper's encoder always sees a 30 s window. Fed a whole recording, whisper.cpp encodes
//! a full window at every seek position — a 58 s file costs four full windows, the last one
//! holding two seconds of audio — and pads every shorter file to 30 s. Cutting the recording
//! at pauses into pieces of at most [`MAX_CHUNK_SECONDS`] lets each piece be encoded with a
//! window just as long as the piece (whisper.cpp's `audio_ctx`): the encoder's work follows the
//! audio instead of the padding, and the attention's quadratic cost stays small.
//!
//! Stretches that are silent by the segmenter's own rule (every 10 ms frame below the file's
//! peak + `prep.silence_db`) for longer than [`MERGE_GAP_SECONDS`] are not transcribed at all;
//! they could never become part of an utterance. Every piece keeps [`KEEP_PAD_SECONDS`] of the
//! quiet around its speech, so Whisper hears where words begin and end.

use vc_audio::analysis::frame_levels_db;

/// Longest piece (seconds). Whisper's window is 30 s; this leaves room for the quiet tail
/// the decoder expects after the last word (`transcribe::audio_ctx`). Shorter pieces would make
/// the attention cheaper, but with less context tiny.en makes more mistakes (12 s pieces: 4.0 %
/// word errors on the test speech instead of 2.6 %).
pub const MAX_CHUNK_SECONDS: f64 = 28.0;
/// Pauses shorter than this (seconds) never split speech.
pub const MIN_PAUSE_SECONDS: f64 = 0.3;
/// Quiet kept around speech at the edges of a piece (seconds).
pub const KEEP_PAD_SECONDS: f64 = 0.3;
/// Speech separated by a pause up to this long (seconds) goes into the same piece, pause
/// included; longer pauses are left out.
pub const MERGE_GAP_SECONDS: f64 = 2.0;
/// The splitting resolution: 10 ms frames.
const FRAME_SECONDS: f64 = 0.01;
/// Where a piece must be split inside speech, it is split at the quietest point of this
/// smoothing window (seconds), searched in the second half of the allowed length.
const SPLIT_SMOOTHING_SECONDS: f64 = 0.1;

/// A piece of the recording: sample range `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub start: usize,
    pub end: usize,
}

impl Chunk {
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// The pieces of `samples` (at `rate` Hz) to transcribe, in order, not overlapping. Silence
/// is `silence_db` (negative) below the loudest frame. A recording without any frame above
/// that (or of digital silence) gives no pieces.
pub fn plan(samples: &[f32], rate: u32, silence_db: f64) -> Vec<Chunk> {
    let frame = ((rate as f64 * FRAME_SECONDS).round() as usize).max(1);
    let levels = frame_levels_db(samples, frame);
    let peak = levels.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // frame_levels_db floors at -200 dB; anything near that is digital silence.
    if levels.is_empty() || peak < -150.0 {
        return Vec::new();
    }
    let threshold = peak + silence_db;
    let frames = |seconds: f64| (seconds / FRAME_SECONDS).round() as usize;
    let n = levels.len();

    // Voiced runs of frames, joined across pauses shorter than MIN_PAUSE_SECONDS.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < n {
        if levels[i] < threshold {
            i += 1;
            continue;
        }
        let start = i;
        while i < n && levels[i] >= threshold {
            i += 1;
        }
        match runs.last_mut() {
            Some(last) if start - last.1 < frames(MIN_PAUSE_SECONDS) => last.1 = i,
            _ => runs.push((start, i)),
        }
    }

    // Pieces: runs grouped while the pause before the next one is short and the piece stays
    // within the limit; a single run longer than the limit is split inside.
    let max_len = frames(MAX_CHUNK_SECONDS);
    let pad = frames(KEEP_PAD_SECONDS);
    let mut pieces: Vec<(usize, usize)> = Vec::new();
    let mut previous_end: Option<usize> = None;
    for (start, end) in runs {
        let padded_end = (end + pad).min(n);
        let joins = previous_end.is_some_and(|prev| start - prev <= frames(MERGE_GAP_SECONDS));
        match pieces.last_mut() {
            Some(last) if joins && padded_end - last.0 <= max_len => last.1 = padded_end,
            last => {
                // Never reach back into the previous piece.
                let lower = last.map_or(0, |p| p.1);
                pieces.push((start.saturating_sub(pad).max(lower), padded_end));
            }
        }
        previous_end = Some(end);
        while pieces.last().is_some_and(|p| p.1 - p.0 > max_len) {
            let (a, b) = pieces.pop().expect("checked above");
            let cut = quietest_frame(&levels, a + max_len / 2, a + max_len);
            pieces.push((a, cut));
            pieces.push((cut, b));
        }
    }

    let to_samples = |f: usize| (f * frame).min(samples.len());
    pieces
        .into_iter()
        .map(|(a, b)| Chunk {
            start: to_samples(a),
            end: to_samples(b),
        })
        .filter(|c| !c.is_empty())
        .collect()
}

/// The frame in `lo..hi` at the centre of the quietest smoothing window (the latest of equals).
fn quietest_frame(levels: &[f64], lo: usize, hi: usize) -> usize {
    let half = ((SPLIT_SMOOTHING_SECONDS / FRAME_SECONDS / 2.0).round() as usize).max(1);
    let power: Vec<f64> = levels.iter().map(|db| 10f64.powf(db / 10.0)).collect();
    let smoothed = |i: usize| {
        let (a, b) = (i.saturating_sub(half), (i + half + 1).min(power.len()));
        power[a..b].iter().sum::<f64>() / (b - a) as f64
    };
    (lo..hi.min(levels.len()))
        .min_by(|&x, &y| smoothed(x).total_cmp(&smoothed(y)).then(y.cmp(&x)))
        .unwrap_or(hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vc_audio::analysis::sine;

    const RATE: u32 = 16000;

    /// Tone bursts (seconds on, seconds off, ...) with quiet noise between them.
    fn bursts(pattern: &[(f64, bool)]) -> Vec<f32> {
        let mut out = Vec::new();
        for &(secs, on) in pattern {
            let n = (secs * RATE as f64) as usize;
            if on {
                out.extend(sine(300.0, 0.5, RATE, n));
            } else {
                out.extend((0..n).map(|i| 1e-4 * ((i * 7919 % 13) as f32 - 6.0)));
            }
        }
        out
    }

    fn seconds(c: &Chunk) -> (f64, f64) {
        (c.start as f64 / RATE as f64, c.end as f64 / RATE as f64)
    }

    #[test]
    fn short_pauses_stay_inside_and_long_silences_are_left_out() {
        let x = bursts(&[
            (1.0, false),
            (3.0, true),
            (0.8, false),
            (2.0, true),
            (5.0, false),
            (2.0, true),
            (0.5, false),
        ]);
        let chunks = plan(&x, RATE, -40.0);
        assert_eq!(chunks.len(), 2, "{chunks:?}");
        let (a0, a1) = seconds(&chunks[0]);
        assert!(
            (a0 - 0.7).abs() < 0.02 && (a1 - 7.1).abs() < 0.02,
            "{a0} {a1}"
        );
        let (b0, b1) = seconds(&chunks[1]);
        assert!(
            (b0 - 11.5).abs() < 0.02 && (b1 - 14.1).abs() < 0.02,
            "{b0} {b1}"
        );
    }

    #[test]
    fn long_speech_is_split_at_pauses_within_the_limit() {
        // 8 bursts of 5 s with 1 s pauses: 47 s in all, split where it is quiet.
        let mut pattern = Vec::new();
        for _ in 0..8 {
            pattern.push((5.0, true));
            pattern.push((1.0, false));
        }
        let x = bursts(&pattern);
        let chunks = plan(&x, RATE, -40.0);
        assert!(chunks.len() >= 2);
        for w in chunks.windows(2) {
            assert!(w[0].end <= w[1].start);
        }
        for c in &chunks {
            let (a, b) = seconds(c);
            assert!(b - a <= MAX_CHUNK_SECONDS + 1e-9, "{a}..{b}");
            // Every cut lies in a pause (the 1 s gaps start at 5, 11, 17, ... s).
            let in_pause = |t: f64| t <= 0.0 || (t % 6.0) >= 4.99 || t >= 47.0;
            assert!(in_pause(a) && in_pause(b), "{a}..{b} cuts into a tone");
        }
        // Nothing voiced is lost.
        let covered: f64 = chunks.iter().map(|c| c.len() as f64 / RATE as f64).sum();
        assert!(covered >= 40.0, "{covered}");
    }

    #[test]
    fn uninterrupted_speech_is_split_at_its_quietest_point() {
        // 40 s of tone whose level dips once, at 17 s.
        let mut x = sine(300.0, 0.5, RATE, 40 * RATE as usize);
        for v in &mut x[17 * RATE as usize..(17 * RATE as usize + 1600)] {
            *v *= 0.05;
        }
        let chunks = plan(&x, RATE, -40.0);
        assert_eq!(chunks.len(), 2, "{chunks:?}");
        let cut = chunks[0].end as f64 / RATE as f64;
        assert!((17.0..17.1).contains(&cut), "cut at {cut}");
        assert_eq!(chunks[0].end, chunks[1].start);
        assert_eq!(chunks[1].end, x.len());
    }

    #[test]
    fn silence_gives_nothing() {
        assert!(plan(&vec![0.0; RATE as usize * 3], RATE, -40.0).is_empty());
        assert!(plan(&[], RATE, -40.0).is_empty());
    }
}
