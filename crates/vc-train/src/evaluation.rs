//! What the training loop asks of evaluation beyond the validation loss
//! (docs/training.md §14.4–14.6): samples spoken with each evaluated checkpoint and measured, and the pages a
//! person watches the run on (`loss.svg`, `report.html`). The `vc-eval` crate does that work —
//! it speaks with the synthesizer and listens with Whisper — so the trainer holds only this
//! interface and builds without either.

use std::path::Path;

use anyhow::Result;

use crate::data::Dataset;
use crate::metrics::{EvalMetrics, SampleMetrics, StepMetrics};
use crate::TrainOptions;
use vc_core::config::Select;

/// Evaluation of one run, given to the trainer in [`TrainOptions::evaluator`].
pub trait Evaluator: Send + Sync {
    /// Decides the samples of a run at its start, the same way on every rank. Fails when the
    /// run's settings ask for what it cannot have (`train.select = "score"` without samples).
    fn plan_samples(&self, run: &SampleRun<'_>) -> Result<SamplePlan>;
    /// Redraws the run's pages from its metrics.
    fn write_pages(&self, pages: &Pages<'_>) -> Result<()>;
}

/// What the samples of a run are planned from.
pub struct SampleRun<'a> {
    pub options: &'a TrainOptions,
    /// The held-out set (none: there are no evaluations).
    pub heldout: Option<&'a Dataset>,
    pub train: &'a Dataset,
    /// Ranks of the run: the others wait while the reporting rank speaks.
    pub world: usize,
}

/// The samples of a run, as decided at its start.
pub struct SamplePlan {
    /// What speaks them at each evaluation; `None`: the run has none.
    pub speaker: Option<Box<dyn SampleSpeaker>>,
    /// What the start of the run should say about them (why there are none, too).
    pub notes: Vec<String>,
}

/// Speaks the samples every evaluation of a run speaks.
pub trait SampleSpeaker: Send + Sync {
    /// Speaks and measures every sample with the weights of `checkpoint` (a `step-N`
    /// directory), on the CPU; `status(done, total)` after each.
    fn speak(&self, checkpoint: &Path, status: &(dyn Fn(usize, usize) + Sync)) -> Result<Spoken>;
}

/// The samples of one checkpoint, measured.
pub struct Spoken {
    pub samples: Vec<SampleMetrics>,
    /// Their score for `train.select = "score"` (docs/training.md §14.5); NaN when none counts.
    pub score: f64,
    /// Measures that could not be taken and drift to warn of, one line each.
    pub warnings: Vec<String>,
}

/// What the pages show.
pub struct Pages<'a> {
    /// `checkpoints/`, where they are written; its parent is the workspace the samples' paths
    /// are relative to.
    pub checkpoints: &'a Path,
    pub steps: &'a [StepMetrics],
    pub evals: &'a [EvalMetrics],
    /// The step of the chosen checkpoint.
    pub chosen: Option<usize>,
    pub select: Select,
}
