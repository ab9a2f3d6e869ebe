//! Evaluation of a training run (docs/training.md §14.4–14.6): the samples each evaluated
//! checkpoint speaks and their measures — speaker similarity, speaking rate, end of speech,
//! word error rate — with the score that can choose the checkpoint, and the pages a person
//! watches the run on. The trainer reaches it through [`vc_train::evaluation::Evaluator`],
//! which [`Evaluation`] implements, so that `vc-train` builds without the synthesizer and
//! Whisper.
//!
//! Modules: [`samples`] (what a run speaks, speaking and measuring it, WER, the score and the
//! drift alarm, which Whisper model listens), [`report`] (`report.html`), [`loss_plot`]
//! (`loss.svg`), [`plot`] (the SVG line charts both draw with).

pub mod loss_plot;
pub mod plot;
pub mod report;
pub mod samples;

use std::path::PathBuf;

use anyhow::Result;

use vc_train::evaluation::{Evaluator, Pages, SamplePlan, SampleRun};

/// Evaluation as `voiceclone train` runs it.
pub struct Evaluation {
    /// What transcribes the samples for their WER.
    pub listener: samples::Listener,
    /// Each voice's reference clip (its lower-cased name as the export names it, and the
    /// clip), shown beside the samples in the report.
    pub references: Vec<(String, PathBuf)>,
}

impl Evaluator for Evaluation {
    fn plan_samples(&self, run: &SampleRun<'_>) -> Result<SamplePlan> {
        samples::setup::plan_run(run, &self.listener)
    }

    fn write_pages(&self, pages: &Pages<'_>) -> Result<()> {
        loss_plot::write(pages.checkpoints, pages.steps, pages.evals)?;
        report::write(&report::ReportInput {
            checkpoints: pages.checkpoints,
            steps: pages.steps,
            evals: pages.evals,
            chosen: pages.chosen,
            select: pages.select,
            references: &self.references,
        })
    }
}
