//! The runaway guard (docs/model.md §7.2): a chunk whose generation misses its end token (EOS on
//! code 0) or loops is stopped early instead of running to the model's frame limit (8191
//! frames, 11 minutes of audio). Two checks, both on by default (`speak.runaway_guard`):
//!
//! | module | what |
//! |---|---|
//! | [`budget`] | the most frames a chunk may take, from its text tokens and the voice's pace |
//! | [`loops`] | a stretch of code 0 repeated for seconds |
//! | [`seams`] | the `test-hooks` seams that force both cases |
//!
//! A generation that ends by itself within its budget and does not loop is unchanged, frame for
//! frame: the guards only decide when a row stops.

pub mod budget;
pub mod loops;
pub mod seams;

use loops::LoopDetector;

/// Which guards run for a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunawayGuard {
    /// Each chunk stops after its frame budget ([`budget::frame_budget`]). Off when a frame
    /// limit was given explicitly (`--max-frames`, a request's `max_frames`): that limit wins.
    pub budget: bool,
    /// A chunk whose code 0 loops stops ([`loops`]).
    pub loops: bool,
}

impl RunawayGuard {
    /// The default: both guards.
    pub const ON: RunawayGuard = RunawayGuard {
        budget: true,
        loops: true,
    };
    /// `speak.runaway_guard = false`: only the frame limit stops a chunk without EOS.
    pub const OFF: RunawayGuard = RunawayGuard {
        budget: false,
        loops: false,
    };
}

/// Why a guard stopped a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardReason {
    /// No end of speech within the chunk's frame budget.
    Budget { budget: usize },
    /// Code 0 repeated a stretch of `period` frames (1: one code held, e.g. silence) over its
    /// last `span` frames.
    Loop { period: usize, span: usize },
}

/// A chunk that a guard stopped, for the user: its frames so far are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardStop {
    /// The chunk of the text, counted from 1.
    pub chunk: usize,
    /// The start of the chunk's text.
    pub text: String,
    /// Frames kept.
    pub frames: usize,
    pub reason: GuardReason,
}

/// Characters of a chunk's text a [`GuardStop`] keeps.
const TEXT_START_CHARS: usize = 40;

/// Seconds of `frames` 80 ms frames.
fn seconds(frames: usize) -> f64 {
    frames as f64 * 0.08
}

impl GuardStop {
    /// `chunk` counted from 0, as the rows are.
    pub fn new(chunk: usize, text: &str, frames: usize, reason: GuardReason) -> Self {
        let text = text.trim();
        let mut start: String = text.chars().take(TEXT_START_CHARS).collect();
        if start.len() < text.len() {
            start.push('…');
        }
        GuardStop {
            chunk: chunk + 1,
            text: start,
            frames,
            reason,
        }
    }

    /// One line for the user: which chunk, why, what was kept.
    pub fn describe(&self) -> String {
        let why = match self.reason {
            GuardReason::Budget { budget } => format!(
                "no end of speech within its budget of {budget} frames ({:.1} s)",
                seconds(budget)
            ),
            GuardReason::Loop { period: 1, span } => format!(
                "one frame held for {:.1} s (code 0 repeated); stopped after {} frames ({:.1} s)",
                seconds(span),
                self.frames,
                seconds(self.frames)
            ),
            GuardReason::Loop { period, span } => format!(
                "a stretch of {period} frames ({:.2} s) repeated for {:.1} s; stopped after {} \
                 frames ({:.1} s)",
                seconds(period),
                seconds(span),
                self.frames,
                seconds(self.frames)
            ),
        };
        format!(
            "chunk {} ({:?}): {why}, the audio so far kept (runaway guard, docs/model.md §7.2)",
            self.chunk, self.text
        )
    }

    /// The stop as one element of the `x-voiceclone-guard` response header (ASCII, no text):
    /// `chunk=2 reason=budget frames=130` or `chunk=1 reason=loop frames=47 period=5`.
    pub fn header_value(&self) -> String {
        match self.reason {
            GuardReason::Budget { .. } => {
                format!("chunk={} reason=budget frames={}", self.chunk, self.frames)
            }
            GuardReason::Loop { period, .. } => format!(
                "chunk={} reason=loop frames={} period={period}",
                self.chunk, self.frames
            ),
        }
    }
}

/// What ends one row of the frame loop besides EOS: its frame limit — the chunk's budget, or
/// the model's limit — and the loop detector.
#[derive(Debug, Clone)]
pub struct RowGuard {
    /// The row ends after this many frames.
    max_frames: usize,
    /// `max_frames` is the chunk's budget, below the frame limit: reaching it is a guard stop.
    budgeted: bool,
    loops: Option<LoopDetector>,
}

