//! Voices registered through `POST /v1/voices` (docs/serving.md §5): the x-vector and, with a
//! transcript, the reference codes of an uploaded clip, computed once, kept in memory and in
//! `serve/voices/ID.safetensors` under the workspace (written atomically) so a restart keeps
//! them. Ids are opaque and made here (`voice_` + 20 hex digits); a client's id is only ever
//! looked up in the in-memory table, never joined into a path.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::RwLock;

use anyhow::{bail, ensure, Context, Result};

use vc_core::artifacts::{codes::CodeFrame, VoiceId};
use vc_core::workspace::Workspace;
use vc_generate::Voice;

const XVECTOR: &str = "speaker_embedding";
const REF_CODES: &str = "ref_codes";

/// One registered voice.
#[derive(Debug, Clone)]
pub struct RegisteredVoice {
    pub id: VoiceId,
    pub name: String,
    /// The reference transcript (in-context cloning), if one was given.
    pub transcript: Option<String>,
    /// Seconds since the Unix epoch.
    pub created: u64,
    pub xvector: Vec<f32>,
    pub ref_codes: Option<Vec<CodeFrame>>,
}

impl RegisteredVoice {
    /// The voice the synthesizer takes (docs/model.md §7).
    pub fn voice(&self) -> Voice {
        match (&self.ref_codes, &self.transcript) {
            (Some(codes), Some(text)) => Voice::Icl {
                xvector: self.xvector.clone(),
                ref_codes: codes.clone(),
                ref_text: text.clone(),
            },
            _ => Voice::XVector(self.xvector.clone()),
        }
    }

    pub fn mode(&self) -> &'static str {
        if self.ref_codes.is_some() {
            "in-context"
        } else {
            "x-vector"
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id.as_str(),
            "object": "voice",
            "name": self.name,
            "mode": self.mode(),
            "transcript": self.transcript,
            "reference_frames": self.ref_codes.as_ref().map(|c| c.len()),
            "created_at": self.created,
        })
    }

    fn to_bytes(&self, model: &str) -> Result<Vec<u8>> {
        let x: Vec<u8> = self.xvector.iter().flat_map(|v| v.to_le_bytes()).collect();
        let codes: Option<Vec<u8>> = self.ref_codes.as_ref().map(|c| {
            c.iter()
                .flat_map(|f| f.0)
                .flat_map(u32::to_le_bytes)
                .collect()
        });
        let mut tensors = vec![(
            XVECTOR,
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![self.xvector.len()],
                &x,
            )?,
        )];
        if let (Some(bytes), Some(c)) = (&codes, &self.ref_codes) {
            tensors.push((
                REF_CODES,
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::U32,
                    vec![c.len(), 16],
                    bytes,
                )?,
            ));
        }
        let mut meta = HashMap::new();
        meta.insert("name".to_string(), self.name.clone());
        meta.insert("created".to_string(), self.created.to_string());
        meta.insert("model".to_string(), model.to_string());
        if let Some(t) = &self.transcript {
            meta.insert("transcript".to_string(), t.clone());
        }
        Ok(safetensors::serialize(tensors, Some(meta))?)
    }

    fn read(path: &Path, id: VoiceId, dim: usize) -> Result<RegisteredVoice> {
        let bytes = std::fs::read(path)?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)?;
        let st = safetensors::SafeTensors::deserialize(&bytes)?;
        let meta = meta.metadata().clone().unwrap_or_default();
        let x = st.tensor(XVECTOR)?;
        ensure!(
            x.dtype() == safetensors::Dtype::F32 && x.shape() == [dim],
            "its x-vector has shape {:?}, this model's talker takes {dim} values (another model \
             made it)",
            x.shape()
        );
        let xvector = x
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let ref_codes = match st.tensor(REF_CODES) {
            Ok(t) => {
                ensure!(
                    t.dtype() == safetensors::Dtype::U32
                        && t.shape().len() == 2
                        && t.shape()[1] == 16,
                    "its reference codes have shape {:?}",
                    t.shape()
                );
                let v: Vec<u32> = t
                    .data()
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                Some(
                    v.chunks_exact(16)
                        .map(|c| CodeFrame(c.try_into().expect("16 codes")))
                        .collect(),
                )
            }
            Err(_) => None,
        };
        let transcript = meta.get("transcript").cloned();
        ensure!(
            ref_codes.is_some() == transcript.is_some(),
            "it has reference codes without a transcript or the reverse"
        );
        Ok(RegisteredVoice {
            id,
            name: meta.get("name").cloned().unwrap_or_default(),
            transcript,
            created: meta
                .get("created")
                .and_then(|c| c.parse().ok())
                .unwrap_or(0),
            xvector,
            ref_codes,
        })
    }
}

/// The registered voices of one workspace for one model.
pub struct Registry {
    ws: Workspace,
    model: String,
    dim: usize,
    entries: RwLock<BTreeMap<VoiceId, RegisteredVoice>>,
}

