#!/usr/bin/env python3
"""Word error rate of a prep manifest against reference transcripts.

Usage:
    prep_wer.py MANIFEST.jsonl TRANSCRIPTS.tsv [--verbose]

MANIFEST is `data/train.jsonl` of `voiceclone prep` or the baseline's
`train.jsonl` (scripts/bench/prep_baseline.py): one JSON object per line with
"source", "start" and "text". TRANSCRIPTS is `file<TAB>text` per source file
(speech/*/transcripts.tsv of scripts/assets/fetch_test_assets.sh). The utterances of
each source are joined in time order and compared word by word with its
transcript; words are normalised like tests/it/common.rs (lower case,
punctuation removed, apostrophes kept inside words). Sources without any
utterance count every reference word as deleted.

Prints one JSON line: {"wer", "errors", "words", "files"}. Needs no packages.
"""

import argparse
import json
import sys
from pathlib import Path


def normalize_words(text):
    kept = "".join(c if c.isalnum() or c == "'" else " " for c in text.lower())
    return [w.strip("'") for w in kept.split() if w.strip("'")]


def word_errors(reference, hypothesis):
    prev = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference):
        cur = [i + 1] * (len(hypothesis) + 1)
        for j, h in enumerate(hypothesis):
            cur[j + 1] = min(prev[j] + (r != h), prev[j + 1] + 1, cur[j] + 1)
        prev = cur
    return prev[len(hypothesis)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("transcripts", type=Path)
    parser.add_argument("--verbose", action="store_true", help="show files with errors")
    args = parser.parse_args()

    hypotheses = {}
    for n, line in enumerate(args.manifest.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        name = Path(row["source"]).name
        hypotheses.setdefault(name, []).append((float(row["start"]), row["text"]))

    errors = words = files = 0
    for line in args.transcripts.read_text(encoding="utf-8").splitlines():
        if "\t" not in line:
            continue
        name, text = line.split("\t", 1)
        reference = normalize_words(text)
        parts = sorted(hypotheses.pop(name, []))
        hypothesis = [w for _, t in parts for w in normalize_words(t)]
        e = word_errors(reference, hypothesis)
        if args.verbose and e:
            print(f"{name}: {e} errors\n  ref: {' '.join(reference)}\n  hyp: {' '.join(hypothesis)}",
                  file=sys.stderr)
        errors += e
        words += len(reference)
        files += 1
    if hypotheses:
        sys.exit(f"utterances from sources without a transcript: {sorted(hypotheses)}")
    if not words:
        sys.exit(f"no reference words in {args.transcripts}")
    print(json.dumps({"wer": round(errors / words, 5), "errors": errors, "words": words, "files": files}))


if __name__ == "__main__":
    main()
