#!/usr/bin/env python3
"""Build the small Qwen3-TTS parity fixtures under tests/fixtures/ with the official package.

What it does
------------
* Builds small, randomly initialised Qwen3-TTS **Base** models in the official directory layout
  (``config.json`` with every field, ``generation_config.json``, bf16 ``model.safetensors``, the
  real Qwen2 BPE tokenizer files, a tiny ``speech_tokenizer/``) with the official ``qwen-tts==0.1.1``
  classes (torch, CPU, float32 init, fixed seeds):
    - ``tests/fixtures/tiny-0b6``: talker hidden == code-predictor hidden
      (``small_to_mtp_projection`` is ``Identity``, no tensors), like the 0.6B;
    - ``tests/fixtures/tiny-1b7``: talker hidden != code-predictor hidden (projection ``Linear``), like the 1.7B;
    - ``tiny-0b6/speech_tokenizer`` (linked from tiny-1b7): a tiny 12 Hz codec with the real structure
      (32 encoder quantizers, the wrapper keeps 16) and frame geometry; its encoder codebooks are built
      against the reference clips so that no nearest-neighbour lookup is a near-tie.
* ``tests/fixtures/tiny-0b6-custom``: the CustomVoice layout the official SFT writes from tiny-0b6
  (``tts_model_type="custom_voice"``, ``spk_id`` / ``spk_is_dialect``, no speaker encoder, speaker
  vectors in ``codec_embedding`` rows 3000..3002).
* Re-loads every directory with the official loader (``Qwen3TTSModel.from_pretrained(dir,
  dtype=torch.float32, device_map="cpu")``, i.e. what a user's load gives; the codec with
  ``Qwen3TTSTokenizer.from_pretrained``) and records reference tensors stage by stage into
  ``tests/fixtures/refs/`` (tokenizer ids, log-mel, x-vector, talker prefill, code predictor, codec
  encode / decode with intermediates, and ``<model>.speak.*``: greedy ``generate_voice_clone`` /
  ``generate_custom_voice`` calls with codes, waveforms, prompts, frame counts and EOS steps).
  The talker's EOS row is calibrated on EOS-free probe runs of the speak cases so that some of
  them stop by EOS (``calibrate_eos``).  ``tests/fixtures/README.md`` documents every file and tensor name.
* ``--full-size DEST`` writes a randomly initialised checkpoint with the real 0.6B shapes
  (~1.8 GB, ignored by git) and checks that the official class loads it.

CI never runs this script; it is run by hand and its output is committed.  Re-running it with the
pinned package versions reproduces its output bit for bit on the same machine (fixed seeds, one
thread, deterministic algorithms); on another CPU the last bits of some float results may differ,
since torch's CPU kernels choose code paths by instruction set (a re-run on the 2-core development
machine changed 17 of the committed reference files by about 1e-7 relative, the script before and
after its shared code moved to ``official.py`` alike). The committed reference clips
``tests/fixtures/audio/ref24k.wav`` and ``codec-clip{1,2}.wav`` are reused when present (espeak-ng output differs between versions;
``--regen-audio`` remakes them).  ``scripts/reference/bench_codec.py`` builds the full-size codec
with the same helpers (``official.py``).
After a run that changed the fixture weights, re-run ``scripts/reference/make_train_refs.py`` (its references
are computed from the same weights).  A run takes about a minute on 2 cores when every model is
accepted at its first attempt (each re-drawn attempt adds ~30 s).

Setup: the reference environment in the checkout (``.reference-venv/``, git-ignored; torch from
PyPI pulls the CUDA wheels, ~6 GB on disk, which is fine for a CPU run), with the pinned versions
of ``requirements.txt`` beside this script (``qwen_tts`` imports torchaudio, onnxruntime and sox at
import time through its 25 Hz tokenizer module, accelerate for ``device_map``; gguf only reads the
Qwen2 vocabulary, see below)::

    bash scripts/reference/setup_venv.sh
    apt-get install -y espeak-ng        # only needed when tests/fixtures/audio/*.wav are (re)made

The model builders this script shares with the benchmarks and the other generators (the official
stack's import, the real checkpoints' constants, ``config.json`` with every field, the weight
inits, the shipped codec config) are in ``official.py`` beside it.

Run (from the repository root)::

    .reference-venv/bin/python scripts/reference/make_fixtures.py             # tiny models + references
    .reference-venv/bin/python scripts/reference/make_fixtures.py --full-size .big-fixtures/qwen3-tts-0.6b-random

Tokenizer source: the Hugging Face hub is unreachable here, so the real Qwen2 BPE vocabulary
(``vocab.json`` 151643 entries, ``merges.txt`` 151387 merges) is rebuilt from
``vendor/llama.cpp/models/ggml-vocab-qwen2.gguf`` in the ``llama-cpp-python`` sdist on PyPI
(fetched with ``pip download``; or pass ``--qwen2-gguf PATH``; once committed, the files in
``tests/fixtures/tiny-0b6/`` are reused).  It is verified against the tokenizations that llama.cpp
ships next to that file (made with the Hugging Face tokenizer) and against known Qwen2 ids.

Later issues are expected to extend this script (full generation references, SFT loss/gradient
references): each stage is one ``ref_*`` function taking the loaded official model and returning
tensors + JSON data.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import official  # the official stack and the model builders the scripts here share
from official import (
    TEXT_VOCAB_SIZE,
    NUM_CODE_GROUPS,
    CP_VOCAB_SIZE,
    GENERATION_CONFIG,
    ADDED_TOKENS,
    TINY_SPEAKER,
    build_config_dict,
    verify_config_roundtrip,
    tokenizer_config_dict,
    link_or_copy,
    build_tts_model,
    save_bf16,
    codec_config_dict,
    new_codec_model,
    codec_codebooks,
    init_codec_weights,
    write_codec_dir,
    write_json,
    load_official,
    codec_spec,
    FIXTURES,
)

REFS = FIXTURES / "refs"
AUDIO_WAV = FIXTURES / "audio" / "ref24k.wav"
GGUF_SDIST = "llama-cpp-python==0.3.36"
GGUF_MEMBER = "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"

# The standard Qwen2 pre-tokenizer regex (transformers' Qwen2Converter; what hub-id loads use).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# --------------------------------------------------------------------------------------------
# Model specs
# --------------------------------------------------------------------------------------------


MODEL_SPECS = {
    # like 0.6B: talker hidden == predictor hidden -> small_to_mtp_projection = Identity
    "tiny-0b6": dict(
        size="0b6",
        seed=1000,
        hidden=8,
        intermediate=24,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=8,  # q dim 32 != hidden 8
        mrope_section=[2, 1, 1],  # sums to head_dim/2 (real: [24, 20, 20] for head_dim 128)
        text_hidden=4,
        cp_hidden=8,
        cp_intermediate=24,
        cp_layers=2,
        cp_heads=4,
        cp_kv_heads=2,
        cp_head_dim=8,
        speaker=TINY_SPEAKER,
    ),
    # like 1.7B: talker hidden != predictor hidden -> small_to_mtp_projection = Linear(16 -> 8)
    "tiny-1b7": dict(
        size="1b7",
        seed=2000,
        hidden=16,
        intermediate=48,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=8,  # q dim 32 != hidden 16
        mrope_section=[2, 1, 1],
        text_hidden=4,
        cp_hidden=8,
        cp_intermediate=24,
        cp_layers=2,
        cp_heads=4,
        cp_kv_heads=2,
        cp_head_dim=8,
        speaker=TINY_SPEAKER,
    ),
}

FULL_0B6_SPEC = dict(
    size="0b6",
    seed=600,
    hidden=1024,
    intermediate=3072,
    layers=28,
    heads=16,
    kv_heads=8,
    head_dim=128,
    mrope_section=[24, 20, 20],
    text_hidden=2048,
    cp_hidden=1024,
    cp_intermediate=3072,
    cp_layers=5,
    cp_heads=16,
    cp_kv_heads=8,
    cp_head_dim=128,
    speaker=dict(
        mel_dim=128,
        enc_channels=[512, 512, 512, 512, 1536],
        enc_kernel_sizes=[5, 3, 3, 3, 1],
        enc_dilations=[1, 2, 3, 4, 1],
        enc_attention_channels=128,
        enc_res2net_scale=8,
        enc_se_channels=128,
        sample_rate=24000,
    ),
)

# Tiny 12 Hz speech tokenizer with the real structure and frame geometry (docs/model.md §2, §9): 24 kHz,
# 1920 samples per frame (encoder SEANet 8*6*5*4 = 960 -> 25 Hz, downsample x2; decoder 2*2 * 8*5*4*3),
# encoder with all 32 quantizers (1 semantic + 31 acoustic; the wrapper keeps the first 16) x 2048
# entries, decoder with 16 quantizers x 2048 entries, every layer type of the real codec, tiny widths.
# Ratios kept from the real config: SEANet channels num_filters*2^k, last conv 16*num_filters ->
# hidden (1024 -> 512), decoder head_dim * heads != hidden (64*16 != 512), latent_dim = 2 * hidden,
# decoder codebook entries codebook_dim // 2 wide (512 // 2 = 256 real).
TINY_CODEC = codec_spec(
    encoder=dict(
        hidden_size=16,
        num_filters=2,  # SEANet channels 2 -> 4 -> 8 -> 16 -> 32, then 32 -> hidden 16
        codebook_dim=6,  # = vector_quantization_hidden_dimension (both 256 real); 6 keeps 32 codebooks small
        # num_quantizers stays 32: HF Mimi computes all 32, the wrapper keeps 16 (docs/model.md §14)
        vector_quantization_hidden_dimension=6,
        upsample_groups=16,  # only used by Mimi's upsample, which the Qwen encoder deletes
        num_hidden_layers=2,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    ),
    decoder=dict(
        codebook_dim=4,  # NOT an __init__ parameter (kwargs); entries are codebook_dim // 2 = 2 wide
        hidden_size=16,
        latent_dim=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,  # NOT an __init__ parameter (kwargs); q dim 4*8 = 32 != hidden 16, like 16*64 != 512
        intermediate_size=32,
        num_hidden_layers=2,
        # num_semantic_quantizers, semantic_codebook_size (docs/model.md §13 Q6) stay as shipped:
        # the code reads neither
        vector_quantization_hidden_dimension=4,  # unused by the code
        decoder_dim=32,  # 32 -> 16 -> 8 -> 4 -> 2 channels through the 4 upsampling blocks (real 1536 -> 96)
    ),
)

# Codec references (refs/codec.*): two espeak-ng clips of different lengths (clip1 is not a whole
# number of 1920-sample frames, clip2 is exactly 40 frames), and a > 300-frame decode crossing the
# 300-frame chunk boundary (chunk 300, left context 25; docs/model.md §9.2).
CODEC_SEED = 77
CODEC_CLIPS = [
    dict(name="clip1", wav="codec-clip1.wav", seconds=1.7, voice="en-gb+f3", speed=165, peak=0.7,
         text="Four hours of steady work faced us. The wide road shimmered in the hot sun."),
    dict(name="clip2", wav="codec-clip2.wav", seconds=3.2, voice="en-us", speed=140, peak=0.9,
         text="A large size in stockings is hard to sell. The boy was there when the sun rose."),
]
LONG_DECODE_FRAMES = 330
LONG_DECODE_TAIL_FROM = 290  # refs keep wav[290*1920:] (chunk boundary at frame 300) + every 32nd sample
LONG_DECODE_STRIDE = 32
CODEC_GAP_MIN = 1e-4  # asserted: (d2^2 - d1^2) / (|r|^2 + |e1|^2) for every recorded NN lookup
CODEC_GAP_TARGET = 1e-3  # codebook entries behind a smaller gap are re-drawn while building
CODEC_CLIP_TARGET = 0.02  # fraction of pre-clamp clip1 decode samples with |y| > 1 (exercises the clamp)

# Texts used by the references.
SINGLE_TEXT = "Hello world."
BATCH_TEXTS = ["Hi there, this is a batch.", "The quick brown fox jumps over the lazy dog!"]
BATCH_LANGUAGES = ["English", "Auto"]
REF_TEXT = "Okay. Yeah. I resent you. I love you."
INSTRUCT_TEXT = "Speak slowly, in a warm and calm voice."
ESPEAK_TEXT = "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background."
TOKENIZER_TEXTS = [
    ("digits", "12345 and 3.14"),
    ("camel_case", "CamelCaseWordsLikeThis"),
    ("mixed_case", "camelCase getHTTPResponse iPhone McDonald's"),
    ("contractions", "I'm can't they'll we've"),
    ("contractions_upper", "I'M HE'S THEY'LL"),
    ("unicode", "Grüße, ça va? 你好，世界。 Привет"),
    ("nfc", "cafe\u0301 vs caf\u00e9"),
    ("emoji", "👍🏽 🎉🎉"),
    ("crlf_tabs", "a\r\nb\n\nc\td"),
    ("spaces", "  leading and trailing  "),
    ("multi_spaces", "multiple    spaces\n  \n end"),
    ("slashes_newline", "path/to/file\n/next"),
    ("punct_newlines", "x=1;\n/* c */\n\n// end./\n"),
    ("combining_marks", "नमस्ते दुनिया, สวัสดี"),
    ("special_literal", "<|im_start|>assistant\nHi<|im_end|>"),
    ("tts_special_literal", "<tts_text_bos>x<tts_text_eod><tts_pad>"),
    ("empty", ""),
]

MARGIN_MIN = 0.05  # required top-1/top-2 gap of every greedy decision recorded (logit units)

# Speak references (refs/<model>.speak.*): greedy `generate_voice_clone` / `generate_custom_voice`.
SPEAK_REF_TEXT = "The birch canoe slid on the smooth planks."  # what ref24k.wav says (ICL ref_text)
SPEAK_TEXT = "Good morning, everyone."
SPEAK_SHORT_TEXT = "Hi!"
SPEAK_LONG_TEXT = (
    "Four hours of steady work faced us. The wide road shimmered in the hot sun, and the boy was there when the sun rose."
)
SPEAK_REPPEN_TEXTS = [
    SPEAK_TEXT,
    "Hello world.",
    "It's a nice day.",
    "A large size in stockings is hard to sell.",
    "The quick brown fox jumps over the lazy dog!",
    "Glue the sheet to the dark blue background.",
    "Four hours of steady work faced us.",
    "The boy was there when the sun rose.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage.",
    "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.",
    "The soft cushion broke the man's fall.",
    "The salt breeze came across from the sea.",
    "The girl at the booth sold fifty bonds.",
    "The small pup gnawed a hole in the sock.",
]
SPEAK_MAX_NEW_TOKENS = 11  # -> at most 10 frames (docs/model.md §14); keeps the recorded waveforms small
SPEAK_CASES = [
    dict(name="xvec_auto", texts=[SPEAK_TEXT], languages=["Auto"], mode="xvec", non_streaming_mode=False,
         repetition_penalty=1.0),
    dict(name="xvec_english", texts=[SPEAK_TEXT], languages=["English"], mode="xvec", non_streaming_mode=False,
         repetition_penalty=1.0),
    dict(name="xvec_nonstreaming", texts=[SPEAK_TEXT], languages=["Auto"], mode="xvec", non_streaming_mode=True,
         repetition_penalty=1.0),
    # texts: the first of SPEAK_REPPEN_TEXTS for which the penalty changes a greedy code-0 pick and
    # an EOS row scale qualifies (`reppen_candidates`, `calibrate_eos`)
    dict(name="xvec_reppen", texts=None, languages=["Auto"], mode="xvec", non_streaming_mode=False,
         repetition_penalty=1.05),
    dict(name="icl_long_text", texts=[SPEAK_LONG_TEXT], languages=["Auto"], mode="icl", ref_text=SPEAK_REF_TEXT,
         non_streaming_mode=False, repetition_penalty=1.0, expect_branch="text_longer"),
    dict(name="icl_short_text", texts=[SPEAK_SHORT_TEXT], languages=["Auto"], mode="icl", ref_text=SPEAK_REF_TEXT,
         non_streaming_mode=False, repetition_penalty=1.0, expect_branch="codes_longer"),
    # streaming x-vector prompts have the same length for any text, so the rows' prompts differ by the
    # language prefix (English: 4 codec ids, Auto: 3): row 1 is left-padded by one position; the
    # trailing texts differ in length (row 0's is padded with tts_pad_embed)
    dict(name="batch2", texts=[SPEAK_SHORT_TEXT, SPEAK_LONG_TEXT], languages=["English", "Auto"], mode="xvec",
         non_streaming_mode=False, repetition_penalty=1.0),
]
# CustomVoice fixture tests/fixtures/tiny-0b6-custom (docs/model.md §10.5): speaker -> (codec id, spk_is_dialect,
# clip, sign): talker.model.codec_embedding.weight[id] = sign * x-vector of the clip.  The random
# speaker encoder gives nearly the same x-vector for every clip (cosine ~0.99), so bob's row is a
# negated x-vector: a distinct speaker vector that visibly changes the generated codes.
CUSTOM_NAME = "tiny-0b6-custom"
CUSTOM_BASE = "tiny-0b6"
CUSTOM_SPEAKERS = {
    "alice": (3000, False, "ref24k.wav", 1.0),
    "bob": (3001, False, "codec-clip2.wav", -1.0),
    "carol": (3002, "sichuan_dialect", "codec-clip1.wav", 1.0),
}
CUSTOM_DIALECT_LANGUAGE_ID = {"sichuan_dialect": 2062, "beijing_dialect": 2074}  # as the CustomVoice configs
CUSTOM_CASES = [
    dict(name="alice_auto", texts=[SPEAK_TEXT], languages=["Auto"], speaker="alice", repetition_penalty=1.05),
    dict(name="alice_english", texts=[SPEAK_TEXT], languages=["English"], speaker="alice", repetition_penalty=1.05),
    dict(name="bob_auto", texts=[SPEAK_TEXT], languages=["Auto"], speaker="bob", repetition_penalty=1.05),
    # dialect rule (docs/model.md §6): language auto/chinese + a dialect speaker -> think prefix with the dialect id
    dict(name="carol_dialect_auto", texts=[SPEAK_TEXT], languages=["Auto"], speaker="carol", repetition_penalty=1.05),
]
# EOS calibration (see `calibrate_eos`): the talker's codec_head row EOS (2150) is replaced by a scaled
# direction so that greedy generation stops by EOS in some speak cases and runs to max_new_tokens in others.
EOS_SCALE_GRID = [round(1.04**k, 6) for k in range(0, 160)]
EOS_DIRECTIONS = 64  # row directions tried: the initialised row, then seeded random ones
EOS_PREDICT_SAFETY = 0.5  # predicted gaps involving EOS must exceed this (logit units; prediction error ~1e-4)


# --------------------------------------------------------------------------------------------
# Imports of the heavy packages (after argparse so --help works without them)
# --------------------------------------------------------------------------------------------


def _import_stack():
    """The official stack (`official.import_stack`), bound here too: the reference functions below
    use torch, numpy and the official classes by their plain names."""
    global np, torch, librosa, sf, safetensors_save, mel_spectrogram, Qwen3TTSModel, Qwen3TTSTokenizer
    s = official.import_stack()
    np, torch, librosa, sf = s["np"], s["torch"], s["librosa"], s["sf"]
    safetensors_save, mel_spectrogram = s["safetensors_save"], s["mel_spectrogram"]
    Qwen3TTSModel, Qwen3TTSTokenizer = s["Qwen3TTSModel"], s["Qwen3TTSTokenizer"]


def _log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# config.json (every field; docs/model.md §14: save_pretrained would only write non-defaults)
# --------------------------------------------------------------------------------------------












# --------------------------------------------------------------------------------------------
# Qwen2 BPE vocabulary
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


















def _encoder_latent(model, x):
    """Encoder up to the quantizer, exactly as `MimiModel._encode_frame` runs it: returns
    (seanet, transformer, latent) for input (B, 1, samples)."""
    enc = model.encoder
    seanet = enc.encoder(x)
    tr = enc.encoder_transformer(seanet.transpose(1, 2), return_dict=True).last_hidden_state
    latent = enc.downsample(tr.transpose(1, 2))
    return seanet, tr, latent


def _nn_with_gaps(r, embed):
    """Nearest neighbour of every row of r (N, D) among embed (K, D) in float64, with the relative
    gap (d2^2 - d1^2) / (|r|^2 + |e1|^2) between the best and second-best squared distances."""
    r64, e64 = r.double(), embed.double()
    d = ((r64[:, None, :] - e64[None, :, :]) ** 2).sum(-1)
    top = torch.topk(d, 2, dim=1, largest=False)
    d1, d2 = top.values[:, 0], top.values[:, 1]
    idx = top.indices[:, 0]
    gap = (d2 - d1) / ((r64**2).sum(-1) + (e64[idx] ** 2).sum(-1))
    return idx, top.indices[:, 1], gap


def _mimi_embed(embed_sum, usage):
    return embed_sum / usage.clamp(min=1e-5)[:, None]  # MimiEuclideanCodebook.embed (epsilon 1e-5)


def _rvq_replay(x, codebooks):
    """Residual VQ as MimiResidualVectorQuantizer.encode computes it (f32 residuals), rows of x
    (N, D); returns codes (N, L) and the relative NN gaps (N, L)."""
    r = x.clone()
    codes, gaps = [], []
    for embed_sum, usage in codebooks:
        embed = _mimi_embed(embed_sum, usage)
        idx, _, gap = _nn_with_gaps(r, embed)
        codes.append(idx)
        gaps.append(gap)
        r = r - embed[idx]
    return torch.stack(codes, 1), torch.stack(gaps, 1)


def _build_rvq_codebooks(x, n_layers: int, scale: float, gen) -> tuple[list, int]:
    """Codebooks for one residual VQ, layer by layer, such that every lookup of the rows of x
    (N, D) has a relative gap >= CODEC_GAP_TARGET: the two entries behind any smaller gap are
    re-drawn.  Entries N(0, scale^2), every layer the same scale, so the residual stays O(scale)
    instead of collapsing towards float32 noise (8-dim codebooks would otherwise shrink it ~0.5x
    per layer)."""
    out, redrawn = [], 0
    r = x.clone()
    dim = x.shape[1]
    for _ in range(n_layers):
        usage = 0.5 + torch.rand(2048, generator=gen)
        base = torch.randn(2048, dim, generator=gen) * scale
        for _ in range(1000):
            embed_sum = base * usage[:, None]
            embed = _mimi_embed(embed_sum, usage)
            idx, idx2, gap = _nn_with_gaps(r, embed)
            bad = gap < CODEC_GAP_TARGET
            if not bool(bad.any()):
                break
            rows = torch.unique(torch.cat([idx[bad], idx2[bad]]))
            base[rows] = torch.randn(len(rows), dim, generator=gen) * scale
            redrawn += len(rows)
        else:
            raise SystemExit("could not build near-tie-free codebooks")
        out.append((embed_sum, usage))
        r = r - embed[idx]
    return out, redrawn


def build_tiny_codec(clips: dict, seed: int) -> tuple[dict, dict, dict]:
    """The tiny codec: init, then encoder codebooks built against the latents of every input
    the references encode (clip1, clip2, and the right-padded batch of both), then the last
    decoder conv scaled so that ~2 % of clip1's pre-clamp decode lies outside [-1, 1].
    Returns (config dict, f32 state dict, build info)."""
    cfg = codec_config_dict(TINY_CODEC)
    model = new_codec_model(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    init_codec_weights(model, gen)
    q = model.encoder.quantizer
    sem, aco = q.semantic_residual_vector_quantizer, q.acoustic_residual_vector_quantizer
    info = {}
    with torch.no_grad():
        # every (input, kept frames) pair the references will quantize
        a1, a2 = clips["clip1"], clips["clip2"]
        batch = torch.zeros(2, max(len(a1), len(a2)))
        batch[0, : len(a1)] = torch.from_numpy(a1)
        batch[1, : len(a2)] = torch.from_numpy(a2)
        inputs = [(torch.from_numpy(a)[None, None], [-(-len(a) // 1920)]) for a in (a1, a2)]
        inputs.append((batch[:, None], [-(-len(a1) // 1920), -(-len(a2) // 1920)]))
        xs, xa = [], []
        for x, keep in inputs:
            seanet, tr, latent = _encoder_latent(model, x)
            ps, pa = sem.input_proj(latent), aco.input_proj(latent)
            for b, n in enumerate(keep):
                xs.append(ps[b, :, :n].T)
                xa.append(pa[b, :, :n].T)
            info.setdefault("rms", {}).setdefault("seanet", float(seanet.pow(2).mean().sqrt()))
            info["rms"].setdefault("transformer", float(tr.pow(2).mean().sqrt()))
            info["rms"].setdefault("latent", float(latent.pow(2).mean().sqrt()))
        xs, xa = torch.cat(xs), torch.cat(xa)
        s_scale, a_scale = float(xs.pow(2).mean().sqrt()), float(xa.pow(2).mean().sqrt())
        sem_cbs, n1 = _build_rvq_codebooks(xs, len(sem.layers), s_scale, gen)
        aco_cbs, n2 = _build_rvq_codebooks(xa, len(aco.layers), a_scale, gen)
        enc_cbs, _ = codec_codebooks(model)
        for (emb, usage), (new_emb, new_usage) in zip(enc_cbs, sem_cbs + aco_cbs):
            emb.copy_(new_emb)
            usage.copy_(new_usage)
        info.update(codebook_scale=dict(semantic=s_scale, acoustic=a_scale), entries_redrawn=n1 + n2)

        # decoder output scale: clip1's codes (replayed) through the decoder, pre-clamp quantile
        n1f = -(-len(a1) // 1920)
        c_sem, _ = _rvq_replay(xs[:n1f], sem_cbs)
        c_aco, _ = _rvq_replay(xa[:n1f], aco_cbs[:15])
        codes = torch.cat([c_sem, c_aco], 1).T[None]  # (1, 16, T)
        final = model.decoder.decoder[-1]
        y = final(_decoder_trunk(model.decoder, codes))
        k = 1.0 / float(torch.quantile(y.abs().flatten(), 1.0 - CODEC_CLIP_TARGET))
        final.conv.weight.mul_(k)
        final.conv.bias.mul_(k)
        info.update(final_conv_scale=k, preclamp_rms_after_scaling=float((k * y).pow(2).mean().sqrt()))
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    return cfg, sd, info


def _decoder_trunk(dec, codes):
    """Qwen3TTSTokenizerV2Decoder.forward up to (not including) the last conv."""
    hidden = dec.quantizer.decode(codes)
    hidden = dec.pre_conv(hidden).transpose(1, 2)
    hidden = dec.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
    for blocks in dec.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in dec.decoder[:-1]:
        hidden = block(hidden)
    return hidden




def write_speech_tokenizer(dst: Path, seed: int, cfg: dict | None = None) -> None:
    """A random codec (no data-dependent codebooks; used by --full-size)."""
    cfg = cfg or codec_config_dict(TINY_CODEC)
    model = new_codec_model(cfg, seed)
    init_codec_weights(model, torch.Generator().manual_seed(seed))
    write_codec_dir(dst, cfg, {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()})






def verify_loaded_weights(tts, saved: dict) -> None:
    """Every saved tensor is loaded (as f32 of the bf16 value) and every parameter came from the file."""
    sd = tts.model.state_dict()
    sd = {k: v for k, v in sd.items() if not k.startswith("speech_tokenizer")}
    assert set(sd) == set(saved), (set(sd) ^ set(saved))
    for k, v in saved.items():
        assert sd[k].dtype == torch.float32, (k, sd[k].dtype)
        assert torch.equal(sd[k], v.to(torch.float32)), k


# --------------------------------------------------------------------------------------------
# Reference audio
# --------------------------------------------------------------------------------------------


def _espeak_clip(path: Path, text: str, voice: str, speed: int, seconds: float, peak: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "espeak.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(raw), text], check=True)
        y, sr = librosa.load(str(raw), sr=None, mono=True)
    y = librosa.resample(y, orig_sr=sr, target_sr=24000)  # librosa default (soxr_hq), as the official code
    y, _ = librosa.effects.trim(y, top_db=40)
    n = int(round(seconds * 24000))
    assert len(y) >= n, f"espeak-ng output too short for {seconds} s"
    y = y[:n]
    y = peak * y / np.max(np.abs(y))
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), y, 24000, subtype="PCM_16")
    _log(f"wrote {path} ({len(y) / 24000:.2f} s)")


def make_reference_audio(regen: bool) -> None:
    if AUDIO_WAV.exists() and not regen:
        return
    _espeak_clip(AUDIO_WAV, ESPEAK_TEXT, "en-us", 150, 2.6, 0.6)


def make_codec_audio(regen: bool) -> dict:
    """The codec reference clips (tests/fixtures/audio/codec-clip*.wav), made once with espeak-ng
    and then reused; returns {name: samples as read back from the file}."""
    out = {}
    for c in CODEC_CLIPS:
        path = FIXTURES / "audio" / c["wav"]
        if regen or not path.exists():
            _espeak_clip(path, c["text"], c["voice"], c["speed"], c["seconds"], c["peak"])
        out[c["name"]] = read_wav_24k(path)
        assert len(out[c["name"]]) == int(round(c["seconds"] * 24000))
    return out


def read_wav_24k(path: Path):
    # Exactly how the official wrappers read a path (`_load_audio_to_np`, `Qwen3TTSTokenizer.load_audio`):
    # librosa.load(sr=None) -> int16 / 32768 for a 16-bit WAV.
    audio, sr = librosa.load(str(path), sr=None, mono=True)
    audio = audio.astype(np.float32)
    assert sr == 24000
    pcm, sr2 = sf.read(str(path), dtype="int16")
    assert sr2 == 24000 and np.array_equal(audio, pcm.astype(np.float32) / 32768.0)
    return audio


def read_reference_audio():
    return read_wav_24k(AUDIO_WAV)



# --------------------------------------------------------------------------------------------
# Reference stages
# --------------------------------------------------------------------------------------------


def ref_tokenizer(tts, std_tok, model_dir: Path) -> list[dict]:
    """Tokenizer cases through the official processor (what `_tokenize_texts` calls)."""
    cases = list(TOKENIZER_TEXTS) + [
        ("assistant_prompt", tts._build_assistant_text(SINGLE_TEXT)),
        ("assistant_prompt_batch0", tts._build_assistant_text(BATCH_TEXTS[0])),
        ("assistant_prompt_batch1", tts._build_assistant_text(BATCH_TEXTS[1])),
        ("ref_prompt", tts._build_ref_text(REF_TEXT)),
        ("instruct_prompt", tts._build_instruct_text(INSTRUCT_TEXT)),
    ]
    patched = _regex_patched_processor(model_dir)
    out = []
    for name, text in cases:
        ids = tts._tokenize_texts([text])[0]
        ids = ids.reshape(-1).tolist()
        std = std_tok.encode(text, add_special_tokens=False).ids
        assert ids == std, f"official processor differs from the standard Qwen2 tokenization for {name}: {ids} vs {std}"
        entry = dict(name=name, text=text, ids=ids)
        pids = patched(text=[text], return_tensors="pt", padding=True)["input_ids"].reshape(-1).tolist()
        if pids != ids:
            entry["ids_mistral_regex_patched"] = pids
        out.append(entry)
    return out


def _regex_patched_processor(model_dir: Path):
    """The processor an official local-dir load gives when config.json says transformers 4.57.3."""
    from transformers import AutoProcessor

    with tempfile.TemporaryDirectory() as tmp:
        for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            shutil.copy2(model_dir / f, Path(tmp) / f)
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg["transformers_version"] = "4.57.3"
        write_json(Path(tmp) / "config.json", cfg)
        proc = AutoProcessor.from_pretrained(tmp, fix_mistral_regex=True)
    assert getattr(proc.tokenizer, "fix_mistral_regex", False), "expected the regex patch to apply"
    return proc


def ref_mel(audio) -> dict:
    # Exactly as `extract_speaker_embedding` calls it.
    mel = mel_spectrogram(
        torch.from_numpy(audio).unsqueeze(0),
        n_fft=1024,
        num_mels=128,
        sampling_rate=24000,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12000,
    ).transpose(1, 2)
    n = len(audio)
    assert mel.shape == (1, 1 + (n + 768 - 1024) // 256, 128), mel.shape
    return {"audio.mel": mel[0].contiguous()}


def ref_xvector(tts, audio) -> torch.Tensor:
    return tts.model.extract_speaker_embedding(audio, sr=24000).detach().clone()


class _Capture:
    """Forward hooks on the talker and the code predictor during one generate call."""

    def __init__(self, tts):
        self.talker_calls = []
        self.cp_calls = []
        self.generated = None
        self.handles = [
            tts.model.talker.register_forward_hook(self._talker_hook, with_kwargs=True),
            tts.model.talker.code_predictor.register_forward_hook(self._cp_hook, with_kwargs=True),
        ]
        self._orig_generate = tts.model.generate
        self._tts = tts

        def wrapped(*a, **kw):
            res = self._orig_generate(*a, **kw)
            self.generated = res
            return res

        tts.model.generate = wrapped

    def _talker_hook(self, module, args, kwargs, output):
        rec = dict(logits=output.logits.detach().clone())
        if len(self.talker_calls) == 0:
            assert kwargs["inputs_embeds"].shape[1] > 1, "first talker call must be the prefill"
            rec.update(
                inputs_embeds=kwargs["inputs_embeds"].detach().clone(),
                attention_mask=kwargs["attention_mask"].detach().clone(),
                hidden_states=torch.stack([h.detach().clone() for h in output.hidden_states[0]]),
                hidden=output.hidden_states[0][-1].detach().clone(),
                trailing_text_hidden=kwargs["trailing_text_hidden"].detach().clone(),
                tts_pad_embed=kwargs["tts_pad_embed"].detach().clone(),
            )
        self.talker_calls.append(rec)

    def _cp_hook(self, module, args, kwargs, output):
        self.cp_calls.append(output.logits[:, -1, :].detach().clone())

    def close(self):
        for h in self.handles:
            h.remove()
        del self._tts.model.generate  # back to the class method


def _margin(x) -> float:
    top = torch.topk(x.double(), 2).values
    return float(top[0] - top[1])


def _check_talker_decisions(cap: _Capture, eos: int, vocab: int) -> tuple[list, list[float]]:
    """Replays the official logits processors (repetition penalty 1.05 over generated code-0 ids,
    min_new_tokens=2, suppress 2048..3071 except EOS) on the captured talker logits; returns the
    greedy code-0 ids per row and the top-1/top-2 margins."""
    bsz = cap.talker_calls[0]["logits"].shape[0]
    history = [[] for _ in range(bsz)]
    margins = []
    for step, rec in enumerate(cap.talker_calls):
        logits = rec["logits"][:, -1, :].float().clone()
        for b in range(bsz):
            s = logits[b]
            for t in set(history[b]):
                s[t] = s[t] * 1.05 if s[t] < 0 else s[t] / 1.05
            if step < 2:
                s[eos] = float("-inf")
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[vocab - 1024:] = True
            mask[eos] = False
            s[mask] = float("-inf")
            history[b].append(int(torch.argmax(s)))
            margins.append(_margin(s))
    return history, margins


def ref_talker(tts, texts: list[str], languages: list[str], prefix: str, max_new_tokens: int = 3):
    """Prefill capture inside the official generate_voice_clone (x-vector only, streaming text)."""
    cap = _Capture(tts)
    try:
        torch.manual_seed(0)
        tts.generate_voice_clone(
            text=texts if len(texts) > 1 else texts[0],
            language=languages if len(languages) > 1 else languages[0],
            ref_audio=str(AUDIO_WAV),
            x_vector_only_mode=True,
            non_streaming_mode=False,
            do_sample=False,
            subtalker_dosample=False,
            max_new_tokens=max_new_tokens,
        )
    finally:
        cap.close()
    pre = cap.talker_calls[0]
    tcfg = tts.model.config.talker_config
    c0_hist, tmargins = _check_talker_decisions(cap, tcfg.codec_eos_token_id, tcfg.vocab_size)
    codes_list, _ = cap.generated
    # Code predictor decisions inside the loop (greedy, raw logits).
    cmargins = [_margin(l[b]) for l in cap.cp_calls for b in range(l.shape[0])]
    n_frames = [int(c.shape[0]) for c in codes_list]
    for b, c in enumerate(codes_list):
        assert c.shape[0] <= max_new_tokens - 1
        assert c[:, 0].tolist() == c0_hist[b][: c.shape[0]], "replayed talker greedy picks differ from the official codes"
    cp_steps = len(cap.cp_calls)
    assert cp_steps == (NUM_CODE_GROUPS - 1) * (max_new_tokens - 1), cp_steps
    for f in range(max_new_tokens - 1):
        picks = torch.stack([torch.argmax(cap.cp_calls[f * 15 + j], dim=-1) for j in range(15)], dim=1)
        for b, c in enumerate(codes_list):
            if f < c.shape[0]:
                assert c[f, 1:].tolist() == picks[b].tolist(), "predictor greedy picks differ from official codes"

    input_ids = [tts._tokenize_texts([tts._build_assistant_text(t)])[0].reshape(-1) for t in texts]
    tensors = {
        f"{prefix}.inputs_embeds": pre["inputs_embeds"],
        f"{prefix}.attention_mask": pre["attention_mask"].to(torch.int64),
        f"{prefix}.hidden": pre["hidden"],
        f"{prefix}.hidden_states": pre["hidden_states"],
        f"{prefix}.logits": pre["logits"],
        f"{prefix}.trailing_text_hidden": pre["trailing_text_hidden"],
        f"{prefix}.tts_pad_embed": pre["tts_pad_embed"].reshape(-1),
    }
    for b, ids in enumerate(input_ids):
        tensors[f"{prefix}.input_ids.{b}"] = ids.to(torch.int64)
        tensors[f"{prefix}.codes.{b}"] = codes_list[b].to(torch.int64).reshape(-1, NUM_CODE_GROUPS)
    meta = dict(
        texts=texts,
        languages=languages,
        input_ids=[i.tolist() for i in input_ids],
        prompt_lengths=pre["attention_mask"].sum(-1).tolist(),
        max_new_tokens=max_new_tokens,
        greedy_code0=c0_hist,
        codes=[c.tolist() for c in codes_list],
        frames=n_frames,
        min_margin_talker=min(tmargins),
        min_margin_code_predictor=min(cmargins),
    )
    return tensors, meta, pre


def ref_code_predictor(tts, h: torch.Tensor, seed: int):
    """Teacher-forced logits (forward_sub_talker_finetune) and greedy generation (as the talker calls it)."""
    talker = tts.model.talker
    gen = torch.Generator().manual_seed(seed)
    frame = torch.randint(0, CP_VOCAB_SIZE, (NUM_CODE_GROUPS,), generator=gen)
    with torch.no_grad():
        tf_logits, _ = talker.forward_sub_talker_finetune(frame[None], h[None])
        tf_logits = tf_logits[0]
        # Manual check of the documented input layout.
        embeds = [h[None], talker.get_input_embeddings()(frame[:1])]
        embeds += [talker.code_predictor.get_input_embeddings()[i - 1](frame[i : i + 1]) for i in range(1, 15)]
        x = talker.code_predictor.small_to_mtp_projection(torch.cat(embeds, 0)[None])
        hid = talker.code_predictor.model(inputs_embeds=x).last_hidden_state[0]
        manual = torch.stack([talker.code_predictor.lm_head[j](hid[j + 1]) for j in range(15)])
        assert torch.allclose(manual, tf_logits, atol=1e-5, rtol=0), (manual - tf_logits).abs().max()

        c0 = frame[:1]
        res = talker.code_predictor.generate(
            inputs_embeds=torch.cat((h[None, None], talker.get_input_embeddings()(c0[None])), dim=1),
            max_new_tokens=NUM_CODE_GROUPS - 1,
            do_sample=False,
            top_p=1.0,
            top_k=50,
            temperature=0.9,
            output_hidden_states=True,
            return_dict_in_generate=True,
            output_logits=True,
        )
    greedy = res.sequences[0]
    glogits = torch.stack([l[0] for l in res.logits])
    assert greedy.shape == (15,) and torch.equal(greedy, glogits.argmax(-1))
    margins = [_margin(l) for l in glogits] + [_margin(l) for l in tf_logits]
    tensors = {
        "cp.h": h.clone(),
        "cp.frame": frame.to(torch.int64),
        "cp.teacher_forced_logits": tf_logits.contiguous(),
        "cp.greedy_codes": greedy.to(torch.int64),
    }
    meta = dict(frame=frame.tolist(), c0=int(c0[0]), greedy_codes=greedy.tolist(), min_margin=min(margins),
                min_margin_greedy=min(margins[:15]))
    return tensors, meta


class _Hooks:
    """Forward hooks that record module outputs (one entry per call)."""

    def __init__(self):
        self.rec, self.handles = {}, []

    def add(self, module, key: str, pick=lambda o: o):
        def hook(_m, _a, out):
            self.rec.setdefault(key, []).append(pick(out).detach().clone())

        self.handles.append(module.register_forward_hook(hook))

    def wrap_method(self, obj, name: str, key: str):
        orig = getattr(obj, name)

        def wrapped(*a, **kw):
            out = orig(*a, **kw)
            self.rec.setdefault(key, []).append(out.detach().clone())
            return out

        setattr(obj, name, wrapped)
        self.handles.append(_Restore(obj, name))

    def reset(self):
        self.rec = {}

    def close(self):
        for h in self.handles:
            h.remove()


class _Restore:
    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def remove(self):
        delattr(self.obj, self.name)  # back to the class method


def _codec_gaps(model, proj_s, proj_a, codes32, n_keep: int):
    """Replays the 32 NN lookups of every frame (rows of the captured input projections) in
    float64, checks them against the official codes, returns the relative gaps (frames, 32)."""
    q = model.encoder.quantizer
    sem = [(l.codebook.embed_sum, l.codebook.cluster_usage) for l in q.semantic_residual_vector_quantizer.layers]
    aco = [(l.codebook.embed_sum, l.codebook.cluster_usage) for l in q.acoustic_residual_vector_quantizer.layers]
    xs, xa = proj_s[:, :n_keep].T, proj_a[:, :n_keep].T
    c_s, g_s = _rvq_replay(xs, sem)
    c_a, g_a = _rvq_replay(xa, aco)
    codes, gaps = torch.cat([c_s, c_a], 1), torch.cat([g_s, g_a], 1)
    assert torch.equal(codes, codes32[:n_keep]), "float64 NN replay disagrees with the official codes"
    return gaps


def ref_codec(codec_dir: Path, saved: dict, clips: dict) -> tuple[dict, dict]:
    """Codec references through the official wrapper (`Qwen3TTSTokenizer.encode/decode`) on the
    re-loaded directory, float32, plus intermediates captured with hooks."""
    tok = Qwen3TTSTokenizer.from_pretrained(str(codec_dir), dtype=torch.float32, device_map="cpu")
    model = tok.model
    sd = model.state_dict()
    assert set(sd) == set(saved), set(sd) ^ set(saved)
    for k, v in saved.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v), k
    enc, dec = model.encoder, model.decoder
    assert enc.upsample is None and enc.decoder is None and enc.decoder_transformer is None
    assert int(tok.feature_extractor.sampling_rate) == 24000
    tensors, meta = {}, dict(
        attn_implementation=dict(encoder=model.config.encoder_config._attn_implementation,
                                 decoder=model.config.decoder_config._attn_implementation),
        config=dict(encoder={k: TINY_CODEC["encoder"][k] for k in (
            "hidden_size", "num_filters", "num_hidden_layers", "num_attention_heads", "head_dim",
            "intermediate_size", "codebook_size", "codebook_dim", "num_quantizers", "num_semantic_quantizers",
            "upsampling_ratios", "sliding_window")},
            decoder={k: TINY_CODEC["decoder"][k] for k in (
            "codebook_dim", "hidden_size", "latent_dim", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "num_hidden_layers", "num_quantizers", "sliding_window", "upsample_rates",
            "upsampling_ratios", "decoder_dim")}),
    )
    h = _Hooks()
    h.add(enc.encoder, "seanet")
    h.add(enc.encoder_transformer, "transformer", lambda o: o[0])
    h.add(enc.downsample, "downsample")
    h.add(enc.quantizer.semantic_residual_vector_quantizer.input_proj, "proj_s")
    h.add(enc.quantizer.acoustic_residual_vector_quantizer.input_proj, "proj_a")
    all_gaps, kept_gaps = [], []
    clip_meta, enc_out = {}, {}
    try:
        with torch.inference_mode():
            for c in CODEC_CLIPS:
                name, path = c["name"], FIXTURES / "audio" / c["wav"]
                audio = clips[name]
                n = len(audio)
                h.reset()
                out = tok.encode(str(path))  # a path: librosa.load(sr=None), 24 kHz -> no resampling
                enc_out[name] = out
                (codes,) = out.audio_codes
                frames = -(-n // 1920)
                assert codes.shape == (frames, 16) and codes.dtype == torch.int64, codes.shape
                # all 32 quantizers, as MimiModel.encode computes them (the wrapper keeps 16)
                codes32 = enc.encode(torch.from_numpy(audio)[None, None], return_dict=True).audio_codes[0].T
                assert torch.equal(codes32[:, :16], codes)
                rec = {k: v[0] for k, v in h.rec.items()}
                gaps = _codec_gaps(model, rec["proj_s"][0], rec["proj_a"][0], codes32, frames)
                all_gaps.append(gaps)
                kept_gaps.append(gaps[:, :16])
                tensors[f"encode.{name}.codes"] = codes.contiguous()
                if name == "clip1":
                    tensors[f"encode.{name}.seanet"] = rec["seanet"].contiguous()
                    tensors[f"encode.{name}.transformer"] = rec["transformer"].contiguous()
                    tensors[f"encode.{name}.latent"] = rec["downsample"].contiguous()
                    tensors[f"encode.{name}.semantic_proj"] = rec["proj_s"].contiguous()
                    tensors[f"encode.{name}.acoustic_proj"] = rec["proj_a"].contiguous()
                    tensors[f"encode.{name}.codes_all"] = codes32.contiguous()
                else:
                    tensors[f"encode.{name}.latent"] = rec["downsample"].contiguous()
                clip_meta[name] = dict(
                    wav=f"audio/{c['wav']}",
                    wav_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                    samples=n,
                    seconds=n / 24000,
                    whole_frames=n % 1920 == 0,
                    frames=frames,
                    seanet_frames=int(rec["seanet"].shape[-1]),
                    first_samples=[float(x) for x in audio[:8]],
                    made_from=f"espeak-ng -v {c['voice']} -s {c['speed']} {c['text']!r} -> librosa resample to 24 kHz "
                    f"(soxr_hq) -> trim silence (top_db 40) -> first {c['seconds']} s -> peak {c['peak']} -> 16-bit PCM",
                    codes=codes.tolist(),
                    min_rel_gap_kept=float(gaps[:, :16].min()),
                    min_rel_gap_all32=float(gaps.min()),
                )

            # right-padded batch of both clips (the wrapper pads to the batch max, keeps ceil(n/1920) frames)
            h.reset()
            paths = [str(FIXTURES / "audio" / c["wav"]) for c in CODEC_CLIPS]
            out = tok.encode(paths)
            rec = {k: v[0] for k, v in h.rec.items()}
            padded = max(len(clips[c["name"]]) for c in CODEC_CLIPS)
            batch_meta = dict(padded_samples=padded)
            batch = np.stack([np.pad(clips[c["name"]], (0, padded - len(clips[c["name"]]))) for c in CODEC_CLIPS])
            codes32_b = enc.encode(torch.from_numpy(batch)[:, None], return_dict=True).audio_codes
            for b, c in enumerate(CODEC_CLIPS):
                codes = out.audio_codes[b]
                single = tensors[f"encode.{c['name']}.codes"]
                assert codes.shape == single.shape
                assert torch.equal(codes32_b[b, :16, : codes.shape[0]].T, codes)
                gaps = _codec_gaps(model, rec["proj_s"][b], rec["proj_a"][b], codes32_b[b].T, codes.shape[0])
                kept_gaps.append(gaps[:, :16])
                all_gaps.append(gaps)
                tensors[f"encode.batch.codes.{b}"] = codes.contiguous()
                diff = (codes != single).any(-1).nonzero().flatten().tolist()
                batch_meta[f"row{b}"] = dict(frames=int(codes.shape[0]), frames_differing_from_single_encode=diff)
            meta["encode_batch"] = batch_meta
            meta["clips"] = clip_meta

            # (b) decode clip1's codes through the wrapper, with intermediates
            h.close()
            h = _Hooks()
            h.wrap_method(dec.quantizer, "decode", "quantized")
            h.add(dec.pre_conv, "pre_conv")
            h.add(dec.pre_transformer, "pre_transformer", lambda o: o.last_hidden_state)
            h.add(dec.upsample[0][1], "upsample.0")
            h.add(dec.upsample[1][1], "upsample.1")
            h.add(dec.decoder[0], "decoder.0")
            h.add(dec.decoder[1], "decoder.1")
            h.add(dec.decoder[-1], "preclamp")
            wavs, sr = tok.decode(enc_out["clip1"])
            assert sr == 24000 and len(wavs) == 1
            wav = torch.from_numpy(wavs[0])
            n1 = tensors["encode.clip1.codes"].shape[0]
            assert wav.shape == (n1 * 1920,), wav.shape
            rec = {k: v for k, v in h.rec.items()}
            assert all(len(v) == 1 for v in rec.values()), "clip1 decode must be one chunk"
            rec = {k: v[0] for k, v in rec.items()}
            pre = rec["preclamp"].reshape(-1)
            assert torch.equal(pre.clamp(-1, 1), wav)
            for k in ("quantized", "pre_conv", "pre_transformer", "upsample.0", "upsample.1", "decoder.0", "decoder.1"):
                tensors[f"decode.clip1.{k}"] = rec[k].contiguous()
            tensors["decode.clip1.wav_preclamp"] = pre.contiguous()
            tensors["decode.clip1.wav"] = wav.contiguous()
            clipped = float((pre.abs() > 1).float().mean())
            # batched decode (pad -1) of both clips: row 0 vs the single decode
            wavs_b, _ = tok.decode([{"audio_codes": tensors[f"encode.{c['name']}.codes"]} for c in CODEC_CLIPS])
            meta["decode_clip1"] = dict(
                frames=n1,
                samples=int(wav.shape[0]),
                fraction_clamped=clipped,
                max_abs_preclamp=float(pre.abs().max()),
                rms=float(wav.pow(2).mean().sqrt()),
                batched_decode_row0_max_abs_diff=float(np.abs(wavs_b[0] - wavs[0]).max()),
                batched_decode_lengths=[int(w.shape[0]) for w in wavs_b],
            )

            # (c) > 300 frames: chunked decode (chunk 300, left context 25)
            h.reset()
            gen = torch.Generator().manual_seed(CODEC_SEED + LONG_DECODE_FRAMES)
            codes = torch.randint(0, 2048, (LONG_DECODE_FRAMES, 16), generator=gen)
            wavs, _ = tok.decode({"audio_codes": codes})
            wav = torch.from_numpy(wavs[0])
            assert wav.shape == (LONG_DECODE_FRAMES * 1920,)
            pts = h.rec["pre_transformer"]
            assert [p.shape[1] for p in pts] == [300, 25 + LONG_DECODE_FRAMES - 300], [p.shape for p in pts]
            single = dec(codes.T[None])[0, 0]  # one pass, no chunking (what a naive port computes)
            b = 300 * 1920
            tail_from = LONG_DECODE_TAIL_FROM * 1920
            tensors["decode.long.codes"] = codes.contiguous()
            tensors["decode.long.pre_transformer.chunk0"] = pts[0].contiguous()
            tensors["decode.long.pre_transformer.chunk1"] = pts[1].contiguous()
            tensors["decode.long.wav_tail"] = wav[tail_from:].contiguous()
            tensors[f"decode.long.wav_stride{LONG_DECODE_STRIDE}"] = wav[::LONG_DECODE_STRIDE].contiguous()
            meta["decode_long"] = dict(
                frames=LONG_DECODE_FRAMES,
                samples=int(wav.shape[0]),
                codes_seed=CODEC_SEED + LONG_DECODE_FRAMES,
                chunks=[dict(frames=[0, 300], context=0), dict(frames=[275, LONG_DECODE_FRAMES], context=25)],
                wav_tail_from_sample=tail_from,
                sum=float(wav.double().sum()),
                sum_abs=float(wav.double().abs().sum()),
                max_abs=float(wav.abs().max()),
                fraction_clamped=float((wav.abs() >= 1).float().mean()),
                single_pass_max_abs_diff_before_300=float((single[:b] - wav[:b]).abs().max()),
                single_pass_max_abs_diff_from_300=float((single[b:] - wav[b:]).abs().max()),
            )
    finally:
        h.close()
    kept = torch.cat([g.flatten() for g in kept_gaps])
    allg = torch.cat([g.flatten() for g in all_gaps])
    meta["min_rel_gap"] = dict(
        definition="(d2^2 - d1^2) / (|r|^2 + |e1|^2): best vs second-best squared distance of each nearest-neighbour "
        "lookup (r = residual entering the quantizer layer, e1 = chosen entry), float64 replay of the official f32 "
        "inputs; over clip1, clip2 and both batch rows",
        kept_16=float(kept.min()),
        all_32=float(allg.min()),
        lookups_kept=int(kept.numel()),
        asserted_min=CODEC_GAP_MIN,
    )
    assert float(kept.min()) >= CODEC_GAP_MIN and float(allg.min()) >= CODEC_GAP_MIN, meta["min_rel_gap"]
    meta["tensors"] = {k: dict(shape=list(v.shape), dtype=str(v.dtype).replace("torch.", "")) for k, v in sorted(tensors.items())}
    return tensors, meta


# --------------------------------------------------------------------------------------------
# Speak references: greedy generation through the official wrappers (refs/<model>.speak.*)
# --------------------------------------------------------------------------------------------


def _speak_case(case: dict, mode: str | None = None) -> dict:
    """A case with every field filled in (CUSTOM_CASES: mode "custom", the wrapper's default
    non_streaming_mode True)."""
    c = dict(case)
    if mode is not None:
        c["mode"] = mode
    if c["mode"] == "custom":
        c.setdefault("non_streaming_mode", True)
    c.setdefault("ref_text", None)
    c.setdefault("speaker", None)
    c.setdefault("max_new_tokens", SPEAK_MAX_NEW_TOKENS)
    return c


def speak_cases(custom: bool) -> list[dict]:
    return [_speak_case(c, "custom") for c in CUSTOM_CASES] if custom else [_speak_case(c) for c in SPEAK_CASES]


def speak_call(tts, case: dict):
    """The official call of a speak case: `generate_voice_clone` (ref_audio = ref24k.wav) or
    `generate_custom_voice`, greedy (`do_sample=False, subtalker_dosample=False`), explicit
    `max_new_tokens` and `repetition_penalty`; `non_streaming_mode` is passed only when it differs
    from the wrapper's default (False for voice clone, True for custom voice)."""
    texts, langs = case["texts"], case["languages"]
    kw = dict(
        text=texts if len(texts) > 1 else texts[0],
        language=langs if len(langs) > 1 else langs[0],
        do_sample=False,
        subtalker_dosample=False,
        max_new_tokens=case["max_new_tokens"],
        repetition_penalty=case["repetition_penalty"],
    )
    if case["mode"] == "custom":
        fn = tts.generate_custom_voice
        kw["speaker"] = case["speaker"]
    else:
        fn = tts.generate_voice_clone
        kw.update(ref_audio=str(AUDIO_WAV), x_vector_only_mode=case["mode"] == "xvec")
        if case["mode"] == "icl":
            kw["ref_text"] = case["ref_text"]
    if case["non_streaming_mode"] != inspect.signature(fn).parameters["non_streaming_mode"].default:
        kw["non_streaming_mode"] = case["non_streaming_mode"]
    torch.manual_seed(0)
    return fn(**kw)


