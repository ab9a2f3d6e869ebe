//! The program's one random generator: SplitMix64, whose whole state is one `u64` and whose
//! output is fixed by its definition, not by a crate version. The trainer's data order (a
//! checkpoint records the state exactly, so a resumed run continues the same stream) and
//! `speak --seed` (the same seed gives the same speech with any build) both use it.

/// SplitMix64 (Steele, Lea, Flood 2014), as in `java.util.SplittableRandom`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The state to save; [`Self::new`] of it continues the stream.
    pub fn state(&self) -> u64 {
        self.state
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`: the top 53 bits of the next output.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`), without modulo bias (Lemire's multiply-shift with rejection).
    pub fn below(&mut self, n: usize) -> usize {
        let n = n as u64;
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as usize;
            }
        }
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_resumable_state() {
        // The published reference values of SplitMix64 seeded with 1234567.
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
        assert_eq!(r.next_u64(), 9817491932198370423);
        let mut f = SplitMix64::new(1234567);
        assert_eq!(
            f.next_f64(),
            (6457827717110365317u64 >> 11) as f64 / 2f64.powi(53)
        );
        let mut again = SplitMix64::new(r.state());
        assert_eq!(again.next_u64(), r.next_u64());
    }

    #[test]
    fn shuffle_is_a_permutation_and_roughly_uniform() {
        let mut r = SplitMix64::new(7);
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            let mut v = [0, 1, 2, 3];
            r.shuffle(&mut v);
            let mut sorted = v;
            sorted.sort();
            assert_eq!(sorted, [0, 1, 2, 3]);
            counts[v[0]] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
    }
}
