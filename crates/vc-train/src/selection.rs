//! Choosing the checkpoint a run exports (docs/training.md §14.3): the one with the lowest
//! validation loss so far (or the newest), named by `checkpoints/best` and kept when older
//! checkpoints are pruned, and the early stop after validations that found nothing better.
//!
//! The state travels in every checkpoint's index, so a resumed run compares against the same
//! best and counts the same validations since it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{step_dir_name, INDEX};
use vc_core::config::Select;

/// The file in `checkpoints/` naming the chosen checkpoint (`step-NNNNNNN`).
pub const BEST: &str = "best";

/// What the validations of a run have found so far, for each way of choosing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Selection {
    /// The step of the lowest validation loss, and that loss.
    pub best_step: Option<usize>,
    pub best_val_loss: Option<f64>,
    /// Validations since the best one that were not lower.
    pub since_best: usize,
    /// The step whose samples scored highest (docs/training.md §14.5), and that score.
    #[serde(default)]
    pub best_score_step: Option<usize>,
    #[serde(default)]
    pub best_score: Option<f64>,
    /// Scored evaluations since the best one that were not higher.
    #[serde(default)]
    pub since_best_score: usize,
}

impl Selection {
    /// Takes in the validation loss after step `step`; whether it is the new best (strictly
    /// lower than every earlier one; a non-finite loss never is).
    pub fn observe(&mut self, step: usize, val_loss: f64) -> bool {
        let better = val_loss.is_finite() && self.best_val_loss.is_none_or(|b| val_loss < b);
        if better {
            self.best_step = Some(step);
            self.best_val_loss = Some(val_loss);
            self.since_best = 0;
        } else {
            self.since_best += 1;
        }
        better
    }

    /// Takes in the score of the samples of step `step`; whether it is the new best (strictly
    /// higher than every earlier one; a non-finite score never is).
    pub fn observe_score(&mut self, step: usize, score: f64) -> bool {
        let better = score.is_finite() && self.best_score.is_none_or(|b| score > b);
        if better {
            self.best_score_step = Some(step);
            self.best_score = Some(score);
            self.since_best_score = 0;
        } else {
            self.since_best_score += 1;
        }
        better
    }

    /// Whether `early_stop` evaluations in a row have found nothing better by `select`'s
    /// measure (the validation loss, except under `score`; 0: never).
    pub fn exhausted(&self, select: Select, early_stop: usize) -> bool {
        let (best, since) = match select {
            Select::Score => (self.best_score_step, self.since_best_score),
            Select::ValLoss | Select::Last => (self.best_step, self.since_best),
        };
        early_stop > 0 && best.is_some() && since >= early_stop
    }

    /// The step whose checkpoint `select` chooses, given the newest saved step.
    pub fn chosen(&self, select: Select, newest: usize) -> usize {
        match (select, self.best_step, self.best_score_step) {
            (Select::ValLoss, Some(step), _) | (Select::Score, _, Some(step)) => step,
            _ => newest,
        }
    }

    /// How `select` chose (for messages): "the lowest validation loss" and the like.
    pub fn describe(select: Select) -> &'static str {
        match select {
            Select::ValLoss => "the checkpoint of the lowest validation loss",
            Select::Score => "the checkpoint whose samples scored highest",
            Select::Last => "the newest checkpoint",
        }
    }
}

/// Points `root/best` at checkpoint `step` (atomically).
pub fn write_best(root: &Path, step: usize) -> Result<()> {
    let name = step_dir_name(step);
    vc_core::fsutil::write_atomic(&root.join(BEST), format!("{name}\n").as_bytes())
        .with_context(|| format!("cannot write {}", root.join(BEST).display()))
}