class _SpeakCapture(_Capture):
    """_Capture plus the last-position final hidden of every talker call (EOS calibration) and the
    voice-clone prompt items the wrapper builds (ICL reference codes, x-vectors)."""

    def __init__(self, tts):
        super().__init__(tts)
        self.prompt_items = None
        orig = tts.create_voice_clone_prompt

        def wrapped(*a, **kw):
            self.prompt_items = orig(*a, **kw)
            return self.prompt_items

        tts.create_voice_clone_prompt = wrapped

    def _talker_hook(self, module, args, kwargs, output):
        super()._talker_hook(module, args, kwargs, output)
        self.talker_calls[-1]["h_last"] = output.hidden_states[0][-1][:, -1].detach().clone()

    def close(self):
        super().close()
        del self._tts.create_voice_clone_prompt  # back to the class method


def run_speak_case(tts, case: dict):
    cap = _SpeakCapture(tts)
    try:
        wavs, sr = speak_call(tts, case)
    finally:
        cap.close()
    assert sr == 24000
    return cap, wavs


def _replay_speak_talker(cap: _SpeakCapture, case: dict, eos: int, vocab: int) -> list[dict]:
    """Replays the official talker logits processors per row on the captured logits: repetition
    penalty over the row's generated code-0 ids (HF skips it at 1.0), min_new_tokens=2 (EOS -inf at
    steps 0, 1), suppression of vocab-1024..vocab-1 except EOS; greedy pick; a row stops at its
    first EOS.  Per row: picks, eos_step, margins, and for `calibrate_eos` the two best non-EOS
    processed logits and the final hidden at every step."""
    pen = case["repetition_penalty"]
    bsz = cap.talker_calls[0]["logits"].shape[0]
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[vocab - 1024:] = True
    suppress[eos] = False
    rows = [dict(c0=[], eos_step=None, margins=[], top2=[], h=[]) for _ in range(bsz)]
    for step, rec in enumerate(cap.talker_calls):
        logits = rec["logits"][:, -1, :].float()
        for b, r in enumerate(rows):
            if r["eos_step"] is not None:
                continue  # HF feeds a finished row EOS (pad_token_id = eos); trimmed afterwards
            s = logits[b].clone()
            if pen != 1.0:
                for t in set(r["c0"]):
                    s[t] = s[t] * pen if s[t] < 0 else s[t] / pen
            if step < 2:
                s[eos] = float("-inf")
            s[suppress] = float("-inf")
            pick = int(torch.argmax(s))
            r["margins"].append(_margin(s))
            s_no_eos = s.clone()
            s_no_eos[eos] = float("-inf")
            r["top2"].append([float(x) for x in torch.topk(s_no_eos, 2).values])
            r["h"].append(rec["h_last"][b])
            r["c0"].append(pick)
            if pick == eos:
                r["eos_step"] = step
    return rows


