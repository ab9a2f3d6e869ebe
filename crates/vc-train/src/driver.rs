//! The training loop, one for every way of training (docs/training.md §1): it asks an
//! [`Engine`] — the single-device [`crate::Trainer`] or one rank of a sharded run — for
//! optimizer steps until the step budget or an agreed stop, and owns what is the same for all of
//! them: the schedule of checkpoints, signals, metrics, evaluations and the progress bar.
//!
//! In a sharded run every rank runs this loop in lockstep: the step count, the checkpoint
//! cadence and the stop decision (agreed through [`Engine::any_rank`]) are the same on every
//! rank, so each rank calls the same collectives in the same order. Only the reporting rank
//! (rank 0) writes metrics (`metrics.jsonl`, the TensorBoard event files) and shows progress.

use std::path::PathBuf;

use anyhow::Result;

use crate::evaluation::{Pages, SamplePlan, SampleRun, SampleSpeaker};
use crate::metrics::{EvalMetrics, MetricsLog, StepMetrics};
use crate::run_state::RunState;
use crate::selection;
use crate::tensorboard::TensorBoardLog;
use crate::{checkpoint, Outcome, TrainOptions};
use vc_core::config::Select;
use vc_core::progress::Progress;
use vc_core::stop_signal as signal;

/// What the loop drives: a trainer around the run's shared state.
pub trait Engine: Send {
    /// Where the run stands.
    fn run(&self) -> &RunState;
    fn run_mut(&mut self) -> &mut RunState;
    /// One optimizer step; nothing changes when it fails.
    fn step(&mut self, micro: &[Vec<usize>]) -> Result<StepMetrics>;
    /// Saves a checkpoint of the current state: its directory on the reporting rank.
    fn save(&mut self) -> Result<Option<PathBuf>>;
    /// The validation loss over the held-out set with the current weights, the same on every
    /// rank (docs/training.md §14); `None` when the run holds nothing out.
    fn validate(&mut self) -> Result<Option<EvalMetrics>>;
    /// Whether `flag` is set on any rank (every rank gets the same answer).
    fn any_rank(&self, flag: bool) -> Result<bool>;
    /// The reporting rank's `values` on every rank (the others' arguments are ignored; every
    /// rank passes as many).
    fn broadcast_from_reporter(&self, values: &[f64]) -> Result<Vec<f64>>;
    /// Whether this is the rank that reports (metrics, progress, messages).
    fn is_reporter(&self) -> bool;
    /// Ranks of the run (1 on one device).
    fn world(&self) -> usize;
}

/// A loss or gradient norm that is not finite: the step was not applied. Restarting would only
/// repeat it (the data and the weights are the same), lowering the learning rate might not.
#[derive(Debug)]
pub struct NonFinite(pub String);

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NonFinite {}

/// Trains until the total step count, an agreed stop or an early stop; checkpoints every
/// `train.save_every` steps, on a stop, at a new best validation loss and at the end;
/// evaluates on the held-out set every `train.eval_every` steps (0: before every checkpoint
/// but a stop's) and at the end, and points `checkpoints/best` at the chosen checkpoint
/// (docs/training.md §14.3).
pub fn run(engine: &mut dyn Engine) -> Result<Outcome> {
    run_with(engine, || Ok(()))
}

