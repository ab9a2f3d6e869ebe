//! `checkpoints/report.html` (docs/training.md §14.6): one self-contained page, rewritten at
//! every evaluation, that shows whether the voice is getting better — the training and
//! validation losses, learning rate and gradient norm over steps; the samples' similarity,
//! speaking rate and WER over checkpoints; every evaluation and sample with an audio player
//! beside the speaker's reference clip; and the checkpoint `train.select` chose.
//!
//! No scripts and nothing fetched: charts are inline SVG ([`crate::plot`]), audio players link
//! the WAV files next to the page. Every number printed comes from `metrics.jsonl` as it is
//! (its full value in the cell's `data-v`); the charts draw the per-voice means of the samples.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::plot::{self, escape, Chart, Series, COLORS};
use crate::samples::score::RATE_RANGE;
use vc_core::config::Select;
use vc_train::metrics::{EvalMetrics, SampleMetrics, StepMetrics};
use vc_train::selection::Selection;

pub const REPORT_FILE: &str = "report.html";

/// What the report shows.
pub struct ReportInput<'a> {
    /// `checkpoints/`, where the page is written; its parent is the workspace the samples'
    /// paths are relative to.
    pub checkpoints: &'a Path,
    pub steps: &'a [StepMetrics],
    pub evals: &'a [EvalMetrics],
    /// The step of the chosen checkpoint.
    pub chosen: Option<usize>,
    pub select: Select,
    /// Each voice's reference clip.
    pub references: &'a [(String, PathBuf)],
}

/// Writes `checkpoints/report.html` atomically.
pub fn write(input: &ReportInput) -> Result<()> {
    let dest = input.checkpoints.join(REPORT_FILE);
    vc_core::fsutil::write_atomic(&dest, render(input).as_bytes())
        .with_context(|| format!("cannot write {}", dest.display()))
}

