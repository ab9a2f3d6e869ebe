#!/usr/bin/env python3
"""Check that the official `qwen-tts==0.1.1` package loads a model directory exported by `voiceclone`
(CustomVoice layout, docs/model.md §10.5) and synthesises with it.

Usage (from the repository root with the reference environment, made by scripts/reference/setup_venv.sh)::

    .reference-venv/bin/python scripts/reference/check_export.py DIR --speaker NAME --text TEXT \\
        [--out WAV] [--language Auto] [--max-new-tokens N] [--greedy] [--seed 0] [--threads N] \\
        [--xvector FILE.safetensors]

    # a hand-made export from a fixture (rewrites config.json, drops speaker_encoder.*, writes the
    # x-vector of --ref-audio into codec_embedding row 3000, bf16), then the check:
    .reference-venv/bin/python scripts/reference/check_export.py --make-from tests/fixtures/tiny-0b6 \\
        --ref-audio tests/fixtures/audio/ref24k.wav /tmp/tiny-0b6-cv --speaker alice
    .reference-venv/bin/python scripts/reference/check_export.py /tmp/tiny-0b6-cv --speaker alice \\
        --text "Hello world." --max-new-tokens 40 --out /tmp/alice.wav

What is checked (exit status 1 with a message on the first failure):
* ``config.json``: ``tts_model_type == "custom_voice"``; ``talker_config.spk_id`` maps NAME
  (case-insensitively) to a codec id (3000 for a voiceclone export; 3000, 3001, … when it holds several
  named speakers — run the check once per speaker) and its key is **lower case** — the
  official ``generate`` looks up ``spk_id[speaker.lower()]`` and ``spk_is_dialect[speaker.lower()]``, so
  a mixed-case key can never be used; ``spk_is_dialect`` has the same key.
* ``model.safetensors``: no ``speaker_encoder.*`` tensors; after
  ``Qwen3TTSModel.from_pretrained(DIR, dtype=torch.float32, device_map="cpu")`` every parameter/buffer of
  the loaded model (speech tokenizer aside) came from the file with the file's value (a missing tensor
  would be silently randomly initialised by transformers), and the file has no tensor the model does not
  use; the model has no speaker encoder.
* with --xvector FILE (tensor ``speaker_embedding``): the speaker's ``codec_embedding`` row equals that
  x-vector up to bf16 rounding (what the export must write, docs/model.md §10.5; a named speaker's
  x-vector is ``data/speakers/NAME.safetensors``).
* ``generate_custom_voice(TEXT, speaker=NAME, language=...)`` (default ``non_streaming_mode=True``) runs;
  prints one JSON line: frames, seconds of audio, sample rate, RMS, the speaker row's norm, and writes
  the WAV (16-bit PCM) if --out is given.

Sampling follows the model's ``generation_config.json`` unless --greedy (do_sample=False for talker and
sub-talker); --seed seeds torch before generation.  --max-new-tokens (default 200) caps the generated
code-0 tokens, i.e. at most 199 frames (a random model rarely emits EOS); 0 uses the model's
generation_config.json (8192).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

SPEAKER_ROW = 3000


def fail(msg: str) -> None:
    print(f"check_export: FAIL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_custom_voice_copy(src: Path, dst: Path, speaker: str, ref_audio: Path) -> None:
    """What the official sft_12hz.py (and voiceclone export) writes: a copy of the Base dir with the
    CustomVoice config, no speaker_encoder.* tensors, the x-vector in codec_embedding row 3000 (bf16)."""
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import official
    import sft_recipe as sft

    sft.import_stack()
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name in ("config.json", "model.safetensors"):
            continue
        target = p.resolve()
        if target.is_dir():
            shutil.copytree(target, dst / p.name)
        else:
            shutil.copy2(target, dst / p.name)
    tts = official.load_official(src)
    xvec = sft.xvector_from_wav(tts, ref_audio)
    del tts
    cfg = json.loads((src / "config.json").read_text())
    cfg["tts_model_type"] = "custom_voice"
    cfg["talker_config"]["spk_id"] = {speaker: SPEAKER_ROW}
    cfg["talker_config"]["spk_is_dialect"] = {speaker: False}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    sd = load_file(str(src / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if not k.startswith("speaker_encoder.")}
    emb = sd["talker.model.codec_embedding.weight"].clone()
    emb[SPEAKER_ROW] = xvec.to(emb.dtype)
    sd["talker.model.codec_embedding.weight"] = emb
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _log(f"wrote {dst} (custom_voice, speaker {speaker!r} -> {SPEAKER_ROW}, {len(sd)} tensors)")


def check(args) -> dict:
    import numpy as np
    import soundfile as sf
    import torch
    from safetensors import safe_open
    from qwen_tts import Qwen3TTSModel

    torch.set_num_threads(args.threads)
    d = Path(args.dir)
    for f in ("config.json", "model.safetensors", "speech_tokenizer/config.json", "generation_config.json"):
        if not (d / f).exists():
            fail(f"{d}: missing {f}")
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("tts_model_type") != "custom_voice":
        fail(f"config.json: tts_model_type is {cfg.get('tts_model_type')!r}, expected 'custom_voice'")
    tc = cfg.get("talker_config", {})
    spk_id = tc.get("spk_id", {})
    keys = [k for k in spk_id if k.lower() == args.speaker.lower()]
    if not keys:
        fail(f"config.json: speaker {args.speaker!r} not in talker_config.spk_id {sorted(spk_id)}")
    key = keys[0]
    if key != key.lower():
        fail(f"config.json: spk_id key {key!r} is not lower case; the official generate looks up "
             f"spk_id[{args.speaker.lower()!r}] and would raise")
    row = spk_id[key]
    if key not in tc.get("spk_is_dialect", {}):
        fail(f"config.json: talker_config.spk_is_dialect lacks {key!r} (the official generate indexes it)")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        file_keys = set(f.keys())
        bad = sorted(k for k in file_keys if k.startswith("speaker_encoder."))
        if bad:
            fail(f"model.safetensors has {len(bad)} speaker_encoder.* tensors (e.g. {bad[0]})")
        file_dtypes = {str(f.get_slice(k).get_dtype()) for k in file_keys}

    tts = Qwen3TTSModel.from_pretrained(str(d), dtype=torch.float32, device_map="cpu")
    model = tts.model
    if model.speaker_encoder is not None:
        fail("the loaded model has a speaker encoder (expected none for custom_voice)")
    if model.tts_model_type != "custom_voice":
        fail(f"loaded tts_model_type {model.tts_model_type!r}")
    sd = model.state_dict()
    missing = sorted(k for k in sd if k not in file_keys)
    unused = sorted(k for k in file_keys if k not in sd)
    if missing:
        fail(f"{len(missing)} model tensors are not in model.safetensors (randomly initialised by the loader), e.g. {missing[:3]}")
    if unused:
        fail(f"{len(unused)} tensors of model.safetensors are not used by the official model, e.g. {unused[:3]}")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        for k in sorted(file_keys):
            v = f.get_tensor(k)
            if v.shape != sd[k].shape or not torch.equal(v.to(torch.float32), sd[k]):
                fail(f"{k}: the loaded value differs from the file (shape {tuple(v.shape)} vs {tuple(sd[k].shape)})")
    spk_vec = model.talker.model.codec_embedding.weight[row].detach()
    spk_norm = float(spk_vec.norm())
    xvec_diff = None
    if args.xvector:
        from safetensors.torch import load_file

        x = load_file(args.xvector)["speaker_embedding"].reshape(-1).to(torch.float32)
        if x.shape != spk_vec.shape:
            fail(f"--xvector has {x.shape[0]} values, codec_embedding rows have {spk_vec.shape[0]}")
        # stored bf16: the row must be the x-vector rounded to bf16 (rel. error <= 2^-8 per value)
        xvec_diff = float((spk_vec - x).abs().max())
        if not torch.allclose(spk_vec, x, rtol=2.0**-8, atol=1e-6):
            fail(f"codec_embedding row {row} is not the given x-vector (max abs diff {xvec_diff:.3g})")

    gen = {}
    if args.greedy:
        gen.update(do_sample=False, subtalker_dosample=False)
    if args.max_new_tokens:
        gen["max_new_tokens"] = args.max_new_tokens
    torch.manual_seed(args.seed)
    wavs, sr = tts.generate_custom_voice(args.text, speaker=args.speaker, language=args.language, **gen)
    wav = np.asarray(wavs[0], dtype=np.float32).reshape(-1)
    if wav.size == 0 or not np.isfinite(wav).all():
        fail(f"generated audio is empty or not finite ({wav.size} samples)")
    frames = wav.size // 1920
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        sf.write(args.out, wav, sr, subtype="PCM_16")
    return dict(
        dir=str(d),
        speaker=args.speaker,
        speaker_key=key,
        speaker_row=row,
        speaker_row_norm=spk_norm,
        speaker_row_vs_xvector_max_abs_diff=xvec_diff,
        file_dtypes=sorted(file_dtypes),
        tensors=len(file_keys),
        text=args.text,
        language=args.language,
        frames=frames,
        seconds=wav.size / sr,
        sample_rate=sr,
        rms=float(np.sqrt(np.mean(wav.astype(np.float64) ** 2))),
        out=args.out,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="exported model directory (or the destination with --make-from)")
    ap.add_argument("--speaker", required=True)
    ap.add_argument("--text", help="text to synthesise (required unless --make-from)")
    ap.add_argument("--out", metavar="WAV")
    ap.add_argument("--language", default="Auto")
    ap.add_argument("--max-new-tokens", type=int, default=200,
                    help="cap on generated code-0 tokens (default 200 = 16 s; 0 = generation_config.json's 8192)")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--xvector", metavar="FILE", help="safetensors with tensor speaker_embedding: row 3000 must equal it (bf16-rounded)")
    ap.add_argument("--make-from", metavar="BASE_DIR", help="write a hand-made custom-voice copy of BASE_DIR to DIR and exit")
    ap.add_argument("--ref-audio", metavar="WAV", help="with --make-from: the clip whose x-vector goes into row 3000")
    args = ap.parse_args()
    if args.make_from:
        if not args.ref_audio:
            ap.error("--make-from needs --ref-audio")
        make_custom_voice_copy(Path(args.make_from), Path(args.dir), args.speaker, Path(args.ref_audio))
        return
    if not args.text:
        ap.error("--text is required")
    with contextlib.redirect_stdout(sys.stderr):  # qwen_tts prints notices on stdout; keep it for the JSON line
        res = check(args)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
