//! Training metrics: `checkpoints/metrics.jsonl` (one JSON object per optimizer step, and one
//! per evaluation over the held-out set, docs/training.md §9, §14) and `checkpoints/loss.svg`,
//! a plot of the losses drawn by hand (no plotting dependency).

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

pub const METRICS_FILE: &str = "metrics.jsonl";
pub const PLOT_FILE: &str = "loss.svg";

/// One optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    pub epoch: usize,
    pub loss: f64,
    pub loss_talker: f64,
    pub loss_sub: f64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// Audio frames in the step's batches.
    pub frames: usize,
    /// Wall time of the step.
    pub seconds: f64,
}

/// One evaluation over the held-out set, after optimizer step `step` (docs/training.md §14).
/// Told apart from a [`StepMetrics`] line by its `val_loss`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    pub step: usize,
    /// The training objective over the held-out set, and its talker and sub parts.
    pub val_loss: f64,
    pub val_loss_talker: f64,
    pub val_loss_sub: f64,
    /// Utterances of the held-out set.
    pub val_utterances: usize,
    /// Wall time of the evaluation.
    pub seconds: f64,
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
        fs::create_dir_all(dir)?;
        let path = dir.join(METRICS_FILE);
        if path.is_file() {
            let text = fs::read_to_string(&path)?;
            let kept: String = text
                .lines()
                .filter(|l| line_step(l).is_some_and(|step| step <= resumed_step))
                .map(|l| format!("{l}\n"))
                .collect();
            if kept != text {
                crate::fsutil::write_atomic(&path, kept.as_bytes())?;
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

    /// Redraws `loss.svg` next to the metrics file.
    pub fn plot(&self) -> Result<()> {
        let svg = loss_svg(&self.read_all()?, &self.read_evals()?);
        let dest = self.path.with_file_name(PLOT_FILE);
        crate::fsutil::write_atomic(&dest, svg.as_bytes())
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

/// One line of the plot: its name, colour, whether dashed, and its (step, value) points.
struct Series {
    name: &'static str,
    color: &'static str,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

/// An SVG line plot against the step of loss, loss_talker and loss_sub per optimizer step, and
/// of the validation loss at each evaluation (docs/training.md §14.2), dashed with its points
/// marked.
pub fn loss_svg(rows: &[StepMetrics], evals: &[EvalMetrics]) -> String {
    let (w, h) = (720.0, 400.0);
    let (left, right, top, bottom) = (64.0, 16.0, 28.0, 44.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let title = if evals.is_empty() {
        "loss per optimizer step"
    } else {
        "loss per optimizer step, validation loss per evaluation"
    };
    s.push_str(&format!(
        "<text x=\"{left}\" y=\"18\" font-size=\"14\">voiceclone train: {title}</text>\n"
    ));
    let per_step = |name, color, f: fn(&StepMetrics) -> f64| Series {
        name,
        color,
        dashed: false,
        points: rows.iter().map(|m| (m.step as f64, f(m))).collect(),
    };
    let series = [
        per_step("loss", "#1f77b4", |m| m.loss),
        per_step("loss_talker", "#ff7f0e", |m| m.loss_talker),
        per_step("loss_sub", "#2ca02c", |m| m.loss_sub),
        Series {
            name: "val_loss",
            color: "#d62728",
            dashed: true,
            points: evals.iter().map(|e| (e.step as f64, e.val_loss)).collect(),
        },
    ];
    let finite: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|l| l.points.iter().copied())
        .filter(|(_, v)| v.is_finite())
        .collect();
    if rows.is_empty() || finite.is_empty() {
        s.push_str(
            "<text x=\"50%\" y=\"50%\" text-anchor=\"middle\">no steps yet</text>\n</svg>\n",
        );
        return s;
    }
    let x0 = finite.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let x1 = finite
        .iter()
        .map(|p| p.0)
        .fold(f64::NEG_INFINITY, f64::max)
        .max(x0 + 1.0);
    let y0 = finite
        .iter()
        .map(|p| p.1)
        .fold(f64::INFINITY, f64::min)
        .min(0.0);
    let y1 = finite
        .iter()
        .map(|p| p.1)
        .fold(f64::NEG_INFINITY, f64::max)
        .max(y0 + 1e-9)
        * 1.05;
    let px = |x: f64| left + (x - x0) / (x1 - x0) * pw;
    let py = |y: f64| top + ph - (y - y0) / (y1 - y0) * ph;
    // Axes, ticks and grid.
    s.push_str(&format!(
        "<rect x=\"{left}\" y=\"{top}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#444\"/>\n"
    ));
    for i in 0..=5 {
        let yv = y0 + (y1 - y0) * i as f64 / 5.0;
        let y = py(yv);
        s.push_str(&format!(
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            left + pw,
            left - 6.0,
            y + 4.0,
            tick(yv)
        ));
    }
    // Step ticks on whole steps: as many as there are steps between the ends, at most 5.
    let intervals = ((x1 - x0).round() as usize).clamp(1, 5);
    for i in 0..=intervals {
        let xv = x0 + (x1 - x0) * i as f64 / intervals as f64;
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            px(xv),
            top + ph + 16.0,
            xv.round()
        ));
    }
    s.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">step</text>\n",
        left + pw / 2.0,
        h - 8.0
    ));
    let mut k = 0;
    for line in series.iter().filter(|l| !l.points.is_empty()) {
        let pts: Vec<(f64, f64)> = line
            .points
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|&(x, y)| (px(x), py(y)))
            .collect();
        let dash = if line.dashed {
            " stroke-dasharray=\"6 3\""
        } else {
            ""
        };
        let color = line.color;
        if pts.len() > 1 {
            let joined: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            s.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\"{dash} points=\"{}\"/>\n",
                joined.join(" ")
            ));
        }
        // A lone point, and every point of a dashed (sparse) line, is marked.
        if pts.len() == 1 || line.dashed {
            for (x, y) in &pts {
                s.push_str(&format!(
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{color}\"/>\n"
                ));
            }
        }
        let lx = left + pw - 130.0;
        let ly = top + 16.0 + 16.0 * k as f64;
        s.push_str(&format!(
            "<line x1=\"{lx}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>\
             <text x=\"{}\" y=\"{}\">{}</text>\n",
            lx + 20.0,
            lx + 26.0,
            ly + 4.0,
            line.name
        ));
        k += 1;
    }
    s.push_str("</svg>\n");
    s
}

fn tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
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
        }
    }

    #[test]
    fn resume_drops_later_steps_and_plot_has_the_losses_and_validations() {
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
        };
        let log = MetricsLog::open(dir.path(), 5).unwrap();
        log.append_eval(&eval(2)).unwrap();
        log.append_eval(&eval(4)).unwrap();
        let log = MetricsLog::open(dir.path(), 3).unwrap();
        let steps: Vec<usize> = log.read_all().unwrap().iter().map(|m| m.step).collect();
        assert_eq!(steps, [1, 2, 3]);
        assert_eq!(log.read_evals().unwrap(), [eval(2)]);
        log.plot().unwrap();
        let svg = fs::read_to_string(dir.path().join(PLOT_FILE)).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // One evaluation: a marked point and its legend entry; two: a dashed line through both.
        assert_eq!(svg.matches("fill=\"#d62728\"").count(), 1);
        assert!(svg.contains(">val_loss</text>"));
        log.append_eval(&EvalMetrics {
            val_loss: 2.0,
            ..eval(3)
        })
        .unwrap();
        log.plot().unwrap();
        let svg = fs::read_to_string(dir.path().join(PLOT_FILE)).unwrap();
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