/// Points `root/best` at the checkpoint `select` chooses among those of a run whose newest is
/// step `newest`; when the chosen one is gone (moved aside as damaged), at the newest, and
/// says so.
pub fn point_best(
    root: &Path,
    selection: &Selection,
    select: Select,
    newest: usize,
) -> Result<Option<String>> {
    let chosen = selection.chosen(select, newest);
    let complete = |step| root.join(step_dir_name(step)).join(INDEX).is_file();
    if complete(chosen) {
        write_best(root, chosen)?;
        return Ok(None);
    }
    write_best(root, newest)?;
    Ok(Some(format!(
        "{}, {}, is no longer in {}; {} now names the newest, {}",
        Selection::describe(select),
        step_dir_name(chosen),
        root.display(),
        BEST,
        step_dir_name(newest)
    )))
}

/// The checkpoint directory `root/best` names, if the file is there and names a complete
/// checkpoint.
pub fn find_best(root: &Path) -> Result<Option<PathBuf>> {
    let text = match std::fs::read_to_string(root.join(BEST)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(e).with_context(|| format!("cannot read {}", root.join(BEST).display()))
        }
    };
    let dir = root.join(text.trim());
    Ok(dir.join(INDEX).is_file().then_some(dir))
}

/// The checkpoint name `root/best` holds (whether or not it is complete), so that pruning
/// spares it.
pub fn best_name(root: &Path) -> Option<String> {
    std::fs::read_to_string(root.join(BEST))
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_loss_is_chosen_and_stale_validations_are_counted() {
        let mut s = Selection::default();
        assert_eq!(s.chosen(Select::ValLoss, 3), 3, "nothing validated yet");
        assert!(s.observe(2, 5.0));
        assert!(!s.observe(4, 5.0), "equal is not better");
        assert!(s.observe(6, 4.0));
        assert!(!s.observe(8, f64::NAN));
        assert!(!s.observe(10, 4.5));
        assert_eq!((s.best_step, s.since_best), (Some(6), 2));
        assert!(
            s.exhausted(Select::ValLoss, 2)
                && !s.exhausted(Select::ValLoss, 3)
                && !s.exhausted(Select::ValLoss, 0)
        );
        assert_eq!(s.chosen(Select::ValLoss, 10), 6);
        assert_eq!(s.chosen(Select::Last, 10), 10);
        assert_eq!(s.chosen(Select::Score, 10), 10, "nothing scored yet");
        assert!(!s.exhausted(Select::Score, 1), "nothing scored yet");
    }

    #[test]
    fn the_highest_score_is_chosen_apart_from_the_loss() {
        let mut s = Selection::default();
        assert!(s.observe(2, 5.0) && s.observe_score(2, -0.5));
        assert!(!s.observe(4, 6.0) && s.observe_score(4, 0.25));
        assert!(!s.observe_score(6, 0.25), "equal is not better");
        assert!(!s.observe_score(8, f64::NAN));
        assert_eq!(s.chosen(Select::Score, 8), 4);
        assert_eq!(s.chosen(Select::ValLoss, 8), 2);
        assert_eq!((s.since_best_score, s.since_best), (2, 1));
        assert!(s.exhausted(Select::Score, 2) && !s.exhausted(Select::ValLoss, 2));
        // An index written before scores existed reads with none.
        let old: Selection =
            serde_json::from_str(r#"{"best_step": 2, "best_val_loss": 5.0, "since_best": 0}"#)
                .unwrap();
        assert_eq!((old.best_score_step, old.since_best_score), (None, 0));
    }

    #[test]
    fn best_names_a_complete_checkpoint_only() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(find_best(dir.path()).unwrap(), None);
        write_best(dir.path(), 7).unwrap();
        assert_eq!(best_name(dir.path()).as_deref(), Some("step-0000007"));
        assert_eq!(find_best(dir.path()).unwrap(), None, "no such checkpoint");
        let ckpt = dir.path().join("step-0000007");
        std::fs::create_dir(&ckpt).unwrap();
        std::fs::write(ckpt.join(INDEX), "{}").unwrap();
        assert_eq!(find_best(dir.path()).unwrap(), Some(ckpt));
    }
}
