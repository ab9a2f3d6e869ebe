//! Named speakers in one workspace (docs/training.md §3.3): `voiceclone prep --speaker NAME` and
//! `--speakers-from-dirs PARENT`.
//!
//! Each run prepares the recordings of one or more speakers exactly like an unnamed run (the same
//! records, segments and reuse), then merges them into `data/train.jsonl`: the lines of every
//! other speaker are kept byte for byte and in place, the lines of the run's speakers are
//! replaced by the new ones (where the speaker's first line was, or at the end for a new
//! speaker), each tagged `"speaker": NAME` and pointing at the speaker's own reference clip
//! `data/ref/NAME.wav`. Lines of an earlier unnamed run whose recording the run prepares are
//! named by it; any other unnamed line is an error, as is a recording already prepared for
//! another speaker. Every check runs before anything is written: a bad name before any work,
//! the rest before the reference clips and the manifest.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use super::transcribe::Transcriber;
use super::{
    collect, nothing_usable_message, record_whisper_model, write_reference, PrepOptions, Summary,
};
use super::{TranscriberFactory, UtteranceRecord};
use vc_core::artifacts::manifest::{Manifest, ManifestLine};
use vc_core::artifacts::{manifest::ManifestRow, speaker};
use vc_core::workspace::Workspace;

/// The recordings of one named speaker.
#[derive(Debug, Clone)]
pub struct SpeakerInputs {
    pub name: String,
    pub inputs: Vec<PathBuf>,
}

