//! The data order: which utterances form each micro-batch of an epoch, and where a run is in
//! it. An epoch's plan is a pure function of the utterance lengths, the batch size and the RNG
//! state at the start of the epoch, so a checkpoint that records that state and the cursor
//! (epoch, next micro-batch) resumes the exact order.
//!
//! Shuffled plans bucket by length to limit padding: the shuffled utterances are cut into pools
//! of [`POOL_BATCHES`] batches, each pool is sorted by length and cut into batches, and the
//! batch order of the whole epoch is shuffled again. Unshuffled plans take the manifest order
//! in fixed consecutive batches (for benchmarks and comparisons).

use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;

/// Batches per length-sorting pool.
pub const POOL_BATCHES: usize = 32;

/// Micro-batches of one epoch, as indices into the dataset.
pub fn plan_epoch(
    lengths: &[usize],
    batch_size: usize,
    shuffle: bool,
    rng: &mut SplitMix64,
) -> Vec<Vec<usize>> {
    let bs = batch_size.max(1);
    let mut order: Vec<usize> = (0..lengths.len()).collect();
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
            batch_size,
            shuffle,
            cursor,
            plan,
            next_state: rng.state(),
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
        self.plan = plan_epoch(&self.lengths, self.batch_size, self.shuffle, &mut rng);
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
