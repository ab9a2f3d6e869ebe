//! The held-out set (docs/training.md §14): utterances set aside before training, never in a
//! batch, on which the validation loss is computed. Chosen once from the data and `train.seed`
//! (or read from `train.val_manifest`), and recorded in the checkpoint's identity as
//! [`HeldoutId`], so that a resume with another split is refused instead of training on what
//! was held out.
//!
//! The choice ranks every utterance by a number drawn from the seed and the utterance's own
//! content, and holds out the lowest of each speaker: the same data and seed always give the
//! same split, whatever the manifest's line order.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::data::{sample_sha256, Dataset};
use vc_core::rng::SplitMix64;

/// Fewest utterances a speaker holds out (when it holds out any).
pub const MIN_HELD_OUT: usize = 2;
/// Most utterances a speaker holds out.
pub const MAX_HELD_OUT: usize = 64;
/// A speaker holds out at most this share of its utterances: with fewer than
/// `MIN_HELD_OUT / MAX_SHARE` (8) it keeps every one for training.
pub const MAX_SHARE: f64 = 0.25;

/// The held-out set as a checkpoint records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldoutId {
    pub utterances: usize,
    /// The held-out samples' digest (the same as a manifest of them would have).
    pub sha256: String,
}

/// The data of a run, split.
#[derive(Debug, Clone)]
pub struct Split {
    /// What trains.
    pub train: Dataset,
    /// What is held out; `None` when nothing is.
    pub heldout: Option<Dataset>,
    /// What the user should hear of the choice (speakers too small to hold any out, lines
    /// of the held-out manifest taken out of training).
    pub notes: Vec<String>,
}

impl Split {
    /// No held-out set: everything trains.
    pub fn none(train: Dataset) -> Self {
        Split {
            train,
            heldout: None,
            notes: Vec::new(),
        }
    }

    pub fn id(&self) -> Option<HeldoutId> {
        self.heldout.as_ref().map(|h| HeldoutId {
            utterances: h.samples.len(),
            sha256: h.digest.clone(),
        })
    }

    /// Holds out `fraction` of each speaker's utterances (rounded, at least [`MIN_HELD_OUT`],
    /// at most [`MAX_HELD_OUT`] and [`MAX_SHARE`] of them), chosen from `seed`.
    pub fn by_fraction(data: Dataset, fraction: f64, seed: u64) -> Self {
        if fraction <= 0.0 {
            return Split::none(data);
        }
        let mut held = vec![false; data.samples.len()];
        let mut notes = Vec::new();
        for speaker in 0..data.speaker_count() {
            let mut members: Vec<(u64, usize)> = data
                .samples
                .iter()
                .enumerate()
                .filter(|(_, s)| s.speaker == speaker)
                .map(|(i, s)| (rank(seed, &sample_sha256(s, &data.speakers)), i))
                .collect();
            let n = members.len();
            let k = held_out_count(n, fraction);
            if k == 0 {
                let who = match data.speakers.get(speaker) {
                    Some(name) => format!("speaker {name:?} has"),
                    None => "the data has".to_string(),
                };
                notes.push(format!(
                    "{who} {n} utterance(s), too few to hold {MIN_HELD_OUT} out for validation \
                     (train.val_fraction needs {} or more); all of them train",
                    (MIN_HELD_OUT as f64 / MAX_SHARE) as usize
                ));
                continue;
            }
            members.sort_unstable();
            for &(_, i) in &members[..k] {
                held[i] = true;
            }
        }
        if !held.contains(&true) {
            return Split {
                notes,
                ..Split::none(data)
            };
        }
        Split {
            heldout: Some(data.subset(|i| held[i])),
            train: data.subset(|i| !held[i]),
            notes,
        }
    }

    /// Holds out the utterances of `heldout` (another manifest, already read; its speaker
    /// indices are those of its own file), removing any that `data` also has from training.
    pub fn by_manifest(data: Dataset, mut heldout: Dataset) -> Result<Self> {
        for s in &mut heldout.samples {
            let name = heldout.speakers.get(s.speaker);
            s.speaker = match (name, data.speakers.is_empty()) {
                (None, true) => 0,
                (Some(name), false) => match data.speakers.iter().position(|n| n == name) {
                    Some(p) => p,
                    None => bail!(
                        "line {} of the held-out manifest {} names speaker {name:?}, which the \
                         training manifest {} does not have ({})",
                        s.line,
                        heldout.manifest.display(),
                        data.manifest.display(),
                        data.speakers.join(", ")
                    ),
                },
                (None, false) => bail!(
                    "line {} of the held-out manifest {} names no speaker, but the training \
                     manifest {} names its speakers",
                    s.line,
                    heldout.manifest.display(),
                    data.manifest.display()
                ),
                (Some(name), true) => bail!(
                    "line {} of the held-out manifest {} names speaker {name:?}, but the \
                     training manifest {} names none",
                    s.line,
                    heldout.manifest.display(),
                    data.manifest.display()
                ),
            };
        }
        let heldout = Dataset {
            speakers: data.speakers.clone(),
            ..heldout
        }
        .subset(|_| true);
        let held: std::collections::HashSet<[u8; 32]> = heldout
            .samples
            .iter()
            .map(|s| sample_sha256(s, &heldout.speakers))
            .collect();
        let keep: Vec<bool> = data
            .samples
            .iter()
            .map(|s| !held.contains(&sample_sha256(s, &data.speakers)))
            .collect();
        let removed: Vec<String> = data
            .samples
            .iter()
            .zip(&keep)
            .filter(|(_, k)| !**k)
            .map(|(s, _)| s.line.to_string())
            .collect();
        let mut notes = Vec::new();
        if !removed.is_empty() {
            notes.push(format!(
                "line(s) {} of {} are also in the held-out manifest {}: they do not train",
                removed.join(", "),
                data.manifest.display(),
                heldout.manifest.display()
            ));
        }
        if removed.len() == data.samples.len() {
            bail!(
                "every utterance of {} is in the held-out manifest {}: nothing is left to \
                 train on",
                data.manifest.display(),
                heldout.manifest.display()
            );
        }
        Ok(Split {
            train: data.subset(|i| keep[i]),
            heldout: Some(heldout),
            notes,
        })
    }
}

