//! Training checkpoints (docs/training.md §7):
//!
//! ```text
//! checkpoints/
//!   step-0000120/
//!     rank-00000.safetensors   fp32 rows of every trained tensor: master.NAME, exp_avg.NAME,
//!                              exp_avg_sq.NAME (one file per rank; one rank on a single device)
//!     index.json               world size, step, data cursor + RNG state, what the run is
//!                              (model identity, trained set, layout), per-tensor shape and
//!                              row ranges per rank
//!   latest                     "step-0000120": the newest complete checkpoint
//! ```
//! A checkpoint is written into `.tmp-step-…` and renamed into place once complete; `latest`
//! is updated after that, and older checkpoints beyond `keep` are deleted last. A run killed at
//! any point leaves the previous checkpoint intact and `latest` naming a complete one.

mod identity;
mod index;
mod layout;
mod recovery;
mod row_reader;
pub mod safetensors_stream;
mod writer;

pub use identity::{read_speakers, Identity, ModelIdentity, SpeakerId, SpeakerSnapshot};
pub use index::{read_index, write_selection, Index, OptimizerInfo, ParamInfo, RankRows, RngInfo};
pub use layout::{rank_file, speaker_file, speakers_file, step_dir_name, INDEX, LATEST};
pub use recovery::{find_latest, list, prune, recover, validate, Damaged, Recovery};
pub use row_reader::RowReader;
pub use writer::{save, write_state, write_tensors, PendingCheckpoint, TrainingState};

