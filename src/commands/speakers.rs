//! `voiceclone speakers`: what the workspace holds per speaker (docs/training.md §3.3) — its
//! utterances and hours in the manifest, how many have codes, its reference clip, its x-vector
//! and its row in the exported model (`model/`). A workspace of one unnamed speaker shows that
//! one (`data/ref.wav`, `data/speaker.safetensors`, `train.speaker_name` in the model).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde_json::{json, Value};

use crate::cli::SpeakersArgs;
use vc_core::artifacts::manifest::Manifest;
use vc_core::artifacts::speaker::name_key;
use vc_core::config::Config;
use vc_core::workspace::Workspace;

/// One speaker's row of the report.
#[derive(Debug, Default)]
struct SpeakerRow {
    /// `None`: the one unnamed speaker.
    name: Option<String>,
    utterances: usize,
    seconds: f64,
    coded: usize,
    ref_clip: Option<PathBuf>,
    x_vector: Option<PathBuf>,
    x_vector_mode: Option<String>,
    model_row: Option<u64>,
    in_manifest: bool,
}

pub fn run(ws: &Workspace, config: &Config, args: &SpeakersArgs) -> Result<()> {
    let entries = collect(ws, config)?;
    if entries.is_empty() {
        bail!(
            "workspace {} holds no speaker yet: run `voiceclone prep` (or `voiceclone prep \
             --speaker NAME`) on recordings first",
            ws.root().display()
        );
    }
    if args.json {
        for e in &entries {
            println!("{}", to_json(ws, e));
        }
        return Ok(());
    }
    print!("{}", render(ws, &entries));
    Ok(())
}

fn collect(ws: &Workspace, config: &Config) -> Result<Vec<SpeakerRow>> {
    let manifest = ws.manifest();
    let rows = if manifest.is_file() {
        Some(Manifest::read(&manifest)?)
    } else {
        None
    };
    let named = rows.as_ref().map(Manifest::speakers).unwrap_or_default();
    let model = model_speakers(&ws.model_dir());
    let mut entries: Vec<SpeakerRow> = Vec::new();
    if named.is_empty() {
        let ref_wav = ws.ref_wav();
        let x = ws.speaker_file();
        if rows.is_none() && !ref_wav.is_file() && !x.is_file() && model.is_empty() {
            return Ok(entries);
        }
        let mut e = SpeakerRow {
            name: None,
            in_manifest: rows.is_some(),
            ref_clip: ref_wav.is_file().then_some(ref_wav),
            ..Default::default()
        };
        if let Some(m) = &rows {
            for (_, r) in m.rows() {
                count(&mut e, r);
            }
        }
        set_x_vector(&mut e, x);
        // The export's one speaker (named by `train.speaker_name` or `--speaker-name`).
        e.model_row = match model.len() {
            1 => model.values().next().copied(),
            _ => model
                .get(&name_key(config.train.speaker_name.trim()))
                .copied(),
        };
        entries.push(e);
        return Ok(entries);
    }
    let mut by_key: BTreeMap<String, SpeakerRow> = BTreeMap::new();
    for name in &named {
        let mut e = SpeakerRow {
            name: Some(name.clone()),
            in_manifest: true,
            ..Default::default()
        };
        if let Some(m) = &rows {
            for (_, r) in m.rows().filter(|(_, r)| r.speaker.as_deref() == Some(name)) {
                count(&mut e, r);
            }
        }
        by_key.insert(name_key(name), e);
    }
    // x-vectors and model speakers of no manifest speaker are shown too.
    if let Ok(dir) = std::fs::read_dir(ws.speakers_dir()) {
        for f in dir.flatten() {
            let file = f.file_name().to_string_lossy().into_owned();
            if let Some(name) = file.strip_suffix(".safetensors") {
                by_key.entry(name_key(name)).or_insert_with(|| SpeakerRow {
                    name: Some(name.to_string()),
                    ..Default::default()
                });
            }
        }
    }
    for name in model.keys() {
        by_key.entry(name.clone()).or_insert_with(|| SpeakerRow {
            name: Some(name.clone()),
            ..Default::default()
        });
    }
    for (key, mut e) in by_key {
        let name = e.name.clone().unwrap_or_default();
        let clip = ws.ref_clip(&name);
        e.ref_clip = clip.is_file().then_some(clip);
        set_x_vector(&mut e, ws.speaker_file_of(&name));
        e.model_row = model.get(&key).copied();
        entries.push(e);
    }
    Ok(entries)
}

