//! A model's files with changes put on them at load time (docs/training.md §13): an adapter
//! directory on its base model, or a training checkpoint's trained tensors and speakers on the
//! base it was trained from — the tensors `voiceclone export` would have written, as a
//! [`WeightOverlay`], and the CustomVoice `config.json` entries of the speakers.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};

use super::files::ModelFiles;
use super::overlay::{WeightOverlay, CODEC_EMBEDDING, SPEAKER_ROW};
use vc_core::artifacts::adapter::AdapterDir;

impl ModelFiles {
    /// These files with `adapter` put on them: a Base model becomes the CustomVoice model the
    /// merged export of the same checkpoint is (its speakers in `spk_id`, rows 3000, 3001, …).
    pub fn with_adapter(self, adapter: &AdapterDir) -> Result<Self> {
        let what = format!("the adapter {}", adapter.dir.display());
        let shape_of = |name: &str| -> Result<Vec<usize>> {
            self.checkpoint
                .tensor(name)
                .map(|t| t.shape.clone())
                .with_context(|| {
                    format!(
                        "{what} changes {name}, which {} does not have",
                        self.source.describe()
                    )
                })
        };
        let mut overlay = WeightOverlay::default();
        for (name, v) in &adapter.saved {
            if shape_of(name)? != v.shape {
                bail!(
                    "{what}: {name} is {:?}, the model's {:?}",
                    v.shape,
                    shape_of(name)?
                );
            }
            overlay.replace(name, v.data.clone());
        }
        for (name, f) in &adapter.factors {
            let shape = shape_of(name)?;
            if shape != [f.b.shape[0], f.a.shape[1]] {
                bail!(
                    "{what}: the factors of {name} make {:?}, the matrix is {shape:?}",
                    [f.b.shape[0], f.a.shape[1]]
                );
            }
            let t = |v: &vc_core::artifacts::adapter::Values| {
                Tensor::from_vec(v.data.clone(), v.shape.as_slice(), &Device::Cpu)
            };
            overlay.add_low_rank(name, t(&f.a)?, t(&f.b)?, adapter.scale());
        }
        self.as_custom_voice(overlay, &adapter.speakers, &what)
    }

    /// These files as the CustomVoice model an export makes of them (docs/training.md §10):
    /// the tensors `overlay` changes, each of `speakers` (name, x-vector) in its codec-embedding
    /// row (3000, 3001, … in order, rounded to bf16 as the export stores it) and in
    /// `spk_id`. `what` names the source of the changes in errors.
    pub fn as_custom_voice(
        mut self,
        mut overlay: WeightOverlay,
        speakers: &[(String, Vec<f32>)],
        what: &str,
    ) -> Result<Self> {
        if self.config.tts_model_type != "base" {
            bail!(
                "{what} goes on a Base model, but {} is a {} model",
                self.source.describe(),
                self.config.tts_model_type
            );
        }
        let hidden = self.config.talker_config.hidden_size;
        let vocab = self.config.talker_config.vocab_size;
        if speakers.is_empty() || SPEAKER_ROW + speakers.len() > vocab {
            bail!(
                "{what} holds {} speakers; rows {SPEAKER_ROW}..{vocab} hold at most {}",
                speakers.len(),
                vocab.saturating_sub(SPEAKER_ROW)
            );
        }
        let mut rows = Vec::new();
        let tc = &mut self.config.talker_config;
        for (i, (name, x)) in speakers.iter().enumerate() {
            if x.len() != hidden {
                bail!(
                    "{what}: the x-vector of {name:?} has {} values, the model needs {hidden}",
                    x.len()
                );
            }
            let row = SPEAKER_ROW + i;
            rows.push((
                row,
                x.iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect(),
            ));
            tc.spk_id.insert(name.clone(), row as u32);
            tc.spk_is_dialect
                .insert(name.clone(), serde_json::Value::Bool(false));
        }
        overlay.set_rows(CODEC_EMBEDDING, rows);
        self.config.tts_model_type = "custom_voice".into();
        self.overlay = Some(Arc::new(overlay));
        Ok(self)
    }
}
