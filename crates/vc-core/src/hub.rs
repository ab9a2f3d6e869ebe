//! Model resolution: a local directory or file, or a Hugging Face hub repository through
//! `hf-hub` with its normal cache (`HF_HOME`). `HF_HUB_OFFLINE=1` uses the cache only and a
//! missing file is an error that names it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf_hub::{Cache, Repo, RepoType};

/// Where a model lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A directory in the official layout (or, for single-file models, the file itself).
    Local(PathBuf),
    /// A hub model repository, e.g. `Qwen/Qwen3-TTS-12Hz-1.7B-Base`.
    Hub { repo: String },
}

impl ModelSource {
    /// A spec naming an existing path is local; otherwise it must look like `owner/name`.
    pub fn parse(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        if path.exists() {
            return Ok(ModelSource::Local(path.to_path_buf()));
        }
        if looks_like_repo_id(spec) {
            return Ok(ModelSource::Hub {
                repo: spec.to_string(),
            });
        }
        bail!(
            "model {spec:?} is neither an existing local path nor a hub repository id (owner/name)"
        )
    }

    /// A stable description for checkpoints and exports: the absolute directory or the hub
    /// repository id.
    pub fn stable_spec(&self) -> String {
        match self {
            ModelSource::Local(p) => std::path::absolute(p)
                .unwrap_or_else(|_| p.clone())
                .display()
                .to_string(),
            ModelSource::Hub { repo } => repo.clone(),
        }
    }

    /// The path of `file` inside this model, downloading it if needed.
    pub fn file(&self, file: &str) -> Result<PathBuf> {
        match self {
            ModelSource::Local(dir) => {
                let path = dir.join(file);
                if !path.is_file() {
                    bail!("model directory {} has no file {file}", dir.display());
                }
                Ok(path)
            }
            ModelSource::Hub { repo } => hub_file(repo, file),
        }
    }

    /// Like [`ModelSource::file`], but `Ok(None)` when the model does not have the file.
    pub fn optional_file(&self, file: &str) -> Result<Option<PathBuf>> {
        match self {
            ModelSource::Local(dir) => {
                let path = dir.join(file);
                Ok(path.is_file().then_some(path))
            }
            ModelSource::Hub { .. } => match self.file(file) {
                Ok(p) => Ok(Some(p)),
                Err(e) if is_not_found(&e) => Ok(None),
                Err(e) => Err(e),
            },
        }
    }

    pub fn describe(&self) -> String {
        match self {
            ModelSource::Local(p) => p.display().to_string(),
            ModelSource::Hub { repo } => format!("hub repository {repo}"),
        }
    }

    /// The error for a model in which [`ModelSource::optional_file`] found none of `files`
    /// (alternatives, e.g. a single checkpoint file or a shard index). With the hub offline the
    /// files may well be in the repository, only not in the cache: the message says so and how
    /// to get them, instead of claiming the repository lacks them.
    pub fn none_of(&self, files: &[&str]) -> anyhow::Error {
        match (self, files) {
            (ModelSource::Hub { repo }, _) if offline() => {
                let (all, verb) = match files {
                    [.., last] if files.len() > 1 => (
                        format!("{} and {last}", files[..files.len() - 1].join(", ")),
                        "are",
                    ),
                    _ => (files.join(""), "is"),
                };
                anyhow::anyhow!(
                    "{all} of hub repository {repo} {verb} not in the local Hugging Face cache \
                     ({}), and the hub cannot be reached: HF_HUB_OFFLINE is set. {}",
                    Cache::from_env().path().display(),
                    not_cached_help(repo)
                )
            }
            (_, [one]) => anyhow::anyhow!("{} has no file {one}", self.describe()),
            (_, [a, b]) => anyhow::anyhow!("{} has neither {a} nor {b}", self.describe()),
            _ => anyhow::anyhow!("{} has none of {}", self.describe(), files.join(", ")),
        }
    }
}

/// How to get a hub model's files onto a machine that cannot reach the hub (docs/usage.md §1,
/// "Models and the hub").
fn not_cached_help(repo: &str) -> String {
    format!(
        "To fix: on a machine with network, fetch {repo} (any voiceclone command that uses it \
         does), copy that machine's Hugging Face cache here and point HF_HOME at it; or give a \
         local model directory instead of the hub id"
    )
}

/// A single-file model spec: a local file path, or `owner/repo/path/in/repo`.
pub fn resolve_single_file(spec: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        bail!("{spec} is not a file");
    }
    let mut parts = spec.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(owner), Some(name), Some(file))
            if !owner.is_empty()
                && !name.is_empty()
                && !file.is_empty()
                && looks_like_repo_id(&format!("{owner}/{name}")) =>
        {
            hub_file(&format!("{owner}/{name}"), file)
        }
        _ => bail!(
            "model file {spec:?} does not exist locally and is not a hub file reference \
             (owner/repo/file, e.g. ggerganov/whisper.cpp/ggml-base.bin)"
        ),
    }
}