impl Registry {
    /// Loads `serve/voices/*.safetensors`; files of another model (x-vector size) or that do
    /// not read are skipped with a warning naming them.
    pub fn open(ws: &Workspace, model: &str, dim: usize) -> Result<Self> {
        let dir = ws.serve_voices_dir();
        let mut entries = BTreeMap::new();
        if dir.is_dir() {
            let listing = std::fs::read_dir(&dir)
                .with_context(|| format!("cannot list {}", dir.display()))?;
            for item in listing {
                let path = item?.path();
                let Some(id) = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".safetensors"))
                    .and_then(VoiceId::parse)
                else {
                    continue;
                };
                match RegisteredVoice::read(&path, id.clone(), dim) {
                    Ok(e) => {
                        entries.insert(id, e);
                    }
                    Err(e) => tracing::warn!("skipping voice {}: {e:#}", ws.display(&path)),
                }
            }
        }
        Ok(Registry {
            ws: ws.clone(),
            model: model.to_string(),
            dim,
            entries: RwLock::new(entries),
        })
    }

    /// The voice with id `id`; `None` also for a string that is no voice id.
    pub fn get(&self, id: &str) -> Option<RegisteredVoice> {
        let id = VoiceId::parse(id)?;
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    pub fn list(&self) -> Vec<RegisteredVoice> {
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// How many voices are registered.
    pub fn len(&self) -> usize {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers a voice: written to disk first, then visible. Refused with [`Full`] when
    /// `limit` voices are already there.
    pub fn add(
        &self,
        name: String,
        transcript: Option<String>,
        xvector: Vec<f32>,
        ref_codes: Option<Vec<CodeFrame>>,
        limit: usize,
    ) -> Result<RegisteredVoice> {
        ensure!(
            xvector.len() == self.dim,
            "x-vector of {} values for a talker of width {}",
            xvector.len(),
            self.dim
        );
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= limit {
            return Err(Full(limit).into());
        }
        let id = loop {
            let id = VoiceId::random();
            if !entries.contains_key(&id) {
                break id;
            }
        };
        let entry = RegisteredVoice {
            id: id.clone(),
            name,
            transcript,
            created,
            xvector,
            ref_codes,
        };
        let path = self.ws.serve_voice_file(&id);
        vc_core::fsutil::write_atomic(&path, &entry.to_bytes(&self.model)?)
            .with_context(|| format!("cannot write {}", self.ws.display(&path)))?;
        entries.insert(id, entry.clone());
        Ok(entry)
    }

    /// Deletes a voice; false when there is none with that id.
    pub fn remove(&self, id: &str) -> Result<bool> {
        let Some(id) = VoiceId::parse(id) else {
            return Ok(false);
        };
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = entries.get(&id) else {
            return Ok(false);
        };
        let path = self.ws.serve_voice_file(&entry.id);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => bail!("cannot delete {}: {e}", self.ws.display(&path)),
        }
        entries.remove(&id);
        Ok(true)
    }
}

/// The store holds its limit of voices (`serve.max_voices`).
#[derive(Debug)]
pub struct Full(pub usize);

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "this server already holds {} registered voices (serve.max_voices); delete one \
             (DELETE /v1/voices/ID) before registering another",
            self.0
        )
    }
}

impl std::error::Error for Full {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_registry_refuses_another_voice() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open(dir.path()).unwrap();
        let reg = Registry::open(&ws, "m", 2).unwrap();
        reg.add("a".into(), None, vec![1.0, 2.0], None, 1).unwrap();
        let e = reg
            .add("b".into(), None, vec![1.0, 2.0], None, 1)
            .unwrap_err();
        assert!(e.downcast_ref::<Full>().is_some(), "{e}");
        assert_eq!(reg.len(), 1);
    }

    #[test]
    fn voices_survive_a_restart_and_ids_are_opaque() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open(dir.path()).unwrap();
        let reg = Registry::open(&ws, "m", 4).unwrap();
        let a = reg
            .add("a".into(), None, vec![1.0, 2.0, 3.0, 4.0], None, 8)
            .unwrap();
        let frames = vec![CodeFrame([7; 16]), CodeFrame([9; 16])];
        let b = reg
            .add(
                "b".into(),
                Some("hello".into()),
                vec![0.5; 4],
                Some(frames.clone()),
                8,
            )
            .unwrap();
        assert_ne!(a.id, b.id);
        assert!(reg.get("../etc/passwd").is_none() && !reg.remove("voice_XYZ").unwrap());
        let again = Registry::open(&ws, "m", 4).unwrap();
        assert_eq!(again.list().len(), 2);
        assert_eq!(
            again.get(a.id.as_str()).unwrap().xvector,
            vec![1.0, 2.0, 3.0, 4.0]
        );
        let got = again.get(b.id.as_str()).unwrap();
        assert_eq!(got.ref_codes.as_deref(), Some(&frames[..]));
        assert_eq!(got.mode(), "in-context");
        // Another model's width: skipped.
        assert_eq!(Registry::open(&ws, "m", 8).unwrap().list().len(), 0);
        assert!(again.remove(a.id.as_str()).unwrap());
        assert!(!again.remove(a.id.as_str()).unwrap());
        assert!(!again.remove("voice_nonexistent").unwrap());
        assert_eq!(Registry::open(&ws, "m", 4).unwrap().list().len(), 1);
    }
}