/// [`run`], with `before_first_write` called on the reporting rank once the run's own checks
/// have passed (the samples' plan, `train.select`), just before it writes anything under
/// `checkpoints/`: where `--fresh` moves the previous run's checkpoints aside, so that a run
/// its checks refuse leaves them where they were (docs/training.md §7).
pub fn run_with(
    engine: &mut dyn Engine,
    before_first_write: impl FnOnce() -> Result<()>,
) -> Result<Outcome> {
    let total = engine.run().total_steps();
    let start_step = engine.run().step;
    let mut outcome = Outcome {
        start_step,
        step: start_step,
        total_steps: total,
        checkpoint: engine.run().resumed_from.clone(),
        interrupted: false,
        first_loss: None,
        last_loss: None,
        last_val_loss: None,
        early_stopped: false,
        frames_per_second: None,
    };
    let opts_checkpoints = engine.run().opts.checkpoints.clone();
    let c = engine.run().opts.config.clone();
    let reporter = engine.is_reporter();
    if reporter && engine.run().resumed_from.is_some() {
        // The choice under this run's `train.select`, which may differ from the last run's.
        if let Some(note) = selection::point_best(
            &opts_checkpoints,
            &engine.run().selection,
            c.select,
            start_step,
        )? {
            eprintln!("note: {note}");
        }
    }
    if start_step >= total {
        return Ok(outcome);
    }
    if engine.run().selection.exhausted(c.select, c.early_stop) {
        // The checkpoint's run already stopped early under this patience.
        outcome.early_stopped = true;
        return Ok(outcome);
    }
    let hooks = engine.run().opts.hooks.clone();
    let device = engine.run().opts.device.clone();
    let samples = plan_samples(engine)?;
    let (log, tensorboard) = if reporter {
        before_first_write()?;
        for note in &samples.notes {
            println!("{note}");
        }
        let tensorboard = if c.tensorboard {
            Some(TensorBoardLog::open(&opts_checkpoints, start_step)?)
        } else {
            None
        };
        (
            Some(MetricsLog::open(&opts_checkpoints, start_step)?),
            tensorboard,
        )
    } else {
        (None, None)
    };
    let progress = if reporter {
        Progress::new(total as u64, "steps", "train")
    } else {
        Progress::hidden(total as u64)
    };
    progress.set_position(start_step as u64);
    let ranks = match engine.world() {
        1 => String::new(),
        n => format!(" · {n} ranks"),
    };
    signal::install();
    // The newest saved step, which the report names when nothing better is chosen.
    let mut last_saved = engine.run().resumed_from.as_ref().map(|_| start_step);
    // Where a failure happens, for the launcher's restart rule (docs/distributed.md §5.1).
    vc_dist::launch::note_step(start_step);
    let result = (|| -> Result<()> {
        let (mut frames, mut seconds) = (0usize, 0f64);
        let mut val: Option<f64> = None;
        while engine.run().step < total {
            let micro = engine.run_mut().next_step_batches();
            let m = crate::run_step(&device, || engine.step(&micro))
                .map_err(|e| with_hint(e, &opts_checkpoints, c.lr))?;
            if let Some(log) = &log {
                log.append(&m)?;
            }
            if let Some(tb) = &tensorboard {
                tb.append_step(&m)?;
            }
            frames += m.frames;
            seconds += m.seconds;
            outcome.first_loss.get_or_insert(m.loss);
            outcome.last_loss = Some(m.loss);
            outcome.step = m.step;
            vc_dist::launch::note_step(m.step);
            let fps = frames as f64 / seconds.max(1e-9);
            outcome.frames_per_second = Some(fps);
            progress.set_position(m.step as u64);
            let message = |val: Option<f64>| {
                let val = val.map_or(String::new(), |v| format!(" · val {v:.4}"));
                format!(
                    "epoch {}/{} · loss {:.4} (talker {:.4}, sub {:.4}){val} · lr {:.2e} · {:.0} frames/s{ranks}",
                    m.epoch + 1,
                    c.epochs,
                    m.loss,
                    m.loss_talker,
                    m.loss_sub,
                    m.lr,
                    fps
                )
            };
            progress.set_message(message(val));
            hooks.after_step(m.step);
            let stop = engine.any_rank(signal::stop_requested())?;
            let due = c.save_every > 0 && m.step.is_multiple_of(c.save_every);
            let mut save = due || stop || m.step == total;
            let eval_due = match c.eval_every {
                0 => save && !stop,
                n => m.step.is_multiple_of(n),
            };
            let mut evaluated = None;
            if eval_due || m.step == total {
                progress.set_message(format!("{} · validating", message(val)));
                let e = crate::run_step(&device, || engine.validate())?;
                if let Some(e) = e {
                    val = Some(e.val_loss);
                    evaluated = Some(e);
                }
                progress.set_message(message(val));
            }
            let mut early = false;
            if let Some(e) = &evaluated {
                let mut sel = engine.run().selection.clone();
                let improved = sel.observe(e.step, e.val_loss);
                if c.select != Select::Score {
                    early = sel.exhausted(c.select, c.early_stop);
                }
                engine.run_mut().selection = sel;
                // A new best is saved even between checkpoints, so that it can be chosen; an
                // evaluation with samples always is, since they belong to its checkpoint.
                save |=
                    (improved && c.select == Select::ValLoss) || early || samples.speaker.is_some();
            }
            if save {
                let dir = engine.save()?;
                if let (Some(e), Some(speaker)) = (evaluated.as_mut(), &samples.speaker) {
                    let status = |i: usize, n: usize| {
                        progress.set_message(format!("{} · speaking samples {i}/{n}", message(val)))
                    };
                    let warn = |line: String| progress.println(line);
                    let scored =
                        score_samples(engine, dir.as_deref(), e, &**speaker, status, warn)?;
                    progress.set_message(message(val));
                    if c.select == Select::Score {
                        early = scored && engine.run().selection.exhausted(c.select, c.early_stop);
                    }
                }
                if let (Some(log), Some(e)) = (&log, &evaluated) {
                    log.append_eval(e)?;
                }
                if let (Some(tb), Some(e)) = (&tensorboard, &evaluated) {
                    tb.append_eval(e)?;
                }
                if let (Some(log), Some(dir)) = (&log, dir) {
                    let shown = match opts_checkpoints.parent() {
                        Some(base) => vc_core::fsutil::display_relative(&dir, base),
                        None => dir.display().to_string(),
                    };
                    let val = evaluated
                        .as_ref()
                        .map_or(String::new(), |e| format!(", validation {:.4}", e.val_loss));
                    let score = evaluated
                        .as_ref()
                        .and_then(|e| e.score)
                        .map_or(String::new(), |s| format!(", sample score {s:.3}"));
                    progress.println(format!(
                        "step {}/{total}: loss {:.4}{val}{score}; saved {shown}",
                        m.step, m.loss
                    ));
                    outcome.checkpoint = Some(dir);
                    last_saved = Some(m.step);
                    let chosen = engine.run().selection.chosen(c.select, m.step);
                    selection::write_best(&opts_checkpoints, chosen)?;
                    // What the commit spared as the chosen one before may go now.
                    checkpoint::prune(
                        &opts_checkpoints,
                        c.keep,
                        &checkpoint::step_dir_name(m.step),
                    )?;
                    write_pages(&engine.run().opts, log, Some(chosen))?;
                }
            } else if let (Some(log), Some(e)) = (&log, &evaluated) {
                log.append_eval(e)?;
                if let Some(tb) = &tensorboard {
                    tb.append_eval(e)?;
                }
                progress.println(format!(
                    "step {}/{total}: loss {:.4}, validation {:.4}",
                    m.step, m.loss, e.val_loss
                ));
                // Not saved: the choice stands among the saved checkpoints.
                let chosen =
                    last_saved.map(|newest| engine.run().selection.chosen(c.select, newest));
                write_pages(&engine.run().opts, log, chosen)?;
            }
            if let Some(e) = evaluated {
                outcome.last_val_loss = Some(e.val_loss);
            }
            if stop {
                outcome.interrupted = true;
                break;
            }
            if early {
                let sel = &engine.run().selection;
                progress.println(if c.select == Select::Score {
                    format!(
                        "early stop after step {}: {} evaluation(s) without a sample score \
                         above {:.3} (step {}; train.early_stop = {})",
                        m.step,
                        sel.since_best_score,
                        sel.best_score.unwrap_or(f64::NAN),
                        sel.best_score_step.unwrap_or(0),
                        c.early_stop
                    )
                } else {
                    format!(
                        "early stop after step {}: {} validation(s) without a loss below {:.4} \
                         (step {}; train.early_stop = {})",
                        m.step,
                        sel.since_best,
                        sel.best_val_loss.unwrap_or(f64::NAN),
                        sel.best_step.unwrap_or(0),
                        c.early_stop
                    )
                });
                outcome.early_stopped = true;
                break;
            }
        }
        Ok(())
    })();
    progress.finish();
    signal::restore();
    result.map(|()| outcome)
}

