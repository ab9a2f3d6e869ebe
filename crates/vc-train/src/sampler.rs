//! The data order: which utterances form each micro-batch of an epoch, and where a run is in
//! it. An epoch's plan is a pure function of the utterance lengths, the batch size and the RNG
//! state at the start of the epoch, so a checkpoint that records that state and the cursor
//! (epoch, next micro-batch) resumes the exact order.
//!
//! Shuffled plans bucket by length to limit padding: the shuffled utterances are cut into pools
//! of [`POOL_BATCHES`] batches, each pool is sorted by length and cut into batches, and the
//! batch order of the whole epoch is shuffled again. Unshuffled plans take the manifest order
//! in fixed consecutive batches (for benchmarks and comparisons).
//!
//! With speaker balancing (`train.speaker_balance`, docs/training.md §4) an epoch first draws a
//! list of utterances in which every speaker has as many as the largest one — each utterance of
//! a smaller speaker repeated ⌊max/n⌋ times and the remaining max mod n drawn without
//! repetition — and plans that list the same way.

use serde::{Deserialize, Serialize};

use vc_core::rng::SplitMix64;

/// Batches per length-sorting pool.
pub const POOL_BATCHES: usize = 32;

/// Micro-batches of one epoch, as indices into the dataset.
pub fn plan_epoch(
    lengths: &[usize],
    batch_size: usize,
    shuffle: bool,
    rng: &mut SplitMix64,
) -> Vec<Vec<usize>> {
    plan_items(
        (0..lengths.len()).collect(),
        lengths,
        batch_size,
        shuffle,
        rng,
    )
}

/// The utterances of one speaker-balanced epoch (`speakers[i]` is utterance i's speaker), in
/// rounds that each hold an utterance at most once: every speaker contributes as many as the
/// largest, m. A speaker with n utterances is in rounds 0..⌊m/n⌋ with all of them and, when n
/// does not divide m, in the next round with m mod n of them (drawn at random when shuffling,
/// else its first ones). Round 0 is every utterance once. Draws nothing from `rng` when no
/// speaker needs such a remainder.
pub fn balanced_rounds(speakers: &[usize], shuffle: bool, rng: &mut SplitMix64) -> Vec<Vec<usize>> {
    let count = speakers.iter().max().map_or(0, |&s| s + 1);
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); count];
    for (i, &s) in speakers.iter().enumerate() {
        members[s].push(i);
    }
    members.retain(|m| !m.is_empty());
    let target = members.iter().map(Vec::len).max().unwrap_or(0);
    let rounds = members
        .iter()
        .map(|m| target.div_ceil(m.len()))
        .max()
        .unwrap_or(0);
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); rounds];
    for m in &members {
        let full = target / m.len();
        for round in out.iter_mut().take(full) {
            round.extend_from_slice(m);
        }
        let rest = target % m.len();
        if rest > 0 {
            let mut pick = m.clone();
            if shuffle {
                rng.shuffle(&mut pick);
            }
            out[full].extend_from_slice(&pick[..rest]);
        }
    }
    for round in &mut out {
        round.sort_unstable();
    }
    out
}

/// Micro-batches of the utterances `items` (indices into `lengths`, repeats allowed).
fn plan_items(
    mut order: Vec<usize>,
    lengths: &[usize],
    batch_size: usize,
    shuffle: bool,
    rng: &mut SplitMix64,
) -> Vec<Vec<usize>> {
    let bs = batch_size.max(1);
    if !shuffle {
        return order.chunks(bs).map(<[usize]>::to_vec).collect();
    }
    rng.shuffle(&mut order);
    let mut batches = Vec::with_capacity(order.len().div_ceil(bs));
    for pool in order.chunks(bs * POOL_BATCHES) {
        let mut pool = pool.to_vec();
        pool.sort_by_key(|&i| (lengths[i], i));
        batches.extend(pool.chunks(bs).map(<[usize]>::to_vec));
    }
    rng.shuffle(&mut batches);
    batches
}

/// Where training stands in the data: saved in every checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// 0-based epoch.
    pub epoch: usize,
    /// Next micro-batch of the epoch's plan.
    pub batch: usize,
    /// RNG state at the start of `epoch` (its plan is drawn from it).
    pub rng_state: u64,
}

/// The data order of a run: the current epoch's plan and the cursor into it.
#[derive(Debug, Clone)]
pub struct Sampler {
    lengths: Vec<usize>,
    /// Each utterance's speaker when epochs are speaker-balanced.
    balance: Option<Vec<usize>>,
    batch_size: usize,
    shuffle: bool,
    cursor: Cursor,
    plan: Vec<Vec<usize>>,
    /// RNG state after drawing `plan` = the next epoch's starting state.
    next_state: u64,
}

