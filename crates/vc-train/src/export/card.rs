//! The model card of an export (docs/training.md §10): `README.md` in the format model hubs read
//! — YAML front matter (base model and relation, license, pipeline, library, tags) over a body
//! that says what the directory holds, all from the run's own files: the speakers and their data
//! (the training manifest), the training (the checkpoint's index, `metrics.jsonl`, and what the
//! session that exported knew when it was training's own end), the chosen checkpoint and why
//! (`checkpoints/best`, the index's selection), the evaluation of its step with its samples
//! (copied beside the card into `samples/`), and how to use it. A piece the files do not hold is
//! a sentence saying so, never an empty table. Written into the export's temporary directory, so
//! it arrives (and is replaced) with the rest of the export.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::checkpoint::Index;
use crate::metrics::{self, EvalMetrics, SampleMetrics, StepMetrics, METRICS_FILE};
use crate::selection;
use crate::step::backend::{Backend, Storage};
use vc_core::artifacts::manifest::Manifest;
use vc_core::artifacts::speaker::name_key;
use vc_core::hub::ModelSource;
use vc_model::files::{self as mf, ModelFiles};

/// The card's file in the export.
pub const CARD: &str = "README.md";
/// The folder of the samples copied beside the card (and of a checkpoint's own samples,
/// `checkpoints/step-N/samples/NN.wav`, docs/training.md §14.4).
pub const SAMPLES: &str = "samples";
/// The marker's field listing the card's files (`voiceclone-export.json`, docs/training.md §10).
pub const MARKER_FIELD: &str = "card";
/// The license of the Qwen3-TTS release (its repository and model cards: Apache 2.0), for a base
/// model whose own files name none.
pub const QWEN3_TTS_LICENSE: &str = "apache-2.0";
/// The official package, as docs/model.md names it: what loads a merged export.
pub const OFFICIAL_PACKAGE: &str = "qwen-tts";

/// How the exported checkpoint was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// The one `checkpoints/best` names: training's choice (docs/training.md §14.3).
    Best,
    /// The newest checkpoint of the run.
    Newest,
    /// A checkpoint named by hand (`export --checkpoint DIR`).
    Given,
}

/// What the session exporting at the end of training knows and a checkpoint does not record:
/// its configuration (a resumed run may have changed these since earlier sessions).
#[derive(Debug, Clone)]
pub struct Session {
    pub backend: Backend,
    /// Where it trained ("CPU", "CUDA").
    pub device: String,
    pub grad_accum: usize,
    pub epochs: usize,
    /// 0: no cap.
    pub max_steps: usize,
    /// `train.select`.
    pub select: String,
}

/// What the card is written from.
pub struct Card<'a> {
    /// The base model.
    pub files: &'a ModelFiles,
    pub index: &'a Index,
    /// The checkpoint directory (`checkpoints/step-…`).
    pub checkpoint: &'a Path,
    /// The exported speakers (lower-cased names) with their codec rows.
    pub speakers: &'a [(String, usize)],
    pub adapter_only: bool,
    pub lora_scale: f64,
    /// The training manifest; `None`: the card says it had none.
    pub manifest: Option<&'a Path>,
    pub choice: Choice,
    pub session: Option<&'a Session>,
    /// The export directory's name, for the usage lines.
    pub dir_name: &'a str,
}

