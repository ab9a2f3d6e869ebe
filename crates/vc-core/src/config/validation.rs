//! The checks a configuration's types cannot express (ranges, combinations of keys), each error
//! naming the key and where it was set.

use anyhow::Result;

use super::layers::{Resolved, Source};
use super::schema::{adapter_entry, ShardGroup, TrainBackend};

impl Resolved {
    /// Semantic checks that the type system cannot express; each error names key and origin.
    pub(super) fn validate(&self) -> Result<()> {
        let p = &self.config.prep;
        let bad = |key: &str, why: String| -> anyhow::Error {
            anyhow::anyhow!(
                "invalid value for `{key}` (set in {}): {why}",
                self.source_of(key)
            )
        };
        if self.config.model.base.trim().is_empty() {
            return Err(bad(
                "model.base",
                "must name a hub repo id or a local directory".into(),
            ));
        }
        if p.whisper_model.trim().is_empty() {
            return Err(bad("prep.whisper_model", "must name a model file".into()));
        }
        if !(p.min_seconds > 0.0 && p.min_seconds.is_finite()) {
            return Err(bad(
                "prep.min_seconds",
                format!("{} is not a positive number", p.min_seconds),
            ));
        }
        if !(p.max_seconds > p.min_seconds && p.max_seconds.is_finite()) {
            return Err(bad(
                "prep.max_seconds",
                format!(
                    "{} must be larger than `prep.min_seconds` = {} (set in {})",
                    p.max_seconds,
                    p.min_seconds,
                    self.source_of("prep.min_seconds")
                ),
            ));
        }
        for (key, v) in [
            ("prep.max_merge_gap", p.max_merge_gap),
            ("prep.pad_seconds", p.pad_seconds),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(
                    key,
                    format!("{v} is not a non-negative number of seconds"),
                ));
            }
        }
        if !(0.0..=1.0).contains(&p.max_no_speech_prob) {
            return Err(bad(
                "prep.max_no_speech_prob",
                format!(
                    "{} is not a probability between 0 and 1",
                    p.max_no_speech_prob
                ),
            ));
        }
        if !(p.silence_db < 0.0 && p.silence_db.is_finite()) {
            return Err(bad(
                "prep.silence_db",
                format!("{} must be negative (dB below the peak)", p.silence_db),
            ));
        }
        if self.config.codes.batch_size == 0 {
            return Err(bad("codes.batch_size", "must be at least 1".into()));
        }
        if self.config.embed.mean_clips == 0 {
            return Err(bad("embed.mean_clips", "must be at least 1".into()));
        }
        self.validate_train()?;
        self.validate_speak()?;
        self.validate_serve()?;
        let lang = p.language.trim();
        if lang != "auto" && (lang.is_empty() || !lang.chars().all(|c| c.is_ascii_lowercase())) {
            return Err(bad(
                "prep.language",
                format!(
                    "{:?} is neither \"auto\" nor a Whisper language code such as \"en\"",
                    p.language
                ),
            ));
        }
        Ok(())
    }
}

