//! Audio codes of the 12 Hz speech tokenizer as the pipeline stores them: frames of 16 codes
//! (codebook 0, the semantic one, then the 15 acoustic codebooks; docs/model.md §9), written as
//! JSON `[[16 ints], ...]` — the `audio_codes` format of the official `prepare_data.py` — in
//! manifests and as `{"codes": [[16 ints], ...]}` in single-file code documents
//! (`voiceclone codec encode`, `speak --save-codes`).

use std::ops::Deref;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::fsutil::write_atomic;

/// Codebooks per frame.
pub const CODE_GROUPS: usize = 16;

/// The codes of one 80 ms frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CodeFrame(pub [u32; CODE_GROUPS]);

impl CodeFrame {
    /// A frame from a codec row; the row must have exactly [`CODE_GROUPS`] codes.
    pub fn from_row(row: &[u32]) -> Result<Self> {
        <[u32; CODE_GROUPS]>::try_from(row)
            .map(CodeFrame)
            .map_err(|_| {
                anyhow::anyhow!(
                    "the speech tokenizer produced {} codes per frame; the training format needs \
                     {CODE_GROUPS}",
                    row.len()
                )
            })
    }
}

impl Deref for CodeFrame {
    type Target = [u32; CODE_GROUPS];
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<'a> IntoIterator for &'a CodeFrame {
    type Item = &'a u32;
    type IntoIter = std::slice::Iter<'a, u32>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl AsRef<[u32]> for CodeFrame {
    fn as_ref(&self) -> &[u32] {
        &self.0
    }
}

/// Every row of a codec's output as frames.
pub fn frames_from_rows<R: AsRef<[u32]>>(rows: &[R]) -> Result<Vec<CodeFrame>> {
    rows.iter()
        .map(|r| CodeFrame::from_row(r.as_ref()))
        .collect()
}

/// `[[16 ints], ...]` as frames. The error names the first frame that is wrong and how; an
/// empty list is valid here (callers decide whether they need frames).
pub fn frames_from_json(value: &Value) -> std::result::Result<Vec<CodeFrame>, String> {
    let frames = value.as_array().ok_or("not a list of frames")?;
    frames
        .iter()
        .enumerate()
        .map(|(k, f)| {
            let items = f
                .as_array()
                .ok_or_else(|| format!("frame {k} is not a list of codes"))?;
            if items.len() != CODE_GROUPS {
                return Err(format!(
                    "frame {k} has {} codes, expected {CODE_GROUPS} (shape must be T x \
                     {CODE_GROUPS})",
                    items.len()
                ));
            }
            let mut out = [0u32; CODE_GROUPS];
            for (o, v) in out.iter_mut().zip(items) {
                *o = v
                    .as_u64()
                    .and_then(|c| u32::try_from(c).ok())
                    .ok_or_else(|| {
                        format!("frame {k} has code {v}, expected a non-negative integer")
                    })?;
            }
            Ok(CodeFrame(out))
        })
        .collect()
}

/// Frames as `[[16 ints], ...]`.
pub fn frames_to_json(frames: &[CodeFrame]) -> Value {
    Value::Array(
        frames
            .iter()
            .map(|f| Value::Array(f.iter().map(|&c| Value::from(c)).collect()))
            .collect(),
    )
}

/// The first frame with a code at or above `codebook_size`, as an error message.
pub fn check_range(frames: &[CodeFrame], codebook_size: u32) -> std::result::Result<(), String> {
    for (k, f) in frames.iter().enumerate() {
        if let Some(c) = f.iter().find(|&&c| c >= codebook_size) {
            return Err(format!(
                "frame {k} has code {c}, expected an integer in 0..{codebook_size}"
            ));
        }
    }
    Ok(())
}

/// Reads a `{"codes": [[16 ints], ...]}` document; it must hold at least one frame.
pub fn read_codes_file(path: &Path) -> Result<Vec<CodeFrame>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let doc: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let frames = doc
        .get("codes")
        .ok_or_else(|| "no \"codes\" field".to_string())
        .and_then(frames_from_json)
        .map_err(|why| {
            anyhow::anyhow!(
                "{}: expected {{\"codes\": [[{CODE_GROUPS} non-negative ints], ...]}}: {why}",
                path.display()
            )
        })?;
    anyhow::ensure!(!frames.is_empty(), "{} holds no frames", path.display());
    Ok(frames)
}

/// Writes `{"codes": [[16 ints], ...]}` atomically.
pub fn write_codes_file(path: &Path, frames: &[CodeFrame]) -> Result<()> {
    write_atomic(path, codes_file_text(frames).as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// What [`write_codes_file`] writes: `{"codes": [[16 ints], ...]}` and a line break.
pub fn codes_file_text(frames: &[CodeFrame]) -> String {
    let doc = serde_json::json!({ "codes": frames_to_json(frames) });
    format!("{doc}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trips_and_bad_shapes_name_the_frame() {
        let frames = vec![CodeFrame([1; 16]), CodeFrame([2047; 16])];
        assert_eq!(frames_from_json(&frames_to_json(&frames)).unwrap(), frames);
        let short = serde_json::json!([vec![1u32; 16], vec![1, 2, 3]]);
        let e = frames_from_json(&short).unwrap_err();
        assert!(e.contains("frame 1 has 3 codes"), "{e}");
        let neg = serde_json::json!([vec![-1i32; 16]]);
        assert!(frames_from_json(&neg)
            .unwrap_err()
            .contains("frame 0 has code -1"));
        assert!(frames_from_json(&serde_json::json!({"a": 1})).is_err());
        assert_eq!(
            check_range(&[CodeFrame([5; 16]), CodeFrame([2048; 16])], 2048).unwrap_err(),
            "frame 1 has code 2048, expected an integer in 0..2048"
        );
        assert!(CodeFrame::from_row(&[0; 15]).is_err());
        // The serde form is the same plain array.
        assert_eq!(
            serde_json::to_string(&CodeFrame([3; 16])).unwrap(),
            serde_json::to_string(&[3u32; 16]).unwrap()
        );
    }

    #[test]
    fn codes_files_round_trip_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.json");
        let frames = vec![CodeFrame([9; 16])];
        write_codes_file(&path, &frames).unwrap();
        assert_eq!(read_codes_file(&path).unwrap(), frames);
        std::fs::write(&path, "{\"codes\": []}").unwrap();
        assert!(read_codes_file(&path)
            .unwrap_err()
            .to_string()
            .contains("no frames"));
        std::fs::write(&path, "{\"codes\": [[1]]}").unwrap();
        let e = read_codes_file(&path).unwrap_err().to_string();
        assert!(e.contains("frame 0 has 1 codes"), "{e}");
    }
}