impl Card<'_> {
    /// Writes `README.md` and the samples into `dir`; returns the paths written, relative to
    /// `dir` (the card first).
    pub fn write(&self, dir: &Path) -> Result<Vec<String>> {
        let metrics_path = self.root().join(METRICS_FILE);
        let (steps, evals) = read_metrics(&metrics_path, self.index.step)?;
        let eval = evals.iter().rev().find(|e| e.step == self.index.step);
        let mut files = vec![CARD.to_string()];
        let samples = match eval.and_then(|e| e.samples.as_deref()) {
            Some(s) => self.copy_samples(s, dir, &mut files)?,
            None => Vec::new(),
        };
        let mut md = self.front_matter();
        self.intro(&mut md);
        self.speakers_section(&mut md)?;
        self.training_section(&mut md, &steps);
        self.choice_section(&mut md, eval, &evals);
        self.evaluation_section(&mut md, eval, &samples);
        self.usage_section(&mut md);
        let path = dir.join(CARD);
        fs::write(&path, md).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(files)
    }

    /// The directory of checkpoints the exported one belongs to.
    fn root(&self) -> PathBuf {
        self.checkpoint
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }

    fn checkpoint_name(&self) -> String {
        file_name(self.checkpoint)
    }

    fn is_lora(&self) -> bool {
        self.index.identity.lora.is_some()
    }

    fn front_matter(&self) -> String {
        let mut s = String::from("---\n");
        if let Some(id) = hub_id(&self.files.source) {
            let _ = writeln!(s, "base_model: {}", yaml(&id));
        }
        let relation = if self.adapter_only {
            "adapter"
        } else {
            "finetune"
        };
        let _ = writeln!(s, "base_model_relation: {relation}");
        let _ = writeln!(s, "license: {}", yaml(&base_license(&self.files.source).0));
        s.push_str("pipeline_tag: text-to-speech\n");
        // An adapter directory is loaded by PEFT onto the official model (docs/training.md §13).
        let library = if self.adapter_only {
            "peft"
        } else {
            OFFICIAL_PACKAGE
        };
        let _ = writeln!(s, "library_name: {library}");
        s.push_str("tags:\n");
        let mut tags = vec!["voiceclone", "qwen3-tts", "text-to-speech", "custom-voice"];
        if self.is_lora() {
            tags.push("lora");
        }
        if self.adapter_only {
            tags.extend(["peft", OFFICIAL_PACKAGE]);
        }
        for t in tags {
            let _ = writeln!(s, "- {t}");
        }
        s.push_str("---\n\n");
        s
    }

    fn intro(&self, md: &mut String) {
        let names: Vec<String> = self.speakers.iter().map(|(n, _)| code(n)).collect();
        let _ = writeln!(md, "# {}\n", plain(&self.title()));
        let base = match hub_id(&self.files.source) {
            Some(id) => code(&id),
            None => format!("the local model {}", code(&source_name(&self.files.source))),
        };
        let what = match (&self.index.identity.lora, self.adapter_only) {
            (Some(l), true) => format!(
                "LoRA adapters (rank {}, α {}) in PEFT's format for {base}",
                l.rank,
                num(self.lora_scale * l.alpha)
            ),
            (Some(l), false) => format!(
                "{base} with LoRA adapters (rank {}, α {}) merged in at {} of their trained \
                 strength",
                l.rank,
                num(l.alpha),
                num(self.lora_scale)
            ),
            (None, _) => format!("a full fine-tune of {base}"),
        };
        let _ = writeln!(
            md,
            "This directory is {what}, made with voiceclone from checkpoint {} (step {}). \
             Speaker{}: {}.\n",
            code(&self.checkpoint_name()),
            self.index.step,
            if names.len() == 1 { "" } else { "s" },
            names.join(", ")
        );
        if hub_id(&self.files.source).is_none() {
            md.push_str(
                "The base model is a local directory whose hub id is not known (it is neither a \
                 hub model nor in the Hugging Face cache), so this card names no `base_model`.\n\n",
            );
        }
        let (license, from) = base_license(&self.files.source);
        let _ = writeln!(md, "License: {}, {from}.\n", code(&license));
    }

    fn title(&self) -> String {
        let names: Vec<&str> = self.speakers.iter().map(|(n, _)| n.as_str()).collect();
        let kind = if self.adapter_only {
            "Qwen3-TTS voice adapter"
        } else {
            "fine-tuned Qwen3-TTS voice"
        };
        format!("{}: {kind}", names.join(", "))
    }

    fn speakers_section(&self, md: &mut String) -> Result<()> {
        md.push_str("## Speakers\n\n");
        let Some(manifest) = self.manifest.filter(|m| m.is_file()) else {
            md.push_str(
                "The export had no training manifest to read, so this card does not say how much \
                 data each speaker had.\n\n",
            );
            self.speaker_rows_only(md);
            return Ok(());
        };
        let data = speaker_data(manifest, self.speakers)?;
        let rate = frame_rate(&self.files.source);
        md.push_str(
            "| speaker | codec row | utterances | frames | audio |\n|---|---|---|---|---|\n",
        );
        for (name, row) in self.speakers {
            let (utterances, frames) = data.get(name).copied().unwrap_or((0, 0));
            let audio = rate.map_or("—".to_string(), |r| duration(frames as f64 / r));
            let _ = writeln!(
                md,
                "| {} | {row} | {utterances} | {frames} | {audio} |",
                cell(name)
            );
        }
        let _ = write!(
            md,
            "\nFrom the training manifest ({}): its lines with a text and audio codes",
            code(&file_name(manifest))
        );
        match rate {
            Some(r) => {
                let _ = write!(md, ", at {} codec frames per second", num(r));
            }
            None => md.push_str(
                " (the audio's length is not given: the base model's speech tokenizer config, \
                 which holds the frame rate, could not be read)",
            ),
        }
        md.push_str(". ");
        match &self.index.identity.heldout {
            Some(h) => {
                let _ = writeln!(
                    md,
                    "Of them, {} utterance(s) were held out of training for validation.\n",
                    h.utterances
                );
            }
            None => md.push_str("Nothing was held out for validation.\n\n"),
        }
        Ok(())
    }

    fn speaker_rows_only(&self, md: &mut String) {
        md.push_str("| speaker | codec row |\n|---|---|\n");
        for (name, row) in self.speakers {
            let _ = writeln!(md, "| {} | {row} |", cell(name));
        }
        md.push('\n');
    }

    fn training_section(&self, md: &mut String, steps: &[StepMetrics]) {
        let ix = self.index;
        md.push_str("## Training\n\n| setting | value |\n|---|---|\n");
        let method = match &ix.identity.lora {
            Some(l) => {
                let (targets, full) = lora_modules(ix);
                let mut kinds: Vec<&str> = targets
                    .iter()
                    .filter_map(|m| m.rsplit('.').next())
                    .collect();
                kinds.sort_unstable();
                kinds.dedup();
                let mut m = format!(
                    "LoRA, rank {}, α {}, on {} matrices ({})",
                    l.rank,
                    num(l.alpha),
                    targets.len(),
                    kinds.join(", ")
                );
                if !full.is_empty() {
                    let _ = write!(m, "; trained fully beside them: {}", full.join(", "));
                }
                m
            }
            None => format!(
                "full fine-tune of {} talker tensors",
                ix.identity.trained_tensors
            ),
        };
        let mut row = |k: &str, v: String| {
            let _ = writeln!(md, "| {k} | {} |", cell(&v));
        };
        row("method", method);
        row("optimizer steps", ix.step.to_string());
        row(
            "data epochs",
            format!(
                "{} reached (the checkpoint's data cursor: epoch {}, micro-batch {})",
                ix.cursor.epoch + 1,
                ix.cursor.epoch + 1,
                ix.cursor.batch
            ),
        );
        row(
            "micro-batch",
            format!(
                "{} utterances on each of {} rank(s)",
                ix.identity.batch_size, ix.world_size
            ),
        );
        row("world size", ix.world_size.to_string());
        if let Some(lr) = lr_facts(steps, ix.step) {
            row(
                "learning rate",
                format!(
                    "peak {} (first at step {}), {} at step {}: linear warm-up, then cosine decay",
                    sci(lr.peak),
                    lr.peak_step,
                    sci(lr.last),
                    ix.step
                ),
            );
        }
        let o = &ix.optimizer;
        row(
            "optimizer",
            format!(
                "{} (β1 {}, β2 {}, eps {}, weight decay {}), state {}",
                o.name,
                num(o.beta1),
                num(o.beta2),
                sci(o.eps),
                num(o.weight_decay),
                o.state.name()
            ),
        );
        row(
            "data order",
            format!(
                "seed {}, {}",
                ix.identity.seed,
                if ix.identity.shuffle {
                    "shuffled"
                } else {
                    "in manifest order"
                }
            ),
        );
        if let Some(s) = self.session {
            let storage = match s.backend {
                Backend::Kernels | Backend::Autograd(Storage::F32) => "f32",
                Backend::Autograd(Storage::Bf16) => "bf16",
            };
            row(
                "backend",
                format!(
                    "{} on the {}, weights computed in {storage}",
                    s.backend.name(),
                    s.device
                ),
            );
            row(
                "gradient accumulation",
                format!("{} micro-batch(es) per step", s.grad_accum),
            );
            let cap = if s.max_steps > 0 {
                format!(", at most {} steps", s.max_steps)
            } else {
                String::new()
            };
            row("planned", format!("{} epochs{cap}", s.epochs));
            row(
                "checkpoint choice",
                format!("train.select = \"{}\"", s.select),
            );
        }
        md.push('\n');
        if steps.is_empty() {
            md.push_str(
                "`metrics.jsonl` holds no step of this run, so the learning rate is not given.\n",
            );
        } else {
            md.push_str("The learning rate is read from the run's `metrics.jsonl`.\n");
        }
        if self.session.is_some() {
            md.push_str(
                "Backend, gradient accumulation, the plan and the choice are the settings of the \
                 training session that exported at its end.\n\n",
            );
        } else {
            md.push_str(
                "The backend and precision, gradient accumulation and the planned length are not \
                 recorded in the checkpoint; the export made at the end of training states them.\n\n",
            );
        }
    }

    fn choice_section(&self, md: &mut String, eval: Option<&EvalMetrics>, evals: &[EvalMetrics]) {
        md.push_str("## The checkpoint\n\n");
        let name = code(&self.checkpoint_name());
        let best = selection::best_name(&self.root());
        let named_best = best.as_deref() == Some(self.checkpoint_name().as_str());
        let how = match self.choice {
            Choice::Best => {
                format!("{name} is the checkpoint training chose: `checkpoints/best` names it.")
            }
            Choice::Newest => {
                let mut s = format!("{name} is the newest checkpoint of the run.");
                match &best {
                    Some(b) if !named_best => {
                        let _ = write!(
                            s,
                            " Training's own choice, `checkpoints/best`, is {}.",
                            code(b)
                        );
                    }
                    Some(_) => s.push_str(" `checkpoints/best` names it too."),
                    None => {}
                }
                s
            }
            Choice::Given => {
                let mut s = format!("{name} was named for the export by hand.");
                if named_best {
                    s.push_str(" `checkpoints/best` names it too.");
                }
                s
            }
        };
        let _ = writeln!(md, "{how}");
        let sel = self.index.selection.clone().unwrap_or_default();
        let step = self.index.step;
        let mut why = Vec::new();
        if let (Some(s), Some(v)) = (sel.best_step, sel.best_val_loss) {
            if s == step {
                why.push(format!(
                    "its validation loss, {}, was the lowest of the run's validations up to step {step}",
                    fixed(v)
                ));
            } else {
                why.push(format!(
                    "the lowest validation loss up to it was {} at step {s}",
                    fixed(v)
                ));
            }
        }
        if let (Some(s), Some(v)) = (sel.best_score_step, sel.best_score) {
            if s == step {
                why.push(format!(
                    "its samples' score, {}, was the highest up to step {step}",
                    fixed(v)
                ));
            } else {
                why.push(format!(
                    "the highest score up to it was {} at step {s}",
                    fixed(v)
                ));
            }
        }
        if why.is_empty() {
            md.push_str("No validation had chosen a checkpoint by then (the run held nothing out, or had not validated yet).\n\n");
        } else {
            let _ = writeln!(md, "By the checkpoint's own record, {}.\n", why.join("; "));
        }
        if eval.is_none() {
            let _ = writeln!(
                md,
                "`metrics.jsonl` has no evaluation of step {step}, so there are no validation \
                 measures or samples of these weights.\n"
            );
        }
        if let Some(last) = evals.last().filter(|e| e.step < step && eval.is_none()) {
            let _ = writeln!(
                md,
                "The run's last evaluation before it was at step {}: validation loss {}.\n",
                last.step,
                fixed(last.val_loss)
            );
        }
    }

    fn evaluation_section(&self, md: &mut String, eval: Option<&EvalMetrics>, samples: &[Copied]) {
        let Some(e) = eval else {
            return;
        };
        md.push_str("## Evaluation\n\n| measure | value |\n|---|---|\n");
        let _ = writeln!(md, "| step | {} |", e.step);
        let _ = writeln!(md, "| validation loss | {} |", fixed(e.val_loss));
        let _ = writeln!(
            md,
            "| validation loss, talker | {} |",
            fixed(e.val_loss_talker)
        );
        let _ = writeln!(
            md,
            "| validation loss, sub-talker | {} |",
            fixed(e.val_loss_sub)
        );
        let _ = writeln!(md, "| held-out utterances | {} |", e.val_utterances);
        if let Some(s) = e.score {
            let _ = writeln!(md, "| sample score | {} |", fixed(s));
        }
        md.push('\n');
        md.push_str("The validation loss is the training objective on the held-out utterances. ");
        let Some(list) = e.samples.as_deref().filter(|s| !s.is_empty()) else {
            md.push_str("This evaluation spoke no samples.\n\n");
            return;
        };
        md.push_str(
            "Each sample was spoken greedily with these weights: similarity is the cosine of its \
             speaker embedding and the speaker's, rate ratio the speaker's own pace over the \
             sample's (1 = the same), WER its word error rate against the text.\n\n",
        );
        md.push_str(
            "| # | speaker | text | audio | similarity | rate ratio | WER | end of speech |\n",
        );
        md.push_str("|---|---|---|---|---|---|---|---|\n");
        for (i, (s, c)) in list.iter().zip(samples).enumerate() {
            let audio = match &c.file {
                Some(f) => format!("[{}]({f})", file_name(Path::new(f))),
                None => "(file missing)".into(),
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {audio} | {} | {} | {} | {} |",
                i + 1,
                cell(&s.voice),
                cell(&s.text),
                s.similarity.map_or("—".into(), fixed),
                fixed(s.rate_ratio),
                s.wer.map_or("—".into(), fixed),
                if s.eos { "yes" } else { "no (frame limit)" }
            );
        }
        md.push('\n');
        if list.iter().any(|s| s.wer.is_none()) {
            md.push_str("A WER of — : no Whisper model transcribed the sample.\n");
        }
        if samples.iter().any(|c| c.file.is_none()) {
            md.push_str("(file missing): the checkpoint no longer has the sample's WAV.\n");
        }
        md.push('\n');
    }

    fn usage_section(&self, md: &mut String) {
        md.push_str("## Use\n\n");
        let dir = &self.dir_name;
        let first = self.speakers.first().map_or("speaker", |(n, _)| n.as_str());
        let base = hub_id(&self.files.source).unwrap_or_else(|| "BASE".into());
        let sh = |args: &[&str]| {
            vc_core::shell::command(std::iter::once("voiceclone").chain(args.iter().copied()))
        };
        if self.adapter_only {
            let _ = writeln!(
                md,
                "With voiceclone (the base model is the one the adapter records):\n\n```sh\n{}\n{}\n```\n",
                sh(&["speak", "--adapter", dir, "--speaker", first, "Hello!", "-o", "hello.wav"]),
                sh(&["serve", "--adapter", dir])
            );
            let _ = writeln!(
                md,
                "With the official package and PEFT:\n\n```python\nfrom peft import PeftModel\n\
                 from qwen_tts import Qwen3TTSModel\n\ntts = Qwen3TTSModel.from_pretrained({base:?})\n\
                 tts.model = PeftModel.from_pretrained(tts.model, {dir:?})\n```\n\n\
                 The speakers' embeddings are in `speakers.safetensors`; voiceclone puts them in \
                 codec rows 3000, 3001, … as the merged export does.\n"
            );
        } else {
            let _ = writeln!(
                md,
                "With voiceclone:\n\n```sh\n{}\n{}\n```\n",
                sh(&[
                    "speak",
                    "--model",
                    dir,
                    "--speaker",
                    first,
                    "Hello!",
                    "-o",
                    "hello.wav"
                ]),
                sh(&["serve", "--model", dir])
            );
            let _ = writeln!(
                md,
                "With the official `{OFFICIAL_PACKAGE}` package:\n\n```python\n\
                 from qwen_tts import Qwen3TTSModel\n\ntts = Qwen3TTSModel.from_pretrained({dir:?})\n\
                 wavs, sr = tts.generate_custom_voice(\"Hello!\", speaker={first:?})\n```"
            );
        }
    }

    /// Copies the evaluation's WAVs from the checkpoint to `samples/<voice>-<i>.wav`.
    fn copy_samples(
        &self,
        samples: &[SampleMetrics],
        dir: &Path,
        files: &mut Vec<String>,
    ) -> Result<Vec<Copied>> {
        let mut per_voice: BTreeMap<String, usize> = BTreeMap::new();
        let mut out = Vec::with_capacity(samples.len());
        for s in samples {
            let k = per_voice.entry(s.voice.clone()).or_default();
            *k += 1;
            let src = self
                .checkpoint
                .join(SAMPLES)
                .join(file_name(Path::new(&s.wav)));
            if !src.is_file() {
                out.push(Copied { file: None });
                continue;
            }
            let rel = format!("{SAMPLES}/{}-{k}.wav", safe_file_name(&s.voice));
            let dest = dir.join(&rel);
            fs::create_dir_all(dir.join(SAMPLES))
                .with_context(|| format!("cannot create {}", dir.join(SAMPLES).display()))?;
            fs::copy(&src, &dest).with_context(|| format!("cannot copy {}", src.display()))?;
            files.push(rel.clone());
            out.push(Copied { file: Some(rel) });
        }
        Ok(out)
    }
}