impl Sampler {
    /// A fresh run starting at epoch 0 with the RNG seeded by `seed`.
    pub fn new(lengths: Vec<usize>, batch_size: usize, shuffle: bool, seed: u64) -> Self {
        Self::resume(
            lengths,
            batch_size,
            shuffle,
            Cursor {
                epoch: 0,
                batch: 0,
                rng_state: seed,
            },
        )
    }

    /// Continues at `cursor` (from a checkpoint).
    pub fn resume(lengths: Vec<usize>, batch_size: usize, shuffle: bool, cursor: Cursor) -> Self {
        let mut rng = SplitMix64::new(cursor.rng_state);
        let plan = plan_epoch(&lengths, batch_size, shuffle, &mut rng);
        Self {
            lengths,
            balance: None,
            batch_size,
            shuffle,
            cursor,
            plan,
            next_state: rng.state(),
        }
    }

    /// The same sampler with speaker-balanced epochs over `speakers` (each utterance's speaker;
    /// docs/training.md §4), the current epoch re-drawn from the cursor's state; `None` keeps it
    /// as it is.
    pub fn with_balance(mut self, speakers: Option<Vec<usize>>) -> Self {
        if speakers.is_none() {
            return self;
        }
        self.balance = speakers;
        let mut rng = SplitMix64::new(self.cursor.rng_state);
        self.plan = self.draw(&mut rng);
        self.next_state = rng.state();
        self
    }