pub const FORMAT: &str = "voiceclone-train-checkpoint";
pub const VERSION: u32 = 1;
/// Version of the batch layout (docs/model.md §10.2) and objective (docs/model.md §10.3); part
/// of the identity of a run, stored in every checkpoint: the string itself must not change.
/// doc-refs: allow-next-line
pub const OBJECTIVE: &str = "qwen3-tts-12hz sft layout §10.2 + corrected objective §10.3, v1";

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::fs;
    use std::path::{Path, PathBuf};

    use anyhow::Result;
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::hooks::NoHooks;
    use crate::hooks::{CheckpointPhase, TrainHooks};
    use crate::sampler::Cursor;

    fn index(step: usize) -> Index {
        let model = ModelIdentity {
            base: "m".into(),
            config_sha256: "c".into(),
            weights_sha256: "w".into(),
        };
        let identity = Identity {
            model,
            trained_sha256: "t".into(),
            trained_tensors: 0,
            objective: OBJECTIVE.into(),
            batch_size: 1,
            shuffle: false,
            seed: 0,
            speaker_sha256: "s".into(),
            speakers: Vec::new(),
            speaker_balance: false,
            lora: None,
            heldout: None,
        };
        Index {
            format: FORMAT.into(),
            version: VERSION,
            world_size: 1,
            step,
            epoch: 0,
            cursor: Cursor {
                epoch: 0,
                batch: step,
                rng_state: 0,
            },
            rng: RngInfo {
                algorithm: "splitmix64".into(),
                state: 0,
            },
            config_digest: identity.digest(),
            identity,
            data_sha256: "d".into(),
            optimizer: OptimizerInfo {
                name: "adamw".into(),
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
                step: step as u64,
                state: vc_core::config::OptimizerState::Fp32,
            },
            loss: None,
            selection: None,
            params: BTreeMap::new(),
        }
    }

    /// A checkpoint without tensors whose rank file carries `content` in its metadata.
    fn write(root: &Path, step: usize, content: &str, hooks: &dyn TrainHooks) -> Result<PathBuf> {
        let p = PendingCheckpoint::begin(root, step, "test")?;
        let meta = std::collections::HashMap::from([("content".to_string(), content.to_string())]);
        let empty: Vec<(&str, safetensors::tensor::TensorView)> = Vec::new();
        fs::write(
            p.dir.join(rank_file(0)),
            safetensors::serialize(empty, Some(meta))?,
        )?;
        fs::write(speaker_file(&p.dir), b"x")?;
        p.commit(&index(step), 3, hooks)
    }

    /// Panics (like a crash: no cleanup runs) at one phase.
    struct CrashAt(CheckpointPhase);
    impl TrainHooks for CrashAt {
        fn checkpoint(&self, _step: usize, phase: CheckpointPhase) {
            if phase == self.0 {
                panic!("simulated crash at {}", phase.name());
            }
        }
    }

    fn content_of_latest(root: &Path) -> String {
        let dir = find_latest(root).unwrap().expect("a checkpoint");
        validate(&dir).expect("the checkpoint is whole");
        let bytes = fs::read(dir.join(rank_file(0))).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        meta.metadata().as_ref().unwrap()["content"].clone()
    }

    #[test]
    fn a_crash_at_any_point_of_a_write_leaves_the_last_complete_checkpoint() {
        for resave in [false, true] {
            for phase in CheckpointPhase::ALL {
                let dir = tempfile::tempdir().unwrap();
                let root = dir.path().join("checkpoints");
                write(&root, 2, "step 2", &NoHooks).unwrap();
                if resave {
                    write(&root, 4, "step 4, first save", &NoHooks).unwrap();
                }
                let before = content_of_latest(&root);
                let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    write(&root, 4, "step 4, new save", &CrashAt(phase))
                }));
                let reached = crashed.is_err();
                // Only a re-save moves an old directory aside.
                assert_eq!(
                    reached,
                    resave || phase != CheckpointPhase::OldMovedAside,
                    "{phase:?}"
                );
                recover(&root).unwrap();
                let after = content_of_latest(&root);
                let expected = match phase {
                    _ if !reached => "step 4, new save",
                    CheckpointPhase::RankFilesWritten
                    | CheckpointPhase::IndexWritten
                    | CheckpointPhase::OldMovedAside => before.as_str(),
                    // In place but `latest` not yet updated: a fresh step is not committed yet,
                    // a re-saved one already replaced its directory.
                    CheckpointPhase::InPlace if !resave => "step 2",
                    CheckpointPhase::InPlace | CheckpointPhase::LatestWritten => "step 4, new save",
                };
                assert_eq!(after, expected, "resave {resave}, crash at {phase:?}");
                // Nothing temporary is left, and the next save works.
                let leftovers: Vec<_> = fs::read_dir(&root)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with('.'))
                    .collect();
                assert!(leftovers.is_empty(), "{leftovers:?}");
                write(&root, 6, "step 6", &NoHooks).unwrap();
                assert_eq!(content_of_latest(&root), "step 6");
            }
        }
    }

    #[test]
    fn speaker_sets_are_part_of_the_identity_and_kept_in_the_checkpoint() {
        let table = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let names = vec!["ann".to_string(), "bob".to_string()];
        let ids = SpeakerId::of(&names, &table).unwrap();
        assert_eq!(ids.len(), 2);
        assert_ne!(ids[0].sha256, ids[1].sha256);
        // One unnamed speaker: the identity JSON has no new keys.
        let single = index(1).identity;
        let json = serde_json::to_string(&single).unwrap();
        assert!(
            !json.contains("speakers") && !json.contains("speaker_balance"),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Identity>(&json).unwrap(), single);

        let named = Identity {
            speakers: ids.clone(),
            ..single.clone()
        };
        let e = named.check_compatible(&single).unwrap_err().to_string();
        assert!(
            e.contains("one unnamed speaker; the manifest now names the speakers ann, bob"),
            "{e}"
        );
        let e = single.check_compatible(&named).unwrap_err().to_string();
        assert!(e.contains("trained on the named speakers ann, bob"), "{e}");
        let three = Identity {
            speakers: SpeakerId::of(
                &["ann".into(), "bob".into(), "cy".into()],
                &Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &Device::Cpu).unwrap(),
            )
            .unwrap(),
            ..single.clone()
        };
        let e = three.check_compatible(&named).unwrap_err().to_string();
        assert!(
            e.contains("the speaker set changed: ann, bob then, ann, bob, cy now"),
            "{e}"
        );
        let mut moved = named.clone();
        moved.speakers[1].sha256 = "other".into();
        let e = moved.check_compatible(&named).unwrap_err().to_string();
        assert!(
            e.contains("the x-vector of speaker \"bob\" (data/speakers/bob.safetensors)"),
            "{e}"
        );
        let balanced = Identity {
            speaker_balance: true,
            ..named.clone()
        };
        let e = balanced.check_compatible(&named).unwrap_err().to_string();
        assert!(
            e.contains("train.speaker_balance was false, now true"),
            "{e}"
        );
        assert!(named.check_compatible(&named.clone()).is_ok());

        // The checkpoint's x-vector files: the single one in the speaker-file format.
        let dir = tempfile::tempdir().unwrap();
        let one = Tensor::new(&[[0.5f32, -1.0]], &Device::Cpu).unwrap();
        SpeakerSnapshot::new(&[], &one)
            .unwrap()
            .write(dir.path())
            .unwrap();
        assert_eq!(
            fs::read(speaker_file(dir.path())).unwrap(),
            vc_core::artifacts::speaker::to_bytes(&[0.5, -1.0], None).unwrap()
        );
        assert_eq!(
            read_speakers(dir.path(), &index(1)).unwrap(),
            vec![(None, vec![0.5, -1.0])]
        );
        SpeakerSnapshot::new(&ids, &table)
            .unwrap()
            .write(dir.path())
            .unwrap();
        let mut idx = index(1);
        idx.identity.speakers = ids;
        assert_eq!(
            read_speakers(dir.path(), &idx).unwrap(),
            vec![
                (Some("ann".to_string()), vec![1.0, 2.0]),
                (Some("bob".to_string()), vec![3.0, 4.0])
            ]
        );
        idx.identity.speakers.reverse();
        assert!(read_speakers(dir.path(), &idx).is_err());
    }
}