/// Where a sample went in the export; `None`: its WAV was not in the checkpoint.
struct Copied {
    file: Option<String>,
}

/// The step and evaluation lines of `metrics.jsonl` up to `step` (later ones are of later
/// weights).
fn read_metrics(path: &Path, step: usize) -> Result<(Vec<StepMetrics>, Vec<EvalMetrics>)> {
    let steps: Vec<StepMetrics> = metrics::read(path)?;
    let evals: Vec<EvalMetrics> = metrics::read(path)?;
    Ok((
        steps.into_iter().filter(|m| m.step <= step).collect(),
        evals.into_iter().filter(|m| m.step <= step).collect(),
    ))
}

struct LrFacts {
    peak: f64,
    peak_step: usize,
    last: f64,
}

/// The peak learning rate, the first step at it, and the rate of step `step`.
fn lr_facts(steps: &[StepMetrics], step: usize) -> Option<LrFacts> {
    let last = steps.iter().rev().find(|m| m.step == step)?.lr;
    let peak = steps
        .iter()
        .map(|m| m.lr)
        .filter(|l| l.is_finite())
        .fold(f64::NAN, f64::max);
    let peak_step = steps.iter().find(|m| m.lr == peak)?.step;
    Some(LrFacts {
        peak,
        peak_step,
        last,
    })
}

