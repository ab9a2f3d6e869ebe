//! Prompt strings of the official wrapper (`qwen3_tts_model.py`, docs/model.md §3.2) and the fixed
//! slices of their token ids that the talker input uses (docs/model.md §6, §7.1).
//!
//! The slices are positional, exactly as in the official code (`input_id[:, :3]`,
//! `input_id[:, 3:-5]`, `ref_id[:, 3:-2]`); they are not re-derived from the text. A text that
//! merges with the surrounding prompt (e.g. one starting with a newline: `"\n\n"` is one token)
//! therefore shifts the slices the same way it does officially.

use anyhow::{ensure, Result};

use super::TextTokenizer;

/// `_build_assistant_text`: the synthesis target.
pub fn assistant_text(text: &str) -> String {
    format!("<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
}

/// `_build_ref_text`: the transcript of the reference clip (ICL voice clone).
pub fn ref_text(text: &str) -> String {
    format!("<|im_start|>assistant\n{text}<|im_end|>\n")
}

/// `_build_instruct_text`: a VoiceDesign/CustomVoice instruction (used whole).
pub fn instruct_text(text: &str) -> String {
    format!("<|im_start|>user\n{text}<|im_end|>\n")
}

/// Role tokens at the start of every assistant prompt (`<|im_start|>assistant\n`).
const ROLE_LEN: usize = 3;
/// `<|im_end|>\n<|im_start|>assistant\n` closing a synthesis target.
const ASSISTANT_TAIL_LEN: usize = 5;
/// `<|im_end|>\n` closing a reference transcript.
const REF_TAIL_LEN: usize = 2;

/// Token ids of [`assistant_text`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssistantPrompt {
    pub ids: Vec<u32>,
}

impl AssistantPrompt {
    /// `ids[:3]`: the role prefix, positions 0..2 of the talker input (docs/model.md §6).
    pub fn role(&self) -> &[u32] {
        &self.ids[..ROLE_LEN]
    }

    /// `ids[3:-5]`: the text tokens `T` (length Lt).
    pub fn text(&self) -> &[u32] {
        &self.ids[ROLE_LEN..self.ids.len() - ASSISTANT_TAIL_LEN]
    }
}

/// Token ids of [`ref_text`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefPrompt {
    pub ids: Vec<u32>,
}

impl RefPrompt {
    /// `ref_ids[3:-2]`: the reference transcript tokens (length Lr).
    pub fn text(&self) -> &[u32] {
        &self.ids[ROLE_LEN..self.ids.len() - REF_TAIL_LEN]
    }
}

impl TextTokenizer {
    /// Tokenizes the synthesis target `text` inside its prompt.
    pub fn assistant_prompt(&self, text: &str) -> Result<AssistantPrompt> {
        let ids = self.encode(&assistant_text(text))?;
        // The special tokens alone give 3 + 5 ids, so this only fails with a broken tokenizer.
        ensure!(
            ids.len() >= ROLE_LEN + ASSISTANT_TAIL_LEN,
            "assistant prompt tokenized to only {} ids",
            ids.len()
        );
        Ok(AssistantPrompt { ids })
    }

    /// Tokenizes a reference transcript inside its prompt.
    pub fn ref_prompt(&self, text: &str) -> Result<RefPrompt> {
        let ids = self.encode(&ref_text(text))?;
        ensure!(
            ids.len() >= ROLE_LEN + REF_TAIL_LEN,
            "reference prompt tokenized to only {} ids",
            ids.len()
        );
        Ok(RefPrompt { ids })
    }

    /// The ids of a whole instruction prompt.
    pub fn instruct_ids(&self, text: &str) -> Result<Vec<u32>> {
        self.encode(&instruct_text(text))
    }
}
