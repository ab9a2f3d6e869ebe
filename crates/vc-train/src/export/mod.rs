//! Export of a training checkpoint as a model directory in the official layout
//! (docs/model.md §10.5), loadable by the official `qwen-tts` package (`generate_custom_voice(text,
//! speaker=NAME)`) and by `voiceclone speak --speaker NAME`:
//!
//! ```text
//! config.json              the base config with tts_model_type "custom_voice",
//!                          talker_config.spk_id {NAME: 3000}, spk_is_dialect {NAME: false}
//! model.safetensors        bf16: every base tensor except speaker_encoder.*, trained ones
//!                          replaced, the x-vector in talker.model.codec_embedding.weight[3000]
//!                          (named speakers: one row each, 3000, 3001, … in table order)
//! generation_config.json, tokenizer files, speech_tokenizer/   copied from the base model
//! README.md, samples/      the model card and its samples ([`card`])
//! voiceclone-export.json   marks the directory as ours (a later export may replace it), lists
//!                          the card's files, and records each speaker's pace measured on the
//!                          manifest ([`pace`])
//! ```
//! The directory is written under a temporary name and renamed into place; an existing
//! directory is only replaced when it is an earlier export (or empty).
//!
//! Here: the options, the order of the steps, the copied files and `config.json`. The marker,
//! what it says of a directory and the recovery of an interrupted export are [`marker`]'s; the
//! bf16 weight file, adapters merged, is [`weights`]'.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use serde_json::{json, Value};

use crate::checkpoint::{self, ModelIdentity};
use vc_core::hub::ModelSource;
use vc_core::workspace::Workspace;
use vc_model::files::{self as mf, ModelFiles};

pub mod adapters;
pub mod card;
mod marker;
pub mod pace;
pub mod weights;

use marker::check_output;
pub use marker::{base_identity, export_kind, is_current, recover, MARKER};
use weights::merge_adapters;
use weights::write_weights;

/// Codec-embedding row that holds the fine-tuned speaker (docs/model.md §10.5); named speakers
/// take this row and the ones after it, in the order of the checkpoint's speaker table
/// (docs/training.md §10).
pub const SPEAKER_ROW: usize = vc_model::overlay::SPEAKER_ROW;
/// Files of a hub model copied next to the weights (the official recipe copies the whole
/// directory; these are the ones the loaders read).
const HUB_FILES: &[&str] = &[
    mf::GENERATION_CONFIG,
    mf::TOKENIZER_JSON,
    mf::VOCAB,
    mf::MERGES,
    mf::TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "preprocessor_config.json",
    mf::SPEECH_TOKENIZER_CONFIG,
    mf::SPEECH_TOKENIZER_WEIGHTS,
    "speech_tokenizer/preprocessor_config.json",
    "speech_tokenizer/configuration.json",
];

pub struct ExportOptions<'a> {
    /// The base model the checkpoint was trained from.
    pub files: &'a ModelFiles,
    pub model_spec: &'a str,
    /// A checkpoint directory (`checkpoints/step-…`).
    pub checkpoint: PathBuf,
    pub output: PathBuf,
    /// The speaker name of a checkpoint of one unnamed speaker (`train.speaker_name`); named
    /// speakers keep their own names.
    pub speaker_name: String,
    /// A LoRA checkpoint's adapters are merged as `W + lora_scale · α/r · B·A`
    /// (docs/training.md §13); 1 = as trained.
    pub lora_scale: f64,
    /// A LoRA checkpoint: write its adapters in PEFT's format instead of a merged model
    /// ([`crate::export::adapters`]).
    pub adapter_only: bool,
    /// The training manifest, whose utterances give each speaker's pace ([`pace`]) and the
    /// card's data per speaker ([`card`]); `None`: neither is recorded.
    pub manifest: Option<PathBuf>,
    /// How the checkpoint was picked, for the card.
    pub choice: card::Choice,
    /// The settings of the training session exporting at its end, for the card; `None` for
    /// `voiceclone export` (the checkpoint does not record them).
    pub session: Option<card::Session>,
}

#[derive(Debug, Clone)]
pub struct ExportSummary {
    pub output: PathBuf,
    pub step: usize,
    /// The exported speakers (lower-cased names) with their codec-embedding rows.
    pub speakers: Vec<(String, usize)>,
    pub tensors: usize,
    pub trained_tensors: usize,
    /// The directory replaced an earlier export.
    pub replaced: bool,
    /// It holds adapters in PEFT's format, not a model ([`crate::export::adapters`]).
    pub adapter_only: bool,
    /// What was repaired of an earlier interrupted export first ([`recover`]).
    pub recovered: Vec<String>,
    /// What else the user should know (a pace that could not be measured).
    pub notes: Vec<String>,
}