/// How a row goes on after a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowVerdict {
    Continue,
    /// The frame limit ends the row.
    Limit,
    /// A guard ends the row.
    Stop(GuardReason),
}

impl RowGuard {
    /// The guard of a chunk of `text_tokens` text tokens spoken by a voice of `pace` frames per
    /// token (`None`: unknown), under the frame limit `limit`.
    pub fn new(guard: RunawayGuard, text_tokens: usize, pace: Option<f64>, limit: usize) -> Self {
        let limit = limit.max(1);
        let budget = budget::frame_budget(text_tokens, pace, limit);
        let budgeted = guard.budget && budget < limit;
        RowGuard {
            max_frames: if budgeted { budget } else { limit },
            budgeted,
            loops: guard
                .loops
                .then(|| LoopDetector::new(budget::expected_frames(text_tokens, pace))),
        }
    }

    /// Only the frame limit: the loop as it was before the guards.
    pub fn limit_only(limit: usize) -> Self {
        RowGuard {
            max_frames: limit.max(1),
            budgeted: false,
            loops: None,
        }
    }

    /// The most frames the row may take.
    pub fn max_frames(&self) -> usize {
        self.max_frames
    }

    /// After the row kept a frame whose code 0 is `code0`, making `frames` in all.
    pub fn after_frame(&mut self, code0: u32, frames: usize) -> RowVerdict {
        if let Some(found) = self.loops.as_mut().and_then(|l| l.push(code0)) {
            return RowVerdict::Stop(found);
        }
        if frames >= self.max_frames {
            return if self.budgeted {
                RowVerdict::Stop(GuardReason::Budget {
                    budget: self.max_frames,
                })
            } else {
                RowVerdict::Limit
            };
        }
        RowVerdict::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_below_the_limit_stops_as_a_guard_and_the_limit_does_not() {
        // 2 tokens at the default pace: the 100-frame floor.
        let mut g = RowGuard::new(RunawayGuard::ON, 2, None, 8191);
        assert_eq!(g.max_frames(), budget::MIN_FRAMES);
        let verdicts: Vec<RowVerdict> = (1..=100).map(|f| g.after_frame(f as u32, f)).collect();
        assert!(verdicts[..99].iter().all(|v| *v == RowVerdict::Continue));
        assert_eq!(
            verdicts[99],
            RowVerdict::Stop(GuardReason::Budget { budget: 100 })
        );
        // A limit below the budget (an explicit --max-frames) is the plain limit.
        let mut g = RowGuard::new(RunawayGuard::ON, 2, None, 10);
        assert_eq!(g.max_frames(), 10);
        assert_eq!(g.after_frame(1, 10), RowVerdict::Limit);
        // Budget off: the limit alone.
        let g = RowGuard::new(
            RunawayGuard {
                budget: false,
                loops: true,
            },
            2,
            None,
            8191,
        );
        assert_eq!(g.max_frames(), 8191);
    }

    #[test]
    fn guards_off_keep_the_loop_as_it_was() {
        let mut g = RowGuard::new(RunawayGuard::OFF, 2, None, 500);
        for f in 1..500 {
            // One code held for 40 s would be a loop with the guards on.
            assert_eq!(g.after_frame(7, f), RowVerdict::Continue);
        }
        assert_eq!(g.after_frame(7, 500), RowVerdict::Limit);
    }

    #[test]
    fn a_stop_names_its_chunk_and_the_start_of_its_text() {
        let long = "The quick brown fox jumps over the lazy dog, then naps in the sun.";
        let s = GuardStop::new(1, long, 130, GuardReason::Budget { budget: 130 });
        assert_eq!(s.chunk, 2);
        assert_eq!(s.text, "The quick brown fox jumps over the lazy …");
        let d = s.describe();
        assert!(d.starts_with("chunk 2 (\"The quick brown fox"), "{d}");
        assert!(d.contains("budget of 130 frames (10.4 s)"), "{d}");
        assert_eq!(s.header_value(), "chunk=2 reason=budget frames=130");
        let l = GuardStop::new(
            0,
            "Hi.",
            47,
            GuardReason::Loop {
                period: 5,
                span: 43,
            },
        );
        assert_eq!(l.text, "Hi.");
        assert_eq!(l.header_value(), "chunk=1 reason=loop frames=47 period=5");
        assert!(
            l.describe().contains("a stretch of 5 frames"),
            "{}",
            l.describe()
        );
    }
}
