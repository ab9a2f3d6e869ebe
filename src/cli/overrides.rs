//! The builder from a subcommand's flags to its config overrides, shared by every argument type:
//! a flag that mirrors a config key becomes an [`Override`], the last configuration layer
//! (docs/architecture.md §5), and a path given as a flag is made absolute so it resolves as a
//! config file's path does.

use toml::Value;
use vc_core::config::Override;

/// Flags name paths relative to the current directory, config files relative to the workspace:
/// make a flag's existing path absolute so both resolve the same way.
pub(super) fn absolutize_if_exists(v: &str) -> String {
    let p = std::path::Path::new(v);
    if p.exists() {
        std::path::absolute(p)
            .map(|a| a.to_string_lossy().into_owned())
            .unwrap_or_else(|_| v.to_string())
    } else {
        v.to_string()
    }
}

/// The config overrides of one subcommand's flags: each call adds an [`Override`] when its flag
/// was given.
#[derive(Default)]
pub(super) struct Overrides(pub(super) Vec<Override>);

impl Overrides {
    pub(super) fn set(
        mut self,
        key: &'static str,
        flag: &'static str,
        v: Option<impl Into<Value>>,
    ) -> Self {
        if let Some(v) = v {
            self.0.push(Override::new(key, flag, v));
        }
        self
    }

    /// A model or file given as a path or hub id: an existing path is made absolute.
    pub(super) fn path(self, key: &'static str, flag: &'static str, v: &Option<String>) -> Self {
        self.set(key, flag, v.as_deref().map(absolutize_if_exists))
    }

    pub(super) fn count(self, key: &'static str, flag: &'static str, v: Option<usize>) -> Self {
        self.set(key, flag, v.map(|v| v as i64))
    }

    /// A seed (u64) as the TOML integer it is written as.
    pub(super) fn seed(self, key: &'static str, flag: &'static str, v: Option<u64>) -> Self {
        self.set(key, flag, v.map(|v| v.min(i64::MAX as u64) as i64))
    }

    /// A switch that sets `key` to `value` when given.
    pub(super) fn flag(
        self,
        key: &'static str,
        flag: &'static str,
        on: bool,
        value: impl Into<Value>,
    ) -> Self {
        self.set(key, flag, on.then_some(value))
    }
}

impl From<Overrides> for Vec<Override> {
    fn from(o: Overrides) -> Self {
        o.0
    }
}