impl ExportSummary {
    /// Prints where the export went and how to use it (what `export` and `train` report).
    pub fn print(&self, ws: &Workspace) {
        for note in self.recovered.iter().chain(&self.notes) {
            eprintln!("note: {note}");
        }
        let out = ws.relative(&self.output);
        let names: Vec<String> = self
            .speakers
            .iter()
            .map(|(n, _)| format!("{n:?}"))
            .collect();
        println!(
            "{} {out}: step {} ({} tensors, {} trained), speaker{} {}",
            if self.replaced {
                "replaced"
            } else {
                "exported"
            },
            self.step,
            self.tensors,
            self.trained_tensors,
            if names.len() == 1 { "" } else { "s" },
            names.join(", ")
        );
        if self.adapter_only {
            println!(
                "  PEFT adapters: PeftModel.from_pretrained(Qwen3TTSModel.from_pretrained(BASE).model, {out:?})"
            );
        } else if let Some((first, _)) = self.speakers.first() {
            // Quoted for a shell: names and paths may hold spaces or quotes.
            let speak = vc_core::shell::command([
                "voiceclone",
                "speak",
                "--model",
                out.as_str(),
                "--speaker",
                first.as_str(),
                "Hello!",
                "-o",
                "hello.wav",
            ]);
            println!("  speak with: {speak}");
        }
    }
}

/// The lower-cased names of named speakers with their rows 3000, 3001, … (table order).
fn named_rows(speakers: &[checkpoint::SpeakerId]) -> impl Iterator<Item = (String, usize)> + '_ {
    speakers.iter().enumerate().map(|(i, s)| {
        (
            vc_core::artifacts::speaker::name_key(&s.name),
            SPEAKER_ROW + i,
        )
    })
}

/// The exported speakers (lower-cased names) with their codec-embedding rows: the one unnamed
/// speaker as `speaker_name`, or the checkpoint's named speakers in table order.
fn speaker_rows(index: &checkpoint::Index, speaker_name: &str) -> Result<Vec<(String, usize)>> {
    let rows: Vec<(String, usize)> = if index.identity.speakers.is_empty() {
        let name = speaker_name.trim().to_lowercase();
        if name.is_empty() {
            bail!("the speaker name is empty");
        }
        vec![(name, SPEAKER_ROW)]
    } else {
        named_rows(&index.identity.speakers).collect()
    };
    vc_core::artifacts::speaker::check_unique(rows.iter().map(|(n, _)| n.as_str()))?;
    Ok(rows)
}

/// The model the export of `checkpoint` (a full fine-tune's, or a LoRA run's merged as
/// trained) would be, without writing it: `files` (its base model) with the trained tensors replaced
/// by their masters rounded to bf16 as the export stores them, and the speakers in their rows
/// and `spk_id` ([`ModelFiles::as_custom_voice`]). On a bf16-stored base every tensor then
/// reads as the export's; on an f32-stored one the untrained tensors keep their f32 values
/// where the export rounds them. What a run speaks its samples with (docs/training.md §14.4).
pub fn checkpoint_as_model(
    files: &ModelFiles,
    checkpoint: &Path,
    speaker_name: &str,
) -> Result<ModelFiles> {
    let index = checkpoint::read_index(checkpoint)?;
    let rows = speaker_rows(&index, speaker_name)?;
    let vectors = checkpoint::read_speakers(checkpoint, &index)?;
    let mut trained = checkpoint::RowReader::open(checkpoint)?.masters(&Device::Cpu)?;
    if let Some(lora) = &index.identity.lora {
        let adapted: HashSet<String> = trained
            .keys()
            .filter_map(|n| n.strip_suffix(".lora_A.weight"))
            .map(|m| format!("{m}.weight"))
            .collect();
        let base = files
            .load_weights(candle_core::DType::F32, &Device::Cpu, |n| {
                adapted.contains(n)
            })
            .context("cannot read the base model")?;
        trained = merge_adapters(trained, lora.scale(), |name| base.get_any(name))?;
    }
    let mut overlay = vc_model::overlay::WeightOverlay::default();
    for (name, t) in trained {
        let want = files
            .checkpoint
            .tensor(&name)
            .map(|t| t.shape.clone())
            .with_context(|| {
                format!("the checkpoint trains {name}, which the base model does not have")
            })?;
        if t.dims() != want.as_slice() {
            bail!(
                "the checkpoint's {name} has shape {:?}, the base model {want:?}",
                t.dims()
            );
        }
        let values: Vec<f32> = t
            .flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_f32())
            .collect();
        overlay.replace(&name, values);
    }
    let speakers: Vec<(String, Vec<f32>)> = rows
        .into_iter()
        .zip(vectors)
        .map(|((name, _), (_, x))| (name, x))
        .collect();
    files.clone().as_custom_voice(
        overlay,
        &speakers,
        &format!("checkpoint {}", checkpoint.display()),
    )
}

