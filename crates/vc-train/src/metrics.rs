//! Training metrics: `checkpoints/metrics.jsonl`, one JSON object per optimizer step and one
//! per evaluation over the held-out set with its samples (docs/training.md §9, §14). The pages
//! drawn from it are evaluation's ([`crate::evaluation::Evaluator::write_pages`]).

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

pub const METRICS_FILE: &str = "metrics.jsonl";

/// One optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    pub epoch: usize,
    #[serde(deserialize_with = "number_or_nan")]
    pub loss: f64,
    #[serde(deserialize_with = "number_or_nan")]
    pub loss_talker: f64,
    #[serde(deserialize_with = "number_or_nan")]
    pub loss_sub: f64,
    /// Global gradient L2 norm before clipping.
    #[serde(deserialize_with = "number_or_nan")]
    pub grad_norm: f64,
    #[serde(deserialize_with = "number_or_nan")]
    pub lr: f64,
    /// Audio frames in the step's batches.
    pub frames: usize,
    /// Wall time of the step.
    #[serde(deserialize_with = "number_or_nan")]
    pub seconds: f64,
    /// Sharded runs: the most tensor bytes any rank sent in the step to ranks on its own node,
    /// and to ranks on other nodes (docs/distributed.md §8.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_within_node: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_across_nodes: Option<u64>,
}

/// One evaluation over the held-out set, after optimizer step `step` (docs/training.md §14).
/// Told apart from a [`StepMetrics`] line by its `val_loss`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    pub step: usize,
    /// The training objective over the held-out set, and its talker and sub parts.
    #[serde(deserialize_with = "number_or_nan")]
    pub val_loss: f64,
    #[serde(deserialize_with = "number_or_nan")]
    pub val_loss_talker: f64,
    #[serde(deserialize_with = "number_or_nan")]
    pub val_loss_sub: f64,
    /// Utterances of the held-out set.
    pub val_utterances: usize,
    /// Wall time of the evaluation (the validation loss, and the samples when there are).
    #[serde(deserialize_with = "number_or_nan")]
    pub seconds: f64,
    /// The samples spoken with the checkpoint of this step, and their score
    /// (docs/training.md §14.4 and §14.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<Vec<SampleMetrics>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<f64>,
}

/// One sample of an evaluation, as `checkpoints/metrics.jsonl` records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleMetrics {
    pub text: String,
    /// The speaker (its lower-cased name, as the export names it).
    pub voice: String,
    /// The WAV and its codes, relative to the workspace.
    pub wav: String,
    pub codes: String,
    /// Frames generated, and the most it could take.
    pub frames: usize,
    pub cap: usize,
    /// Whether it stopped with end of speech (not at `cap`).
    pub eos: bool,
    /// Cosine of its x-vector and the speaker's (both by the model's speaker encoder).
    pub similarity: Option<f64>,
    /// Frames per text token, and the speaker's own pace over this one: 1 = the speaker's
    /// pace, above 1 faster (docs/training.md §14.4).
    pub frames_per_token: f64,
    pub rate_ratio: f64,
    /// The held-out recording of the same text the rate is measured against (its audio as
    /// the manifest names it); null for a text of `train.sample_texts`, measured against the
    /// speaker's mean pace.
    pub recording: Option<String>,
    /// Word error rate of its transcript against `text` (null without a Whisper model).
    pub wer: Option<f64>,
    pub transcript: Option<String>,
}

/// A number of `metrics.jsonl`: serde_json writes a value that is not finite as `null`, which
/// reads back as NaN (so that the line is kept, not taken for a broken one).
pub fn number_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// The step a line of `metrics.jsonl` belongs to, whichever kind it is; `None` for a line
/// that is neither (the unreadable tail of a killed run).
fn line_step(line: &str) -> Option<usize> {
    serde_json::from_str::<StepMetrics>(line)
        .map(|m| m.step)
        .or_else(|_| serde_json::from_str::<EvalMetrics>(line).map(|m| m.step))
        .ok()
}

pub struct MetricsLog {
    path: PathBuf,
}