/// Speaks and measures the samples of the checkpoint just saved (`dir` on the reporting rank)
/// into `e`, warns of drift, and takes their score into the selection on every rank, recording
/// it in the checkpoint's index (docs/training.md §14.4 and §14.5). Returns whether there was a
/// score (there is none when the samples failed: a warning, and the evaluation counts for
/// nothing).
fn score_samples(
    engine: &mut dyn Engine,
    dir: Option<&std::path::Path>,
    e: &mut EvalMetrics,
    speaker: &dyn SampleSpeaker,
    status: impl Fn(usize, usize) + Sync,
    warn: impl Fn(String),
) -> Result<bool> {
    let mut score = f64::NAN;
    if let (Some(dir), true) = (dir, engine.is_reporter()) {
        let started = std::time::Instant::now();
        match speaker.speak(dir, &status) {
            Ok(spoken) => {
                score = spoken.score;
                for problem in spoken.warnings {
                    warn(format!(
                        "warning: {}: {problem}",
                        checkpoint::step_dir_name(e.step)
                    ));
                }
                e.samples = Some(spoken.samples);
            }
            Err(err) => warn(format!("warning: no samples at step {}: {err:#}", e.step)),
        }
        e.seconds += started.elapsed().as_secs_f64();
    }
    let score = engine.broadcast_from_reporter(&[score])?[0];
    if !score.is_finite() {
        return Ok(false);
    }
    e.score = Some(score);
    let mut sel = engine.run().selection.clone();
    sel.observe_score(e.step, score);
    if let (Some(dir), true) = (dir, engine.is_reporter()) {
        // The checkpoint was written before its samples were scored.
        checkpoint::write_selection(dir, &sel)?;
    }
    engine.run_mut().selection = sel;
    Ok(true)
}

