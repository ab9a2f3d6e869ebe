//! `generation_config.json`: the sampling defaults of docs/model.md §2.
//!
//! The official wrapper (`qwen3_tts_model.py::_merge_generate_kwargs`) takes each key from the
//! model's generation config and falls back to its own hard-coded value when the key is
//! missing; the fallbacks equal the shipped values except `max_new_tokens` (2048 instead of
//! 8192). A missing file means every key falls back. Unknown keys are ignored (the file also
//! carries transformers bookkeeping such as `transformers_version`).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

/// Sampling settings for the talker (code 0) and the code predictor (`subtalker_*`, codes 1..15).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    pub do_sample: bool,
    pub temperature: f64,
    /// 0 disables top-k filtering (transformers' convention).
    pub top_k: usize,
    pub top_p: f64,
    pub repetition_penalty: f64,
    pub subtalker_dosample: bool,
    pub subtalker_temperature: f64,
    pub subtalker_top_k: usize,
    pub subtalker_top_p: f64,
    pub max_new_tokens: usize,
}

impl Default for GenerationConfig {
    /// The wrapper's fallbacks (docs/model.md §2).
    fn default() -> Self {
        GenerationConfig {
            do_sample: true,
            temperature: 0.9,
            top_k: 50,
            top_p: 1.0,
            repetition_penalty: 1.05,
            subtalker_dosample: true,
            subtalker_temperature: 0.9,
            subtalker_top_k: 50,
            subtalker_top_p: 1.0,
            max_new_tokens: 2048,
        }
    }
}

impl GenerationConfig {
    /// Reads `generation_config.json`; errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let map = value
            .as_object()
            .ok_or_else(|| anyhow!("{}: expected a JSON object", path.display()))?;
        Self::from_map(map)
            .with_context(|| format!("{}: invalid generation config", path.display()))
    }

    /// Each present, non-null key overrides the fallback (`null` counts as missing).
    fn from_map(map: &Map<String, Value>) -> Result<Self> {
        let keys = Keys(map);
        let d = Self::default();
        let cfg = GenerationConfig {
            do_sample: keys.bool("do_sample")?.unwrap_or(d.do_sample),
            temperature: keys.f64("temperature")?.unwrap_or(d.temperature),
            top_k: keys.usize("top_k")?.unwrap_or(d.top_k),
            top_p: keys.f64("top_p")?.unwrap_or(d.top_p),
            repetition_penalty: keys
                .f64("repetition_penalty")?
                .unwrap_or(d.repetition_penalty),
            subtalker_dosample: keys
                .bool("subtalker_dosample")?
                .unwrap_or(d.subtalker_dosample),
            subtalker_temperature: keys
                .f64("subtalker_temperature")?
                .unwrap_or(d.subtalker_temperature),
            subtalker_top_k: keys.usize("subtalker_top_k")?.unwrap_or(d.subtalker_top_k),
            subtalker_top_p: keys.f64("subtalker_top_p")?.unwrap_or(d.subtalker_top_p),
            max_new_tokens: keys.usize("max_new_tokens")?.unwrap_or(d.max_new_tokens),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The checks transformers' `GenerationConfig.validate` / logits warpers would fail on.
    fn validate(&self) -> Result<()> {
        for (key, sample, t) in [
            ("temperature", self.do_sample, self.temperature),
            (
                "subtalker_temperature",
                self.subtalker_dosample,
                self.subtalker_temperature,
            ),
        ] {
            if sample && !(t > 0.0 && t.is_finite()) {
                bail!("{key} must be a positive number when sampling, got {t}");
            }
        }
        for (key, p) in [
            ("top_p", self.top_p),
            ("subtalker_top_p", self.subtalker_top_p),
        ] {
            if !(p > 0.0 && p <= 1.0) {
                bail!("{key} must be in (0, 1], got {p}");
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            bail!(
                "repetition_penalty must be a positive number, got {}",
                self.repetition_penalty
            );
        }
        if self.max_new_tokens == 0 {
            bail!("max_new_tokens must be at least 1");
        }
        Ok(())
    }
}

struct Keys<'a>(&'a Map<String, Value>);

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| anyhow!("{key} must be true or false, got {v}"))
            })
            .transpose()
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| anyhow!("{key} must be a number, got {v}"))
            })
            .transpose()
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| anyhow!("{key} must be a non-negative integer, got {v}"))
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<GenerationConfig> {
        GenerationConfig::from_map(
            serde_json::from_str::<Value>(json)
                .unwrap()
                .as_object()
                .unwrap(),
        )
    }

    #[test]
    fn shipped_values_and_fallbacks() {
        let shipped = parse(
            r#"{"do_sample": true, "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
                "subtalker_dosample": true, "subtalker_temperature": 0.9, "subtalker_top_k": 50,
                "subtalker_top_p": 1.0, "max_new_tokens": 8192, "transformers_version": "4.57.3"}"#,
        )
        .unwrap();
        assert_eq!(
            shipped,
            GenerationConfig {
                max_new_tokens: 8192,
                ..GenerationConfig::default()
            }
        );

        // Missing and null keys take the wrapper's fallbacks (max_new_tokens 2048).
        let partial =
            parse(r#"{"temperature": 0.5, "top_k": null, "subtalker_top_k": 10}"#).unwrap();
        assert_eq!(partial.temperature, 0.5);
        assert_eq!(partial.top_k, 50);
        assert_eq!(partial.subtalker_top_k, 10);
        assert_eq!(partial.max_new_tokens, 2048);
        assert!(partial.do_sample);
    }

    #[test]
    fn bad_values_name_the_key() {
        let err = format!("{:#}", parse(r#"{"top_k": "fifty"}"#).unwrap_err());
        assert!(err.contains("top_k"), "{err}");
        let err = format!("{:#}", parse(r#"{"top_p": 1.5}"#).unwrap_err());
        assert!(err.contains("top_p"), "{err}");
        let err = format!(
            "{:#}",
            parse(r#"{"subtalker_temperature": 0}"#).unwrap_err()
        );
        assert!(err.contains("subtalker_temperature"), "{err}");
        // Greedy decoding does not need a valid temperature.
        assert!(parse(r#"{"do_sample": false, "temperature": 0}"#).is_ok());
    }
}