/// The adapted modules and the fully trained tensors of a LoRA checkpoint, by name.
fn lora_modules(index: &Index) -> (Vec<String>, Vec<String>) {
    let mut targets = Vec::new();
    let mut full = Vec::new();
    for name in index.params.keys() {
        if let Some(m) = name.strip_suffix(".lora_A.weight") {
            targets.push(m.to_string());
        } else if !name.ends_with(".lora_B.weight") {
            full.push(name.clone());
        }
    }
    (targets, full)
}

/// Utterances and frames per exported speaker over the manifest's lines with a text and codes
/// (the unnamed speaker's lines count for the one speaker of its export).
fn speaker_data(
    manifest: &Path,
    speakers: &[(String, usize)],
) -> Result<BTreeMap<String, (usize, usize)>> {
    let mut by: BTreeMap<Option<String>, (usize, usize)> = BTreeMap::new();
    for (_, row) in Manifest::read(manifest)?.rows() {
        let has_text = row.text.as_deref().is_some_and(|t| !t.trim().is_empty());
        let Some(frames) = row.frames().filter(|_| has_text) else {
            continue;
        };
        let e = by.entry(row.speaker.as_deref().map(name_key)).or_default();
        *e = (e.0 + 1, e.1 + frames.len());
    }
    Ok(speakers
        .iter()
        .filter_map(|(name, _)| {
            let own = by.get(&Some(name.clone()));
            let unnamed = (speakers.len() == 1).then(|| by.get(&None)).flatten();
            own.or(unnamed).map(|d| (name.clone(), *d))
        })
        .collect())
}

