//! Choosing the checkpoint a run exports (docs/training.md §14.3): the one with the lowest
//! validation loss so far (or the newest), named by `checkpoints/best` and kept when older
//! checkpoints are pruned, and the early stop after validations that found nothing better.
//!
//! The state travels in every checkpoint's index, so a resumed run compares against the same
//! best and counts the same validations since it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::checkpoint;
use crate::config::Select;

/// The file in `checkpoints/` naming the chosen checkpoint (`step-NNNNNNN`).
pub const BEST: &str = "best";

/// What the validations of a run have found so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Selection {
    /// The step of the lowest validation loss, and that loss.
    pub best_step: Option<usize>,
    pub best_val_loss: Option<f64>,
    /// Validations since the best one that were not lower.
    pub since_best: usize,
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

    /// Whether `early_stop` validations in a row have found nothing better (0: never).
    pub fn exhausted(&self, early_stop: usize) -> bool {
        early_stop > 0 && self.best_step.is_some() && self.since_best >= early_stop
    }

    /// The step whose checkpoint `select` chooses, given the newest saved step.
    pub fn chosen(&self, select: Select, newest: usize) -> usize {
        match (select, self.best_step) {
            (Select::ValLoss, Some(step)) => step,
            _ => newest,
        }
    }
}

/// Points `root/best` at checkpoint `step` (atomically).
pub fn write_best(root: &Path, step: usize) -> Result<()> {
    let name = checkpoint::step_dir_name(step);
    crate::fsutil::write_atomic(&root.join(BEST), format!("{name}\n").as_bytes())
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
    let complete = |step| {
        root.join(checkpoint::step_dir_name(step))
            .join(checkpoint::INDEX)
            .is_file()
    };
    if complete(chosen) {
        write_best(root, chosen)?;
        return Ok(None);
    }
    write_best(root, newest)?;
    Ok(Some(format!(
        "the checkpoint of the lowest validation loss, {}, is no longer in {}; {} now names \
         the newest, {}",
        checkpoint::step_dir_name(chosen),
        root.display(),
        BEST,
        checkpoint::step_dir_name(newest)
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
    Ok(dir.join(checkpoint::INDEX).is_file().then_some(dir))
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
        assert!(s.exhausted(2) && !s.exhausted(3) && !s.exhausted(0));
        assert_eq!(s.chosen(Select::ValLoss, 10), 6);
        assert_eq!(s.chosen(Select::Last, 10), 10);
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
        std::fs::write(ckpt.join(checkpoint::INDEX), "{}").unwrap();
        assert_eq!(find_best(dir.path()).unwrap(), Some(ckpt));
    }
}
