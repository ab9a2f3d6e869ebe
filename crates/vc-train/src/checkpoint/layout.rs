//! The names inside `checkpoints/` (docs/training.md §7): a checkpoint's directory for its
//! step, its index and per-rank files, its copy of the speaker file(s), and `latest`. Apart
//! from the checkpoint code that writes and reads them, so that what only needs to find a
//! checkpoint (the choice of the best one, [`crate::selection`]) does not depend on it.

use std::path::{Path, PathBuf};

/// The file naming the newest complete checkpoint.
pub const LATEST: &str = "latest";
/// A checkpoint's index: what it holds and how its rows are split over the ranks.
pub const INDEX: &str = "index.json";

/// The copy of the speaker file kept in every checkpoint of one unnamed speaker (what the
/// export uses).
pub fn speaker_file(dir: &Path) -> PathBuf {
    dir.join("speaker.safetensors")
}

/// The x-vectors of a checkpoint of named speakers (docs/training.md §7.1): a speaker table
/// file ([`vc_core::artifacts::speaker::read_table`]).
pub fn speakers_file(dir: &Path) -> PathBuf {
    dir.join("speakers.safetensors")
}

/// The directory of the checkpoint of `step`.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:07}")
}

/// The rows rank `rank` holds of every trained tensor and of its optimizer state.
pub fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}
