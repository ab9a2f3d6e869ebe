//! Commands printed for the user to copy (`speak with: voiceclone speak …`, the command a
//! message suggests): every value put into one is quoted for a POSIX shell, so a speaker name
//! or path with spaces, quotes or `$` gives a command that runs as printed.

use std::borrow::Cow;

/// `word` as one word of a POSIX shell command line: unchanged when every character is one no
/// shell gives a meaning to (ASCII letters, digits and `-_./:=@%+,`, not starting with `~`
/// or `=`), else in single quotes, inside which a `'` is written `'\''`.
pub fn quote(word: &str) -> Cow<'_, str> {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c);
    if !word.is_empty() && !word.starts_with(['~', '=']) && word.chars().all(plain) {
        Cow::Borrowed(word)
    } else {
        Cow::Owned(format!("'{}'", word.replace('\'', r"'\''")))
    }
}

/// The words as one command line, each [`quote`]d.
pub fn command<S: AsRef<str>>(words: impl IntoIterator<Item = S>) -> String {
    words
        .into_iter()
        .map(|w| quote(w.as_ref()).into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_words_stay_and_others_are_single_quoted() {
        for w in [
            "alice",
            "model/",
            "data/ref.wav",
            "a-b_c.d",
            "x=1",
            "--speaker",
        ] {
            assert_eq!(quote(w), w);
        }
        assert_eq!(quote(""), "''");
        assert_eq!(quote("Mary Ann"), "'Mary Ann'");
        assert_eq!(quote("O'Brien"), r"'O'\''Brien'");
        assert_eq!(quote("$HOME"), "'$HOME'");
        assert_eq!(quote("~alice"), "'~alice'");
        assert_eq!(quote("Zoë"), "'Zoë'");
        assert_eq!(
            command(["voiceclone", "speak", "--speaker", "a b", "Hello!"]),
            "voiceclone speak --speaker 'a b' 'Hello!'"
        );
    }

    /// What a shell makes of the quoted words is the words themselves.
    #[test]
    fn a_shell_reads_the_words_back() {
        let words = [
            "plain",
            "two words",
            "it's",
            "'",
            "''",
            "$(echo no)",
            "`no`",
            "back\\slash",
            "semi;colon && |pipe| >out <in",
            "*glob?[a]",
            "new\nline",
            "tab\there",
            "!bang",
            "\"double\"",
            "~",
            "#hash",
            "",
            "ünïcødé",
        ];
        let script = format!("printf '%s\\0' {}", command(words));
        let out = match std::process::Command::new("sh")
            .args(["-c", &script])
            .output()
        {
            Ok(o) => o,
            // No shell on this machine: the first test covers the rules.
            Err(_) => return,
        };
        assert!(out.status.success(), "{script}");
        let got: Vec<&[u8]> = out.stdout.split(|&b| b == 0).collect();
        let want: Vec<&[u8]> = words.iter().map(|w| w.as_bytes()).collect();
        assert_eq!(&got[..words.len()], &want[..], "{script}");
    }
}
