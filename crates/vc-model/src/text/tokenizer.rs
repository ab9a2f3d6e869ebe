//! The Qwen2 byte-level BPE tokenizer, built the way transformers builds `Qwen2TokenizerFast`
//! (docs/model.md §3.1).
//!
//! The official repositories ship `vocab.json` + `merges.txt` + `tokenizer_config.json` and may
//! not ship a `tokenizer.json` (docs/model.md §13 Q2). Without one, transformers converts the slow
//! tokenizer with its `Qwen2Converter`; [`TextTokenizer`] reproduces that conversion:
//! BPE (no unk token, no byte fallback) ← NFC normalizer ← Split(Qwen2 regex, isolated) then
//! ByteLevel(add_prefix_space from the config, use_regex=false) pre-tokenizers, a ByteLevel
//! decoder, and the added tokens of `tokenizer_config.json`'s `added_tokens_decoder` (so the
//! literal text `<|im_start|>` becomes id 151644). Nothing is added around the ids (Qwen2 has no
//! BOS/EOS template), matching `add_special_tokens` having no effect in the official processor.
//!
//! Pre-tokenizer regex (docs/model.md §3.1 caveat, docs/model.md §13 Q5): transformers 4.57.3 swaps
//! in a Mistral regex for *local-directory* loads whose `config.json` says `transformers_version`
//! in (4.57.2, 5.0). Hub-id loads, the documented way to use the models, keep the standard Qwen2
//! regex, and so do we, always. The fixtures record both tokenizations; the parity test pins the
//! standard one.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::files::TokenizerFiles;
use vc_core::hub::ModelSource;

/// transformers' `Qwen2Converter` pre-tokenizer pattern (also the slow `Qwen2Tokenizer`'s
/// `PRETOKENIZE_REGEX`). Digits are split one by one (`\p{N}`), unlike GPT-2's `\p{N}+`.
pub const QWEN2_PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Tokenizer classes whose files this module knows how to rebuild from vocab + merges.
const QWEN2_TOKENIZER_CLASSES: [&str; 2] = ["Qwen2Tokenizer", "Qwen2TokenizerFast"];

/// Text → token ids, exactly as the official processor computes them. Cloning shares one
/// tokenizer: it is never changed once built.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Arc<Tokenizer>,
    /// The largest id it can produce, found once when built.
    max_id: u32,
}

/// The files a tokenizer was built from, as they were: each path with its length and
/// modification time, so that a file replaced on disk is read again.
type FilesKey = Vec<(PathBuf, u64, Option<SystemTime>)>;

/// The tokenizers this process has built. Building one from the official files takes most of a
/// training rank's set-up (docs/performance.md §13): every trainer, synthesizer and sample
/// speaker of a process shares the first.
static BUILT: Mutex<Vec<(FilesKey, TextTokenizer)>> = Mutex::new(Vec::new());

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .finish()
    }
}

impl TextTokenizer {
    /// Resolves the tokenizer files of a model (local directory or hub repository) and builds
    /// the tokenizer; the path a real download takes.
    pub fn from_model(source: &ModelSource) -> Result<Self> {
        Self::from_files(&TokenizerFiles::resolve(source)?)
    }

