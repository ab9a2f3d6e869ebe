//! Whether a run speaks samples, and which (docs/training.md §14.4): decided once at its
//! start, the same way on every rank, from `train.samples`, the held-out set and the model's
//! size, with what the start should say about them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;

use super::plan::{self, PlannedSample};
use super::{speak, Listener, SampleJob};
use vc_core::config::Select;
use vc_generate::DecodeOptions;
use vc_model::files::ModelFiles;
use vc_prep::transcribe::Transcriber;
use vc_train::evaluation::{SamplePlan, SampleRun, SampleSpeaker, Spoken};

/// Talker parameters above which `train.samples = "auto"` leaves samples off on a CPU-only
/// run: the 1.7B (their cost: docs/performance.md §12).
const AUTO_CPU_LIMIT: usize = 1_000_000_000;
/// Bytes of weights per second the samples of the 0.6B-shaped model went through on the
/// 2-core machine of docs/performance.md §12 (its frames' [`frame_bytes`] over the time its
/// samples took): what the start's estimate of another model's samples scales by.
const MEASURED_BYTES_PER_SECOND: f64 = 18.0e9;

/// Plans the samples of `run`, heard by `listener`: none when `train.samples` (or `auto` on
/// the CPU for a large model) turns them off, nothing is held out (there are no evaluations) or
/// there is nothing to speak. `train.select = "score"` without samples is refused.
pub fn plan_run(run: &SampleRun<'_>, listener: &Listener) -> Result<SamplePlan> {
    let (opts, heldout, train, world) = (run.options, run.heldout, run.train, run.world);
    let c = &opts.config;
    let off = off_reason(
        c.samples,
        opts.device.is_cpu(),
        talker_parameters(&opts.files),
    );
    let plan = match heldout {
        Some(heldout) => {
            let tokenizer = opts.files.text_tokenizer()?;
            let generation = DecodeOptions::from_generation_config(&opts.files.generation);
            plan::plan(
                &c.sample_texts,
                heldout,
                train,
                &tokenizer,
                &c.speaker_name,
                generation.max_frames,
            )?
        }
        None => Vec::new(),
    };
    let frames: usize = plan.iter().map(|p| p.cap).sum();
    let seconds = frames as f64 * frame_bytes(&opts.files) / MEASURED_BYTES_PER_SECOND;
    let why_not = match (off, heldout.is_some(), plan.is_empty()) {
        (Some(why), _, true) => Some(why),
        (Some(why), _, false) => Some(format!(
            "{why}; they would speak {} sample(s) of up to {frames} frames at each \
             evaluation, about {seconds:.0} s at the pace measured on 2 cores \
             (docs/performance.md §12)",
            plan.len(),
        )),
        (None, false, _) => Some(
            "nothing is held out (train.val_fraction = 0, or too few utterances), so there \
             are no evaluations to speak them at"
                .to_string(),
        ),
        (None, true, true) => Some("no speaker has a held-out utterance to speak".to_string()),
        (None, true, false) => None,
    };
    if let Some(why) = why_not {
        if c.select == Select::Score {
            anyhow::bail!(
                "train.select = \"score\" chooses by the samples' score, but there are no \
                 samples: {why}"
            );
        }
        return Ok(SamplePlan {
            speaker: None,
            notes: vec![format!("no samples at evaluations: {why}")],
        });
    }
    let wer = match listener {
        Listener::Whisper(_) => "and their WER".to_string(),
        Listener::Missing(why) => format!("but no WER ({why})"),
    };
    let mut notes = vec![format!(
        "samples: {} at each evaluation (up to {frames} frames in all), spoken on the CPU \
         from the checkpoint as its export would speak them; similarity, speaking rate, end \
         of speech {wer} in checkpoints/metrics.jsonl and report.html",
        plan.len()
    )];
    // The other ranks wait for the samples in their next collective.
    if world > 1 && seconds > c.dist_timeout as f64 / 2.0 {
        notes.push(format!(
            "warning: the samples may take about {seconds:.0} s at each evaluation while the \
             other ranks wait at most train.dist_timeout = {} s for them: raise \
             train.dist_timeout, or speak fewer samples (train.sample_texts, train.samples)",
            c.dist_timeout
        ));
    }
    let speaker = RunSamples {
        files: opts.files.clone(),
        workspace: opts.base_dir.clone(),
        speaker_name: c.speaker_name.clone(),
        plan,
        whisper: match listener {
            Listener::Whisper(w) => Some(w.clone()),
            Listener::Missing(_) => None,
        },
    };
    Ok(SamplePlan {
        speaker: Some(Box::new(speaker)),
        notes,
    })
}