/// The page.
pub fn render(input: &ReportInput) -> String {
    let mut h = String::new();
    h.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>voiceclone training report</title>\n<style>\n\
         body{font-family:sans-serif;margin:24px;color:#222;max-width:1500px}\n\
         h1{font-size:22px}h2{font-size:18px;margin-top:28px}\n\
         .charts{display:flex;flex-wrap:wrap;gap:12px}\n\
         .charts svg{width:600px;height:auto}\n\
         table{border-collapse:collapse;font-size:13px}\n\
         td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}\n\
         td.n{text-align:right;font-variant-numeric:tabular-nums}\n\
         tr.chosen{background:#fff4c2}\n.bad{color:#b00020;font-weight:bold}\n\
         .muted{color:#777}\naudio{height:32px;width:240px}\n\
         </style>\n</head>\n<body>\n<h1>voiceclone training report</h1>\n",
    );
    summary(&mut h, input);
    h.push_str("<h2>Training</h2>\n<div class=\"charts\">\n");
    for chart in step_charts(input) {
        h.push_str(&plot::svg(&chart));
    }
    h.push_str("</div>\n");
    if input.evals.iter().any(|e| e.samples.is_some()) {
        h.push_str("<h2>Samples over checkpoints</h2>\n<div class=\"charts\">\n");
        for chart in sample_charts(input) {
            h.push_str(&plot::svg(&chart));
        }
        h.push_str("</div>\n");
    }
    evaluations(&mut h, input);
    samples(&mut h, input);
    h.push_str("</body>\n</html>\n");
    h
}

fn summary(h: &mut String, input: &ReportInput) {
    h.push_str("<p>");
    match input.steps.last() {
        Some(m) => {
            let _ = write!(
                h,
                "{} optimizer steps so far; the last: loss {}",
                input.steps.len(),
                num(m.loss)
            );
        }
        None => h.push_str("no optimizer step yet"),
    }
    if let Some(e) = input.evals.last() {
        let _ = write!(
            h,
            ", validation loss {} after step {}",
            num(e.val_loss),
            e.step
        );
    }
    h.push_str(".</p>\n<p>");
    let how = Selection::describe(input.select);
    match input.chosen {
        Some(step) => {
            let _ = write!(
                h,
                "Chosen (train.select = \"{}\", {how}): <b>★ step {step}</b>, which the run \
                 exports and <code>checkpoints/best</code> names.",
                input.select.name()
            );
        }
        None => h.push_str("No checkpoint chosen yet."),
    }
    h.push_str("</p>\n");
}

/// The charts over optimizer steps: losses, learning rate, gradient norm.
fn step_charts(input: &ReportInput) -> Vec<Chart> {
    let steps = input.steps;
    let per_step = |name: &str, color, f: fn(&StepMetrics) -> f64| Series {
        name: name.into(),
        color,
        dashed: false,
        points: steps.iter().map(|m| (m.step as f64, f(m))).collect(),
    };
    let loss = vec![
        per_step("loss", COLORS[0], |m| m.loss),
        Series {
            name: "val_loss".into(),
            color: COLORS[3],
            dashed: true,
            points: input
                .evals
                .iter()
                .map(|e| (e.step as f64, e.val_loss))
                .collect(),
        },
    ];
    vec![
        Chart {
            title: "training and validation loss".into(),
            x_label: "step",
            series: loss,
            band: None,
            from_zero: true,
            empty: "no steps yet",
            marker: marker(input),
        },
        Chart {
            title: "learning rate".into(),
            x_label: "step",
            series: vec![per_step("lr", COLORS[2], |m| m.lr)],
            band: None,
            from_zero: true,
            empty: "no steps yet",
            marker: marker(input),
        },
        Chart {
            title: "gradient norm (before clipping)".into(),
            x_label: "step",
            series: vec![per_step("grad_norm", COLORS[4], |m| m.grad_norm)],
            band: None,
            from_zero: true,
            empty: "no steps yet",
            marker: marker(input),
        },
    ]
}

/// The chosen checkpoint's step, marked on every chart.
fn marker(input: &ReportInput) -> Option<(f64, String)> {
    input
        .chosen
        .map(|step| (step as f64, "★ chosen".to_string()))
}

/// The charts over checkpoints: per voice, the mean similarity, rate ratio and WER of its
/// samples at each evaluation.
fn sample_charts(input: &ReportInput) -> Vec<Chart> {
    let voices: Vec<String> = {
        let mut v: Vec<String> = input
            .evals
            .iter()
            .flat_map(|e| e.samples.iter().flatten().map(|s| s.voice.clone()))
            .collect();
        v.sort();
        v.dedup();
        v
    };
    let series = |f: fn(&SampleMetrics) -> Option<f64>| -> Vec<Series> {
        voices
            .iter()
            .enumerate()
            .map(|(i, voice)| Series {
                name: voice.clone(),
                color: COLORS[i % COLORS.len()],
                dashed: true,
                points: input
                    .evals
                    .iter()
                    .filter_map(|e| {
                        let values: Vec<f64> = e
                            .samples
                            .as_ref()?
                            .iter()
                            .filter(|s| &s.voice == voice)
                            .filter_map(f)
                            .collect();
                        (!values.is_empty()).then(|| {
                            (
                                e.step as f64,
                                values.iter().sum::<f64>() / values.len() as f64,
                            )
                        })
                    })
                    .collect(),
            })
            .collect()
    };
    let mut charts = vec![
        Chart {
            title: "speaker similarity (mean per voice)".into(),
            x_label: "step",
            series: series(|s| s.similarity),
            band: None,
            from_zero: false,
            empty: "no similarity measured",
            marker: marker(input),
        },
        Chart {
            title: format!(
                "speaking rate / the speaker's (mean per voice; {}–{} shaded)",
                RATE_RANGE.0, RATE_RANGE.1
            ),
            x_label: "step",
            series: series(|s| Some(s.rate_ratio)),
            band: Some(RATE_RANGE),
            from_zero: false,
            empty: "no samples",
            marker: marker(input),
        },
    ];
    if input
        .evals
        .iter()
        .any(|e| e.samples.iter().flatten().any(|s| s.wer.is_some()))
    {
        charts.push(Chart {
            title: "word error rate (mean per voice)".into(),
            x_label: "step",
            series: series(|s| s.wer),
            band: None,
            from_zero: true,
            empty: "no WER measured",
            marker: marker(input),
        });
    }
    charts
}

fn evaluations(h: &mut String, input: &ReportInput) {
    if input.evals.is_empty() {
        return;
    }
    h.push_str(
        "<h2>Evaluations</h2>\n<table>\n<tr><th>step</th><th>val_loss</th>\
         <th>val_loss_talker</th><th>val_loss_sub</th><th>held-out utterances</th>\
         <th>score</th><th>seconds</th><th></th></tr>\n",
    );
    for e in input.evals {
        let chosen = input.chosen == Some(e.step);
        let _ = writeln!(
            h,
            "<tr{}><td class=\"n\">{}</td>{}{}{}{}{}{}<td>{}</td></tr>",
            if chosen { " class=\"chosen\"" } else { "" },
            e.step,
            cell(e.val_loss),
            cell(e.val_loss_talker),
            cell(e.val_loss_sub),
            cell(e.val_utterances as f64),
            e.score.map_or("<td class=\"muted\">–</td>".into(), cell),
            cell(e.seconds),
            if chosen { "★ chosen" } else { "" }
        );
    }
    h.push_str("</table>\n");
}

fn samples(h: &mut String, input: &ReportInput) {
    let workspace = input.checkpoints.parent().unwrap_or(input.checkpoints);
    let references: BTreeMap<&str, &PathBuf> = input
        .references
        .iter()
        .map(|(v, p)| (v.as_str(), p))
        .collect();
    let with_samples: Vec<&EvalMetrics> = input
        .evals
        .iter()
        .filter(|e| e.samples.as_ref().is_some_and(|s| !s.is_empty()))
        .collect();
    if with_samples.is_empty() {
        return;
    }
    h.push_str("<h2>Samples</h2>\n");
    if !references.is_empty() {
        h.push_str("<p>Reference clips: ");
        for (voice, path) in &references {
            let _ = write!(h, "{} {} ", escape(voice), player(input.checkpoints, path));
        }
        h.push_str("</p>\n");
    }
    h.push_str(
        "<table>\n<tr><th>step</th><th>voice</th><th>text</th><th>sample</th>\
         <th>held-out recording</th><th>similarity</th><th>rate ratio</th><th>frames per token</th><th>frames</th>\
         <th>frame limit</th><th>end of speech</th><th>WER</th><th>transcript</th></tr>\n",
    );
    for e in with_samples.iter().rev() {
        let chosen = input.chosen == Some(e.step);
        for s in e.samples.iter().flatten() {
            let wav = workspace.join(&s.wav);
            let audio = if wav.is_file() {
                player(input.checkpoints, &wav)
            } else {
                "<span class=\"muted\">(pruned with its checkpoint)</span>".into()
            };
            let recording = match &s.recording {
                Some(r) if workspace.join(r).is_file() => {
                    player(input.checkpoints, &workspace.join(r))
                }
                Some(r) => format!("<span class=\"muted\">{}</span>", escape(r)),
                None => {
                    "<span class=\"muted\">(its own text: the speaker's mean pace)</span>".into()
                }
            };
            let (lo, hi) = RATE_RANGE;
            let rate_bad = !(lo..=hi).contains(&s.rate_ratio);
            let _ = writeln!(
                h,
                "<tr{}><td class=\"n\">{}{}</td><td>{}</td><td>{}</td><td>{audio}</td>\
                 <td>{recording}</td>{}{}{}{}{}\
                 <td{}>{}</td>{}<td>{}</td></tr>",
                if chosen { " class=\"chosen\"" } else { "" },
                e.step,
                if chosen { " ★" } else { "" },
                escape(&s.voice),
                escape(&s.text),
                s.similarity
                    .map_or("<td class=\"muted\">–</td>".into(), cell),
                if rate_bad {
                    cell(s.rate_ratio).replace("class=\"n\"", "class=\"n bad\"")
                } else {
                    cell(s.rate_ratio)
                },
                cell(s.frames_per_token),
                cell(s.frames as f64),
                cell(s.cap as f64),
                if s.eos { "" } else { " class=\"bad\"" },
                if s.eos { "yes" } else { "no (frame limit)" },
                s.wer.map_or("<td class=\"muted\">–</td>".into(), cell),
                escape(s.transcript.as_deref().unwrap_or("")),
            );
        }
    }
    h.push_str("</table>\n");
}

/// A table cell with `v` as shown (4 significant digits at most) and as recorded (`data-v`).
fn cell(v: f64) -> String {
    format!("<td class=\"n\" data-v=\"{v}\">{}</td>", num(v))
}

/// `v` for reading: integers as they are, else 4 significant digits.
fn num(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    if v.fract() == 0.0 && v.abs() < 1e15 {
        return format!("{v:.0}");
    }
    let digits = (3 - v.abs().log10().floor() as i64).clamp(0, 12) as usize;
    format!("{v:.digits$}")
}

/// An audio player for the file `target`, linked relative to `dir` when it lies under `dir`'s
/// parent (the workspace), else by its absolute path.
fn player(dir: &Path, target: &Path) -> String {
    let link = relative_link(dir, target);
    format!(
        "<audio controls preload=\"none\" src=\"{}\"></audio>",
        escape(&link)
    )
}

fn relative_link(dir: &Path, target: &Path) -> String {
    use std::path::Component;
    let url = |p: &Path| {
        p.components()
            .filter_map(|c| match c {
                Component::Normal(s) => Some(percent(&s.to_string_lossy())),
                Component::ParentDir => Some("..".into()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("/")
    };
    if let Ok(rest) = target.strip_prefix(dir) {
        return url(rest);
    }
    if let Some(parent) = dir.parent() {
        if let Ok(rest) = target.strip_prefix(parent) {
            return format!("../{}", url(rest));
        }
    }
    let abs = std::path::absolute(target).unwrap_or_else(|_| target.to_path_buf());
    format!("file:///{}", url(&abs))
}

/// A path segment with the characters a URL cannot hold as they are percent-encoded.
fn percent(segment: &str) -> String {
    let mut out = String::new();
    for b in segment.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well_and_keep_their_recorded_value() {
        assert_eq!(num(3.0), "3");
        assert_eq!(num(4.56789), "4.568");
        assert_eq!(num(0.012345), "0.01235");
        assert_eq!(num(1234.5678), "1235");
        assert_eq!(
            cell(0.1 + 0.2),
            "<td class=\"n\" data-v=\"0.30000000000000004\">0.3000</td>"
        );
    }

    #[test]
    fn links_are_relative_to_the_page_and_encoded() {
        let dir = Path::new("/w/checkpoints");
        assert_eq!(
            relative_link(dir, Path::new("/w/checkpoints/step-0000002/samples/01.wav")),
            "step-0000002/samples/01.wav"
        );
        assert_eq!(
            relative_link(dir, Path::new("/w/data/ref/A b.wav")),
            "../data/ref/A%20b.wav"
        );
        assert_eq!(
            relative_link(dir, Path::new("/elsewhere/ref.wav")),
            "file:///elsewhere/ref.wav"
        );
    }
}