    /// Builds the tokenizer of `files`, or shares the one this process already built from them
    /// while they are unchanged on disk.
    pub fn from_files(files: &TokenizerFiles) -> Result<Self> {
        let key = files_key(files);
        // Held while building: a second thread asking for the same files waits for the first
        // instead of building it again.
        let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, t)) = built.iter().find(|(k, _)| *k == key) {
            return Ok(t.clone());
        }
        let t = Self::build(files)?;
        if !key.is_empty() {
            // The same files as they were before a change are not asked for again.
            let paths = |k: &FilesKey| k.iter().map(|(p, ..)| p.clone()).collect::<Vec<_>>();
            built.retain(|(k, _)| paths(k) != paths(&key));
            built.push((key, t.clone()));
        }
        Ok(t)
    }

    fn build(files: &TokenizerFiles) -> Result<Self> {
        match files {
            TokenizerFiles::Json { tokenizer, config } => {
                Self::from_tokenizer_json(tokenizer, config.as_deref())
            }
            TokenizerFiles::VocabMerges {
                vocab,
                merges,
                config,
            } => Self::from_vocab_merges(vocab, merges, config),
        }
    }

    /// A serialized fast tokenizer. As transformers does, the added tokens of
    /// `tokenizer_config.json` are registered on top when they are not in it already.
    fn from_tokenizer_json(path: &Path, config: Option<&Path>) -> Result<Self> {
        let mut inner = Tokenizer::from_file(path)
            .map_err(|e| anyhow!("{}: not a usable tokenizer.json: {e}", path.display()))?;
        if let Some(config_path) = config {
            let config = TokenizerConfig::read(config_path)?;
            let added = config.added_tokens(config_path)?;
            let missing: Vec<AddedToken> = added
                .iter()
                .filter(|(_, t)| inner.token_to_id(&t.content).is_none())
                .map(|(_, t)| t.clone())
                .collect();
            inner
                .add_tokens(missing)
                .map_err(|e| anyhow!("{}: cannot add its added tokens: {e}", path.display()))?;
            check_added_ids(&inner, &added, config_path)?;
        }
        let max_id = inner.get_vocab(true).values().copied().max().unwrap_or(0);
        Ok(TextTokenizer {
            inner: Arc::new(inner),
            max_id,
        })
    }

    /// The `Qwen2Converter` conversion of the slow tokenizer files (see the module docs).
    fn from_vocab_merges(
        vocab_path: &Path,
        merges_path: &Path,
        config_path: &Path,
    ) -> Result<Self> {
        let config = TokenizerConfig::read(config_path)?;
        if let Some(class) = config.tokenizer_class.as_deref() {
            if !QWEN2_TOKENIZER_CLASSES.contains(&class) {
                bail!(
                    "{}: tokenizer_class {class:?} is not a Qwen2 tokenizer; only Qwen2Tokenizer(Fast) can be \
                     rebuilt from vocab.json + merges.txt (ship a tokenizer.json for other tokenizers)",
                    config_path.display()
                );
            }
        }
        let added = config.added_tokens(config_path)?;
        let mut vocab = read_vocab(vocab_path)?;
        // Give every added token its id from tokenizer_config.json by putting it in the model
        // vocabulary: the added-token registry then takes the model's id instead of numbering
        // tokens sequentially, so gaps in the id range cannot shift them.
        reserve_added_ids(&mut vocab, &added, vocab_path, config_path)?;
        let merges = read_merges(merges_path)?;
        // Every added token has its id in the vocabulary now (above).
        let max_id = vocab.values().copied().max().unwrap_or(0);
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| {
                anyhow!(
                    "{} does not fit {}: {e}",
                    merges_path.display(),
                    vocab_path.display()
                )
            })?;

        let split = Split::new(
            SplitPattern::Regex(QWEN2_PRETOKENIZE_REGEX.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| anyhow!("cannot compile the Qwen2 pre-tokenizer regex: {e}"))?;
        // use_regex=false: the Split above already did the GPT-2-style splitting; ByteLevel only
        // maps bytes to its printable alphabet. trim_offsets only affects offsets, not ids.
        let byte_level = ByteLevel::new(config.add_prefix_space.unwrap_or(false), true, false);

        let mut inner = Tokenizer::new(bpe);
        inner
            .with_normalizer(Some(NFC))
            .map_err(|e| anyhow!("cannot set the NFC normalizer: {e}"))?
            .with_pre_tokenizer(Some(Sequence::new(vec![split.into(), byte_level.into()])))
            .with_decoder(Some(ByteLevel::default()));
        inner
            .add_tokens(added.iter().map(|(_, t)| t.clone()))
            .map_err(|e| {
                anyhow!(
                    "{}: cannot add its added tokens: {e}",
                    config_path.display()
                )
            })?;
        check_added_ids(&inner, &added, config_path)?;
        Ok(TextTokenizer {
            inner: Arc::new(inner),
            max_id,
        })
    }

    /// Token ids of `text`, no special tokens added (docs/model.md §3.1). Literal special-token
    /// text (`<|im_start|>`, `<tts_pad>`, …) maps to its added-token id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.inner.encode_fast(text, false).map_err(|e| {
            let head: String = text.chars().take(40).collect();
            anyhow!("cannot tokenize {head:?}: {e}")
        })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids` (special tokens kept); for diagnostics and tests.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("cannot decode token ids: {e}"))
    }

    /// The id of one token (a vocabulary entry in byte-level form, or an added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The largest id the tokenizer can produce; must index the talker's text embedding.
    pub fn max_token_id(&self) -> u32 {
        self.max_id
    }
}

/// The identity of `files` on disk; empty (nothing shared) where one cannot be read, so that
/// building reports the error.
fn files_key(files: &TokenizerFiles) -> FilesKey {
    let paths: Vec<&Path> = match files {
        TokenizerFiles::Json { tokenizer, config } => std::iter::once(tokenizer.as_path())
            .chain(config.as_deref())
            .collect(),
        TokenizerFiles::VocabMerges {
            vocab,
            merges,
            config,
        } => vec![vocab, merges, config],
    };
    let mut key = Vec::with_capacity(paths.len());
    for p in paths {
        let Ok(meta) = std::fs::metadata(p) else {
            return Vec::new();
        };
        let path = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        key.push((path, meta.len(), meta.modified().ok()));
    }
    key
}

/// The parts of `tokenizer_config.json` that change tokenization.
#[derive(Debug, Deserialize)]
struct TokenizerConfig {
    #[serde(default)]
    added_tokens_decoder: BTreeMap<String, AddedTokenEntry>,
    #[serde(default)]
    add_prefix_space: Option<bool>,
    #[serde(default)]
    tokenizer_class: Option<String>,
}

/// One `added_tokens_decoder` entry; defaults are transformers' `AddedToken` defaults.
#[derive(Debug, Deserialize)]
struct AddedTokenEntry {
    content: String,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    /// transformers: `normalized = not special` when unset.
    #[serde(default)]
    normalized: Option<bool>,
    #[serde(default)]
    special: bool,
}

impl TokenizerConfig {
    fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid tokenizer config", path.display()))
    }

    /// `(id, token)` pairs sorted by id.
    fn added_tokens(&self, path: &Path) -> Result<Vec<(u32, AddedToken)>> {
        let mut out = Vec::with_capacity(self.added_tokens_decoder.len());
        for (key, entry) in &self.added_tokens_decoder {
            let id: u32 = key.parse().map_err(|_| {
                anyhow!(
                    "{}: added_tokens_decoder key {key:?} is not a token id",
                    path.display()
                )
            })?;
            if entry.content.is_empty() {
                bail!("{}: added token {id} has empty content", path.display());
            }
            let token = AddedToken::from(entry.content.clone(), entry.special)
                .single_word(entry.single_word)
                .lstrip(entry.lstrip)
                .rstrip(entry.rstrip)
                .normalized(entry.normalized.unwrap_or(!entry.special));
            out.push((id, token));
        }
        out.sort_by_key(|(id, _)| *id);
        Ok(out)
    }
}

fn read_vocab(path: &Path) -> Result<Vocab> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let map: Vocab = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a JSON object of token → id", path.display()))?;
    if map.is_empty() {
        bail!("{} is empty", path.display());
    }
    Ok(map)
}

/// Parses `merges.txt` as the slow `Qwen2Tokenizer` does: a first `#version` line and blank
/// lines are skipped, every other line is one `left right` pair, in rank order.
fn read_merges(path: &Path) -> Result<Merges> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut merges = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("#version")) {
            continue;
        }
        let mut parts = line.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {
                merges.push((a.to_string(), b.to_string()))
            }
            _ => bail!(
                "{}:{}: expected a merge \"left right\", found {line:?}",
                path.display(),
                i + 1
            ),
        }
    }
    if merges.is_empty() {
        bail!("{} has no merges", path.display());
    }
    Ok(merges)
}