pub fn export(opts: &ExportOptions) -> Result<ExportSummary> {
    let index = checkpoint::read_index(&opts.checkpoint)?;
    let identity = ModelIdentity::compute(
        opts.model_spec,
        &opts.files.config_path,
        &opts.files.checkpoint.shards,
    )?;
    if identity != index.identity.model {
        bail!(
            "checkpoint {} was trained from another base model ({}) than {} (model.base); \
             pass the original with --model",
            opts.checkpoint.display(),
            index.identity.model.base,
            opts.model_spec
        );
    }
    if index.identity.lora.is_none() && opts.lora_scale != 1.0 {
        bail!(
            "checkpoint {} is a full fine-tune: it has no adapters to merge at another scale \
             (--lora-scale)",
            opts.checkpoint.display()
        );
    }
    if index.identity.lora.is_none() && opts.adapter_only {
        bail!(
            "checkpoint {} is a full fine-tune: it has no adapters to export alone \
             (--adapter-only needs a run with train.lora_rank > 0)",
            opts.checkpoint.display()
        );
    }
    if !(opts.lora_scale >= 0.0 && opts.lora_scale.is_finite()) {
        bail!(
            "--lora-scale {} is not a non-negative number",
            opts.lora_scale
        );
    }
    if let Some(lora) = &index.identity.lora {
        let scale = opts.lora_scale * lora.scale();
        let most = vc_core::artifacts::adapter::MAX_ADAPTER_SCALE;
        if scale > most {
            bail!(
                "--lora-scale {} times the run's α/r = {} scales the adapters by {scale:e}, \
                 beyond {most}: the voice would be noise (at most --lora-scale {})",
                opts.lora_scale,
                lora.scale(),
                most / lora.scale()
            );
        }
    }
    let vectors = checkpoint::read_speakers(&opts.checkpoint, &index)?;
    let rows = speaker_rows(&index, &opts.speaker_name)?;
    let recovered = recover(&opts.output)?;
    let kind = if opts.adapter_only {
        "adapter"
    } else {
        "model"
    };
    let replaced = check_output(&opts.output, kind)?;
    let hidden = opts.files.config.talker_config.hidden_size;
    for ((name, _), (_, x)) in rows.iter().zip(&vectors) {
        if x.len() != hidden {
            bail!(
                "the checkpoint's x-vector of speaker {name:?} has {} values, the model needs \
                 {hidden}",
                x.len()
            );
        }
    }
    let vocab = opts.files.config.talker_config.vocab_size;
    let last = SPEAKER_ROW + rows.len() - 1;
    if vocab <= last {
        bail!(
            "talker_config.vocab_size {vocab} has no row {last} for speaker {:?}: at most {} \
             speakers fit (rows {SPEAKER_ROW}..{vocab})",
            rows[rows.len() - 1].0,
            vocab.saturating_sub(SPEAKER_ROW)
        );
    }
    let speaker_rows: Vec<(usize, &[f32])> = rows
        .iter()
        .zip(&vectors)
        .map(|((_, row), (_, x))| (*row, x.as_slice()))
        .collect();

    let parent = opts
        .output
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    fs::create_dir_all(&parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let base_name = opts
        .output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let tmp = parent.join(format!(".{base_name}.tmp-export-{}", std::process::id()));
    fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut notes = Vec::new();
    let result = (|| -> Result<(usize, usize)> {
        let counts = match &index.identity.lora {
            Some(lora) if opts.adapter_only => {
                let trained =
                    checkpoint::RowReader::open(&opts.checkpoint)?.masters(&Device::Cpu)?;
                let named: Vec<(String, Vec<f32>)> = rows
                    .iter()
                    .zip(&vectors)
                    .map(|((n, _), (_, x))| (n.clone(), x.clone()))
                    .collect();
                let base = |modules: &[String]| {
                    opts.files
                        .load_weights(candle_core::DType::F32, &Device::Cpu, |n| {
                            modules.iter().any(|m| adapters::in_module(n, m))
                        })
                        .context("cannot read the base model")
                };
                adapters::write(
                    lora,
                    &trained,
                    opts.lora_scale,
                    &base,
                    opts.model_spec,
                    &named,
                    &tmp,
                )?
            }
            _ => {
                copy_model_files(opts.files, &tmp)?;
                let counts =
                    write_weights(opts, &index, &speaker_rows, &tmp.join(mf::SINGLE_FILE))?;
                write_config(&opts.files.config_path, &rows, &tmp.join(mf::CONFIG))?;
                counts
            }
        };
        let card_files = card::Card {
            files: opts.files,
            index: &index,
            checkpoint: &opts.checkpoint,
            speakers: &rows,
            adapter_only: opts.adapter_only,
            lora_scale: opts.lora_scale,
            manifest: opts.manifest.as_deref(),
            choice: opts.choice,
            session: opts.session.as_ref(),
            dir_name: &base_name,
        }
        .write(&tmp)?;
        let mut marker = if index.identity.speakers.is_empty() {
            json!({
                "format": "voiceclone-export",
                "version": 1,
                "base_model": opts.model_spec,
                "checkpoint": opts.checkpoint.display().to_string(),
                "step": index.step,
                "speaker_name": rows[0].0,
                "speaker_row": SPEAKER_ROW,
            })
        } else {
            json!({
                "format": "voiceclone-export",
                "version": 1,
                "base_model": opts.model_spec,
                "checkpoint": opts.checkpoint.display().to_string(),
                "step": index.step,
                "speakers": rows,
            })
        };
        marker["kind"] = json!(kind);
        // The card and its samples: written by the export, replaced with it.
        marker[card::MARKER_FIELD] = json!(card_files);
        if let Some(lora) = &index.identity.lora {
            marker["lora"] = json!({
                "rank": lora.rank,
                "alpha": lora.alpha,
                "scale": opts.lora_scale,
            });
        }
        // The base model the adapters go on (`speak --adapter` checks it).
        marker["base_identity"] = serde_json::to_value(&identity)?;
        // Each speaker's pace, for the frame budgets of `speak` and `serve`
        // (docs/model.md §7.2). Without it they use the default pace: a note, not a failure.
        if let Some(manifest) = opts.manifest.as_deref().filter(|m| m.is_file()) {
            let names: Vec<String> = rows.iter().map(|(n, _)| n.clone()).collect();
            let measured = opts
                .files
                .text_tokenizer()
                .and_then(|t| pace::measure(manifest, &t));
            match measured {
                Ok(m) => {
                    let paces = pace::of_speakers(&m, &names);
                    if !paces.is_empty() {
                        marker[pace::FIELD] = serde_json::to_value(&paces)?;
                    }
                }
                Err(e) => notes.push(format!(
                    "no speaking pace recorded (speak and serve use the default pace): {e:#}"
                )),
            }
        }
        fs::write(
            tmp.join(MARKER),
            serde_json::to_string_pretty(&marker)? + "\n",
        )?;
        Ok(counts)
    })();
    let (tensors, trained_tensors) = match result {
        Ok(c) => c,
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e.context(format!("cannot export to {}", opts.output.display())));
        }
    };
    if replaced {
        // Crash-safe with `recover`: killed after the first rename, the next run puts the old
        // export back; after the second, it deletes the old one.
        let old = parent.join(format!(".{base_name}.old-export-{}", std::process::id()));
        fs::rename(&opts.output, &old)
            .with_context(|| format!("cannot move the earlier {} aside", opts.output.display()))?;
        crate::hooks::pause_point("export-old-aside");
        fs::rename(&tmp, &opts.output)
            .with_context(|| format!("cannot move {} into place", tmp.display()))?;
        crate::hooks::pause_point("export-in-place");
        fs::remove_dir_all(&old).with_context(|| format!("cannot delete {}", old.display()))?;
    } else {
        fs::rename(&tmp, &opts.output)
            .with_context(|| format!("cannot move {} into place", tmp.display()))?;
    }
    Ok(ExportSummary {
        output: opts.output.clone(),
        step: index.step,
        speakers: rows,
        tensors,
        trained_tensors,
        replaced,
        adapter_only: opts.adapter_only,
        recovered,
        notes,
    })
}