/// How many of a speaker's `n` utterances `fraction` holds out (0 when too few).
pub fn held_out_count(n: usize, fraction: f64) -> usize {
    let k = ((fraction * n as f64).round() as usize).clamp(MIN_HELD_OUT, MAX_HELD_OUT);
    if k as f64 > MAX_SHARE * n as f64 {
        0
    } else {
        k
    }
}

/// The utterance's place in the order of choice: drawn from the seed and its content.
fn rank(seed: u64, content: &[u8; 32]) -> u64 {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(content);
    let d = h.finalize();
    SplitMix64::new(u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))).next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Sample;
    use vc_core::artifacts::codes::CodeFrame;

    fn data(speakers: &[&str], per_speaker: usize) -> Dataset {
        let mut samples = Vec::new();
        let count = speakers.len().max(1);
        for i in 0..per_speaker * count {
            samples.push(Sample {
                line: i + 1,
                text_ids: vec![1, 2, 3, 100 + i as u32],
                codes: vec![CodeFrame([i as u32; 16]); 2 + i % 3],
                speaker: i % count,
            });
        }
        let d = Dataset {
            manifest: "train.jsonl".into(),
            samples,
            digest: String::new(),
            speakers: speakers.iter().map(|s| s.to_string()).collect(),
        };
        d.subset(|_| true)
    }

    #[test]
    fn counts_follow_the_fraction_within_their_bounds() {
        assert_eq!(held_out_count(7, 0.05), 0);
        assert_eq!(held_out_count(8, 0.05), 2);
        assert_eq!(held_out_count(100, 0.05), 5);
        assert_eq!(held_out_count(10_000, 0.05), MAX_HELD_OUT);
        assert_eq!(held_out_count(20, 0.5), 0, "more than a quarter");
        assert_eq!(held_out_count(40, 0.25), 10);
    }

    #[test]
    fn the_split_depends_on_the_seed_and_the_content_not_the_order() {
        let d = data(&[], 60);
        let a = Split::by_fraction(d.clone(), 0.05, 7);
        let h = a.heldout.as_ref().unwrap();
        assert_eq!(h.samples.len(), 3);
        assert_eq!(a.train.samples.len(), 57);
        let held: Vec<usize> = h.samples.iter().map(|s| s.line).collect();
        assert!(a.train.samples.iter().all(|s| !held.contains(&s.line)));
        assert_eq!(a.id(), Split::by_fraction(d.clone(), 0.05, 7).id());
        assert_ne!(a.id(), Split::by_fraction(d.clone(), 0.05, 8).id());
        let mut reversed = d.clone();
        reversed.samples.reverse();
        let b = Split::by_fraction(reversed.subset(|_| true), 0.05, 7);
        let mut lines: Vec<usize> = b.heldout.unwrap().samples.iter().map(|s| s.line).collect();
        lines.sort();
        assert_eq!(lines, held);
        assert!(Split::by_fraction(d, 0.0, 7).heldout.is_none());
    }

    #[test]
    fn each_named_speaker_holds_out_its_own_share() {
        let d = data(&["alice", "bob"], 40);
        let s = Split::by_fraction(d, 0.05, 1);
        let h = s.heldout.unwrap();
        for speaker in 0..2 {
            assert_eq!(h.samples.iter().filter(|x| x.speaker == speaker).count(), 2);
        }
        let small = data(&["alice"], 5);
        let s = Split::by_fraction(small, 0.05, 1);
        assert!(s.heldout.is_none());
        assert!(s.notes[0].contains("\"alice\" has 5"), "{:?}", s.notes);
    }

    #[test]
    fn a_heldout_manifest_takes_its_lines_out_of_training() {
        let d = data(&[], 10);
        let mut h = d.subset(|i| i == 3 || i == 4);
        h.manifest = "val.jsonl".into();
        let s = Split::by_manifest(d.clone(), h).unwrap();
        assert_eq!(s.train.samples.len(), 8);
        assert!(s.notes[0].contains("line(s) 4, 5"), "{:?}", s.notes);
        let named = data(&["alice"], 4);
        let e = Split::by_manifest(d.clone(), named).unwrap_err();
        assert!(format!("{e}").contains("names none"), "{e}");
        let e = Split::by_manifest(d.clone(), d).unwrap_err();
        assert!(format!("{e}").contains("nothing is left"), "{e}");
    }
}