impl MetricsLog {
    /// Opens `dir/metrics.jsonl`, dropping lines of steps after `resumed_step` (they are about
    /// to be recomputed) and unreadable tails of a killed run.
    pub fn open(dir: &Path, resumed_step: usize) -> Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let path = dir.join(METRICS_FILE);
        if path.is_file() {
            let text = fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let kept: String = text
                .lines()
                .filter(|l| line_step(l).is_some_and(|step| step <= resumed_step))
                .map(|l| format!("{l}\n"))
                .collect();
            if kept != text {
                vc_core::fsutil::write_atomic(&path, kept.as_bytes())?;
            }
        }
        Ok(Self { path })
    }

    pub fn append(&self, m: &StepMetrics) -> Result<()> {
        self.append_line(m)
    }

    pub fn append_eval(&self, m: &EvalMetrics) -> Result<()> {
        self.append_line(m)
    }

    fn append_line(&self, m: &impl Serialize) -> Result<()> {
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        writeln!(f, "{}", serde_json::to_string(m)?)?;
        Ok(())
    }

    pub fn read_all(&self) -> Result<Vec<StepMetrics>> {
        read(&self.path)
    }

    pub fn read_evals(&self) -> Result<Vec<EvalMetrics>> {
        read(&self.path)
    }

    /// Every step line and every evaluation line, from one read of the file.
    pub fn read_lines(&self) -> Result<(Vec<StepMetrics>, Vec<EvalMetrics>)> {
        let text = match fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => {
                return Err(e).with_context(|| format!("cannot read {}", self.path.display()))
            }
        };
        let (mut steps, mut evals) = (Vec::new(), Vec::new());
        for line in text.lines() {
            if let Ok(m) = serde_json::from_str::<StepMetrics>(line) {
                steps.push(m);
            } else if let Ok(e) = serde_json::from_str::<EvalMetrics>(line) {
                evals.push(e);
            }
        }
        Ok((steps, evals))
    }
}

/// The lines of one kind ([`StepMetrics`] or [`EvalMetrics`]) of the metrics file at `path`.
pub fn read<M: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<M>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(step: usize, loss: f64) -> StepMetrics {
        StepMetrics {
            step,
            epoch: 0,
            loss,
            loss_talker: loss * 0.7,
            loss_sub: loss,
            grad_norm: 1.0,
            lr: 1e-3,
            frames: 10,
            seconds: 0.1,
            sent_within_node: None,
            sent_across_nodes: None,
        }
    }

    #[test]
    fn resume_drops_later_steps_and_keeps_validations() {
        let dir = tempfile::tempdir().unwrap();
        let log = MetricsLog::open(dir.path(), 0).unwrap();
        for s in 1..=5 {
            log.append(&m(s, 10.0 / s as f64)).unwrap();
        }
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.path().join(METRICS_FILE))
            .unwrap();
        f.write_all(b"{\"step\": 6, \"trunc").unwrap();
        let eval = |step| EvalMetrics {
            step,
            val_loss: 1.0,
            val_loss_talker: 0.5,
            val_loss_sub: 0.5,
            val_utterances: 2,
            seconds: 0.1,
            samples: None,
            score: None,
        };
        let log = MetricsLog::open(dir.path(), 5).unwrap();
        log.append_eval(&eval(2)).unwrap();
        log.append_eval(&eval(4)).unwrap();
        let log = MetricsLog::open(dir.path(), 3).unwrap();
        let steps: Vec<usize> = log.read_all().unwrap().iter().map(|m| m.step).collect();
        assert_eq!(steps, [1, 2, 3]);
        assert_eq!(log.read_evals().unwrap(), [eval(2)]);
        // A validation loss that is not finite is written as null and read back as NaN: the
        // line stays, also through a resume.
        log.append_eval(&EvalMetrics {
            val_loss: f64::NAN,
            ..eval(3)
        })
        .unwrap();
        let log = MetricsLog::open(dir.path(), 3).unwrap();
        let evals = log.read_evals().unwrap();
        assert_eq!(evals.len(), 2);
        assert!(evals[1].val_loss.is_nan() && evals[1].step == 3);
        let log = MetricsLog::open(dir.path(), 2).unwrap();
        assert_eq!(log.read_evals().unwrap(), [eval(2)]);
        let (steps, evals) = log.read_lines().unwrap();
        assert_eq!((steps, evals), (log.read_all().unwrap(), vec![eval(2)]));
    }
}
