//! The layering of a configuration (docs/architecture.md §5): built-in defaults, the
//! workspace's `voiceclone.toml`, `--config FILE`, flags; every layer checked against the
//! defaults' keys, types and choices before it is merged, and the origin of every value kept for
//! messages and `voiceclone config`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use toml::{Table, Value};

use super::schema::{
    Config, EmbedMode, MemoryKeys, MemoryPolicy, NonStreaming, Offload, OptimizerState,
    PrecisionSetting, Recompute, ReduceDtype, Select, Shard, TrainBackend,
};
use super::DEFAULT_TOML;

/// Keys whose string values name one of a fixed set (checked in every layer, so a typo is an
/// error naming the key, where it was set and the allowed values).
pub(super) const CHOICES: &[(&str, &[&str])] = &[
    ("speak.precision", PrecisionSetting::NAMES),
    ("speak.non_streaming", NonStreaming::NAMES),
    ("train.shard", Shard::NAMES),
    ("train.select", Select::NAMES),
    ("train.backend", TrainBackend::NAMES),
    ("train.optimizer_state", OptimizerState::NAMES),
    ("train.offload", Offload::NAMES),
    ("train.recompute", Recompute::NAMES),
    ("train.reduce_dtype", ReduceDtype::NAMES),
    ("train.memory", MemoryPolicy::NAMES),
    ("embed.mode", EmbedMode::NAMES),
];

/// Keys that take "auto" (their default), true or false.
const AUTO_OR_BOOL: &[&str] = &["train.samples"];
/// Keys whose default is a number and whose other values include a word.
const COUNT_OR_WORD: &[&str] = &["train.shard_group"];

/// Where a configuration value came from, for error messages and `voiceclone config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => write!(f, "built-in defaults"),
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Flag(flag) => write!(f, "command-line flag {flag}"),
        }
    }
}

/// The merged configuration together with the origin of every key.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub config: Config,
    pub sources: BTreeMap<String, Source>,
    merged: Table,
}

/// One command-line override: a dotted key, its value, and the flag that set it.
#[derive(Debug, Clone)]
pub struct Override {
    pub key: &'static str,
    pub value: Value,
    pub flag: &'static str,
}

impl Override {
    pub fn new(key: &'static str, flag: &'static str, value: impl Into<Value>) -> Self {
        Override {
            key,
            value: value.into(),
            flag,
        }
    }
}

/// Builds the configuration from the defaults, the workspace's config file (if present), an
/// explicit `--config` file (which must exist), and flag overrides, in that order.
pub fn resolve(
    workspace_file: PathBuf,
    explicit: Option<&Path>,
    overrides: &[Override],
) -> Result<Resolved> {
    let mut layers: Vec<(Table, Source)> = Vec::new();
    if workspace_file.is_file() {
        layers.push((read_table(&workspace_file)?, Source::File(workspace_file)));
    }
    if let Some(path) = explicit {
        if !path.is_file() {
            bail!("config file {} does not exist", path.display());
        }
        layers.push((read_table(path)?, Source::File(path.to_path_buf())));
    }
    for o in overrides {
        layers.push((
            dotted_table(o.key, o.value.clone()),
            Source::Flag(o.flag.to_string()),
        ));
    }
    resolve_layers(layers)
}

/// Merges already-parsed layers over the defaults; exposed for tests.
pub fn resolve_layers(layers: Vec<(Table, Source)>) -> Result<Resolved> {
    let defaults: Table = DEFAULT_TOML
        .parse()
        .context("the built-in configs/default.toml is not valid TOML")?;
    let mut merged = defaults.clone();
    let mut sources = BTreeMap::new();
    collect_keys(&defaults, "", &mut |key| {
        sources.insert(key, Source::Default);
    });
    for (layer, source) in layers {
        check_against_schema(&layer, &defaults, "", &source)?;
        // A value of the right kind may still not fit its setting (a port above 65535): try the
        // layer alone over the defaults, so the error names the file or flag that set it.
        let mut alone = defaults.clone();
        merge_into(&mut alone, layer.clone(), "", &source, &mut BTreeMap::new());
        Value::Table(alone).try_into::<Config>().map_err(|e| {
            anyhow::anyhow!(
                "invalid value in {source}: {}",
                e.to_string().trim().replace('\n', " ")
            )
        })?;
        merge_into(&mut merged, layer, "", &source, &mut sources);
    }
    let mut config: Config = Value::Table(merged.clone())
        .try_into()
        .context("internal error: the merged configuration does not match the schema")?;
    let set = |key: &str| sources.get(key).is_some_and(|s| *s != Source::Default);
    config.train.set_by_user = MemoryKeys {
        optimizer_state: set("train.optimizer_state"),
        offload: set("train.offload"),
        recompute: set("train.recompute"),
    };
    config.prep.whisper_model_set = set("prep.whisper_model");
    let resolved = Resolved {
        config,
        sources,
        merged,
    };
    resolved.validate()?;
    Ok(resolved)
}

/// Keys whose values are secrets: `voiceclone config` shows that they are set, not what they
/// are (a printed configuration ends up in terminals, logs and bug reports).
pub const SECRET_KEYS: &[&str] = &["serve.api_key"];

/// What `voiceclone config` prints instead of a secret that is set (still a TOML string).
pub const REDACTED: &str = "<redacted>";

