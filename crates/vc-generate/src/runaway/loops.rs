//! Loop detection over the code-0 sequence of a row (docs/model.md §7.2). A loop is a stretch
//! of code 0 that the following frames repeat exactly: with a period of 2 to [`MAX_PERIOD`]
//! frames for [`LOOP_FRAMES`] frames (3 s) after its first occurrence, or one code held for
//! [`HELD_FRAMES`] frames (10 s). Exact repeats of code 0 over seconds do not occur in sampled
//! speech; a held code is what silence can give, and natural pauses are far shorter than
//! 10 s. Nothing is reported before the row has its chunk's expected length, so a text that
//! itself repeats ("la la la …") may be read out before a loop counts.

use super::GuardReason;

/// Frames (3 s) a stretch of 2 to [`MAX_PERIOD`] frames must be repeated over.
pub const LOOP_FRAMES: usize = 38;
/// Longest repeated stretch looked for (3 s: a word or short phrase said over and over).
pub const MAX_PERIOD: usize = 38;
/// Frames (10 s) one code-0 value must be held to count as a loop.
pub const HELD_FRAMES: usize = 125;

/// Watches the code-0 sequence of one row, one frame at a time (`O(MAX_PERIOD)` per frame).
#[derive(Debug, Clone)]
pub struct LoopDetector {
    /// The last `MAX_PERIOD` codes, the newest last.
    recent: std::collections::VecDeque<u32>,
    /// `repeats[p]`: how many of the newest codes each equal the code `p` frames before it.
    repeats: [usize; MAX_PERIOD + 1],
    frames: usize,
    /// No loop is reported before the row has this many frames.
    not_before: usize,
}

impl LoopDetector {
    /// A detector that reports nothing before frame `not_before` (the chunk's expected length).
    pub fn new(not_before: usize) -> Self {
        LoopDetector {
            recent: std::collections::VecDeque::with_capacity(MAX_PERIOD + 1),
            repeats: [0; MAX_PERIOD + 1],
            frames: 0,
            not_before,
        }
    }

    /// Adds the next frame's code 0; `Some` when the sequence now loops.
    pub fn push(&mut self, code0: u32) -> Option<GuardReason> {
        let n = self.recent.len();
        for p in 1..=MAX_PERIOD {
            self.repeats[p] = if p <= n && self.recent[n - p] == code0 {
                self.repeats[p] + 1
            } else {
                0
            };
        }
        self.recent.push_back(code0);
        if self.recent.len() > MAX_PERIOD {
            self.recent.pop_front();
        }
        self.frames += 1;
        if self.frames < self.not_before {
            return None;
        }
        let held = self.repeats[1];
        if held + 1 >= HELD_FRAMES {
            return Some(GuardReason::Loop {
                period: 1,
                span: held + 1,
            });
        }
        // The shortest period wins; a stretch whose newest `p` codes are all one code is a held
        // code, not a loop of period `p`.
        (2..=MAX_PERIOD)
            .find(|&p| self.repeats[p] >= LOOP_FRAMES && held < p)
            .map(|p| GuardReason::Loop {
                period: p,
                span: self.repeats[p] + p,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frame (counted from 1) at which `codes` first loops, and how.
    fn first_loop(codes: &[u32], not_before: usize) -> Option<(usize, GuardReason)> {
        let mut d = LoopDetector::new(not_before);
        codes
            .iter()
            .enumerate()
            .find_map(|(i, &c)| d.push(c).map(|r| (i + 1, r)))
    }

    /// Codes of speech-like variety: a pseudo-random walk over 2048 ids.
    fn varied(n: usize, seed: u64) -> Vec<u32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % 2048) as u32
            })
            .collect()
    }

    #[test]
    fn a_repeated_stretch_is_a_loop_after_three_seconds_of_repeats() {
        let mut codes = varied(20, 1);
        let stretch = [11, 12, 13, 14, 15];
        for _ in 0..20 {
            codes.extend_from_slice(&stretch);
        }
        // The stretch starts at frame 21; its repeats from frame 26 reach 38 frames at 63.
        let (frame, why) = first_loop(&codes, 0).unwrap();
        assert_eq!(frame, 20 + 5 + LOOP_FRAMES);
        assert_eq!(
            why,
            GuardReason::Loop {
                period: 5,
                span: LOOP_FRAMES + 5
            }
        );
        // One repeat short of that is not a loop.
        assert_eq!(first_loop(&codes[..frame - 1], 0), None);
    }

    #[test]
    fn the_longest_period_needs_only_one_full_repeat() {
        let mut codes = varied(10, 2);
        let phrase = varied(MAX_PERIOD, 3);
        codes.extend_from_slice(&phrase);
        codes.extend_from_slice(&phrase);
        let (frame, why) = first_loop(&codes, 0).unwrap();
        assert_eq!(frame, codes.len());
        assert!(matches!(why, GuardReason::Loop { period, .. } if period == MAX_PERIOD));
        // A phrase longer than that is not looked for.
        let mut codes = varied(10, 2);
        let phrase = varied(MAX_PERIOD + 1, 3);
        codes.extend_from_slice(&phrase);
        codes.extend_from_slice(&phrase);
        assert_eq!(first_loop(&codes, 0), None);
    }

    #[test]
    fn a_held_code_needs_ten_seconds() {
        let mut codes = varied(30, 4);
        // A 9.9 s pause inside speech, then speech again: no loop.
        codes.extend(std::iter::repeat_n(1995, HELD_FRAMES - 1));
        codes.extend(varied(30, 5));
        assert_eq!(first_loop(&codes, 0), None);
        // Ten seconds of it is one.
        let mut codes = varied(30, 4);
        codes.extend(std::iter::repeat_n(1995, HELD_FRAMES + 10));
        let (frame, why) = first_loop(&codes, 0).unwrap();
        assert_eq!(frame, 30 + HELD_FRAMES);
        assert_eq!(
            why,
            GuardReason::Loop {
                period: 1,
                span: HELD_FRAMES
            }
        );
    }

    #[test]
    fn speech_like_codes_never_loop() {
        for seed in 0..20 {
            assert_eq!(first_loop(&varied(8191, seed), 0), None, "seed {seed}");
        }
        // Few distinct codes, as a random tiny model picks them, still drawn: no exact repeats.
        let mut x = 9u64;
        let few: Vec<u32> = (0..4000)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                [262, 1222, 1440][((x >> 33) % 3) as usize]
            })
            .collect();
        assert_eq!(first_loop(&few, 0), None);
    }

    #[test]
    fn nothing_is_reported_before_the_expected_length() {
        let mut codes = Vec::new();
        for _ in 0..40 {
            codes.extend_from_slice(&[7, 8, 9]);
        }
        // Looping from the start: at frame 41 without a floor, at the expected length with one.
        assert_eq!(first_loop(&codes, 0).unwrap().0, 3 + LOOP_FRAMES);
        assert_eq!(first_loop(&codes, 100).unwrap().0, 100);
    }
}