fn count(e: &mut SpeakerRow, r: &vc_core::artifacts::manifest::ManifestRow) {
    e.utterances += 1;
    e.seconds += r.duration.unwrap_or(0.0);
    if r.frames().is_some() {
        e.coded += 1;
    }
}

fn set_x_vector(e: &mut SpeakerRow, path: PathBuf) {
    if !path.is_file() {
        return;
    }
    e.x_vector_mode = safetensors_metadata(&path).and_then(|m| m.get("mode").cloned());
    e.x_vector = Some(path);
}

fn safetensors_metadata(path: &Path) -> Option<std::collections::HashMap<String, String>> {
    let bytes = std::fs::read(path).ok()?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).ok()?;
    meta.metadata().clone()
}

/// `spk_id` of the exported model (lower-case names → codec rows); empty without a model.
fn model_speakers(dir: &Path) -> BTreeMap<String, u64> {
    let Ok(text) = std::fs::read_to_string(dir.join(vc_model::files::CONFIG)) else {
        return BTreeMap::new();
    };
    let Ok(cfg) = serde_json::from_str::<Value>(&text) else {
        return BTreeMap::new();
    };
    cfg["talker_config"]["spk_id"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_u64().map(|row| (name_key(k), row)))
                .collect()
        })
        .unwrap_or_default()
}

fn to_json(ws: &Workspace, e: &SpeakerRow) -> Value {
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| ws.relative(p));
    json!({
        "speaker": e.name,
        "in_manifest": e.in_manifest,
        "utterances": e.utterances,
        "seconds": (e.seconds * 1000.0).round() / 1000.0,
        "coded": e.coded,
        "ref_audio": path(&e.ref_clip),
        "x_vector": path(&e.x_vector),
        "x_vector_mode": e.x_vector_mode,
        "model_row": e.model_row,
    })
}

fn render(ws: &Workspace, entries: &[SpeakerRow]) -> String {
    let header = [
        "speaker",
        "utterances",
        "hours",
        "coded",
        "reference clip",
        "x-vector",
        "in model/",
    ];
    let missing = "-".to_string();
    let table: Vec<[String; 7]> = entries
        .iter()
        .map(|e| {
            [
                e.name
                    .clone()
                    .unwrap_or_else(|| "(one unnamed speaker)".into()),
                if e.in_manifest {
                    e.utterances.to_string()
                } else {
                    "0 (not in the manifest)".into()
                },
                format!("{:.3}", e.seconds / 3600.0),
                e.coded.to_string(),
                e.ref_clip
                    .as_ref()
                    .map(|p| ws.relative(p))
                    .unwrap_or_else(|| missing.clone()),
                match (&e.x_vector, &e.x_vector_mode) {
                    (Some(p), Some(m)) => format!("{} ({m})", ws.relative(p)),
                    (Some(p), None) => ws.relative(p),
                    (None, _) => missing.clone(),
                },
                e.model_row
                    .map(|r| format!("row {r}"))
                    .unwrap_or_else(|| missing.clone()),
            ]
        })
        .collect();
    let mut widths = header.map(|h| h.chars().count());
    for row in &table {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let mut out = String::new();
        for (i, (c, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}  "));
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(&header.map(String::from));
    for row in &table {
        out.push_str(&line(row));
    }
    out
}