/// Copies what the official recipe's `copytree` would, minus the weights and config.json
/// (rewritten): every file of a local model directory (symlinks followed), or the known
/// files of a hub model.
fn copy_model_files(files: &ModelFiles, dest: &Path) -> Result<()> {
    let weights: Vec<PathBuf> = files
        .checkpoint
        .shards
        .iter()
        .filter_map(|p| fs::canonicalize(p).ok())
        .collect();
    match &files.source {
        ModelSource::Local(dir) => copy_dir(dir, dest, true, &weights, &mut HashSet::new()),
        ModelSource::Hub { .. } => {
            for f in HUB_FILES {
                if let Some(src) = files.source.optional_file(f)? {
                    let to = dest.join(f);
                    if let Some(p) = to.parent() {
                        fs::create_dir_all(p)
                            .with_context(|| format!("cannot create {}", p.display()))?;
                    }
                    fs::copy(&src, &to)
                        .with_context(|| format!("cannot copy {}", src.display()))?;
                }
            }
            Ok(())
        }
    }
}

/// Copies `src` into `dest`, following links; a folder reached again through a link (a loop, or
/// a second link to it) is copied once and not entered again (`visited`: device and inode).
fn copy_dir(
    src: &Path,
    dest: &Path,
    top: bool,
    skip: &[PathBuf],
    visited: &mut HashSet<(u64, u64)>,
) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(src).with_context(|| format!("cannot read {}", src.display()))?;
    if !visited.insert((m.dev(), m.ino())) {
        return Ok(());
    }
    for e in fs::read_dir(src).with_context(|| format!("cannot read {}", src.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let path = e.path();
        if top
            && (name == mf::CONFIG
                || name == mf::SHARD_INDEX
                || name == MARKER
                // The base's own card is not this model's (ours is written after the copy).
                || name == card::CARD
                || name == card::SAMPLES
                || fs::canonicalize(&path).is_ok_and(|c| skip.contains(&c)))
        {
            continue;
        }
        let to = dest.join(&name);
        if path.is_dir() {
            let m =
                fs::metadata(&path).with_context(|| format!("cannot read {}", path.display()))?;
            if visited.contains(&(m.dev(), m.ino())) {
                continue;
            }
            fs::create_dir_all(&to).with_context(|| format!("cannot create {}", to.display()))?;
            copy_dir(&path, &to, false, skip, visited)?;
        } else if path.is_file() {
            fs::copy(&path, &to).with_context(|| format!("cannot copy {}", path.display()))?;
        }
    }
    Ok(())
}

