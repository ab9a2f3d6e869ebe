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
//! voiceclone-export.json   marks the directory as ours (a later export may replace it)
//! ```
//! The directory is written under a temporary name and renamed into place; an existing
//! directory is only replaced when it is an earlier export (or empty).

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::{json, Value};

use super::adapter_export;
use super::checkpoint::{self, ModelIdentity};
use super::lora::LoraIdentity;
use super::safetensors_stream::{self, TensorHeader};
use vc_core::hub::ModelSource;
use vc_core::workspace::Workspace;
use vc_model::files::{self as mf, ModelFiles};

/// Marker file of an exported directory.
pub const MARKER: &str = "voiceclone-export.json";
/// Codec-embedding row that holds the fine-tuned speaker (docs/model.md §10.5); named speakers
/// take this row and the ones after it, in the order of the checkpoint's speaker table
/// (docs/training.md §10).
pub const SPEAKER_ROW: usize = vc_model::overlay::SPEAKER_ROW;
use vc_model::overlay::CODEC_EMBEDDING;
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
    /// ([`super::adapter_export`]).
    pub adapter_only: bool,
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
    /// It holds adapters in PEFT's format, not a model ([`super::adapter_export`]).
    pub adapter_only: bool,
    /// What was repaired of an earlier interrupted export first ([`recover`]).
    pub recovered: Vec<String>,
}

impl ExportSummary {
    /// Prints where the export went and how to use it (what `export` and `train` report).
    pub fn print(&self, ws: &Workspace) {
        for note in &self.recovered {
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
                "  PEFT adapters: PeftModel.from_pretrained(Qwen3TTSModel.from_pretrained(BASE).model, \"{out}\")"
            );
        } else if let Some((first, _)) = self.speakers.first() {
            println!("  speak with: voiceclone speak --model {out} --speaker {first} \"Hello!\" -o hello.wav");
        }
    }
}

/// Repairs what an interrupted export to `output` left next to it (docs/training.md §10). An
/// export builds `.NAME.tmp-export-PID/` (complete once it holds the marker, written last),
/// moves an earlier export aside to `.NAME.old-export-PID/`, renames the new one into place and
/// deletes the old one. Killed between the renames, `output` is missing: the complete new export
/// is moved into place (or, if there is none, the earlier one put back). Then leftovers are
/// removed: incomplete or superseded temporary directories, and earlier exports once `output`
/// is an export. Returns what was done, for the user.
pub fn recover(output: &Path) -> Result<Vec<String>> {
    let (Some(parent), Some(name)) = (output.parent(), output.file_name()) else {
        return Ok(Vec::new());
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let name = name.to_string_lossy();
    let (tmp, old) = (
        format!(".{name}.tmp-export-"),
        format!(".{name}.old-export-"),
    );
    let Ok(entries) = fs::read_dir(parent) else {
        return Ok(Vec::new());
    };
    let (mut tmps, mut olds) = (Vec::new(), Vec::new());
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if e.path().is_dir() && n.starts_with(&tmp) {
            tmps.push(e.path());
        } else if e.path().is_dir() && n.starts_with(&old) {
            olds.push(e.path());
        }
    }
    // Newest first.
    let newest_first = |v: &mut Vec<PathBuf>| {
        v.sort_by_key(|p| std::cmp::Reverse(fs::metadata(p).and_then(|m| m.modified()).ok()))
    };
    newest_first(&mut tmps);
    newest_first(&mut olds);
    let mut done = Vec::new();
    if !output.exists() {
        let complete = tmps.iter().position(|t| t.join(MARKER).is_file());
        let back = match complete {
            Some(i) => Some((tmps.remove(i), "finished an export that was interrupted")),
            None => olds.iter().position(|o| o.join(MARKER).is_file()).map(|i| {
                (
                    olds.remove(i),
                    "restored the previous export, which an interrupted export had moved aside",
                )
            }),
        };
        if let Some((dir, what)) = back {
            fs::rename(&dir, output).with_context(|| {
                format!("cannot move {} to {}", dir.display(), output.display())
            })?;
            done.push(format!("{}: {what}", output.display()));
        }
    }
    for t in tmps {
        fs::remove_dir_all(&t).with_context(|| format!("cannot remove {}", t.display()))?;
    }
    if output.join(MARKER).is_file() {
        for o in olds.into_iter().filter(|o| o.join(MARKER).is_file()) {
            fs::remove_dir_all(&o).with_context(|| format!("cannot remove {}", o.display()))?;
            done.push(format!(
                "removed {}, the previous export that an interrupted export replaced",
                o.display()
            ));
        }
    }
    Ok(done)
}

