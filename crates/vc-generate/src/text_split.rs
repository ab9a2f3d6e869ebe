//! Splitting long texts into chunks the model speaks well: whole sentences packed up to a
//! character budget; a single sentence over the budget is cut at clause punctuation, then at
//! spaces. Chunks are synthesised separately and their audio joined.

/// Sentence-final punctuation (Latin and CJK full-width).
const SENTENCE_END: &[char] = &['.', '!', '?', '。', '！', '？', '…'];
/// Clause punctuation used when a sentence alone is too long.
const CLAUSE_END: &[char] = &[',', ';', ':', '，', '；', '：', '、'];

/// Splits `text` into chunks of at most `max_chars` characters where possible (a single word
/// longer than that stays whole). `max_chars == 0` disables splitting.
pub fn split(text: &str, max_chars: usize) -> Vec<String> {
    let text = text.trim();
    if max_chars == 0 || text.chars().count() <= max_chars {
        return vec![text.to_string()];
    }
    let mut chunks: Vec<String> = Vec::new();
    let mut current = String::new();
    for sentence in pieces(text, SENTENCE_END) {
        let parts = if sentence.chars().count() > max_chars {
            pieces(&sentence, CLAUSE_END)
                .into_iter()
                .flat_map(|clause| by_words(&clause, max_chars))
                .collect()
        } else {
            vec![sentence]
        };
        for part in parts {
            let joined = current.chars().count() + 1 + part.chars().count();
            if !current.is_empty() && joined > max_chars {
                chunks.push(std::mem::take(&mut current));
            }
            if !current.is_empty() && !is_cjk_boundary(&current, &part) {
                current.push(' ');
            }
            current.push_str(&part);
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Pieces ending at one of `ends` (the punctuation stays with its piece), trimmed.
fn pieces(text: &str, ends: &[char]) -> Vec<String> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if ends.contains(&c) {
            // Keep runs like "?!" or "..." together; Latin marks need a following space
            // (so "3.14" and "e.g." inside words stay whole), CJK marks do not.
            let next = chars.peek().map(|&(_, n)| n);
            if next.is_some_and(|n| ends.contains(&n)) {
                continue;
            }
            let boundary = !c.is_ascii() || next.is_none_or(char::is_whitespace);
            if boundary {
                let end = i + c.len_utf8();
                let piece = text[start..end].trim();
                if !piece.is_empty() {
                    out.push(piece.to_string());
                }
                start = end;
            }
        }
    }
    let rest = text[start..].trim();
    if !rest.is_empty() {
        out.push(rest.to_string());
    }
    out
}

/// Cuts at spaces so that pieces stay within `max_chars` (texts without spaces, e.g. Chinese,
/// are cut every `max_chars` characters).
fn by_words(text: &str, max_chars: usize) -> Vec<String> {
    if text.chars().count() <= max_chars {
        return vec![text.to_string()];
    }
    let mut out = Vec::new();
    let mut current = String::new();
    for word in text.split_whitespace() {
        if word.chars().count() > max_chars && !word.is_ascii() {
            let chars: Vec<char> = word.chars().collect();
            for c in chars.chunks(max_chars) {
                if !current.is_empty() {
                    out.push(std::mem::take(&mut current));
                }
                out.push(c.iter().collect());
            }
            continue;
        }
        if !current.is_empty() && current.chars().count() + 1 + word.chars().count() > max_chars {
            out.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(word);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

fn is_cjk_boundary(left: &str, right: &str) -> bool {
    let l = left.chars().last().is_some_and(|c| !c.is_ascii());
    let r = right.chars().next().is_some_and(|c| !c.is_ascii());
    l && r
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn short_text_is_one_chunk() {
        assert_eq!(split("  Hello there.  ", 100), vec!["Hello there."]);
        assert_eq!(split("No limit at all. Really.", 0).len(), 1);
    }

    #[test]
    fn sentences_are_packed_up_to_the_budget() {
        let text = "One two three. Four five six! Seven eight nine? Ten.";
        let chunks = split(text, 30);
        assert_eq!(
            chunks,
            vec!["One two three. Four five six!", "Seven eight nine? Ten."]
        );
        assert!(chunks.iter().all(|c| c.chars().count() <= 30));
        assert_eq!(chunks.join(" "), text);
    }

    #[test]
    fn decimals_and_ellipses_do_not_end_sentences() {
        let chunks = split("Pi is 3.14 roughly... Then more text follows here.", 25);
        assert_eq!(chunks[0], "Pi is 3.14 roughly...");
    }

    #[test]
    fn long_sentences_split_at_clauses_then_words() {
        let text = "alpha beta gamma, delta epsilon zeta eta theta iota kappa lambda mu";
        let chunks = split(text, 20);
        assert!(chunks.iter().all(|c| c.chars().count() <= 20), "{chunks:?}");
        assert_eq!(chunks[0], "alpha beta gamma,");
        assert_eq!(chunks.join(" "), text);
    }

    #[test]
    fn cjk_text_splits_without_spaces() {
        let text = "今天天气很好。我们去公园散步吧！然后回家吃饭。";
        let chunks = split(text, 10);
        assert_eq!(
            chunks,
            vec!["今天天气很好。", "我们去公园散步吧！", "然后回家吃饭。"]
        );
        assert_eq!(chunks.concat(), text);
    }
}
