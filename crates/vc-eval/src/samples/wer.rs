//! Word error rate of a transcript against the text it should say (docs/training.md §14.4):
//! the word-level edit distance (substitutions, insertions, deletions, each costing 1) divided
//! by the number of words of the reference, after both are normalized the same way.

/// Lower-cased words with punctuation removed: letters and digits are kept (any script), an
/// apostrophe inside a word is kept ("don't"), everything else separates words.
pub fn normalize(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut words = Vec::new();
    let mut word = String::new();
    for (i, &c) in chars.iter().enumerate() {
        let inner_apostrophe = matches!(c, '\'' | '’')
            && !word.is_empty()
            && chars.get(i + 1).is_some_and(|n| n.is_alphanumeric());
        if c.is_alphanumeric() {
            word.extend(c.to_lowercase());
        } else if inner_apostrophe {
            word.push('\'');
        } else if !word.is_empty() {
            words.push(std::mem::take(&mut word));
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

/// The word error rate of `hypothesis` against `reference`; `None` when the reference has no
/// words. It can exceed 1 (a transcript with more words than the text).
pub fn wer(reference: &str, hypothesis: &str) -> Option<f64> {
    let r = normalize(reference);
    let h = normalize(hypothesis);
    if r.is_empty() {
        return None;
    }
    Some(edit_distance(&r, &h) as f64 / r.len() as f64)
}

/// Levenshtein distance between two word sequences, one row at a time.
fn edit_distance(a: &[String], b: &[String]) -> usize {
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, x) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, y) in b.iter().enumerate() {
            let substitute = prev[j] + usize::from(x != y);
            cur[j + 1] = substitute.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalization_keeps_words_and_inner_apostrophes() {
        assert_eq!(
            normalize("  Don't STOP—it's 4:30, 'now'! Ünïcode…"),
            ["don't", "stop", "it's", "4", "30", "now", "ünïcode"]
        );
        assert!(normalize(" ... ").is_empty());
    }

    #[test]
    fn wer_counts_substitutions_insertions_and_deletions() {
        assert_eq!(wer("the cat sat", "The cat sat."), Some(0.0));
        // One substitution of three words.
        assert_eq!(wer("the cat sat", "the hat sat"), Some(1.0 / 3.0));
        // A deletion and an insertion.
        assert_eq!(wer("a b c d", "a c d e"), Some(0.5));
        // Nothing heard: every word deleted.
        assert_eq!(wer("one two", ""), Some(1.0));
        // More words than the text: above 1.
        assert_eq!(wer("yes", "no no no"), Some(3.0));
        assert_eq!(wer("", "anything"), None);
        assert_eq!(wer("?!", "anything"), None);
    }
}