/// One speaker per subfolder of `parent`, named after it (sorted; hidden folders skipped).
/// Audio files directly in `parent` belong to no speaker: they are returned as warnings.
pub fn from_dirs(parent: &Path) -> Result<(Vec<SpeakerInputs>, Vec<String>)> {
    let entries = std::fs::read_dir(parent)
        .with_context(|| format!("cannot read the speakers folder {}", parent.display()))?;
    let mut speakers = Vec::new();
    let mut warnings = Vec::new();
    for e in entries {
        let e =
            e.with_context(|| format!("cannot read the speakers folder {}", parent.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let path = e.path();
        if path.is_dir() {
            speakers.push(SpeakerInputs {
                name,
                inputs: vec![path],
            });
        } else if vc_audio::decode::has_audio_extension(&path) {
            warnings.push(format!(
                "{} is not inside a speaker folder of {}; it is ignored",
                path.display(),
                parent.display()
            ));
        }
    }
    speakers.sort_by(|a, b| a.name.cmp(&b.name));
    if speakers.is_empty() {
        bail!(
            "{} has no subfolders: --speakers-from-dirs takes each subfolder as one speaker",
            parent.display()
        );
    }
    Ok((speakers, warnings))
}

/// An unnamed `prep` would replace the manifest; on a manifest of named speakers that would
/// throw them away, so it is refused (before any work) with what to do instead.
pub fn refuse_unnamed_run(ws: &Workspace) -> Result<()> {
    let path = ws.manifest();
    if !path.is_file() {
        return Ok(());
    }
    let names = Manifest::read(&path)?.speakers();
    if !names.is_empty() {
        bail!(
            "{} holds the named speakers {}; `voiceclone prep` without --speaker would replace \
             them with one unnamed speaker. Use `voiceclone prep --speaker NAME INPUT...` to add \
             or update a speaker, or move {} away to start over",
            ws.relative(&path),
            names.join(", "),
            ws.relative(&path)
        );
    }
    Ok(())
}

/// Prepares every speaker of `speakers` from its inputs (`opts.inputs` is ignored) and merges
/// them into the workspace's manifest; returns each speaker's summary.
pub fn run(
    ws: &Workspace,
    opts: &PrepOptions,
    speakers: &[SpeakerInputs],
    make_transcriber: &TranscriberFactory,
) -> Result<Vec<(String, Summary)>> {
    speaker::check_unique(speakers.iter().map(|s| s.name.as_str()))?;
    if speakers.len() > 1 && opts.ref_audio.is_some() {
        bail!(
            "prep.ref_audio names one reference clip, but this run prepares {} speakers; set it \
             per speaker with `voiceclone prep --speaker NAME --ref-audio CLIP INPUT...`",
            speakers.len()
        );
    }
    let manifest_path = ws.manifest();
    let mut lines = existing_lines(ws, &manifest_path)?;
    check_against_existing(&lines, speakers, ws, &manifest_path)?;

    // The Whisper model is loaded at most once for all speakers.
    let cache: RefCell<Option<Arc<dyn Transcriber>>> = RefCell::new(None);
    let once = || -> Result<Arc<dyn Transcriber>> {
        if let Some(t) = cache.borrow().as_ref() {
            return Ok(t.clone());
        }
        let t = make_transcriber()?;
        *cache.borrow_mut() = Some(t.clone());
        Ok(t)
    };
    let mut collected = Vec::with_capacity(speakers.len());
    for sp in speakers {
        let run_opts = PrepOptions {
            inputs: sp.inputs.clone(),
            ..opts.clone()
        };
        let c = collect(ws, &run_opts, &once)
            .with_context(|| format!("cannot prepare speaker {:?}", sp.name))?;
        if c.summary.utterances == 0 {
            bail!(
                "speaker {:?} has no utterances: {} (nothing was written to {})",
                sp.name,
                nothing_usable_message(&c.summary),
                ws.relative(&manifest_path)
            );
        }
        collected.push(c);
    }

    // Merge in memory (every check), then write the reference clips and the manifest.
    for (sp, c) in speakers.iter().zip(&collected) {
        let ref_rel = ws.relative(&ws.ref_clip(&sp.name));
        let rows: Vec<ManifestRow> = c
            .utterances()
            .iter()
            .map(|(source, u)| ManifestRow {
                speaker: Some(sp.name.clone()),
                ..u.to_row(source, &ref_rel)
            })
            .collect();
        let sources: BTreeSet<String> = c.records.values().map(|r| r.source.clone()).collect();
        lines = merge(&lines, &sp.name, &sources, rows)
            .map_err(|why| anyhow::anyhow!("{}: {why}", ws.relative(&manifest_path)))?;
    }
    let mut summaries = Vec::with_capacity(speakers.len());
    for (sp, c) in speakers.iter().zip(collected) {
        let utterances: Vec<(&str, &UtteranceRecord)> = c.utterances();
        let ref_rel = write_reference(
            ws,
            &ws.ref_clip(&sp.name),
            opts.ref_audio.as_deref(),
            &utterances,
        )?;
        let mut summary = c.summary.clone();
        summary.ref_audio = ref_rel;
        summary.manifest = manifest_path.clone();
        summaries.push((sp.name.clone(), summary));
    }
    Manifest {
        path: manifest_path.clone(),
        lines,
    }
    .write(&manifest_path)?;
    record_whisper_model(ws, opts)?;
    Ok(summaries)
}

/// The current manifest's lines (none when there is no manifest); a line that is not a valid
/// row is an error, since a named run rewrites the file around it.
fn existing_lines(ws: &Workspace, path: &Path) -> Result<Vec<ManifestLine>> {
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let m = Manifest::read(path)?;
    if let Some((line, why)) = m.broken().next() {
        bail!(
            "{}:{line}: {why}; fix or remove that line before adding speakers",
            ws.relative(path)
        );
    }
    Ok(m.lines)
}

/// Names of the run that clash with the manifest's (same name up to case) or are invalid there.
fn check_against_existing(
    lines: &[ManifestLine],
    speakers: &[SpeakerInputs],
    ws: &Workspace,
    path: &Path,
) -> Result<()> {
    let mut existing: HashMap<String, (usize, &str)> = HashMap::new();
    for (i, line) in lines.iter().enumerate() {
        if let ManifestLine::Row(r) = line {
            if let Some(name) = r.speaker.as_deref() {
                existing
                    .entry(speaker::name_key(name))
                    .or_insert((i + 1, name));
            }
        }
    }
    for sp in speakers {
        if let Some((line, other)) = existing.get(&speaker::name_key(&sp.name)) {
            if *other != sp.name {
                bail!(
                    "the speaker name {:?} differs only in case from {other:?} ({}:{line}); \
                     speaker names are compared case-insensitively: use {other:?} to update that \
                     speaker, or another name",
                    sp.name,
                    ws.relative(path)
                );
            }
        }
    }
    Ok(())
}

/// `lines` with the lines of speaker `name` replaced by `rows`. `sources` are the recordings the
/// run prepared: unnamed lines of those recordings are taken over (named), and a line of another
/// speaker from one of them is an error. An old line of `name` with the same `audio` and `text`
/// as a new row gives it its `audio_codes` and extra fields (they describe the same clip).
/// The error names the line.
pub fn merge(
    lines: &[ManifestLine],
    name: &str,
    sources: &BTreeSet<String>,
    mut rows: Vec<ManifestRow>,
) -> std::result::Result<Vec<ManifestLine>, String> {
    let mut out = Vec::with_capacity(lines.len() + rows.len());
    let mut insert_at = None;
    let mut old: HashMap<(String, String), &ManifestRow> = HashMap::new();
    for (i, line) in lines.iter().enumerate() {
        let ManifestLine::Row(r) = line else {
            out.push(line.clone());
            continue;
        };
        let from_run = r.source.as_ref().is_some_and(|s| sources.contains(s));
        match r.speaker.as_deref() {
            Some(s) if s == name => {}
            None if from_run => {}
            None => {
                return Err(format!(
                    "line {} has no speaker: it was written by a `voiceclone prep` without \
                     --speaker (source {}). Name those recordings first with `voiceclone prep \
                     --speaker NAME` on them, or remove their lines",
                    i + 1,
                    r.source.as_deref().unwrap_or("unknown")
                ))
            }
            Some(other) if from_run => {
                return Err(format!(
                    "line {}: the recording {} is already prepared as speaker {other:?}; one \
                     recording belongs to one speaker",
                    i + 1,
                    r.source.as_deref().unwrap_or_default()
                ))
            }
            Some(_) => {
                out.push(line.clone());
                continue;
            }
        }
        // A line of this run's speaker (or taken over): replaced.
        insert_at.get_or_insert(out.len());
        if let (Some(a), Some(t)) = (&r.audio, &r.text) {
            old.insert((a.clone(), t.clone()), r);
        }
    }
    for row in &mut rows {
        if let (Some(a), Some(t)) = (&row.audio, &row.text) {
            if let Some(prev) = old.get(&(a.clone(), t.clone())) {
                row.extra = prev.extra.clone();
                row.audio_codes = prev.audio_codes.clone();
            }
        }
    }
    let at = insert_at.unwrap_or(out.len());
    out.splice(
        at..at,
        rows.into_iter().map(|r| ManifestLine::Row(Box::new(r))),
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<ManifestLine> {
        text.lines().map(ManifestLine::parse).collect()
    }

    fn jsonl(lines: &[ManifestLine]) -> String {
        Manifest {
            path: "m".into(),
            lines: lines.to_vec(),
        }
        .to_jsonl()
        .unwrap()
    }

    fn row(audio: &str, source: &str, speaker: &str) -> ManifestRow {
        ManifestRow {
            audio: Some(audio.into()),
            text: Some("t".into()),
            source: Some(source.into()),
            speaker: Some(speaker.into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_speakers_lines_are_replaced_in_place_and_others_kept() {
        let before = lines(concat!(
            r#"{"audio":"a1","text":"t","source":"A","speaker":"ann"}"#,
            "\n",
            r#"{"audio":"b1","text":"t","source":"B","speaker":"bob","audio_codes":[[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]]}"#,
            "\n",
            r#"{"audio":"b2","text":"t","source":"B","speaker":"bob","x":1,"audio_codes":[[2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2]]}"#,
            "\n",
            r#"{"audio":"c1","text":"t","source":"C","speaker":"cy"}"#,
        ));
        let sources = BTreeSet::from(["B".to_string(), "B2".to_string()]);
        let new = vec![row("b2", "B", "bob"), row("b3", "B2", "bob")];
        let after = merge(&before, "bob", &sources, new).unwrap();
        let text = jsonl(&after);
        let got: Vec<&str> = text.lines().collect();
        let want_first = jsonl(&before[..1]);
        let want_last = jsonl(&before[3..]);
        assert_eq!(got[0], want_first.trim_end());
        // b2 kept its codes and extra field; b1 is gone; b3 is new.
        assert_eq!(
            got[1],
            r#"{"audio":"b2","text":"t","source":"B","speaker":"bob","x":1,"audio_codes":[[2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2]]}"#
        );
        assert_eq!(
            got[2],
            r#"{"audio":"b3","text":"t","source":"B2","speaker":"bob"}"#
        );
        assert_eq!(got[3], want_last.trim_end());
        // A new speaker goes to the end; the same run again changes nothing.
        let d = merge(
            &after,
            "dee",
            &BTreeSet::from(["D".into()]),
            vec![row("d1", "D", "dee")],
        )
        .unwrap();
        assert_eq!(jsonl(&d[..4]), text);
        let again = merge(
            &after,
            "bob",
            &sources,
            vec![row("b2", "B", "bob"), row("b3", "B2", "bob")],
        )
        .unwrap();
        assert_eq!(jsonl(&again), text);
    }

    #[test]
    fn unnamed_lines_are_taken_over_or_refused_and_sources_belong_to_one_speaker() {
        let unnamed = lines(concat!(
            r#"{"audio":"a1","text":"t","source":"A"}"#,
            "\n",
            r#"{"audio":"z1","text":"t","source":"Z"}"#
        ));
        let e = merge(
            &unnamed,
            "ann",
            &BTreeSet::from(["A".into()]),
            vec![row("a1", "A", "ann")],
        )
        .unwrap_err();
        assert!(
            e.contains("line 2 has no speaker") && e.contains("source Z"),
            "{e}"
        );
        let named = merge(
            &unnamed[..1],
            "ann",
            &BTreeSet::from(["A".into()]),
            vec![row("a1", "A", "ann")],
        )
        .unwrap();
        assert_eq!(
            jsonl(&named),
            "{\"audio\":\"a1\",\"text\":\"t\",\"source\":\"A\",\"speaker\":\"ann\"}\n"
        );
        let e = merge(
            &named,
            "bob",
            &BTreeSet::from(["A".into()]),
            vec![row("a1", "A", "bob")],
        )
        .unwrap_err();
        assert!(
            e.contains("line 1: the recording A is already prepared as speaker \"ann\""),
            "{e}"
        );
    }
}
