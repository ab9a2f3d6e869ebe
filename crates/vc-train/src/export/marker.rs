//! The directory marker of an export (`voiceclone-export.json`, docs/training.md §10): what
//! makes a directory ours, so that a later export may replace it; what kind of export it holds,
//! which base model it was made from, and whether it is already the export of a checkpoint; and
//! the recovery of an export interrupted between its renames. The trainer's setup and
//! `speak --adapter` read markers without exporting anything.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::named_rows;
use crate::checkpoint::{self, ModelIdentity};
use vc_model::files as mf;

/// Marker file of an exported directory.
pub const MARKER: &str = "voiceclone-export.json";

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
        // An export from before the card gains one.
        && output.join(super::card::CARD).is_file()
}

/// The identity of the base model an export was made from, as its marker records it.
pub fn base_identity(dir: &Path) -> Option<ModelIdentity> {
    serde_json::from_value(read_marker(dir)?.get("base_identity")?.clone()).ok()
}

/// The marker of the export in `dir`, if it has a readable one.
pub(super) fn read_marker(dir: &Path) -> Option<Value> {
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
pub(super) fn check_output(output: &Path, kind: &str) -> Result<bool> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn export_dir(p: &Path, content: &str) {
        fs::create_dir_all(p).unwrap();
        fs::write(p.join(MARKER), content).unwrap();
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
