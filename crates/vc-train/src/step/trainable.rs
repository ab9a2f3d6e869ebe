//! Which tensors a run trains (docs/training.md §2.2): the talker's, by name prefix, less those
//! the user's `train.freeze` globs match; and the glob itself, which LoRA's target patterns use
//! too. Apart from the parameter store, so that the store and the adapters both depend on it
//! and not on each other.

use anyhow::{bail, Result};

/// Tensors of the checkpoint that are ever trainable: the talker (and its code predictor).
/// The speaker encoder is never trained (its output is detached data, docs/model.md §10.4).
pub const TRAINABLE_PREFIX: &str = "talker.";

/// A `*`/`?` glob over tensor names (`*` matches any run of characters, dots included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob(String);

impl Glob {
    pub fn new(pattern: &str) -> Self {
        Glob(pattern.trim().to_string())
    }

    pub fn matches(&self, name: &str) -> bool {
        fn rec(p: &[u8], s: &[u8]) -> bool {
            match p.split_first() {
                None => s.is_empty(),
                Some((b'*', rest)) => (0..=s.len()).any(|i| rec(rest, &s[i..])),
                Some((b'?', rest)) => !s.is_empty() && rec(rest, &s[1..]),
                Some((c, rest)) => s.first() == Some(c) && rec(rest, &s[1..]),
            }
        }
        rec(self.0.as_bytes(), name.as_bytes())
    }
}

/// Splits the talker tensor names into trained and frozen. Every freeze pattern must match at
/// least one talker tensor (a typo would otherwise silently train everything).
pub fn select_trainable<'a>(
    names: impl IntoIterator<Item = &'a str>,
    freeze: &[String],
) -> Result<(Vec<String>, Vec<String>)> {
    let globs: Vec<Glob> = freeze.iter().map(|p| Glob::new(p)).collect();
    let mut used = vec![false; globs.len()];
    let (mut trained, mut frozen) = (Vec::new(), Vec::new());
    for name in names {
        if !name.starts_with(TRAINABLE_PREFIX) {
            continue;
        }
        let mut hit = false;
        for (g, u) in globs.iter().zip(used.iter_mut()) {
            if g.matches(name) {
                *u = true;
                hit = true;
            }
        }
        if hit {
            frozen.push(name.to_string());
        } else {
            trained.push(name.to_string());
        }
    }
    if let Some((g, _)) = globs.iter().zip(&used).find(|(_, u)| !**u) {
        bail!(
            "train.freeze pattern {:?} matches no talker tensor (names look like \
             talker.model.layers.0.mlp.up_proj.weight; * matches any characters)",
            g.0
        );
    }
    if trained.is_empty() {
        bail!("train.freeze freezes every talker tensor: nothing is left to train");
    }
    Ok((trained, frozen))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_and_selection() {
        let g = Glob::new("talker.model.layers.*.mlp.*");
        assert!(g.matches("talker.model.layers.12.mlp.up_proj.weight"));
        assert!(!g.matches("talker.model.layers.12.self_attn.q_proj.weight"));
        assert!(Glob::new("talker.model.layers.?.*").matches("talker.model.layers.3.x"));
        assert!(!Glob::new("talker.model.layers.?.*").matches("talker.model.layers.13.x"));
        let names = [
            "speaker_encoder.fc.weight",
            "talker.model.text_embedding.weight",
            "talker.codec_head.weight",
        ];
        let (t, f) = select_trainable(names, &["talker.model.text_embedding.*".into()]).unwrap();
        assert_eq!(t, ["talker.codec_head.weight"]);
        assert_eq!(f, ["talker.model.text_embedding.weight"]);
        let e = select_trainable(names, &["talker.typo*".into()]).unwrap_err();
        assert!(e.to_string().contains("talker.typo*"), "{e}");
        assert!(select_trainable(names, &["*".into()]).is_err());
    }
}
