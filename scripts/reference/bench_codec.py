#!/usr/bin/env python3
"""CPU benchmark of the official Qwen3-TTS 12 Hz codec (`qwen-tts==0.1.1`), the baseline for the Rust codec.

Two modes (run from the repository root with the reference environment, made by scripts/reference/setup_venv.sh)::

    # 1. write a randomly initialised codec with the real full-size shapes (docs/model.md §2; ~170.6 M
    #    parameters, f32 model.safetensors ~682 MB) in the official speech_tokenizer/ layout
    .reference-venv/bin/python scripts/reference/bench_codec.py --make-full-size .big-fixtures/codec-full

    # 2. time the official wrapper on it: encode >= 60 s of 24 kHz audio, decode the codes
    .reference-venv/bin/python scripts/reference/bench_codec.py --bench .big-fixtures/codec-full \\
        --audio tests/fixtures/audio/ref24k.wav [--seconds 60] [--threads N]

`--bench` loads DIR with `Qwen3TTSTokenizer.from_pretrained(DIR, dtype=torch.float32,
device_map="cpu")` (load not timed), reads WAV (resampled once to 24 kHz with librosa if needed,
not timed), loops it to `--seconds`, runs one warm-up encode + decode on the first 2 s, then times
`tok.encode(audio, sr=24000)` (so the wrapper does no resampling) and `tok.decode(encoded)`
(chunked decode, 300 frames + 25 context), and prints one JSON line on stdout::

    {"encode_seconds": ..., "decode_seconds": ..., "audio_seconds": ..., "frames": ...}

Diagnostics (threads, output length and RMS, process CPU time, load average) go to stderr.  torch
uses `--threads` intra-op threads (default: every core this process may run on).

The weights are random (no real checkpoint can be downloaded here) but initialised so that every
block has O(1) activations (`official.init_codec_weights`): no NaN/inf or denormal slow paths,
so the timing is that of the real network.  The Rust benchmark must load the same directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import official  # noqa: E402  (the shipped codec config, its init and writer, shared with the fixtures)

FULL_SEED = 1700
EXPECTED_PARAMS = 170.6e6  # docs/model.md §11: encoder 56.2 M + decoder 114.3 M


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_full_size(dest: Path) -> None:
    torch = official.torch
    cfg = official.codec_config_dict(official.CODEC_FULL)
    _err(f"building a random codec with the real shapes in {dest} (f32, ~0.7 GB)")
    model = official.new_codec_model(cfg, FULL_SEED)
    official.init_codec_weights(model, torch.Generator().manual_seed(FULL_SEED))
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    n = sum(v.numel() for v in sd.values())
    n_enc = sum(v.numel() for k, v in sd.items() if k.startswith("encoder."))
    del model
    assert abs(n - EXPECTED_PARAMS) / EXPECTED_PARAMS < 0.01, n
    official.write_codec_dir(dest, cfg, sd)
    # the official wrapper loads it, every tensor comes from the file
    tok = official.Qwen3TTSTokenizer.from_pretrained(str(dest), dtype=torch.float32, device_map="cpu")
    loaded = tok.model.state_dict()
    assert set(loaded) == set(sd), set(loaded) ^ set(sd)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k
    size = (dest / "model.safetensors").stat().st_size
    _err(f"wrote {dest}: {n / 1e6:.1f} M parameters (encoder {n_enc / 1e6:.1f} M, decoder "
         f"{(n - n_enc) / 1e6:.1f} M), {len(sd)} tensors, model.safetensors {size / 1e6:.0f} MB; "
         "the official Qwen3TTSTokenizer loads it")


def bench(model_dir: Path, wav: Path, seconds: float, threads: int, dtype: str) -> None:
    torch, np, librosa = official.torch, official.np, official.librosa
    tok = official.Qwen3TTSTokenizer.from_pretrained(str(model_dir), dtype=getattr(torch, dtype), device_map="cpu")
    sr = int(tok.feature_extractor.sampling_rate)
    audio, file_sr = librosa.load(str(wav), sr=None, mono=True)
    if file_sr != sr:
        audio = librosa.resample(audio, orig_sr=file_sr, target_sr=sr)
    audio = audio.astype(np.float32)
    n = int(round(seconds * sr))
    full = np.tile(audio, math.ceil(n / len(audio)))[:n]

    warm = tok.encode(full[: 2 * sr], sr=sr)
    tok.decode(warm)

    load0 = os.getloadavg()[0]
    c0, t0 = time.process_time(), time.perf_counter()
    enc = tok.encode(full, sr=sr)
    c1, t1 = time.process_time(), time.perf_counter()
    wavs, out_sr = tok.decode(enc)
    c2, t2 = time.process_time(), time.perf_counter()

    frames = int(enc.audio_codes[0].shape[0])
    assert frames == -(-n // 1920), frames
    out = wavs[0]
    assert out.shape == (frames * 1920,) and out_sr == sr
    _err(f"threads={torch.get_num_threads()} input={n} samples ({n / sr:.2f} s) frames={frames} "
         f"output={out.shape[0]} samples rms={float(np.sqrt(np.mean(out.astype(np.float64) ** 2))):.3f} "
         f"finite={bool(np.isfinite(out).all())}; encode {n / sr / (t1 - t0):.2f}x real time, "
         f"decode {n / sr / (t2 - t1):.2f}x real time; process CPU seconds encode {c1 - c0:.1f}, decode {c2 - c1:.1f}; "
         f"1-min load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after (> threads: the timing is disturbed)")
    print(json.dumps(dict(encode_seconds=round(t1 - t0, 3), decode_seconds=round(t2 - t1, 3),
                          audio_seconds=round(n / sr, 3), frames=frames)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--make-full-size", metavar="DIR", help="write a random full-size codec to DIR")
    mode.add_argument("--bench", metavar="DIR", help="benchmark the official wrapper on the codec in DIR")
    ap.add_argument("--audio", metavar="WAV", help="audio to encode (looped to --seconds)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the codec's weights and compute type (the wrapper's dtype argument)")
    args = ap.parse_args()
    if args.make_full_size:
        official.import_stack()  # one thread, deterministic: the same weights on every machine
        make_full_size(Path(args.make_full_size).resolve())
    else:
        if not args.audio:
            ap.error("--bench needs --audio WAV")
        official.import_stack(threads=args.threads, deterministic=False)
        bench(Path(args.bench).resolve(), Path(args.audio), args.seconds, args.threads, args.dtype)


if __name__ == "__main__":
    main()
