//! The id of a voice registered with `voiceclone serve` (docs/serving.md §5): `voice_` and 20
//! lower-case hex digits, drawn at random when a voice is registered and otherwise only read
//! back from the names of the server's own files. A value of this type has that form, so it is
//! safe to join into a path: the workspace takes it for a voice's file, where a string would
//! have to be checked at every use.

use std::fmt;

const PREFIX: &str = "voice_";
const HEX_DIGITS: usize = 20;

/// A registered voice's id (see the module docs for its form).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VoiceId(String);

impl VoiceId {
    /// A new id, drawn at random (the caller checks it against the ids in use).
    pub fn random() -> Self {
        let a: u64 = rand::random();
        let b: u64 = rand::random();
        let hex = format!("{a:016x}{b:016x}");
        VoiceId(format!("{PREFIX}{}", &hex[..HEX_DIGITS]))
    }

    /// `s` as an id, when it has the form; `None` for anything else (a client's made-up id, a
    /// file of another kind).
    pub fn parse(s: &str) -> Option<Self> {
        let well_formed = s.len() == PREFIX.len() + HEX_DIGITS
            && s.starts_with(PREFIX)
            && s[PREFIX.len()..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        well_formed.then(|| VoiceId(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for VoiceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ids_parse_back_and_other_strings_do_not() {
        let (a, b) = (VoiceId::random(), VoiceId::random());
        assert_ne!(a, b);
        assert_eq!(VoiceId::parse(a.as_str()), Some(a.clone()));
        assert_eq!(a.to_string(), a.as_str());
        for bad in [
            "../etc/passwd",
            "voice_XYZ",
            "voice_0123456789abcdef012",
            "voice_0123456789abcdef01234",
            "voice_0123456789ABCDEF0123",
            "voicf_0123456789abcdef0123",
            "",
        ] {
            assert_eq!(VoiceId::parse(bad), None, "{bad:?}");
        }
        assert!(VoiceId::parse("voice_0123456789abcdef0123").is_some());
    }
}