fn reserve_added_ids(
    vocab: &mut Vocab,
    added: &[(u32, AddedToken)],
    vocab_path: &Path,
    config_path: &Path,
) -> Result<()> {
    let by_id: HashMap<u32, &str> = vocab.iter().map(|(t, &id)| (id, t.as_str())).collect();
    let mut reserved = Vec::new();
    for (id, token) in added {
        match (vocab.get(&token.content), by_id.get(id)) {
            (Some(&vid), _) if vid == *id => {}
            (Some(&vid), _) => bail!(
                "{}: added token {:?} has id {id}, but {} gives it id {vid}",
                config_path.display(),
                token.content,
                vocab_path.display()
            ),
            (None, Some(other)) => bail!(
                "{}: added token {:?} has id {id}, which {} already uses for {other:?}",
                config_path.display(),
                token.content,
                vocab_path.display()
            ),
            (None, None) => reserved.push((token.content.clone(), *id)),
        }
    }
    vocab.extend(reserved);
    Ok(())
}

fn check_added_ids(
    inner: &Tokenizer,
    added: &[(u32, AddedToken)],
    config_path: &Path,
) -> Result<()> {
    for (id, token) in added {
        let got = inner.token_to_id(&token.content);
        if got != Some(*id) {
            bail!(
                "{}: added token {:?} should have id {id} but the tokenizer gives it {got:?}",
                config_path.display(),
                token.content
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy byte-level vocabulary: enough to check the pipeline pieces without the real files.
    fn toy(dir: &Path, added: &str) -> TextTokenizer {
        let vocab = r#"{"a":0,"b":1,"c":2,"Ġ":3,"ab":4,"Ġab":5,"1":6,"2":7,"Ċ":8}"#;
        std::fs::write(dir.join("vocab.json"), vocab).unwrap();
        std::fs::write(dir.join("merges.txt"), "#version: 0.2\na b\nĠ ab\n").unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), added).unwrap();
        TextTokenizer::from_vocab_merges(
            &dir.join("vocab.json"),
            &dir.join("merges.txt"),
            &dir.join("tokenizer_config.json"),
        )
        .unwrap()
    }

    #[test]
    fn byte_level_bpe_with_added_tokens_at_their_ids() {
        let dir = tempfile::tempdir().unwrap();
        // Id 20 leaves a gap after the vocabulary (0..8): it must still be 20, not 9.
        let tok = toy(
            dir.path(),
            r#"{"added_tokens_decoder": {"20": {"content": "<|x|>", "special": true}}}"#,
        );
        assert_eq!(tok.encode("ab ab").unwrap(), vec![4, 5]);
        assert_eq!(
            tok.encode("12").unwrap(),
            vec![6, 7],
            "digits split one by one"
        );
        assert_eq!(tok.encode("ab<|x|>\n").unwrap(), vec![4, 20, 8]);
        assert_eq!(tok.encode("").unwrap(), Vec::<u32>::new());
        assert_eq!(tok.decode(&[5, 20]).unwrap(), " ab<|x|>");
        assert_eq!(tok.max_token_id(), 20);
    }

    /// One build per process for unchanged files; a file that changes on disk is read again,
    /// and files that cannot be built are not remembered.
    #[test]
    fn unchanged_files_share_one_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        toy(dir.path(), "{}");
        let files = TokenizerFiles::VocabMerges {
            vocab: dir.path().join("vocab.json"),
            merges: dir.path().join("merges.txt"),
            config: dir.path().join("tokenizer_config.json"),
        };
        let a = TextTokenizer::from_files(&files).unwrap();
        let b = TextTokenizer::from_files(&files).unwrap();
        assert!(Arc::ptr_eq(&a.inner, &b.inner));
        // A longer config (its length changes the key whatever the clock's resolution).
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"added_tokens_decoder": {"20": {"content": "<|x|>", "special": true}}}"#,
        )
        .unwrap();
        let c = TextTokenizer::from_files(&files).unwrap();
        assert!(!Arc::ptr_eq(&a.inner, &c.inner));
        assert_eq!((a.max_token_id(), c.max_token_id()), (8, 20));
        // The files' old build is not kept beside the new one.
        let kept = BUILT.lock().unwrap();
        let here = kept
            .iter()
            .filter(|(k, _)| {
                k.iter()
                    .any(|(p, ..)| p.starts_with(dir.path().canonicalize().unwrap()))
            })
            .count();
        assert_eq!(here, 1);
        drop(kept);
        std::fs::write(dir.path().join("merges.txt"), "#version: 0.2\nx y\n").unwrap();
        assert!(TextTokenizer::from_files(&files).is_err());
        assert!(TextTokenizer::from_files(&files).is_err());
    }

    #[test]
    fn bad_tokenizer_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        toy(dir.path(), "{}");
        let (v, m, c) = (
            dir.path().join("vocab.json"),
            dir.path().join("merges.txt"),
            dir.path().join("tokenizer_config.json"),
        );

        std::fs::write(
            &c,
            r#"{"added_tokens_decoder": {"3": {"content": "<|x|>", "special": true}}}"#,
        )
        .unwrap();
        let err = format!(
            "{:#}",
            TextTokenizer::from_vocab_merges(&v, &m, &c).unwrap_err()
        );
        assert!(
            err.contains("tokenizer_config.json") && err.contains("already uses"),
            "{err}"
        );

        std::fs::write(&c, r#"{"tokenizer_class": "LlamaTokenizer"}"#).unwrap();
        let err = format!(
            "{:#}",
            TextTokenizer::from_vocab_merges(&v, &m, &c).unwrap_err()
        );
        assert!(err.contains("LlamaTokenizer"), "{err}");

        std::fs::write(&c, "{}").unwrap();
        std::fs::write(&m, "#version: 0.2\na b c\n").unwrap();
        let err = format!(
            "{:#}",
            TextTokenizer::from_vocab_merges(&v, &m, &c).unwrap_err()
        );
        assert!(err.contains("merges.txt:2"), "{err}");

        std::fs::write(&m, "#version: 0.2\nx y\n").unwrap();
        let err = format!(
            "{:#}",
            TextTokenizer::from_vocab_merges(&v, &m, &c).unwrap_err()
        );
        assert!(
            err.contains("merges.txt") && err.contains("vocab.json"),
            "{err}"
        );

        std::fs::write(&v, "[1, 2]").unwrap();
        let err = format!(
            "{:#}",
            TextTokenizer::from_vocab_merges(&v, &m, &c).unwrap_err()
        );
        assert!(err.contains("vocab.json"), "{err}");
    }
}
