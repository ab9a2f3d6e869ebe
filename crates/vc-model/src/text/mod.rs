//! Text side of Qwen3-TTS (docs/model.md §3): the Qwen2 byte-level BPE tokenizer that the official
//! `Qwen3TTSProcessor` wraps, and the chat-style prompt strings of docs/model.md §3.2 with the id
//! slices the talker consumes.
//!
//! The tokenizer is built from the model directory through [`crate::files::TokenizerFiles`],
//! i.e. the same resolution a hub download takes.

mod prompt;
mod tokenizer;

pub use prompt::{assistant_text, instruct_text, ref_text, AssistantPrompt, RefPrompt};
pub use tokenizer::{TextTokenizer, QWEN2_PRETOKENIZE_REGEX};
