//! The one TOML configuration shared by every subcommand, and its layering:
//! built-in `configs/default.toml` <- workspace `voiceclone.toml` <- `--config FILE` <- flags.
//!
//! Every layer is checked against the built-in defaults before merging, so an unknown key or a
//! value of the wrong type is reported with the key and the file (or flag) it came from.
//!
//! In three parts: `schema` (one serde type per section, the enums of fixed choices), `layers`
//! (reading, checking and merging the layers, the origin of every value) and `validation` (the
//! ranges and combinations the types cannot express).

mod layers;
mod schema;
mod validation;

pub use layers::*;
pub use schema::*;

/// The built-in defaults, with a comment on every key.
pub const DEFAULT_TOML: &str = include_str!("../../../../configs/default.toml");

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use toml::{Table, Value};

    use super::layers::{dotted_table, CHOICES};
    use super::*;

    fn layer(text: &str, name: &str) -> (Table, Source) {
        (text.parse().unwrap(), Source::File(PathBuf::from(name)))
    }

    #[test]
    fn defaults_parse_and_validate() {
        let r = resolve_layers(vec![]).unwrap();
        assert_eq!(r.config.model.base, "Qwen/Qwen3-TTS-12Hz-1.7B-Base");
        assert_eq!(r.config.prep.min_seconds, 1.0);
        assert_eq!(r.config.prep.max_seconds, 15.0);
        assert_eq!(r.sources["prep.jobs"], Source::Default);
    }

    #[test]
    fn a_value_that_does_not_fit_its_setting_names_the_file_and_the_key() {
        let err = resolve_layers(vec![
            layer("[serve]\nport = 8080", "fine.toml"),
            layer("[serve]\nport = 99999", "ws.toml"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("ws.toml") && err.contains("serve.port") && err.contains("99999"),
            "{err}"
        );
        assert!(
            !err.contains("internal error") && !err.contains('\n'),
            "{err}"
        );
    }

    #[test]
    fn the_cpu_kernels_are_refused_for_gpus_up_front() {
        let err = resolve_layers(vec![layer(
            "[train]\ngpus = 2\nbackend = \"kernels\"",
            "ws.toml",
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("train.backend") && err.contains("CPU only"),
            "{err}"
        );
        let r = resolve_layers(vec![layer(
            "[train]\nbackend = \"autograd-f32\"",
            "ws.toml",
        )])
        .unwrap();
        assert_eq!(r.config.train.backend, TrainBackend::AutogradF32);
    }

    #[test]
    fn later_layers_win_and_integers_widen_to_floats() {
        let r = resolve_layers(vec![
            layer("[prep]\nmax_seconds = 12\njobs = 3", "a.toml"),
            layer("[prep]\njobs = 1", "b.toml"),
        ])
        .unwrap();
        assert_eq!(r.config.prep.max_seconds, 12.0);
        assert_eq!(r.config.prep.jobs, 1);
        assert_eq!(r.sources["prep.jobs"], Source::File("b.toml".into()));
        assert_eq!(r.sources["prep.max_seconds"], Source::File("a.toml".into()));
        assert!(r.to_annotated_toml().contains("jobs = 1  # from b.toml"));
        // Whether the Whisper model was named, even as the default's own value.
        assert!(!r.config.prep.whisper_model_set);
        let named = resolve_layers(vec![layer(
            "[prep]\nwhisper_model = \"ggerganov/whisper.cpp/ggml-base.bin\"",
            "a.toml",
        )])
        .unwrap();
        assert!(named.config.prep.whisper_model_set);
    }

    #[test]
    fn adapter_entries_name_a_valid_voice_or_a_directory() {
        let none = |_: &str| false;
        assert_eq!(adapter_entry("dir", none), Ok((None, "dir")));
        assert_eq!(
            adapter_entry("alice=out/a=b", none),
            Ok((Some("alice"), "out/a=b"))
        );
        // An existing path is a directory whatever it holds.
        assert_eq!(adapter_entry("=dir", |_| true), Ok((None, "=dir")));
        for (entry, says) in [
            ("=dir", "is empty"),
            ("<script>=dir", "letters, digits"),
            ("two words=dir", "letters, digits"),
            (".hidden=dir", "starts with a dot"),
        ] {
            let e = adapter_entry(entry, none).unwrap_err();
            assert!(e.contains(says) && e.contains(&format!("{entry:?}")), "{e}");
        }
        let long = format!("{}=dir", "a".repeat(65));
        assert!(adapter_entry(&long, none).unwrap_err().contains("64"));
        // Every voice name is a speaker name, so the two rules never disagree about a name a
        // voice may have.
        for name in ["alice", "Bob-2", "x.y_z", "Zoë", &"a".repeat(64)] {
            assert_eq!(check_voice_name(name), Ok(()), "{name}");
            assert_eq!(
                crate::artifacts::speaker::check_name(name),
                Ok(()),
                "{name}"
            );
        }
    }

    #[test]
    fn printed_configs_hide_secrets_and_stay_valid_toml() {
        let r =
            resolve_layers(vec![layer("[serve]\napi_key = \"s3cr3t-\\\"k\"", "a.toml")]).unwrap();
        assert_eq!(r.config.serve.api_key, "s3cr3t-\"k");
        let text = r.to_annotated_toml();
        assert!(!text.contains("s3cr3t"), "{text}");
        let printed: Table = text.parse().expect("valid TOML");
        let shown = printed["serve"]["api_key"].as_str().unwrap();
        assert!(!shown.is_empty(), "{text}");
        assert!(text.contains("# from a.toml"), "{text}");
        // Everything else is printed as it is, and an unset key shows that it is unset.
        assert_eq!(printed["serve"]["port"].as_integer(), Some(8000));
        let unset = resolve_layers(vec![]).unwrap().to_annotated_toml();
        let unset: Table = unset.parse().unwrap();
        assert_eq!(unset["serve"]["api_key"].as_str(), Some(""));
    }

    #[test]
    fn enum_keys_are_typed_and_typos_name_the_key_and_the_choices() {
        let r = resolve_layers(vec![layer(
            "[speak]\nprecision = \"bf16-weights\"\nnon_streaming = \"false\"",
            "a.toml",
        )])
        .unwrap();
        assert_eq!(r.config.speak.precision, PrecisionSetting::Bf16Weights);
        assert_eq!(r.config.speak.non_streaming, NonStreaming::False);
        let err = resolve_layers(vec![layer("[speak]\nprecision = \"bf17\"", "a.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`speak.precision`")
                && err.contains("a.toml")
                && err.contains("\"bf17\" is not one of auto, f32, bf16-weights, bf16, q8, q4"),
            "{err}"
        );
        let err = resolve_layers(vec![(
            dotted_table("speak.non_streaming", Value::from("yes")),
            Source::Flag("--x".into()),
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("flag --x") && err.contains("auto, true, false"),
            "{err}"
        );
        // Every listed name is a variant, and every variant is listed.
        for (key, names) in CHOICES {
            for name in *names {
                let t = dotted_table(key, Value::from(*name));
                assert!(
                    resolve_layers(vec![(t, Source::Default)]).is_ok(),
                    "{key} = {name}"
                );
            }
        }
        let all = [
            PrecisionSetting::Auto,
            PrecisionSetting::F32,
            PrecisionSetting::Bf16Weights,
            PrecisionSetting::Bf16,
            PrecisionSetting::Q8,
            PrecisionSetting::Q4,
        ];
        assert_eq!(all.len(), PrecisionSetting::NAMES.len());
        for (p, name) in all.iter().zip(PrecisionSetting::NAMES) {
            assert_eq!(toml::Value::try_from(p).unwrap().as_str(), Some(*name));
        }
        let modes = [EmbedMode::Ref, EmbedMode::Mean];
        assert_eq!(modes.len(), EmbedMode::NAMES.len());
        for (m, name) in modes.iter().zip(EmbedMode::NAMES) {
            assert_eq!(toml::Value::try_from(m).unwrap().as_str(), Some(*name));
            assert_eq!(m.name(), *name);
        }
        let err = resolve_layers(vec![layer("[embed]\nmode = \"median\"", "e.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`embed.mode`") && err.contains("ref, mean"),
            "{err}"
        );
    }

    #[test]
    fn shard_groups_take_a_count_or_node_and_must_divide_the_ranks() {
        let group = |text: &str| {
            resolve_layers(vec![layer(text, "g.toml")]).map(|r| r.config.train.shard_group)
        };
        assert_eq!(group("").unwrap(), ShardGroup::World);
        assert_eq!(
            group("[train]\nshard_group = 8").unwrap(),
            ShardGroup::Ranks(8)
        );
        assert_eq!(
            group("[train]\nshard_group = \"node\"").unwrap(),
            ShardGroup::Node
        );
        for wrong in ["\"nodes\"", "-2", "true"] {
            let err = group(&format!("[train]\nshard_group = {wrong}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("`train.shard_group`") && err.contains("g.toml"),
                "{wrong}: {err}"
            );
        }
        let err = group("[train]\ncpu_ranks = 6\nshard_group = 4")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.shard_group") && err.contains("train.cpu_ranks"),
            "{err}"
        );
        assert!(group("[train]\ncpu_ranks = 6\nshard_group = 3").is_ok());
        // As `voiceclone config` prints it, read back the same.
        for v in [ShardGroup::World, ShardGroup::Ranks(4), ShardGroup::Node] {
            let t = dotted_table("train.shard_group", toml::Value::try_from(v).unwrap());
            let r = resolve_layers(vec![(t, Source::Default)]).unwrap();
            assert_eq!(r.config.train.shard_group, v);
        }
    }

    #[test]
    fn samples_take_auto_true_or_false_and_sample_texts_words() {
        let samples = |text: &str| {
            resolve_layers(vec![layer(text, "s.toml")]).map(|r| r.config.train.samples)
        };
        assert_eq!(samples("").unwrap(), Samples::Auto);
        assert_eq!(samples("[train]\nsamples = true").unwrap(), Samples::On);
        assert_eq!(samples("[train]\nsamples = false").unwrap(), Samples::Off);
        assert_eq!(
            samples("[train]\nsamples = \"auto\"").unwrap(),
            Samples::Auto
        );
        for wrong in ["\"yes\"", "\"true\"", "1"] {
            let err = samples(&format!("[train]\nsamples = {wrong}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("`train.samples`") && err.contains("s.toml"),
                "{wrong}: {err}"
            );
        }
        // As `voiceclone config` prints it, read back the same.
        for v in [Samples::Auto, Samples::On, Samples::Off] {
            let text = toml::Value::try_from(v).unwrap();
            let t = dotted_table("train.samples", text);
            let r = resolve_layers(vec![(t, Source::Default)]).unwrap();
            assert_eq!(r.config.train.samples, v);
        }
        let err = resolve_layers(vec![layer(
            "[train]\nsample_texts = [\"a\", \" \"]",
            "t.toml",
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("train.sample_texts") && err.contains("text 2 is empty"),
            "{err}"
        );
    }

    #[test]
    fn unknown_key_names_key_and_file() {
        let err = resolve_layers(vec![layer("[prep]\nmax_secs = 3", "ws/voiceclone.toml")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("prep.max_secs"), "{err}");
        assert!(err.contains("ws/voiceclone.toml"), "{err}");
        let err = resolve_layers(vec![layer("[nonsense]\nx = 1", "c.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`nonsense`") && err.contains("c.toml"),
            "{err}"
        );
    }

    #[test]
    fn wrong_type_and_bad_values_name_key_and_origin() {
        let err = resolve_layers(vec![layer("[prep]\nmin_seconds = \"one\"", "x.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prep.min_seconds") && err.contains("x.toml") && err.contains("number"),
            "{err}"
        );
        let err = resolve_layers(vec![(
            dotted_table("prep.max_seconds", Value::Float(0.5)),
            Source::Flag("--max-seconds".into()),
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("prep.max_seconds") && err.contains("--max-seconds"),
            "{err}"
        );
        let err = resolve_layers(vec![layer("[prep]\njobs = -2", "y.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prep.jobs") && err.contains("negative"),
            "{err}"
        );
        let err = resolve_layers(vec![layer("[prep]\nlanguage = \"English!\"", "z.toml")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prep.language") && err.contains("z.toml"),
            "{err}"
        );
    }

    #[test]
    fn every_default_key_is_documented_by_a_comment() {
        // The defaults file is the reference documentation of every key: each assignment must
        // be preceded by a comment line.
        let lines: Vec<&str> = DEFAULT_TOML.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim();
            if t.is_empty() || t.starts_with('#') || t.starts_with('[') {
                continue;
            }
            let mut j = i;
            while j > 0 && !lines[j - 1].trim().starts_with('#') && !lines[j - 1].trim().is_empty()
            {
                j -= 1;
            }
            assert!(
                j > 0 && lines[j - 1].trim().starts_with('#'),
                "undocumented key: {t}"
            );
        }
    }
}