/// The codec's frames per second, from the base model's speech tokenizer config (never
/// downloaded for this).
fn frame_rate(source: &ModelSource) -> Option<f64> {
    let path = local_file(source, mf::SPEECH_TOKENIZER_CONFIG)?;
    let rate = vc_model::codec::CodecConfig::from_file(&path)
        .ok()?
        .encoder_config
        .frame_rate();
    (rate > 0.0).then_some(rate)
}

/// A file of the base model that is already on this machine: in its directory, or in the
/// Hugging Face cache (a card never downloads).
fn local_file(source: &ModelSource, file: &str) -> Option<PathBuf> {
    match source {
        ModelSource::Local(dir) => Some(dir.join(file)).filter(|p| p.is_file()),
        ModelSource::Hub { repo } => vc_core::hub::cached_single_file(&format!("{repo}/{file}")),
    }
}

/// The base model's hub id: a hub model's, or that of a local directory in the Hugging Face
/// cache's layout (`…/models--OWNER--NAME/snapshots/REV`).
pub fn hub_id(source: &ModelSource) -> Option<String> {
    match source {
        ModelSource::Hub { repo } => Some(repo.clone()),
        ModelSource::Local(dir) => {
            let from_layout = |p: &Path| {
                let parts: Vec<String> = p
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                parts.windows(2).find_map(|w| {
                    let rest = w[0].strip_prefix("models--")?;
                    let (owner, name) = rest.split_once("--")?;
                    (w[1] == "snapshots" && !owner.is_empty() && !name.is_empty())
                        .then(|| format!("{owner}/{name}"))
                })
            };
            from_layout(dir).or_else(|| from_layout(&fs::canonicalize(dir).ok()?))
        }
    }
}

