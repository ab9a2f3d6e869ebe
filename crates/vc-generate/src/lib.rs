//! Speech synthesis with a loaded Qwen3-TTS model: prompt layouts (docs/model.md §6), the sampling
//! rules and frame loop of the official generator (docs/model.md §5.2, §5.4, §7), long-text
//! splitting, and the voice-clone / custom-voice pipelines that turn frames into 24 kHz audio.
//!
//! | module | what |
//! |---|---|
//! | [`prompt`] | the talker's input for one utterance |
//! | [`sampling`] | the official generator's token choice |
//! | [`talker_loop`] | the frame loop for a batch that starts and ends together |
//! | [`continuous_batch`] | the frame loop for rows that join and leave a running batch |
//! | [`text_split`] | long texts cut into chunks the model speaks well |
//! | [`synthesizer`] | text in, 24 kHz audio out: the voice-clone and custom-voice pipelines |
//! | [`precision`] | the number formats of inference (`speak.precision`) and what `auto` picks |
//! | [`runaway`] | the guards that stop a chunk that misses its end or loops |
//! | [`streaming`], [`audio_chunks`] | one request spoken as it is generated, its audio in growing chunks |

mod audio_chunks;
pub mod continuous_batch;
mod precision;
pub mod prompt;
pub mod runaway;
pub mod sampling;
pub mod streaming;
mod synthesizer;
pub mod talker_loop;
pub mod text_split;

pub use audio_chunks::AudioChunks;
pub use precision::Precision;
pub use synthesizer::{DecodeOptions, Request, RowPlan, Speech, Synthesizer, Voice};