/// The samples of the run (docs/training.md §14.4), as its evaluator plans them; a run without
/// an evaluator has none, and cannot choose by their score.
fn plan_samples(engine: &dyn Engine) -> Result<SamplePlan> {
    let opts = &engine.run().opts;
    let Some(evaluator) = &opts.evaluator else {
        if opts.config.select == Select::Score {
            anyhow::bail!(
                "train.select = \"score\" chooses by the samples' score, but this run has no \
                 evaluator to speak them"
            );
        }
        return Ok(SamplePlan {
            speaker: None,
            notes: Vec::new(),
        });
    };
    evaluator.plan_samples(&SampleRun {
        options: opts,
        heldout: engine.run().heldout.as_ref(),
        train: &engine.run().dataset,
        world: engine.world(),
    })
}

/// Redraws `checkpoints/loss.svg` and `report.html` from the metrics, where the run has an
/// evaluator (docs/training.md §9, docs/training.md §14.6).
fn write_pages(opts: &TrainOptions, log: &MetricsLog, chosen: Option<usize>) -> Result<()> {
    let Some(evaluator) = &opts.evaluator else {
        return Ok(());
    };
    let (steps, evals) = log.read_lines()?;
    evaluator.write_pages(&Pages {
        checkpoints: &opts.checkpoints,
        steps: &steps,
        evals: &evals,
        chosen,
        select: opts.config.select,
    })
}

/// What to do after a failed step: continue from the last good checkpoint (which the failed
/// step did not touch), with a lower learning rate when the loss was not finite.
fn with_hint(e: anyhow::Error, checkpoints: &std::path::Path, lr: f64) -> anyhow::Error {
    let last = checkpoint::find_latest(checkpoints).ok().flatten();
    let non_finite = e.downcast_ref::<NonFinite>().is_some();
    let hint = match (last, non_finite) {
        (Some(d), true) => format!(
            "the last good checkpoint is {}; lower train.lr (now {lr}) and run `voiceclone train` \
             again to continue from it",
            d.display()
        ),
        (None, true) => {
            format!("no checkpoint was saved yet; lower train.lr (now {lr}) and start again")
        }
        (Some(d), false) => format!(
            "the last good checkpoint is {}; run `voiceclone train` again to continue from it",
            d.display()
        ),
        (None, false) => return e,
    };
    e.context(hint)
}
