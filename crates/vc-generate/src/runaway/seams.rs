//! Test seams of the runaway guard (`test-hooks` builds only; a no-op otherwise), read once
//! per process, applied after the code-0 processors (docs/model.md §7 steps 1–3):
//!
//! - `VOICECLONE_TEST_SUPPRESS_EOS=1`: EOS is never chosen — a generation that misses its end
//!   token.
//! - `VOICECLONE_TEST_LOOP_CODES=START:C1,C2,…`: from step START on, code 0 is C1, C2, … over
//!   and over (every other id −∞) — a generation that loops.

/// The seams as set for this process.
#[cfg(feature = "test-hooks")]
struct Seams {
    suppress_eos: bool,
    /// (START, the codes replayed from step START on).
    replay: Option<(usize, Vec<u32>)>,
}

/// Forces this step's code-0 `scores` as the seams say (`eos`: the EOS id).
#[cfg(feature = "test-hooks")]
pub fn force_code0(scores: &mut [f32], step: usize, eos: u32) {
    use std::sync::OnceLock;
    static SEAMS: OnceLock<Seams> = OnceLock::new();
    let Seams {
        suppress_eos,
        replay,
    } = SEAMS.get_or_init(|| {
        let suppress = std::env::var_os("VOICECLONE_TEST_SUPPRESS_EOS").is_some_and(|v| v == "1");
        let replay = std::env::var("VOICECLONE_TEST_LOOP_CODES").ok().map(|v| {
            let (start, codes) = v
                .split_once(':')
                .expect("VOICECLONE_TEST_LOOP_CODES is START:C1,C2,…");
            let codes: Vec<u32> = codes
                .split(',')
                .map(|c| c.trim().parse().expect("a code id"))
                .collect();
            assert!(
                !codes.is_empty(),
                "VOICECLONE_TEST_LOOP_CODES names no code"
            );
            (start.trim().parse().expect("a start step"), codes)
        });
        Seams {
            suppress_eos: suppress,
            replay,
        }
    });
    if *suppress_eos {
        if let Some(s) = scores.get_mut(eos as usize) {
            *s = f32::NEG_INFINITY;
        }
    }
    if let Some((start, codes)) = replay {
        if step >= *start {
            let keep = codes[(step - start) % codes.len()] as usize;
            for (i, s) in scores.iter_mut().enumerate() {
                if i != keep {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Without `test-hooks`: nothing.
#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub fn force_code0(_scores: &mut [f32], _step: usize, _eos: u32) {}