/// The base model's license and where it was read: the `license:` of its README's front matter,
/// else an Apache 2.0 LICENSE file, else the Qwen3-TTS release's.
pub fn base_license(source: &ModelSource) -> (String, &'static str) {
    let readme = local_file(source, CARD).and_then(|p| fs::read_to_string(p).ok());
    if let Some(l) = readme
        .as_deref()
        .and_then(|t| front_matter_value(t, "license"))
    {
        return (l, "as the base model's README.md declares");
    }
    let license = local_file(source, "LICENSE").and_then(|p| fs::read_to_string(p).ok());
    if license
        .as_deref()
        .is_some_and(|t| t.contains("Apache License") && t.contains("Version 2.0"))
    {
        return (
            "apache-2.0".into(),
            "as the base model's LICENSE file states",
        );
    }
    (
        QWEN3_TTS_LICENSE.into(),
        "the license of the Qwen3-TTS release (the base model's own files name none)",
    )
}

/// The value of a top-level `key:` in a Markdown file's YAML front matter (a plain or quoted
/// scalar).
pub fn front_matter_value(text: &str, key: &str) -> Option<String> {
    let mut lines = text.lines();
    if lines.next()?.trim_end() != "---" {
        return None;
    }
    let prefix = format!("{key}:");
    lines
        .take_while(|l| l.trim_end() != "---")
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().trim_matches(|c| c == '"' || c == '\'').to_string())
        .filter(|v| !v.is_empty())
}