impl Resolved {
    /// The resolved configuration as TOML, one comment per key naming its origin when it is not
    /// the built-in default; the values of [`SECRET_KEYS`] that are set are shown as
    /// [`REDACTED`].
    pub fn to_annotated_toml(&self) -> String {
        let mut out = String::new();
        for (section, value) in &self.merged {
            let Value::Table(table) = value else { continue };
            out.push_str(&format!("[{section}]\n"));
            for (key, v) in table {
                let full = format!("{section}.{key}");
                let secret = SECRET_KEYS.contains(&full.as_str())
                    && v.as_str().is_none_or(|s| !s.is_empty());
                let line = if secret {
                    format!("{key} = {}", Value::from(REDACTED))
                } else {
                    format!("{key} = {v}")
                };
                let note = if secret {
                    " (a secret: not printed)"
                } else {
                    ""
                };
                match self.sources.get(&full) {
                    Some(Source::Default) | None => out.push_str(&format!("{line}\n")),
                    Some(src) => out.push_str(&format!("{line}  # from {src}{note}\n")),
                }
            }
            out.push('\n');
        }
        out
    }

    pub(super) fn source_of(&self, key: &str) -> String {
        self.sources
            .get(key)
            .map(|s| s.to_string())
            .unwrap_or_else(|| Source::Default.to_string())
    }
}

fn read_table(path: &Path) -> Result<Table> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    text.parse::<Table>()
        .with_context(|| format!("config file {} is not valid TOML", path.display()))
}

/// `prep.jobs` = 4 -> `{prep = {jobs = 4}}`.
pub(super) fn dotted_table(key: &str, value: Value) -> Table {
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().unwrap_or(key);
    let mut table = Table::new();
    table.insert(last.to_string(), value);
    for part in parts.into_iter().rev() {
        let mut outer = Table::new();
        outer.insert(part.to_string(), Value::Table(table));
        table = outer;
    }
    table
}

fn join_key(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn collect_keys(table: &Table, prefix: &str, f: &mut dyn FnMut(String)) {
    for (k, v) in table {
        let key = join_key(prefix, k);
        match v {
            Value::Table(t) => collect_keys(t, &key, f),
            _ => f(key),
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a number",
        Value::Boolean(_) => "true or false",
        Value::Datetime(_) => "a date",
        Value::Array(_) => "a list",
        Value::Table(_) => "a table",
    }
}

fn check_against_schema(
    layer: &Table,
    schema: &Table,
    prefix: &str,
    source: &Source,
) -> Result<()> {
    for (k, v) in layer {
        let key = join_key(prefix, k);
        let Some(expected) = schema.get(k) else {
            let known: Vec<String> = schema.keys().map(|s| join_key(prefix, s)).collect();
            bail!(
                "unknown configuration key `{key}` in {source} (known keys here: {})",
                known.join(", ")
            );
        };
        // Keys whose default is "auto" and whose other values are true and false.
        let auto_or_bool = AUTO_OR_BOOL.contains(&key.as_str())
            && matches!((expected, v), (Value::String(_), Value::Boolean(_)));
        let count_or_word = COUNT_OR_WORD.contains(&key.as_str())
            && matches!((expected, v), (Value::Integer(_), Value::String(_)));
        let compatible = auto_or_bool
            || count_or_word
            || matches!(
                (expected, v),
                (Value::Table(_), Value::Table(_))
                    | (Value::String(_), Value::String(_))
                    | (Value::Integer(_), Value::Integer(_))
                    | (Value::Float(_), Value::Float(_) | Value::Integer(_))
                    | (Value::Boolean(_), Value::Boolean(_))
                    | (Value::Array(_), Value::Array(_))
            );
        if !compatible {
            bail!(
                "configuration key `{key}` in {source} must be {}, found {} ({v})",
                type_name(expected),
                type_name(v)
            );
        }
        if let (true, Value::String(value)) = (AUTO_OR_BOOL.contains(&key.as_str()), v) {
            if value != "auto" {
                bail!(
                    "invalid value for `{key}` (set in {source}): {value:?}; it is true, false or \
                     \"auto\""
                );
            }
        }
        if let (Some((_, names)), Value::String(value)) =
            (CHOICES.iter().find(|(k, _)| *k == key), v)
        {
            if !names.contains(&value.as_str()) {
                bail!(
                    "invalid value for `{key}` (set in {source}): {value:?} is not one of {}",
                    names.join(", ")
                );
            }
        }
        if let (Value::Integer(i), Value::Integer(_)) = (expected, v) {
            // All integer settings are counts: reject negatives here, where the key is known.
            if *i >= 0 && v.as_integer().is_some_and(|n| n < 0) {
                bail!("configuration key `{key}` in {source} must not be negative, found {v}");
            }
        }
        if let (Value::Table(s), Value::Table(t)) = (expected, v) {
            check_against_schema(t, s, &key, source)?;
        }
    }
    Ok(())
}

fn merge_into(
    base: &mut Table,
    layer: Table,
    prefix: &str,
    source: &Source,
    sources: &mut BTreeMap<String, Source>,
) {
    for (k, v) in layer {
        let key = join_key(prefix, &k);
        match (base.get_mut(&k), v) {
            (Some(Value::Table(b)), Value::Table(t)) => merge_into(b, t, &key, source, sources),
            (Some(Value::Float(_)), Value::Integer(i)) => {
                base.insert(k, Value::Float(i as f64));
                sources.insert(key, source.clone());
            }
            (_, v) => {
                base.insert(k, v);
                sources.insert(key, source.clone());
            }
        }
    }
}