/// Whether `output` already holds the export of `checkpoint` for `speaker_name` (its marker
/// names the same checkpoint directory, step and speaker, or the checkpoint's named speakers).
pub fn is_current(output: &Path, checkpoint: &Path, speaker_name: &str) -> bool {
    // What the end of training exports: a merged model at the trained strength.
    let Some(marker) = read_marker(output) else {
        return false;
    };
    let Ok(index) = checkpoint::read_index(checkpoint) else {
        return false;
    };
    let speakers_match = if index.identity.speakers.is_empty() {
        marker["speaker_name"].as_str() == Some(&speaker_name.trim().to_lowercase())
    } else {
        marker["speakers"] == json!(named_rows(&index.identity.speakers).collect::<Vec<_>>())
    };
    marker["checkpoint"].as_str() == Some(&checkpoint.display().to_string())
        && marker["step"].as_u64() == Some(index.step as u64)
        && speakers_match
        && marker["kind"].as_str().unwrap_or("model") == "model"
        && marker["lora"]["scale"].as_f64().unwrap_or(1.0) == 1.0
        && output.join(mf::SINGLE_FILE).is_file()
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

/// The identity of the base model an export was made from, as its marker records it.
pub fn base_identity(dir: &Path) -> Option<ModelIdentity> {
    serde_json::from_value(read_marker(dir)?.get("base_identity")?.clone()).ok()
}

/// The marker of the export in `dir`, if it has a readable one.
fn read_marker(dir: &Path) -> Option<Value> {
    serde_json::from_str(&fs::read_to_string(dir.join(MARKER)).ok()?).ok()
}

/// What a directory holds, by its marker: `"model"` (a merged or full fine-tune export, also
/// every marker written before adapters existed) or `"adapter"`; `None` without a marker.
pub fn export_kind(dir: &Path) -> Option<String> {
    Some(
        read_marker(dir)?["kind"]
            .as_str()
            .unwrap_or("model")
            .to_string(),
    )
}

/// Why an existing `output` may or may not be replaced by an export of `kind`: an export of
/// another kind is refused (an adapter must not replace a merged model, nor the reverse).
fn check_output(output: &Path, kind: &str) -> Result<bool> {
    if let Some(found) = export_kind(output) {
        if found != kind {
            bail!(
                "{} holds an exported {found}; refusing to replace it with an exported {kind}. \
                 Choose another output (-o) or move it away",
                output.display()
            );
        }
    }
    if !output.exists() {
        return Ok(false);
    }
    if !output.is_dir() {
        bail!(
            "{} exists and is not a directory; choose another output (-o)",
            output.display()
        );
    }
    let empty = fs::read_dir(output)?.next().is_none();
    if empty || output.join(MARKER).is_file() {
        return Ok(true);
    }
    bail!(
        "{} exists and was not written by `voiceclone export` (it has no {MARKER}); refusing to \
         replace it. Choose another output (-o) or move it away",
        output.display()
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
    fs::create_dir_all(&tmp)?;
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
                            modules.iter().any(|m| adapter_export::in_module(n, m))
                        })
                        .context("cannot read the base model")
                };
                adapter_export::write(
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
        if let Some(lora) = &index.identity.lora {
            marker["lora"] = json!({
                "rank": lora.rank,
                "alpha": lora.alpha,
                "scale": opts.lora_scale,
            });
        }
        // The base model the adapters go on (`speak --adapter` checks it).
        marker["base_identity"] = serde_json::to_value(&identity)?;
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
        fs::rename(&opts.output, &old)?;
        crate::hooks::pause_point("export-old-aside");
        fs::rename(&tmp, &opts.output)?;
        crate::hooks::pause_point("export-in-place");
        fs::remove_dir_all(&old)?;
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
                        fs::create_dir_all(p)?;
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
                || fs::canonicalize(&path).is_ok_and(|c| skip.contains(&c)))
        {
            continue;
        }
        let to = dest.join(&name);
        if path.is_dir() {
            let m = fs::metadata(&path)?;
            if visited.contains(&(m.dev(), m.ino())) {
                continue;
            }
            fs::create_dir_all(&to)?;
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
    fs::write(dest, serde_json::to_string_pretty(&cfg)? + "\n")?;
    Ok(())
}