/// A YAML scalar: plain when it is safe, else double-quoted (JSON's escapes are YAML's).
fn yaml(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && s.starts_with(|c: char| c.is_ascii_alphanumeric());
    if plain {
        s.to_string()
    } else {
        serde_json::Value::from(s).to_string()
    }
}

/// Text for a Markdown table cell: no line breaks, `|` escaped, no HTML.
fn cell(s: &str) -> String {
    plain(s).replace('|', "\\|")
}

/// Text for Markdown prose: one line, no HTML.
fn plain(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace(['\n', '\r'], " ")
        .replace('<', "&lt;")
}

/// Inline code (no backticks inside).
fn code(s: &str) -> String {
    format!("`{}`", s.replace('`', "'"))
}

/// A speaker name as a file name: letters, digits, `-`, `_` and `.` kept, anything else `_`.
fn safe_file_name(s: &str) -> String {
    let name: String = s
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.trim_start_matches('.').to_string()
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn source_name(source: &ModelSource) -> String {
    match source {
        ModelSource::Local(dir) => file_name(dir),
        ModelSource::Hub { repo } => repo.clone(),
    }
}

/// A measure as the card prints it: 4 decimals; not finite, "not finite".
pub fn fixed(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.4}")
    } else {
        "not finite".into()
    }
}

