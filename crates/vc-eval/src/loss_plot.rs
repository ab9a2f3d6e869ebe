//! `checkpoints/loss.svg` (docs/training.md §9, §14.2): the training losses per optimizer step
//! and the validation loss per evaluation, redrawn whenever a checkpoint is saved.

use std::path::Path;

use anyhow::{Context, Result};

use crate::plot::{self, Chart, Series, COLORS};
use vc_train::metrics::{EvalMetrics, StepMetrics};

pub const PLOT_FILE: &str = "loss.svg";

/// Writes `checkpoints/loss.svg` atomically.
pub fn write(checkpoints: &Path, steps: &[StepMetrics], evals: &[EvalMetrics]) -> Result<()> {
    let dest = checkpoints.join(PLOT_FILE);
    vc_core::fsutil::write_atomic(&dest, loss_svg(steps, evals).as_bytes())
        .with_context(|| format!("cannot write {}", dest.display()))
}

/// An SVG line plot against the step of loss, loss_talker and loss_sub per optimizer step, and
/// of the validation loss at each evaluation, dashed with its points marked.
pub fn loss_svg(rows: &[StepMetrics], evals: &[EvalMetrics]) -> String {
    let title = if evals.is_empty() {
        "loss per optimizer step"
    } else {
        "loss per optimizer step, validation loss per evaluation"
    };
    let per_step = |name: &str, color, f: fn(&StepMetrics) -> f64| Series {
        name: name.into(),
        color,
        dashed: false,
        points: rows.iter().map(|m| (m.step as f64, f(m))).collect(),
    };
    let series = if rows.is_empty() {
        Vec::new()
    } else {
        vec![
            per_step("loss", COLORS[0], |m| m.loss),
            per_step("loss_talker", COLORS[1], |m| m.loss_talker),
            per_step("loss_sub", COLORS[2], |m| m.loss_sub),
            Series {
                name: "val_loss".into(),
                color: COLORS[3],
                dashed: true,
                points: evals.iter().map(|e| (e.step as f64, e.val_loss)).collect(),
            },
        ]
    };
    plot::svg(&Chart {
        title: format!("voiceclone train: {title}"),
        x_label: "step",
        series,
        band: None,
        from_zero: true,
        empty: "no steps yet",
        marker: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: usize, loss: f64) -> StepMetrics {
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

    fn eval(step: usize, val_loss: f64) -> EvalMetrics {
        EvalMetrics {
            step,
            val_loss,
            val_loss_talker: 0.5,
            val_loss_sub: 0.5,
            val_utterances: 2,
            seconds: 0.1,
            samples: None,
            score: None,
        }
    }

    #[test]
    fn the_plot_has_the_losses_and_the_validations() {
        let dir = tempfile::tempdir().unwrap();
        let steps = [step(1, 10.0), step(2, 5.0)];
        write(dir.path(), &steps, &[eval(2, 1.0)]).unwrap();
        let svg = std::fs::read_to_string(dir.path().join(PLOT_FILE)).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // One evaluation: a marked point and its legend entry; two: a dashed line through both.
        assert_eq!(svg.matches("fill=\"#d62728\"").count(), 1);
        assert!(svg.contains(">val_loss</text>"));
        write(dir.path(), &steps, &[eval(2, 1.0), eval(3, 2.0)]).unwrap();
        let svg = std::fs::read_to_string(dir.path().join(PLOT_FILE)).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert_eq!(
            svg.matches("stroke-dasharray").count(),
            2,
            "the line and its legend"
        );
        assert_eq!(svg.matches("fill=\"#d62728\"").count(), 2);
        assert!(loss_svg(&[], &[]).contains("no steps yet"));
    }
}