/// The samples of one run: what each evaluation speaks, and with what.
struct RunSamples {
    files: ModelFiles,
    workspace: PathBuf,
    speaker_name: String,
    plan: Vec<PlannedSample>,
    whisper: Option<Arc<dyn Transcriber>>,
}

impl SampleSpeaker for RunSamples {
    fn speak(&self, checkpoint: &Path, status: &(dyn Fn(usize, usize) + Sync)) -> Result<Spoken> {
        let job = SampleJob {
            files: &self.files,
            checkpoint,
            workspace: &self.workspace,
            speaker_name: &self.speaker_name,
            plan: &self.plan,
            whisper: self.whisper.as_deref(),
        };
        // On the CPU's pool, whatever device trains (docs/performance.md §2.4).
        vc_kernels::pool::on_pool(|| speak(&job, status))
    }
}

/// Why `setting` leaves the samples of a run (on the CPU only, or not) of a talker of `params`
/// parameters off; `None`: they are on.
fn off_reason(setting: vc_core::config::Samples, cpu: bool, params: usize) -> Option<String> {
    use vc_core::config::Samples;
    match setting {
        Samples::Off => Some("train.samples is false".to_string()),
        Samples::Auto if cpu && params > AUTO_CPU_LIMIT => Some(format!(
            "a CPU-only run of a model with {:.1} B talker parameters leaves them off \
             (train.samples = \"auto\"); train.samples = true turns them on",
            params as f64 / 1e9
        )),
        Samples::Auto | Samples::On => None,
    }
}

/// Bytes of bf16 weights one generated frame reads: the talker's decoder layers, text
/// projection and head once, the code predictor's decoder layers once for every code after the
/// first (docs/model.md §7) and each of its heads once.
fn frame_bytes(files: &ModelFiles) -> f64 {
    let codes = files.config.talker_config.num_code_groups.saturating_sub(1) as f64;
    let elements = |n: &str| -> f64 {
        files
            .checkpoint
            .tensor(n)
            .map_or(0.0, |t| t.shape.iter().product::<usize>() as f64)
    };
    files
        .checkpoint
        .tensor_names()
        .map(|n| {
            if n.starts_with("talker.code_predictor.model.layers.") {
                codes * elements(n)
            } else if n.starts_with("talker.model.layers.")
                || n.starts_with("talker.text_projection.")
                || n.starts_with("talker.code_predictor.lm_head.")
                || n == "talker.codec_head.weight"
            {
                elements(n)
            } else {
                0.0
            }
        })
        .sum::<f64>()
        * 2.0
}

/// Parameters of the talker (with its code predictor), from the checkpoint's headers.
fn talker_parameters(files: &ModelFiles) -> usize {
    files
        .checkpoint
        .tensor_names()
        .filter(|n| n.starts_with("talker."))
        .filter_map(|n| files.checkpoint.tensor(n))
        .map(|t| t.shape.iter().product::<usize>())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use vc_core::config::Samples;

    #[test]
    fn auto_leaves_samples_off_only_for_a_large_model_on_the_cpu() {
        let large = 1_900_000_000;
        let small = 600_000_000;
        assert_eq!(
            off_reason(Samples::Off, false, small).as_deref(),
            Some("train.samples is false")
        );
        let why = off_reason(Samples::Auto, true, large).unwrap();
        assert!(
            why.contains("1.9 B") && why.contains("train.samples = true"),
            "{why}"
        );
        assert_eq!(off_reason(Samples::Auto, true, small), None);
        assert_eq!(off_reason(Samples::Auto, false, large), None, "a GPU run");
        assert_eq!(off_reason(Samples::On, true, large), None);
    }
}
