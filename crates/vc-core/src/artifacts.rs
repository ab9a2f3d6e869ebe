//! The files the pipeline steps exchange, one type and one reader/writer each
//! (docs/architecture.md §4): manifest rows (`data/train.jsonl`), audio code frames
//! (`audio_codes` in the manifest, `{"codes": …}` files), the speaker file (an x-vector), the
//! adapter directory of a LoRA export, the id of a voice registered with the server, and the
//! Whisper model `prep` used.
//! Where each file lives is [`crate::workspace::Workspace`]'s business, not theirs.

pub mod adapter;
pub mod codes;
pub mod manifest;
pub mod prep_whisper;
pub mod speaker;
mod voice_id;

pub use voice_id::VoiceId;