impl Resolved {
    fn validate_train(&self) -> Result<()> {
        let t = &self.config.train;
        let bad = |key: &str, why: String| -> anyhow::Error {
            anyhow::anyhow!(
                "invalid value for `{key}` (set in {}): {why}",
                self.source_of(key)
            )
        };
        for (key, v) in [
            ("train.batch_size", t.batch_size),
            ("train.grad_accum", t.grad_accum),
            ("train.epochs", t.epochs),
            ("train.keep", t.keep),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1".into()));
            }
        }
        if t.gpus > 0 && t.cpu_ranks > 0 {
            return Err(bad(
                "train.cpu_ranks",
                format!(
                    "a run uses GPUs or CPU ranks, not both (train.gpus is {}, set in {})",
                    t.gpus,
                    self.source_of("train.gpus")
                ),
            ));
        }
        let ranks = t.gpus.max(t.cpu_ranks);
        if let ShardGroup::Ranks(n) = t.shard_group {
            if ranks > 0 && (n > ranks || !ranks.is_multiple_of(n)) {
                let from = if t.gpus > 0 {
                    "train.gpus"
                } else {
                    "train.cpu_ranks"
                };
                return Err(bad(
                    "train.shard_group",
                    format!(
                        "groups of {n} ranks do not divide the run's {ranks} ranks ({from} set in \
                         {}) into equal groups",
                        self.source_of(from)
                    ),
                ));
            }
        }
        if t.gpus > 0 && t.backend == TrainBackend::Kernels {
            return Err(bad(
                "train.backend",
                format!(
                    "\"kernels\" runs on the CPU only, and train.gpus is {} (set in {}); use \
                     \"auto\" or \"autograd\"",
                    t.gpus,
                    self.source_of("train.gpus")
                ),
            ));
        }
        if t.dist_timeout == 0 {
            return Err(bad(
                "train.dist_timeout",
                "must be at least 1 second".into(),
            ));
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            return Err(bad(
                "train.lr",
                format!("{} is not a positive number", t.lr),
            ));
        }
        for (key, v) in [
            ("train.weight_decay", t.weight_decay),
            ("train.clip_norm", t.clip_norm),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(key, format!("{v} is not a non-negative number")));
            }
        }
        if !(0.0..=0.5).contains(&t.val_fraction) {
            return Err(bad(
                "train.val_fraction",
                format!(
                    "{} is not a share between 0 (no held-out set) and 0.5",
                    t.val_fraction
                ),
            ));
        }
        if let Some(i) = t.sample_texts.iter().position(|x| x.trim().is_empty()) {
            return Err(bad(
                "train.sample_texts",
                format!("text {} is empty", i + 1),
            ));
        }
        if t.speaker_name.trim().is_empty() || t.speaker_name.trim() != t.speaker_name {
            return Err(bad(
                "train.speaker_name",
                format!(
                    "{:?} must be a non-empty name without surrounding spaces",
                    t.speaker_name
                ),
            ));
        }
        if !(t.gpu_memory >= 0.0 && t.gpu_memory.is_finite()) {
            return Err(bad(
                "train.gpu_memory",
                format!("{} is not a non-negative number of GiB", t.gpu_memory),
            ));
        }
        for (key, globs) in [
            ("train.freeze", &t.freeze),
            ("train.lora_targets", &t.lora_targets),
            ("train.lora_full", &t.lora_full),
        ] {
            if let Some(p) = globs.iter().find(|p| p.trim().is_empty()) {
                return Err(bad(key, format!("{p:?} is not a glob pattern")));
            }
        }
        if !(t.lora_alpha >= 0.0 && t.lora_alpha.is_finite()) {
            return Err(bad(
                "train.lora_alpha",
                format!("{} is not a non-negative number", t.lora_alpha),
            ));
        }
        let scale = t.lora_alpha / t.lora_rank.max(1) as f64;
        if scale > crate::artifacts::adapter::MAX_ADAPTER_SCALE {
            return Err(bad(
                "train.lora_alpha",
                format!(
                    "{} over train.lora_rank {} scales the adapters by {scale:e}, beyond {}: \
                     the updates would swamp the weights (PEFT's default is α = r; ours 2r, \
                     with 0 meaning 2r)",
                    t.lora_alpha,
                    t.lora_rank,
                    crate::artifacts::adapter::MAX_ADAPTER_SCALE
                ),
            ));
        }
        if t.lora_rank == 0 {
            // Adapter settings without adapters would silently train everything.
            for key in ["train.lora_alpha", "train.lora_targets", "train.lora_full"] {
                if !matches!(self.sources.get(key), None | Some(Source::Default)) {
                    return Err(bad(
                        key,
                        "applies to low-rank adapters only, and train.lora_rank is 0 (a full \
                         fine-tune): set train.lora_rank (--lora-rank) too"
                            .into(),
                    ));
                }
            }
        }
        if t.lora_rank > 0 {
            if t.lora_targets.is_empty() {
                return Err(bad(
                    "train.lora_targets",
                    "names no matrix: with train.lora_rank > 0 at least one glob is needed".into(),
                ));
            }
            if !t.freeze.is_empty() {
                return Err(bad(
                    "train.freeze",
                    "has no meaning with adapters (train.lora_rank > 0): every tensor is \
                     frozen but the adapters and train.lora_full"
                        .into(),
                ));
            }
        }
        Ok(())
    }
}

impl Resolved {
    fn validate_serve(&self) -> Result<()> {
        let s = &self.config.serve;
        let bad = |key: &str, why: String| -> anyhow::Error {
            anyhow::anyhow!(
                "invalid value for `{key}` (set in {}): {why}",
                self.source_of(key)
            )
        };
        if s.host.trim().is_empty() {
            return Err(bad(
                "serve.host",
                "must name an address to listen on".into(),
            ));
        }
        for (key, v) in [
            ("serve.max_batch", s.max_batch),
            ("serve.max_input_chars", s.max_input_chars),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1".into()));
            }
        }
        for (key, v) in [
            ("serve.max_body_mb", s.max_body_mb),
            ("serve.max_voice_seconds", s.max_voice_seconds),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(bad(key, format!("{v} is not a positive number")));
            }
        }
        if !(s.shutdown_seconds >= 0.0 && s.shutdown_seconds.is_finite()) {
            return Err(bad(
                "serve.shutdown_seconds",
                format!("{} is not a non-negative number", s.shutdown_seconds),
            ));
        }
        if let Some(e) = s
            .adapters
            .iter()
            .find(|e| matches!(adapter_entry(e, |_| false), Ok((_, dir)) if dir.trim().is_empty()))
        {
            return Err(bad(
                "serve.adapters",
                format!("{e:?} names no adapter directory (DIR or NAME=DIR)"),
            ));
        }
        Ok(())
    }

    fn validate_speak(&self) -> Result<()> {
        let s = &self.config.speak;
        let bad = |key: &str, why: String| -> anyhow::Error {
            anyhow::anyhow!(
                "invalid value for `{key}` (set in {}): {why}",
                self.source_of(key)
            )
        };
        for (key, v) in [
            ("speak.temperature", s.temperature),
            ("speak.sub_temperature", s.sub_temperature),
            ("speak.repetition_penalty", s.repetition_penalty),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(key, format!("{v} is not a non-negative number")));
            }
        }
        for (key, v) in [("speak.top_p", s.top_p), ("speak.sub_top_p", s.sub_top_p)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(bad(key, format!("{v} is not between 0 and 1")));
            }
        }
        for (key, v) in [
            ("speak.batch_size", s.batch_size),
            ("speak.stream_chunk_frames", s.stream_chunk_frames),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1".into()));
            }
        }
        if s.seed < -1 {
            return Err(bad(
                "speak.seed",
                format!("{} is not -1 (random) or a non-negative seed", s.seed),
            ));
        }
        if s.language.trim().is_empty() {
            return Err(bad(
                "speak.language",
                "must be \"auto\" or a language name".into(),
            ));
        }
        Ok(())
    }
}