/// A number as Rust prints it (shortest exact form).
fn num(v: f64) -> String {
    format!("{v}")
}

/// A learning rate or epsilon to 4 significant digits: `1e-2`, `1.25e-2`.
pub fn sci(v: f64) -> String {
    let s = format!("{v:.3e}");
    match s.split_once('e') {
        Some((m, e)) if m.contains('.') => {
            format!("{}e{e}", m.trim_end_matches('0').trim_end_matches('.'))
        }
        _ => s,
    }
}

/// A length of audio: seconds under a minute, minutes under an hour, else hours.
pub fn duration(seconds: f64) -> String {
    if seconds < 60.0 {
        format!("{seconds:.1} s")
    } else if seconds < 3600.0 {
        format!("{:.1} min", seconds / 60.0)
    } else {
        format!("{:.2} h", seconds / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hub_id_comes_from_the_hub_or_the_cache_layout() {
        let hub = ModelSource::Hub {
            repo: "Qwen/Qwen3-TTS-12Hz-0.6B-Base".into(),
        };
        assert_eq!(
            hub_id(&hub).as_deref(),
            Some("Qwen/Qwen3-TTS-12Hz-0.6B-Base")
        );
        let cached = ModelSource::Local(PathBuf::from(
            "/h/.cache/huggingface/hub/models--Qwen--Qwen3-TTS-12Hz-1.7B-Base/snapshots/abc",
        ));
        assert_eq!(
            hub_id(&cached).as_deref(),
            Some("Qwen/Qwen3-TTS-12Hz-1.7B-Base")
        );
        let local = ModelSource::Local(PathBuf::from("/nonexistent/my-model"));
        assert_eq!(hub_id(&local), None);
    }

    #[test]
    fn the_license_is_read_from_the_base_models_files_first() {
        let dir = tempfile::tempdir().unwrap();
        let src = ModelSource::Local(dir.path().to_path_buf());
        assert_eq!(base_license(&src).0, QWEN3_TTS_LICENSE);
        fs::write(
            dir.path().join("LICENSE"),
            "Apache License\nVersion 2.0, January 2004\n",
        )
        .unwrap();
        assert!(base_license(&src).1.contains("LICENSE"));
        fs::write(
            dir.path().join(CARD),
            "---\nlicense: \"other\"\ntags:\n- a\n---\n# x\n",
        )
        .unwrap();
        assert_eq!(
            base_license(&src),
            ("other".into(), "as the base model's README.md declares")
        );
        // Not front matter: a `license:` in the body does not count.
        fs::write(dir.path().join(CARD), "# x\nlicense: mit\n").unwrap();
        assert_eq!(base_license(&src).0, "apache-2.0");
    }

    #[test]
    fn text_is_made_safe_for_yaml_tables_and_file_names() {
        assert_eq!(
            yaml("Qwen/Qwen3-TTS-12Hz-0.6B-Base"),
            "Qwen/Qwen3-TTS-12Hz-0.6B-Base"
        );
        assert_eq!(yaml("a: b"), "\"a: b\"");
        assert_eq!(cell("a|b\n<c>"), "a\\|b &lt;c>");
        assert_eq!(safe_file_name("anna marie/../x"), "anna_marie_.._x");
        assert_eq!(safe_file_name(".hidden"), "hidden");
        assert_eq!(duration(2.72), "2.7 s");
        assert_eq!(duration(5400.0), "1.50 h");
        assert_eq!(sci(1.2500000000000006e-2), "1.25e-2");
        assert_eq!(sci(5e-2), "5e-2");
    }
}