/// `config.json`: the base config as a CustomVoice model with `speakers` (name, row).
fn write_config(base: &Path, speakers: &[(String, usize)], dest: &Path) -> Result<()> {
    let text =
        fs::read_to_string(base).with_context(|| format!("cannot read {}", base.display()))?;
    let mut cfg: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", base.display()))?;
    let obj = cfg
        .as_object_mut()
        .with_context(|| format!("{} is not a JSON object", base.display()))?;
    obj.insert("tts_model_type".into(), json!("custom_voice"));
    let talker = obj
        .get_mut("talker_config")
        .and_then(Value::as_object_mut)
        .with_context(|| format!("{} has no talker_config", base.display()))?;
    let ids: serde_json::Map<String, Value> = speakers
        .iter()
        .map(|(n, row)| (n.clone(), json!(row)))
        .collect();
    let dialect: serde_json::Map<String, Value> = speakers
        .iter()
        .map(|(n, _)| (n.clone(), json!(false)))
        .collect();
    talker.insert("spk_id".into(), Value::Object(ids));
    talker.insert("spk_is_dialect".into(), Value::Object(dialect));
    fs::write(dest, serde_json::to_string_pretty(&cfg)? + "\n")
        .with_context(|| format!("cannot write {}", dest.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_folder_with_a_link_loop_is_copied_once() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("base");
        fs::create_dir_all(src.join("speech_tokenizer")).unwrap();
        fs::write(src.join("vocab.json"), "{}").unwrap();
        fs::write(src.join("speech_tokenizer/config.json"), "{}").unwrap();
        std::os::unix::fs::symlink("..", src.join("speech_tokenizer/up")).unwrap();
        let dest = dir.path().join("out");
        fs::create_dir_all(&dest).unwrap();
        copy_dir(&src, &dest, true, &[], &mut HashSet::new()).unwrap();
        assert!(dest.join("vocab.json").is_file());
        assert!(dest.join("speech_tokenizer/config.json").is_file());
        assert!(!dest.join("speech_tokenizer/up").exists());
    }
}
