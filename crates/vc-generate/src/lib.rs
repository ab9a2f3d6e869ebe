//! Speech synthesis with a loaded Qwen3-TTS model: prompt layouts (docs/model.md §6), the sampling
//! rules and frame loop of the official generator (docs/model.md §5.2, §5.4, §7), long-text
//! splitting, and the voice-clone / custom-voice pipelines that turn frames into 24 kHz audio.

pub mod audio_chunks;
pub mod continuous_batch;
pub mod prompt;
pub mod sampling;
pub mod streaming;
pub mod synthesizer;
pub mod talker_loop;
pub mod text_split;

pub use audio_chunks::AudioChunks;
pub use synthesizer::{DecodeOptions, Precision, Request, RowPlan, Speech, Synthesizer, Voice};