def _codec_prefix(tts, language: str, speaker: str | None) -> list[int]:
    """docs/model.md §6: the think/language codec ids (with the CustomVoice dialect rule)."""
    tc = tts.model.config.talker_config
    lang_id = None if language.lower() == "auto" else tc.codec_language_id[language.lower()]
    if language.lower() in ("chinese", "auto") and speaker and tc.spk_is_dialect[speaker.lower()] is not False:
        lang_id = tc.codec_language_id[tc.spk_is_dialect[speaker.lower()]]
    if lang_id is None:
        return [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    return [tc.codec_think_id, tc.codec_think_bos_id, lang_id, tc.codec_think_eos_id]


def ref_speak(tts, cases: list[dict]) -> tuple[dict, list[dict], list]:
    """Speak references: every case through the official wrapper; codes, waveforms, prompts and
    trailing texts per row, the ICL reference codes; checks the replayed greedy decisions, the
    prompt layout (docs/model.md §6) and the frame / EOS bookkeeping (docs/model.md §7, §14).  Returns (tensors,
    JSON list, per-case replayed rows for `calibrate_eos`)."""
    tcfg = tts.model.config.talker_config
    eos, vocab = tcfg.codec_eos_token_id, tcfg.vocab_size
    tensors, out, replays = {}, [], []
    for case in cases:
        name, mnt, mode = case["name"], case["max_new_tokens"], case["mode"]
        cap, wavs = run_speak_case(tts, case)
        rows = _replay_speak_talker(cap, case, eos, vocab)
        replays.append((case, rows))
        codes_list, _ = cap.generated
        bsz = len(case["texts"])
        assert len(rows) == len(codes_list) == len(wavs) == bsz
        # frame / EOS bookkeeping: a row stops at its first EOS (frames = eos_step), else
        # max_new_tokens code-0 picks of which the last never gets sub-codes (frames = mnt - 1)
        n_calls = len(cap.talker_calls)
        if all(r["eos_step"] is not None for r in rows):
            assert n_calls == max(r["eos_step"] for r in rows) + 1, n_calls
        else:
            assert n_calls == mnt, n_calls
        assert len(cap.cp_calls) == (NUM_CODE_GROUPS - 1) * (n_calls - 1), len(cap.cp_calls)

        pre = cap.talker_calls[0]
        emb, mask = pre["inputs_embeds"], pre["attention_mask"]
        trailing, pad_e = pre["trailing_text_hidden"], pre["tts_pad_embed"].reshape(-1)
        input_ids = [tts._tokenize_texts([tts._build_assistant_text(t)])[0].reshape(-1) for t in case["texts"]]
        ref_ids = ref_codes = None
        if mode == "icl":
            ref_ids = tts._tokenize_texts([tts._build_ref_text(case["ref_text"])])[0].reshape(-1)
            ref_codes = cap.prompt_items[0].ref_code
            assert all(torch.equal(it.ref_code, ref_codes) for it in cap.prompt_items)
            tensors[f"{name}.ref_codes"] = ref_codes.to(torch.int64).contiguous()
        branch = None
        row_meta, tm_all, cm_all = [], [], []
        for b, r in enumerate(rows):
            codes = codes_list[b].to(torch.int64).reshape(-1, NUM_CODE_GROUPS)
            frames = r["eos_step"] if r["eos_step"] is not None else mnt - 1
            assert len(r["c0"]) == (r["eos_step"] + 1 if r["eos_step"] is not None else mnt)
            assert codes.shape[0] == frames, (name, b, codes.shape, frames)
            assert codes[:, 0].tolist() == r["c0"][:frames], "replayed talker greedy picks differ from the official codes"
            cm = []
            for f in range(frames):
                for j in range(NUM_CODE_GROUPS - 1):
                    lg = cap.cp_calls[f * (NUM_CODE_GROUPS - 1) + j][b]
                    assert int(torch.argmax(lg)) == int(codes[f, j + 1]), "predictor greedy pick differs from official codes"
                    cm.append(_margin(lg))
            tm_all += r["margins"]
            cm_all += cm
            r["cp_margins"] = [min(cm[f * (NUM_CODE_GROUPS - 1):(f + 1) * (NUM_CODE_GROUPS - 1)]) for f in range(frames)]

            # prompt layout (docs/model.md §6) and trailing text length
            prefix = _codec_prefix(tts, case["languages"][b], case["speaker"])
            n_codec = len(prefix) + 1 + 2  # prefix ++ [speaker] ++ [pad, bos]
            lt = int(input_ids[b].numel()) - 8  # text tokens between "<|im_start|>assistant\n" and "<|im_end|>\n<|im_start|>assistant\n"
            length = 3 + n_codec - 1
            if mode == "icl":
                text_blk = int(ref_ids.numel()) - 5 + lt + 1
                codec_blk = int(ref_codes.shape[0]) + 1
                if case["non_streaming_mode"]:
                    length, n_trail = length + text_blk + codec_blk, 1
                else:
                    branch = "text_longer" if text_blk > codec_blk else "codes_longer"
                    length += codec_blk
                    n_trail = text_blk - codec_blk if branch == "text_longer" else 1
            elif case["non_streaming_mode"]:
                length, n_trail = length + lt + 2, 1
            else:
                length, n_trail = length + 1, lt
            n_pad = emb.shape[1] - length
            assert mask[b].tolist() == [0] * n_pad + [1] * length, (name, b, mask[b].tolist(), length)
            assert not emb[b, :n_pad].any()
            prompt = emb[b, n_pad:]
            spk_pos = 3 + len(prefix)  # the speaker slot: tts_pad_e + speaker vector
            if mode == "custom":
                spk = tts.model.talker.get_input_embeddings().weight[tcfg.spk_id[case["speaker"].lower()]]
            else:
                # one prompt item for the whole batch when one ref_audio is given (the wrapper repeats it)
                spk = cap.prompt_items[b if len(cap.prompt_items) > 1 else 0].ref_spk_embedding
            assert torch.allclose(prompt[spk_pos] - pad_e, spk, atol=1e-5), (prompt[spk_pos] - pad_e - spk).abs().max()
            assert torch.equal(trailing[b, n_trail:], pad_e.expand(trailing.shape[1] - n_trail, -1))
            wav = torch.from_numpy(wavs[b]).to(torch.float32)
            rm = dict(frames=frames, eos_step=r["eos_step"], wav_samples=int(wav.shape[0]), code0=r["c0"],
                      prompt_length=length, left_padding=n_pad, trailing_length=n_trail, codec_prefix=prefix,
                      min_margin_talker=min(r["margins"]), min_margin_code_predictor=min(cm) if cm else None)
            if mode == "icl":
                # generate_voice_clone decodes ref_codes ++ codes and drops int(T_ref / total * samples) samples
                t_ref, total = int(ref_codes.shape[0]), int(ref_codes.shape[0]) + frames
                cut = int(t_ref / max(total, 1) * (total * 1920))
                assert wav.shape[0] == total * 1920 - cut, (wav.shape, total, cut)
                rm.update(decoded_frames=total, wav_cut_samples=cut)
            else:
                assert wav.shape[0] == frames * 1920
            if bsz > 1:
                (single,), _ = tts.model.speech_tokenizer.decode([{"audio_codes": codes}])
                rm["batched_decode_vs_single_max_abs_diff"] = float(np.abs(single - wavs[b]).max()) if frames else 0.0
            row_meta.append(rm)
            tensors[f"{name}.{b}.codes"] = codes.contiguous()
            tensors[f"{name}.{b}.wav"] = wav.contiguous()
            tensors[f"{name}.{b}.prompt_embeds"] = prompt.contiguous()
            tensors[f"{name}.{b}.trailing_text"] = trailing[b, :n_trail].contiguous()
        if mode == "icl" and not case["non_streaming_mode"]:
            assert branch == case["expect_branch"], (name, branch)
        penalty_effect = None
        if "min_frames" in case:
            # the same call with repetition_penalty=1.0: the penalty must change an output frame
            plain = dict(case, repetition_penalty=1.0)
            pcap, _ = run_speak_case(tts, plain)
            prow = _replay_speak_talker(pcap, plain, eos, vocab)[0]
            first = next(i for i, (x, y) in enumerate(zip(rows[0]["c0"], prow["c0"])) if x != y)
            assert first < row_meta[0]["frames"], (name, first, row_meta[0]["frames"])
            penalty_effect = dict(code0_without_penalty=prow["c0"], first_step_changed_by_penalty=first)
        entry = dict(
            name=name,
            texts=case["texts"],
            languages=case["languages"],
            mode=mode,
            ref_audio=None if mode == "custom" else str(AUDIO_WAV.relative_to(FIXTURES)),
            ref_text=case["ref_text"],
            non_streaming_mode=case["non_streaming_mode"],
            repetition_penalty=case["repetition_penalty"],
            max_new_tokens=mnt,
            rows=row_meta,
            icl_branch=branch,
            min_margin=min(tm_all + cm_all),
            min_margin_talker=min(tm_all),
            min_margin_code_predictor=min(cm_all) if cm_all else None,
            input_ids=[i.tolist() for i in input_ids],
            talker_calls=n_calls,
        )
        if penalty_effect:
            entry.update(penalty_effect)
        if mode == "custom":
            entry.update(speaker=case["speaker"], speaker_codec_id=tcfg.spk_id[case["speaker"].lower()],
                         speaker_is_dialect=tcfg.spk_is_dialect[case["speaker"].lower()])
        if mode == "icl":
            entry.update(ref_ids=ref_ids.tolist(), ref_frames=int(ref_codes.shape[0]))
        out.append(entry)
    return tensors, out, replays


def probe_speak(tts, cases: list[dict]) -> list:
    """The speak cases with the codec_head EOS row set to zero in memory (EOS logit 0, never the
    greedy pick: asserted): the EOS-free trajectories `calibrate_eos` works on."""
    eos = tts.model.config.talker_config.codec_eos_token_id
    w = tts.model.talker.codec_head.weight
    with torch.no_grad():
        keep = w[eos].clone()
        w[eos] = 0.0
    try:
        _, _, replays = ref_speak(tts, cases)
    finally:
        with torch.no_grad():
            w[eos] = keep
    for case, rows in replays:
        assert all(r["eos_step"] is None for r in rows), f"{case['name']}: EOS picked with a zero EOS row"
    return replays


def reppen_candidates(tts, case: dict) -> list[tuple]:
    """The repetition-penalty case with each text of SPEAK_REPPEN_TEXTS (in order) for which the
    penalty changes a greedy code-0 pick of an output frame (EOS-free probe runs with and without
    the penalty) and every decision up to that frame has a margin >= MARGIN_MIN, with its probe
    replay; `min_frames` makes `calibrate_eos` keep that frame."""
    out = []
    for text in SPEAK_REPPEN_TEXTS:
        c = dict(case, texts=[text])
        (_, with_pen), (_, without) = probe_speak(tts, [c, dict(c, repetition_penalty=1.0)])
        a, b = with_pen[0]["c0"], without[0]["c0"]
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None or step > c["max_new_tokens"] - 2:
            continue
        r = with_pen[0]
        if min(r["margins"][: step + 1] + r["cp_margins"][: step + 1]) >= MARGIN_MIN:
            c = dict(c, min_frames=step + 1)
            out.append((c, with_pen))
    return out


def _predict_eos(r: dict, rows_eos) -> tuple:
    """For one replayed row of a probe run (EOS row zero, so EOS never won; the row ran to
    max_new_tokens) and candidate codec_head EOS rows `rows_eos` (S, H): per candidate, the step at
    which greedy picks EOS first (-1: never), the smallest top-1/top-2 gap that involves EOS
    (|EOS logit - best other logit| where EOS is among the best two; inf if none) and the smallest
    margin of every decision that would be recorded (talker picks up to the stop, sub-codes of
    the frames kept)."""
    e = torch.stack(r["h"]).double() @ rows_eos.double().T  # (T, S) predicted EOS logits
    t1 = torch.tensor([a for a, _ in r["top2"]], dtype=torch.float64)[:, None]
    t2 = torch.tensor([b for _, b in r["top2"]], dtype=torch.float64)[:, None]
    n_steps, inf = e.shape[0], float("inf")
    steps = torch.arange(n_steps)[:, None]
    involved = (steps >= 2) & (e > t2)  # min_new_tokens=2; EOS among the best two
    fire = involved & (e > t1)
    has = fire.any(0)
    stop = torch.where(has, fire.int().argmax(0), torch.full_like(has, n_steps - 1, dtype=torch.long))
    kept = steps <= stop[None, :]
    gap = (e - t1).abs()
    margins = torch.where(involved, gap, (t1 - t2).expand_as(e))
    margin = torch.where(kept, margins, torch.full_like(e, inf)).min(0).values
    close = torch.where(kept & involved, gap, torch.full_like(e, inf)).min(0).values
    cp = torch.tensor([inf] + r["cp_margins"], dtype=torch.float64).cummin(0).values  # cp[f] = min over frames < f
    frames = torch.where(has, stop, torch.full_like(stop, n_steps - 1))
    margin = torch.minimum(margin, cp[frames])
    return torch.where(has, stop, torch.full_like(stop, -1)), close, margin


def calibrate_eos(replays: list, rp_candidates: list, u_row, seed: int) -> dict | None:
    """Chooses codec_head row EOS from the probe trajectories: row = bf16(scale * direction) with
    direction 0 the initialised row and then EOS_DIRECTIONS - 1 seeded N(0, 1) directions of the
    same norm, scale in EOS_SCALE_GRID.  For each direction, and for each repetition-penalty
    candidate text (`reppen_candidates`), a scale qualifies if it (1) keeps the predicted EOS logit
    EOS_PREDICT_SAFETY away from the best other logit wherever EOS is among the best two, (2) gives
    every decision that will be recorded a margin >= MARGIN_MIN, (3) stops every row that picks
    EOS at step 4..max_new_tokens-2 (>= 4 frames, and never at the last step, where EOS and
    max_new_tokens give the same frames), stops at least two rows (one a single-row voice-clone
    case) by EOS and lets at least two rows run to max_new_tokens, (4) stops the two batch rows at
    different steps, (5) keeps `min_frames` frames of the penalty case.  The first direction and
    candidate with a qualifying scale win; among their scales the most balanced split between
    EOS-stopped and full-length rows, then the most EOS rows, then the largest EOS gap.  Returns
    None if nothing qualifies (the caller re-draws the weights)."""
    gen = torch.Generator().manual_seed(seed)
    u = u_row.float()
    scales = torch.tensor(EOS_SCALE_GRID, dtype=torch.float32)
    for k in range(EOS_DIRECTIONS):
        d = u if k == 0 else torch.randn(u.shape, generator=gen) * (u.norm() / u.numel() ** 0.5)
        rows_eos = (scales[:, None] * d[None, :]).to(torch.bfloat16)
        def predict(rows):
            return [[x.tolist() for x in _predict_eos(r, rows_eos.float())] for r in rows]

        base = [(c, predict(rows)) for c, rows in replays]
        for rp_case, rp_rows in rp_candidates:
            preds = base + [(rp_case, predict(rp_rows))]
            best = None
            for j in range(len(EOS_SCALE_GRID)):
                outcome = [(c, [p[0][j] for p in ps]) for c, ps in preds]
                close = min(p[1][j] for _, ps in preds for p in ps)
                margin = min(p[2][j] for _, ps in preds for p in ps)
                if close < EOS_PREDICT_SAFETY or margin < MARGIN_MIN:
                    continue
                stops = [(c, s) for c, ss in outcome for s in ss if s >= 0]
                n_full = sum(s < 0 for _, ss in outcome for s in ss)
                if any(s < 4 or s > c["max_new_tokens"] - 2 for c, s in stops):
                    continue
                single = [c for c, ss in outcome if len(ss) == 1 and c["mode"] != "custom" and ss[0] >= 0]
                if len(stops) < 2 or not single or n_full < 2:
                    continue
                if not all(len(set(ss)) > 1 for _, ss in outcome if len(ss) > 1):
                    continue
                if not all(s < 0 or s >= c.get("min_frames", 0) for c, ss in outcome for s in ss):
                    continue
                key = (min(len(stops), n_full), len(stops), close)
                if best is None or key > best[0]:
                    best = (key, j, outcome, close, margin)
            if best is not None:
                _, j, outcome, close, margin = best
                return dict(direction=k, scale=EOS_SCALE_GRID[j], row=rows_eos[j], reppen_case=rp_case,
                            predicted_min_distance=close, predicted_min_margin=margin,
                            predicted={c["name"]: [None if s < 0 else s for s in ss] for c, ss in outcome})
    return None


def set_eos_row(model_dir: Path, saved: dict, eos: int, row) -> dict:
    """Rewrites model.safetensors with codec_head row EOS = `row` (bf16)."""
    saved = dict(saved)
    w = saved["talker.codec_head.weight"].clone()
    w[eos] = row.to(torch.bfloat16)
    saved["talker.codec_head.weight"] = w
    safetensors_save(saved, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return saved


def custom_speaker_xvectors(tts) -> dict:
    """The CustomVoice speakers' vectors: sign * x-vector of their clip from the Base model's speaker
    encoder (the official SFT writes the x-vector into codec_embedding row 3000)."""
    return {s: sign * ref_xvector(tts, read_wav_24k(FIXTURES / "audio" / wav))
            for s, (_, _, wav, sign) in CUSTOM_SPEAKERS.items()}


def make_custom_dir(base_dir: Path, base_cfg: dict, saved: dict, xvecs: dict, copy_shared: bool) -> tuple[Path, dict, dict]:
    """tests/fixtures/tiny-0b6-custom: what the official SFT writes from tiny-0b6 (docs/model.md §10.5):
    config.json with tts_model_type "custom_voice", talker_config.spk_id / spk_is_dialect (and the
    CustomVoice dialect language ids), bf16 model.safetensors without speaker_encoder.* and with
    talker.model.codec_embedding.weight[spk_id] = the speaker's x-vector; tokenizer vocabulary and
    speech_tokenizer linked to tiny-0b6."""
    d = FIXTURES / CUSTOM_NAME
    if d.exists():
        for p in d.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    d.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(base_cfg)
    cfg["tts_model_type"] = "custom_voice"
    tc = cfg["talker_config"]
    tc["spk_id"] = {s: v[0] for s, v in CUSTOM_SPEAKERS.items()}
    tc["spk_is_dialect"] = {s: v[1] for s, v in CUSTOM_SPEAKERS.items()}
    tc["codec_language_id"] = {**tc["codec_language_id"], **CUSTOM_DIALECT_LANGUAGE_ID}
    sd = {k: v for k, v in saved.items() if not k.startswith("speaker_encoder.")}
    emb = sd["talker.model.codec_embedding.weight"].clone()
    for s, (i, _, _, _) in CUSTOM_SPEAKERS.items():
        emb[i] = xvecs[s].to(emb.dtype)
    sd["talker.model.codec_embedding.weight"] = emb
    safetensors_save(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    write_json(d / "config.json", cfg)
    write_json(d / "generation_config.json", GENERATION_CONFIG)
    write_json(d / "tokenizer_config.json", tokenizer_config_dict())
    for f in ("vocab.json", "merges.txt", "speech_tokenizer"):
        link_or_copy(base_dir / f, d / f, copy_shared)
    verify_config_roundtrip(d, cfg)
    return d, cfg, sd


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def make_model_dir(name: str, spec: dict, vocab, merges, attempt: int, copy_shared: bool, codec) -> tuple[Path, dict, dict]:
    model_dir = FIXTURES / name
    if model_dir.exists():
        # keep nothing stale, but never touch the tokenizer files other dirs may link to
        for p in model_dir.iterdir():
            if p.name in ("vocab.json", "merges.txt") and name == "tiny-0b6":
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = build_config_dict(spec)
    model = build_tts_model(spec, cfg, seed=spec["seed"] + attempt)
    saved = save_bf16(model, model_dir / "model.safetensors")
    write_json(model_dir / "config.json", cfg)
    write_json(model_dir / "generation_config.json", GENERATION_CONFIG)
    first = FIXTURES / "tiny-0b6"
    if name == "tiny-0b6":
        write_tokenizer_files(model_dir, vocab, merges)
        write_codec_dir(model_dir / "speech_tokenizer", codec[0], codec[1])
    else:
        write_json(model_dir / "tokenizer_config.json", tokenizer_config_dict())
        for f in ("vocab.json", "merges.txt", "speech_tokenizer"):
            link_or_copy(first / f, model_dir / f, copy_shared)
    verify_config_roundtrip(model_dir, cfg)
    return model_dir, cfg, saved


def run_tiny(args) -> None:
    vocab, merges, gguf_path = load_qwen2_bpe(args)
    std_tok = standard_qwen2_tokenizer(vocab, merges)
    verify_vocab(std_tok, gguf_path)
    make_reference_audio(args.regen_audio)
    audio = read_reference_audio()
    REFS.mkdir(parents=True, exist_ok=True)

    audio_refs = ref_mel(audio)
    safetensors_save({k: v.contiguous() for k, v in audio_refs.items()}, str(REFS / "audio.safetensors"))
    write_json(
        REFS / "audio.json",
        dict(
            wav=str(AUDIO_WAV.relative_to(FIXTURES)),
            wav_sha256=hashlib.sha256(AUDIO_WAV.read_bytes()).hexdigest(),
            sample_rate=24000,
            samples=int(len(audio)),
            samples_read_as="int16 / 32768 (librosa.load(sr=None), as the official wrapper reads a path)",
            made_from=f"first 2.6 s (after trimming silence) of espeak-ng -v en-us -s 150 saying {ESPEAK_TEXT!r}, "
            "resampled to 24 kHz with librosa (soxr_hq), peak-normalised to 0.6, 16-bit PCM",
            mel_shape=list(audio_refs["audio.mel"].shape),
            first_samples=[float(x) for x in audio[:8]],
        ),
    )
    # The codec is built once (its encoder codebooks depend on the clips' latents) and written into
    # tiny-0b6/speech_tokenizer/ (tiny-1b7 links to it); its references are made after the loop.
    clips = make_codec_audio(args.regen_audio)
    codec = build_tiny_codec(clips, CODEC_SEED)
    _log(f"codec: built ({json.dumps(codec[2])})")
    codec_codes_in_tts = {}
    summary = {}
    for name, spec in MODEL_SPECS.items():
        for attempt in range(args.max_attempts):
            model_dir, cfg, saved = make_model_dir(name, spec, vocab, merges, attempt, args.copy_shared, codec)
            tts = load_official(model_dir)
            verify_loaded_weights(tts, saved)
            with_custom = name == CUSTOM_BASE
            # EOS calibration on EOS-free probe runs of every speak case (CustomVoice ones included),
            # then the final weights are written and re-loaded
            eos = cfg["talker_config"]["codec_eos_token_id"]
            base_cases = speak_cases(custom=False)
            i_rp = next(i for i, c in enumerate(base_cases) if c["name"] == "xvec_reppen")
            replays = probe_speak(tts, base_cases[:i_rp] + base_cases[i_rp + 1:])
            if with_custom:
                spk_xvecs = custom_speaker_xvectors(tts)
                cdir, _, csaved = make_custom_dir(model_dir, cfg, saved, spk_xvecs, args.copy_shared)
                ctts = load_official(cdir)
                verify_loaded_weights(ctts, csaved)
                replays += probe_speak(ctts, speak_cases(custom=True))
                del ctts
            eos_cal = calibrate_eos(replays, reppen_candidates(tts, base_cases[i_rp]),
                                    saved["talker.codec_head.weight"][eos], seed=spec["seed"] + attempt)
            if eos_cal is None:
                _log(f"{name} attempt {attempt}: no (EOS row, penalty text) qualifies; re-drawing weights")
                continue
            base_cases[i_rp] = eos_cal["reppen_case"]
            _log(f"{name} attempt {attempt}: EOS row direction {eos_cal['direction']} scale {eos_cal['scale']}, "
                 f"penalty text {eos_cal['reppen_case']['texts'][0]!r}, predicted EOS steps {json.dumps(eos_cal['predicted'])}")
            saved = set_eos_row(model_dir, saved, eos, eos_cal["row"])
            tts = load_official(model_dir)
            verify_loaded_weights(tts, saved)
            cp_mod = tts.model.talker.code_predictor
            has_proj = isinstance(cp_mod.small_to_mtp_projection, torch.nn.Linear)
            assert has_proj == (spec["hidden"] != spec["cp_hidden"])
            tensors, meta = {}, dict(model=name, attempt=attempt, seed=spec["seed"] + attempt,
                                     attn_implementation=tts.model.config._attn_implementation)
            torch.manual_seed(0)
            xvec = ref_xvector(tts, audio)
            tensors["xvector"] = xvec
            t1, m1, pre = ref_talker(tts, [SINGLE_TEXT], ["Auto"], "talker.single")
            tensors.update(t1)
            meta["talker_single"] = m1
            # the x-vector inside the prompt (position 6 for language=auto) is the reference one
            prompt_x = pre["inputs_embeds"][0, 6] - pre["tts_pad_embed"].reshape(-1)
            assert torch.allclose(prompt_x, xvec, atol=1e-5), (prompt_x - xvec).abs().max()
            t2, m2, _ = ref_talker(tts, BATCH_TEXTS, BATCH_LANGUAGES, "talker.batch")
            tensors.update(t2)
            meta["talker_batch"] = m2
            h = t1["talker.single.hidden"][0, -1]
            t3, m3 = ref_code_predictor(tts, h, seed=spec["seed"] + 7)
            tensors.update(t3)
            meta["code_predictor"] = m3
            speak_t, speak_m, _ = ref_speak(tts, base_cases)
            got = {c["name"]: [r["eos_step"] for r in c["rows"]] for c in speak_m}
            if with_custom:
                cdir, ccfg, csaved = make_custom_dir(model_dir, cfg, saved, spk_xvecs, args.copy_shared)
                ctts = load_official(cdir)
                verify_loaded_weights(ctts, csaved)
                assert ctts.model.speaker_encoder is None and ctts.get_supported_speakers() == sorted(CUSTOM_SPEAKERS)
                custom_t, custom_m, _ = ref_speak(ctts, speak_cases(custom=True))
                got.update({c["name"]: [r["eos_step"] for r in c["rows"]] for c in custom_m})
                del ctts
            assert got == eos_cal["predicted"], f"EOS steps {got} differ from the prediction {eos_cal['predicted']}"
            meta["eos_calibration"] = dict(
                eos_row=eos,
                direction=eos_cal["direction"],
                scale=eos_cal["scale"],
                rule="talker.codec_head.weight[EOS] = bf16(scale * direction); direction 0 = the initialised row (bf16), "
                "k > 0 = the k-th N(0,1) draw of torch.Generator().manual_seed(seed) scaled to its norm; chosen by "
                "make_fixtures.calibrate_eos from EOS-free probe runs of the speak cases",
                row=[float(x) for x in eos_cal["row"].float()],
                predicted_min_distance=eos_cal["predicted_min_distance"],
                predicted_min_margin=eos_cal["predicted_min_margin"],
                eos_steps=got,
            )
            margins = dict(
                talker_single=m1["min_margin_talker"],
                talker_batch=m2["min_margin_talker"],
                cp_in_loop_single=m1["min_margin_code_predictor"],
                cp_in_loop_batch=m2["min_margin_code_predictor"],
                cp_reference=m3["min_margin"],
                speak_talker=min(c["min_margin_talker"] for c in speak_m),
                speak_code_predictor=min(c["min_margin_code_predictor"] for c in speak_m),
            )
            if with_custom:
                margins["custom_talker"] = min(c["min_margin_talker"] for c in custom_m)
                margins["custom_code_predictor"] = min(c["min_margin_code_predictor"] for c in custom_m)
            meta["min_margins"] = margins
            worst = min(margins.values())
            _log(f"{name} attempt {attempt}: min greedy margins {json.dumps(margins)}")
            if worst >= MARGIN_MIN:
                break
            _log(f"{name}: min margin {worst:.4g} < {MARGIN_MIN}; re-drawing weights")
        else:
            raise SystemExit(f"{name}: no seed gave margins >= {MARGIN_MIN}")
        if name == "tiny-0b6":
            cases = ref_tokenizer(tts, std_tok, model_dir)
            write_json(REFS / "tokenizer_cases.json", cases)
            n_diff = sum("ids_mistral_regex_patched" in c for c in cases)
            _log(f"tokenizer: {len(cases)} cases; {n_diff} differ under the mistral-regex patch")
        meta["dims"] = {k: v for k, v in spec.items() if k != "speaker"}
        meta["speaker_encoder"] = cfg["speaker_encoder_config"]
        meta["tensors"] = {k: dict(shape=list(v.shape), dtype=str(v.dtype).replace("torch.", "")) for k, v in sorted(tensors.items())}
        safetensors_save({k: v.contiguous() for k, v in tensors.items()}, str(REFS / f"{name}.safetensors"))
        write_json(REFS / f"{name}.json", meta)
        write_speak_refs(name, speak_t, speak_m)
        if with_custom:
            write_speak_refs(CUSTOM_NAME, custom_t, custom_m)
        summary[name] = margins
        # the codec as Qwen3TTSModel loads it (what create_voice_clone_prompt uses) is the referenced one
        with torch.inference_mode():
            codec_codes_in_tts[name] = tts.model.speech_tokenizer.encode(
                str(FIXTURES / "audio" / CODEC_CLIPS[0]["wav"])).audio_codes[0]
        del tts
    ctensors, cmeta = ref_codec(FIXTURES / "tiny-0b6" / "speech_tokenizer", codec[1], clips)
    for name, codes in codec_codes_in_tts.items():
        assert torch.equal(codes, ctensors["encode.clip1.codes"]), f"{name}: codec inside Qwen3TTSModel differs"
    cmeta = dict(seed=CODEC_SEED, build=codec[2], **cmeta)
    safetensors_save({k: v.contiguous() for k, v in ctensors.items()}, str(REFS / "codec.safetensors"))
    write_json(REFS / "codec.json", cmeta)
    summary["codec_min_rel_gap"] = cmeta["min_rel_gap"]["all_32"]
    _log("done: " + json.dumps(summary))
    _log_sizes()


def write_speak_refs(name: str, tensors: dict, cases: list[dict]) -> None:
    safetensors_save({k: v.contiguous() for k, v in tensors.items()}, str(REFS / f"{name}.speak.safetensors"))
    write_json(REFS / f"{name}.speak.json", cases)
    summary = {c["name"]: [(r["frames"], r["eos_step"]) for r in c["rows"]] for c in cases}
    _log(f"{name}: speak cases (frames, eos_step) {json.dumps(summary)}")


def _log_sizes() -> None:
    total = 0
    for p in sorted(FIXTURES.rglob("*")):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    _log(f"tests/fixtures working tree: {total / 1e6:.2f} MB (symlinks not counted)")


def run_full_size(dest: Path, args) -> None:
    vocab, merges, gguf_path = load_qwen2_bpe(args)
    dest.mkdir(parents=True, exist_ok=True)
    spec = FULL_0B6_SPEC
    cfg = build_config_dict(spec)
    _log("building a random model with the real 0.6B shapes (f32 in memory, ~3.7 GB)")
    model = build_tts_model(spec, cfg, seed=spec["seed"], randomize=False)  # official init: N(0, 0.02)
    n_params = sum(p.numel() for p in model.parameters())
    saved = save_bf16(model, dest / "model.safetensors")
    del model
    write_json(dest / "config.json", cfg)
    write_json(dest / "generation_config.json", GENERATION_CONFIG)
    write_tokenizer_files(dest, vocab, merges)
    write_speech_tokenizer(dest / "speech_tokenizer", seed=78)
    verify_config_roundtrip(dest, cfg)
    tts = Qwen3TTSModel.from_pretrained(str(dest), dtype=torch.bfloat16, device_map="cpu")
    verify_loaded_weights_bf16(tts, saved)
    n_talker = sum(1 for k in saved if k.startswith("talker.") and not k.startswith("talker.code_predictor"))
    _log(f"full-size: {n_params / 1e6:.1f} M parameters, {len(saved)} tensors ({n_talker} talker-only), "
         f"{(dest / 'model.safetensors').stat().st_size / 1e9:.2f} GB; the official class loads it")


def verify_loaded_weights_bf16(tts, saved: dict) -> None:
    sd = {k: v for k, v in tts.model.state_dict().items() if not k.startswith("speech_tokenizer")}
    assert set(sd) == set(saved), (set(sd) ^ set(saved))
    for k, v in saved.items():
        assert sd[k].shape == v.shape and sd[k].dtype == torch.bfloat16, k
        assert torch.equal(sd[k], v), k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full-size", metavar="DEST", help="write a random checkpoint with the real 0.6B shapes to DEST")
    ap.add_argument("--qwen2-gguf", metavar="PATH", help="llama.cpp ggml-vocab-qwen2.gguf to rebuild the Qwen2 vocabulary from")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "voiceclone-fixtures"))
    ap.add_argument("--regen-audio", action="store_true",
                    help="re-make tests/fixtures/audio/{ref24k,codec-clip1,codec-clip2}.wav with espeak-ng")
    ap.add_argument("--copy-shared", action="store_true",
                    help="copy (instead of symlink) tokenizer/speech_tokenizer files into tiny-1b7")
    ap.add_argument("--max-attempts", type=int, default=40)
    args = ap.parse_args()
    _import_stack()
    if args.full_size:
        run_full_size(Path(args.full_size).resolve(), args)
    else:
        run_tiny(args)


if __name__ == "__main__":
    main()