/// A single-file model spec resolved without the network: the local file, or the hub file if
/// it is in the Hugging Face cache already; `None` otherwise.
pub fn cached_single_file(spec: &str) -> Option<PathBuf> {
    let path = Path::new(spec);
    if path.is_file() {
        return Some(path.to_path_buf());
    }
    let (repo, file) = spec.split_once('/').and_then(|(owner, rest)| {
        let (name, file) = rest.split_once('/')?;
        let repo = format!("{owner}/{name}");
        (looks_like_repo_id(&repo) && !file.is_empty()).then(|| (repo, file.to_string()))
    })?;
    Cache::from_env()
        .repo(Repo::new(repo, RepoType::Model))
        .get(&file)
}

fn looks_like_repo_id(spec: &str) -> bool {
    let mut parts = spec.split('/');
    let ok = |s: Option<&str>| {
        s.is_some_and(|s| {
            !s.is_empty()
                && !s.starts_with('.')
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
    };
    ok(parts.next()) && ok(parts.next()) && parts.next().is_none()
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| {
            let v = v.trim().to_ascii_lowercase();
            !v.is_empty() && v != "0" && v != "false" && v != "no"
        })
        .unwrap_or(false)
}

#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct NotFound {
    message: String,
}

fn is_not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<NotFound>().is_some()
}

fn hub_file(repo_id: &str, file: &str) -> Result<PathBuf> {
    let cache = Cache::from_env();
    let repo = Repo::new(repo_id.to_string(), RepoType::Model);
    if let Some(path) = cache.repo(repo.clone()).get(file) {
        return Ok(path);
    }
    if offline() {
        return Err(NotFound {
            message: format!(
                "{file} of hub repository {repo_id} is not in the local Hugging Face cache ({}), \
                 and the hub cannot be reached: HF_HUB_OFFLINE is set. {}",
                cache.path().display(),
                not_cached_help(repo_id)
            ),
        }
        .into());
    }
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .build()
        .context("cannot set up the Hugging Face hub client")?;
    match api.repo(repo).download(file) {
        Ok(path) => Ok(path),
        // hf-hub boxes ureq's status errors; their text is all we can inspect.
        Err(e @ hf_hub::api::sync::ApiError::RequestError(_)) if e.to_string().contains("404") => {
            Err(NotFound {
                message: format!("hub repository {repo_id} has no file {file}"),
            }
            .into())
        }
        // The cache was looked at first: pointing HF_HUB_OFFLINE at it would not help.
        Err(e) => bail!(
            "{file} of hub repository {repo_id} is not in the local Hugging Face cache ({}) and \
             cannot be downloaded: {}. {}",
            cache.path().display(),
            distinct_causes(&e),
            not_cached_help(repo_id)
        ),
    }
}

/// An error and its sources as one line, each message once: the hub client's errors repeat
/// their source's text in their own (a DNS failure read three times over).
fn distinct_causes(e: &dyn std::error::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(err) = next {
        let msg = err.to_string();
        if !parts.iter().any(|p| p.contains(msg.trim())) {
            // A later, longer message that contains an earlier one replaces it.
            parts.retain(|p| !msg.contains(p.as_str()));
            parts.push(msg);
        }
        next = err.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_repeated_in_its_wrapper_is_said_once() {
        #[derive(Debug)]
        struct E(String, Option<Box<E>>);
        impl std::fmt::Display for E {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl std::error::Error for E {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let dns = "failed to lookup address information";
        let e = E(
            format!("request error: https://h/x: Dns Failed: {dns}"),
            Some(Box::new(E(
                format!("https://h/x: Dns Failed: {dns}"),
                Some(Box::new(E(dns.into(), None))),
            ))),
        );
        let text = distinct_causes(&e);
        assert_eq!(text.matches(dns).count(), 1, "{text}");
        assert_eq!(text.matches("https://h/x").count(), 1, "{text}");
    }

    #[test]
    fn repo_ids_are_recognised() {
        assert!(looks_like_repo_id("Qwen/Qwen3-TTS-12Hz-1.7B-Base"));
        assert!(!looks_like_repo_id("just-a-name"));
        assert!(!looks_like_repo_id("a/b/c"));
        assert!(!looks_like_repo_id("./local/dir"));
        assert!(ModelSource::parse("no such thing").is_err());
    }
}
