"""The real Qwen2 BPE vocabulary of the fixture models' tokenizer files (``vocab.json``, ``merges.txt``).

The Hugging Face hub is unreachable where the fixtures are made, so ``make_fixtures.py`` rebuilds the
vocabulary (151643 entries, 151387 merges) from ``vendor/llama.cpp/models/ggml-vocab-qwen2.gguf`` in the
``llama-cpp-python`` sdist on PyPI (fetched with ``pip download``, or a local ``--qwen2-gguf PATH``; once
committed, the files in ``tests/fixtures/tiny-0b6/`` are reused), writes the files in the Hugging Face
serialisation, and verifies an independent ``tokenizers`` build of the standard Qwen2 tokenizer against
known Qwen2 ids and against the tokenizations llama.cpp ships next to the gguf (made with the Hugging
Face tokenizer).  Nothing here needs torch: ``gguf`` and ``tokenizers`` are imported where they are used.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from official import ADDED_TOKENS, FIXTURES, TEXT_VOCAB_SIZE, tokenizer_config_dict, write_json
from official import log as _log

GGUF_SDIST = "llama-cpp-python==0.3.36"
GGUF_MEMBER = "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"

# The standard Qwen2 pre-tokenizer regex (transformers' Qwen2Converter; what hub-id loads use).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)



def _fetch_gguf_from_pypi(cache: Path) -> Path:
    dst = cache / "ggml-vocab-qwen2.gguf"
    if dst.exists():
        return dst
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _log(f"fetching {GGUF_SDIST} sdist (~77 MB) with pip download for {GGUF_MEMBER}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", GGUF_SDIST, "-d", tmp],
            check=True,
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tf:
            for suffix in ("", ".inp", ".out"):
                member = next(m for m in tf.getmembers() if m.name.endswith(GGUF_MEMBER + suffix))
                with tf.extractfile(member) as src, open(str(dst) + suffix, "wb") as out:
                    shutil.copyfileobj(src, out)
    return dst


def load_qwen2_bpe(args) -> tuple[dict, list[str], Path | None]:
    """Returns (vocab, merges, gguf path or None)."""
    committed = FIXTURES / "tiny-0b6"
    if args.qwen2_gguf is None and (committed / "vocab.json").exists() and (committed / "merges.txt").exists():
        vocab = json.loads((committed / "vocab.json").read_text(encoding="utf-8"))
        merges = (committed / "merges.txt").read_text(encoding="utf-8").split("\n")
        assert merges[0].startswith("#version")
        merges = [m for m in merges[1:] if m]
        _log("tokenizer: reusing the committed vocab.json / merges.txt")
        return vocab, merges, None
    gguf_path = Path(args.qwen2_gguf) if args.qwen2_gguf else _fetch_gguf_from_pypi(Path(args.cache_dir))
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    assert len(tokens) == TEXT_VOCAB_SIZE
    n_regular = 151643
    assert all(t == 1 for t in types[:n_regular]) and types[n_regular] == 3, "unexpected token types"
    vocab = {t: i for i, t in enumerate(tokens[:n_regular])}
    assert len(vocab) == n_regular and len(merges) == 151387
    _log(f"tokenizer: rebuilt vocab.json ({len(vocab)}) + merges.txt ({len(merges)}) from {gguf_path}")
    return vocab, merges, gguf_path


def write_tokenizer_files(dst: Path, vocab: dict, merges: list[str]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    # Same serialisation as the Hugging Face Qwen2 files (compact JSON, '#version: 0.2' header).
    (dst / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    (dst / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    write_json(dst / "tokenizer_config.json", tokenizer_config_dict())


def standard_qwen2_tokenizer(vocab: dict, merges: list[str]):
    """An independent Qwen2 tokenizer built with `tokenizers` (standard regex, NFC, ByteLevel)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], unk_token=None, fuse_unk=False,
                   byte_fallback=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(c, special=s, normalized=False) for _, c, s in ADDED_TOKENS]
    tok.add_tokens(added)
    for i, c, _ in ADDED_TOKENS:
        assert tok.token_to_id(c) == i, (c, tok.token_to_id(c))
    return tok


def verify_vocab(tok, gguf_path: Path | None) -> None:
    known = {"\n": [198], "assistant": [77091], "Hello": [9707], " world": [1879], "Hello world": [9707, 1879]}
    for text, ids in known.items():
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == ids, f"{text!r}: {got} != {ids}"
    if gguf_path is None:
        return
    inp, out = Path(str(gguf_path) + ".inp"), Path(str(gguf_path) + ".out")
    if not (inp.exists() and out.exists()):
        return
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = out.read_text(encoding="utf-8").split("\n")
    n = 0
    for text, line in zip(texts, expected):
        want = [int(x) for x in line.split()]
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, f"llama.cpp reference mismatch for {text!r}: {got} != {want}"
        n += 1
    _log(f"tokenizer: matches all {n} reference tokenizations shipped with the llama.cpp vocab")
