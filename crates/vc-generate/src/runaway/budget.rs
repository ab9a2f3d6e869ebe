//! The frame budget of a text chunk (docs/model.md §7.2): the frames the chunk is expected to
//! take — its text tokens times the voice's pace in frames per token — with a generous margin,
//! never below a floor, never above the frame limit.
//!
//! Text tokens, not characters: they predict a chunk's frames a little better on real speech
//! and far better across scripts, where characters per second differ about fourfold
//! (docs/model.md §7.2 has the measurements).

/// Frames per text token of a voice whose pace is not known (a zero-shot clone, a model
/// without a measured pace): generous, 1.45× the pace measured on English speech
/// (docs/model.md §7.2), for slow speakers and scripts with more speech per token.
pub const DEFAULT_FRAMES_PER_TOKEN: f64 = 6.0;
/// The budget is this multiple of the chunk's expected frames...
pub const MARGIN: f64 = 3.0;
/// ...and never below this many frames (8 s): short chunks vary most around their pace.
pub const MIN_FRAMES: usize = 100;

/// The pace used for `pace`: a measured one when it is a positive number, else the default.
fn frames_per_token(pace: Option<f64>) -> f64 {
    pace.filter(|p| p.is_finite() && *p > 0.0)
        .unwrap_or(DEFAULT_FRAMES_PER_TOKEN)
}

/// Whole frames covering `frames`: rounded up, but not for the last bits of a product such as
/// 4.15 × 60 = 249.00000000000003.
fn whole_frames(frames: f64) -> usize {
    (frames - 1e-6).ceil().max(0.0) as usize
}

/// Frames a chunk of `text_tokens` tokens is expected to take at `pace` frames per token
/// (`None`: [`DEFAULT_FRAMES_PER_TOKEN`]).
pub fn expected_frames(text_tokens: usize, pace: Option<f64>) -> usize {
    whole_frames(frames_per_token(pace) * text_tokens as f64)
}

/// The most frames a chunk of `text_tokens` tokens may take: `max(MIN_FRAMES, MARGIN ×
/// expected)`, capped by the frame limit `limit`.
pub fn frame_budget(text_tokens: usize, pace: Option<f64>, limit: usize) -> usize {
    let expected = frames_per_token(pace) * text_tokens as f64;
    whole_frames(MARGIN * expected).max(MIN_FRAMES).min(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_three_times_the_expected_frames_above_eight_seconds() {
        // 60 tokens (about 300 characters of English) at a measured 4.15 frames per token:
        // 249 frames expected, 747 allowed (60 s) instead of the model's 8191.
        assert_eq!(expected_frames(60, Some(4.15)), 249);
        assert_eq!(frame_budget(60, Some(4.15), 8191), 747);
        // The default pace for an unknown voice.
        assert_eq!(frame_budget(60, None, 8191), 1080);
        // A short chunk gets the floor; the frame limit caps everything.
        assert_eq!(frame_budget(2, Some(4.15), 8191), MIN_FRAMES);
        assert_eq!(frame_budget(60, None, 500), 500);
        assert_eq!(frame_budget(0, None, 8191), MIN_FRAMES);
    }

    #[test]
    fn a_pace_that_is_not_a_positive_number_counts_as_unknown() {
        for bad in [0.0, -3.0, f64::NAN, f64::INFINITY] {
            assert_eq!(
                frame_budget(60, Some(bad), 8191),
                frame_budget(60, None, 8191)
            );
        }
    }
}
