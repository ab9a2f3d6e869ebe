//! The validation loss (docs/training.md §14): the training objective — talker and sub losses,
//! as [`crate::step::loss`] computes them — over the held-out set, teacher-forced, with no update.
//! Every trainer batches the held-out set the same way ([`micro_batches`]) and averages the
//! micro-batches' losses as a step averages its micro-batches', so the single-device and the
//! sharded runs report the same number.

use crate::data::Dataset;
use crate::metrics::EvalMetrics;

/// The held-out set's micro-batches (indices into `heldout.samples`): `batch_size` utterances
/// each, taken by length so that a batch pads little, ties in manifest order.
pub fn micro_batches(heldout: &Dataset, batch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..heldout.samples.len()).collect();
    order.sort_by_key(|&i| (heldout.samples[i].seq_len(), heldout.samples[i].line));
    order
        .chunks(batch_size.max(1))
        .map(<[usize]>::to_vec)
        .collect()
}

/// The sums of the micro-batches' losses.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossSums {
    pub total: f64,
    pub talker: f64,
    pub sub: f64,
    pub batches: usize,
}

impl LossSums {
    pub fn add(&mut self, total: f64, talker: f64, sub: f64) {
        self.total += total;
        self.talker += talker;
        self.sub += sub;
        self.batches += 1;
    }

    /// The mean losses as the metrics line of an evaluation after optimizer step `step`.
    pub fn metrics(&self, step: usize, utterances: usize, seconds: f64) -> EvalMetrics {
        let n = self.batches.max(1) as f64;
        EvalMetrics {
            step,
            val_loss: self.total / n,
            val_loss_talker: self.talker / n,
            val_loss_sub: self.sub / n,
            val_utterances: utterances,
            seconds,
            samples: None,
            score: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Sample;
    use vc_core::artifacts::codes::CodeFrame;

    #[test]
    fn micro_batches_go_by_length_and_cover_every_utterance_once() {
        let lens = [5, 2, 9, 2, 7];
        let samples = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| Sample {
                line: i + 1,
                text_ids: vec![1, 2, 3, 4],
                codes: vec![CodeFrame([0; 16]); n],
                speaker: 0,
            })
            .collect();
        let d = Dataset {
            manifest: "v.jsonl".into(),
            samples,
            digest: String::new(),
            speakers: Vec::new(),
        };
        assert_eq!(micro_batches(&d, 2), [vec![1, 3], vec![0, 4], vec![2]]);
        let mut s = LossSums::default();
        s.add(2.0, 1.0, 4.0);
        s.add(4.0, 3.0, 2.0);
        let m = s.metrics(7, 5, 0.5);
        assert_eq!(
            (m.step, m.val_loss, m.val_loss_talker, m.val_loss_sub),
            (7, 3.0, 2.0, 3.0)
        );
    }
}