/// Writes `model.safetensors` (bf16) with each speaker's x-vector in its codec-embedding row,
/// and returns (tensor count, trained tensor count).
fn write_weights(
    opts: &ExportOptions,
    index: &checkpoint::Index,
    speakers: &[(usize, &[f32])],
    dest: &Path,
) -> Result<(usize, usize)> {
    let mut trained: BTreeMap<String, Tensor> =
        checkpoint::RowReader::open(&opts.checkpoint)?.masters(&Device::Cpu)?;
    let mmaps = opts
        .files
        .checkpoint
        .shards
        .iter()
        .map(|p| {
            let f = fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
            // SAFETY: read-only mapping of a checkpoint that is not modified while exporting.
            Ok(unsafe { Mmap::map(&f)? })
        })
        .collect::<Result<Vec<_>>>()?;
    let files = mmaps
        .iter()
        .zip(&opts.files.checkpoint.shards)
        .map(|(m, p)| {
            SafeTensors::deserialize(m)
                .map_err(|e| anyhow::anyhow!("{} is not valid safetensors: {e}", p.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut entries = Vec::new();
    let mut origin = Vec::new();
    for (fi, st) in files.iter().enumerate() {
        for name in st.names() {
            if name.starts_with("speaker_encoder.") {
                continue;
            }
            let view = st.tensor(name)?;
            let dtype = if is_float(view.dtype()) {
                StDtype::BF16
            } else {
                view.dtype()
            };
            entries.push(TensorHeader {
                name: name.to_string(),
                dtype,
                shape: view.shape().to_vec(),
            });
            origin.push(fi);
        }
    }
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by(|&a, &b| entries[a].name.cmp(&entries[b].name));
    let entries: Vec<TensorHeader> = order.iter().map(|&i| entries[i].clone()).collect();
    let origin: Vec<usize> = order.iter().map(|&i| origin[i]).collect();
    if let Some(lora) = &index.identity.lora {
        // S·α/r as the adapter-only export's α' = S·α gives it (α'/r), so both merge alike.
        let scale = LoraIdentity {
            rank: lora.rank,
            alpha: opts.lora_scale * lora.alpha,
        }
        .scale();
        let base = |name: &str| -> Result<Tensor> {
            let i = entries
                .iter()
                .position(|e| e.name == name)
                .with_context(|| {
                    format!("the checkpoint adapts {name}, which the base model does not have")
                })?;
            view_f32(&files[origin[i]].tensor(name)?)
        };
        trained = merge_adapters(trained, scale, base)?;
    }
    for name in trained.keys() {
        let Some(e) = entries.iter().find(|e| &e.name == name) else {
            bail!("the checkpoint trains {name}, which the base model does not have");
        };
        if trained[name].dims() != e.shape.as_slice() {
            bail!(
                "the checkpoint's {name} has shape {:?}, the base model {:?}",
                trained[name].dims(),
                e.shape
            );
        }
    }
    let speaker_bf16: Vec<(usize, Vec<u8>)> = speakers
        .iter()
        .map(|(row, x)| {
            let bytes = x
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            (*row, bytes)
        })
        .collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let file =
        fs::File::create(dest).with_context(|| format!("cannot create {}", dest.display()))?;
    let mut w = BufWriter::new(file);
    safetensors_stream::write(&mut w, &entries, &meta, |i| {
        let e = &entries[i];
        let mut bytes = match trained.get(&e.name) {
            Some(t) => safetensors_stream::bf16_bytes(t)?,
            None => {
                let view = files[origin[i]].tensor(&e.name)?;
                to_bf16_bytes(view.dtype(), view.data())?
            }
        };
        if e.name == CODEC_EMBEDDING {
            for (row, x) in &speaker_bf16 {
                let n = x.len();
                bytes[row * n..(row + 1) * n].copy_from_slice(x);
            }
        }
        Ok(bytes)
    })?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok((entries.len(), trained.len()))
}

/// The trained tensors of a LoRA checkpoint with every adapter merged into its matrix:
/// `W + scale · B·A` in f32 (`base(name)` gives `W`); the fully trained tensors as they are.
pub fn merge_adapters(
    trained: BTreeMap<String, Tensor>,
    scale: f64,
    base: impl Fn(&str) -> Result<Tensor>,
) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    for (name, t) in &trained {
        if let Some(module) = name.strip_suffix(".lora_A.weight") {
            let b_name = format!("{module}.lora_B.weight");
            let b = trained
                .get(&b_name)
                .with_context(|| format!("the checkpoint has {name} but no {b_name}"))?;
            let weight = format!("{module}.weight");
            let w = base(&weight)?;
            let merged = vc_model::overlay::merge_low_rank(&w, t, b, scale)
                .with_context(|| format!("merging the adapter of {weight}"))?;
            out.insert(weight, merged);
        } else if name.ends_with(".lora_B.weight") {
            let a_name = name.replace(".lora_B.weight", ".lora_A.weight");
            if !trained.contains_key(&a_name) {
                bail!("the checkpoint has {name} but no {a_name}");
            }
        } else {
            out.insert(name.clone(), t.clone());
        }
    }
    Ok(out)
}

/// A safetensors tensor as an f32 CPU tensor.
fn view_f32(view: &safetensors::tensor::TensorView<'_>) -> Result<Tensor> {
    let dtype = match view.dtype() {
        StDtype::BF16 => candle_core::DType::BF16,
        StDtype::F16 => candle_core::DType::F16,
        StDtype::F32 => candle_core::DType::F32,
        StDtype::F64 => candle_core::DType::F64,
        d => bail!("a {d:?} tensor is not a matrix an adapter can sit on"),
    };
    Ok(
        Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)?
            .to_dtype(candle_core::DType::F32)?,
    )
}

fn is_float(d: StDtype) -> bool {
    matches!(
        d,
        StDtype::BF16 | StDtype::F16 | StDtype::F32 | StDtype::F64
    )
}

/// Raw little-endian tensor bytes converted to bf16 (floats) or kept (other dtypes).
fn to_bf16_bytes(dtype: StDtype, data: &[u8]) -> Result<Vec<u8>> {
    let conv = |v: f32| half::bf16::from_f32(v).to_le_bytes();
    Ok(match dtype {
        StDtype::BF16 => data.to_vec(),
        StDtype::F16 => data
            .chunks_exact(2)
            .flat_map(|b| conv(half::f16::from_le_bytes([b[0], b[1]]).to_f32()))
            .collect(),
        StDtype::F32 => data
            .chunks_exact(4)
            .flat_map(|b| conv(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        StDtype::F64 => data
            .chunks_exact(8)
            .flat_map(|b| conv(f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32))
            .collect(),
        _ => data.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export_dir(p: &Path, content: &str) {
        fs::create_dir_all(p).unwrap();
        fs::write(p.join(MARKER), content).unwrap();
    }

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

    #[test]
    fn recovery_puts_back_the_previous_export_when_the_new_one_is_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        export_dir(&dir.path().join(".model.old-export-7"), "previous");
        // Killed before the new export was complete: its marker is written last.
        fs::create_dir_all(dir.path().join(".model.tmp-export-7")).unwrap();
        let done = recover(&model).unwrap();
        assert_eq!(fs::read_to_string(model.join(MARKER)).unwrap(), "previous");
        assert!(done[0].contains("restored the previous export"), "{done:?}");
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "leftovers remain"
        );
        // Nothing to do now; and a directory the user made is never touched.
        assert!(recover(&model).unwrap().is_empty());
        let mine = dir.path().join("mine");
        fs::create_dir_all(&mine).unwrap();
        fs::create_dir_all(dir.path().join(".mine.old-export-3")).unwrap();
        assert!(recover(&mine).unwrap().is_empty());
        assert!(dir.path().join(".mine.old-export-3").exists());
    }
}