    fn draw(&self, rng: &mut SplitMix64) -> Vec<Vec<usize>> {
        match &self.balance {
            None => plan_epoch(&self.lengths, self.batch_size, self.shuffle, rng),
            Some(speakers) => {
                let rounds = balanced_rounds(speakers, self.shuffle, rng);
                let several = rounds.len() > 1;
                let mut plan: Vec<Vec<usize>> = rounds
                    .into_iter()
                    .flat_map(|r| plan_items(r, &self.lengths, self.batch_size, self.shuffle, rng))
                    .collect();
                if self.shuffle && several {
                    rng.shuffle(&mut plan);
                }
                plan
            }
        }
    }

    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Micro-batches per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.plan.len()
    }

    /// Optimizer steps per epoch with `grad_accum` micro-batches per step (the last step of an
    /// epoch may have fewer; steps never span two epochs).
    pub fn steps_per_epoch(&self, grad_accum: usize) -> usize {
        self.plan.len().div_ceil(grad_accum.max(1))
    }

    /// The micro-batches of the next optimizer step (at most `grad_accum`, never crossing the
    /// end of an epoch), advancing the cursor; rolls over to the next epoch first when the
    /// current one is finished.
    pub fn next_step(&mut self, grad_accum: usize) -> Vec<Vec<usize>> {
        if self.cursor.batch >= self.plan.len() {
            self.start_epoch(self.cursor.epoch + 1);
        }
        let end = (self.cursor.batch + grad_accum.max(1)).min(self.plan.len());
        let step = self.plan[self.cursor.batch..end].to_vec();
        self.cursor.batch = end;
        step
    }

    /// The epoch the next step belongs to.
    pub fn next_epoch(&self) -> usize {
        if self.cursor.batch >= self.plan.len() {
            self.cursor.epoch + 1
        } else {
            self.cursor.epoch
        }
    }

    fn start_epoch(&mut self, epoch: usize) {
        let mut rng = SplitMix64::new(self.next_state);
        self.cursor = Cursor {
            epoch,
            batch: 0,
            rng_state: self.next_state,
        };
        self.plan = self.draw(&mut rng);
        self.next_state = rng.state();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_utterance_once_per_epoch_and_buckets_by_length() {
        let lengths: Vec<usize> = (0..200).map(|i| (i * 37) % 101).collect();
        let mut rng = SplitMix64::new(1);
        let plan = plan_epoch(&lengths, 4, true, &mut rng);
        let mut seen: Vec<usize> = plan.concat();
        seen.sort();
        assert_eq!(seen, (0..200).collect::<Vec<_>>());
        assert_eq!(plan.len(), 50);
        // Within a pool the batches are sorted, so a batch's spread is small on average.
        let spread: usize = plan
            .iter()
            .map(|b| {
                let l: Vec<usize> = b.iter().map(|&i| lengths[i]).collect();
                l.iter().max().unwrap() - l.iter().min().unwrap()
            })
            .sum();
        assert!(
            spread / plan.len() < 10,
            "mean spread {}",
            spread / plan.len()
        );
        let fixed = plan_epoch(&lengths, 4, false, &mut rng);
        assert_eq!(fixed[0], vec![0, 1, 2, 3]);
        assert_eq!(fixed[49], vec![196, 197, 198, 199]);
    }

    #[test]
    fn balanced_epochs_give_every_speaker_the_largest_count() {
        // Speaker 0: 7 utterances, speaker 1: 2, speaker 2: 3.
        let speakers = [0, 1, 0, 0, 2, 0, 1, 0, 2, 0, 2, 0];
        let mut rng = SplitMix64::new(9);
        let rounds = balanced_rounds(&speakers, true, &mut rng);
        // Speaker 1 needs 4 rounds (2 + 2 + 2 + 1).
        assert_eq!(rounds.len(), 4);
        assert_eq!(rounds[0], (0..12).collect::<Vec<_>>());
        let items: Vec<usize> = rounds.concat();
        assert_eq!(items.len(), 21);
        for (i, &s) in speakers.iter().enumerate() {
            let n = speakers.iter().filter(|&&x| x == s).count();
            let c = items.iter().filter(|&&x| x == i).count();
            assert!(
                c == 7 / n || c == 7 / n + 1,
                "utterance {i} of speaker {s}: {c}"
            );
        }
        for s in 0..3 {
            assert_eq!(items.iter().filter(|&&i| speakers[i] == s).count(), 7);
        }
        for r in &rounds {
            let mut d = r.clone();
            d.dedup();
            assert_eq!(&d, r, "a round repeats an utterance");
        }
        // Unshuffled: deterministic, no randomness used, the first ones of the remainder.
        let mut r2 = SplitMix64::new(1);
        let fixed = balanced_rounds(&speakers, false, &mut r2);
        assert_eq!(r2, SplitMix64::new(1));
        assert_eq!(fixed[1], vec![1, 4, 6, 8, 10]);
        assert_eq!(fixed[2], vec![1, 4, 6]);
        assert_eq!(fixed[3], vec![1]);
        // One speaker: the plain epoch, and the sampler's plan is unchanged.
        let mut r3 = SplitMix64::new(3);
        assert_eq!(
            balanced_rounds(&[0; 5], true, &mut r3),
            vec![vec![0, 1, 2, 3, 4]]
        );
        assert_eq!(r3, SplitMix64::new(3));
        let lengths: Vec<usize> = (0..12).map(|i| 10 + i % 5).collect();
        let plain = Sampler::new(lengths.clone(), 2, true, 4);
        let bal = Sampler::new(lengths.clone(), 2, true, 4).with_balance(Some(vec![0; 12]));
        assert_eq!(plain.plan, bal.plan);
        let bal = Sampler::new(lengths, 2, true, 4).with_balance(Some(speakers.to_vec()));
        // 6 + 3 + 2 + 1 batches of at most 2; no batch holds an utterance twice.
        assert_eq!(bal.batches_per_epoch(), 12);
        for b in &bal.plan {
            assert!(!b.is_empty() && (b.len() < 2 || b[0] != b[1]), "{b:?}");
        }
        let mut seen: Vec<usize> = bal.plan.concat();
        seen.sort();
        let mut want = items;
        want.sort();
        assert_eq!(seen.len(), want.len());
    }

    #[test]
    fn balanced_runs_resume_at_any_cursor() {
        let lengths: Vec<usize> = (0..9).map(|i| 5 + i).collect();
        let speakers = vec![0, 0, 0, 0, 0, 0, 1, 1, 2];
        let mut a = Sampler::new(lengths.clone(), 2, true, 42).with_balance(Some(speakers.clone()));
        let mut all = Vec::new();
        let mut cursors = Vec::new();
        for _ in 0..12 {
            cursors.push(a.cursor());
            all.push(a.next_step(3));
        }
        for k in 0..12 {
            let mut b = Sampler::resume(lengths.clone(), 2, true, cursors[k])
                .with_balance(Some(speakers.clone()));
            for expected in &all[k..] {
                assert_eq!(&b.next_step(3), expected, "resumed at step {k}");
            }
        }
    }

    #[test]
    fn resuming_at_a_cursor_continues_the_same_order() {
        let lengths: Vec<usize> = (0..23).collect();
        let mut a = Sampler::new(lengths.clone(), 2, true, 42);
        assert_eq!(a.batches_per_epoch(), 12);
        assert_eq!(a.steps_per_epoch(5), 3);
        let mut all = Vec::new();
        let mut cursors = Vec::new();
        for _ in 0..10 {
            cursors.push(a.cursor());
            all.push(a.next_step(5));
        }
        // Steps do not cross epochs: 5, 5, 2 micro-batches.
        assert_eq!(
            all.iter().take(4).map(Vec::len).collect::<Vec<_>>(),
            [5, 5, 2, 5]
        );
        assert_ne!(all[0], all[3], "epochs are shuffled differently");
        for k in 0..10 {
            let mut b = Sampler::resume(lengths.clone(), 2, true, cursors[k]);
            for expected in &all[k..] {
                assert_eq!(&b.next_step(5), expected, "resumed at step {k}");
            }
        }
    }
}
