#!/usr/bin/env python3
"""CPU benchmark of the official Qwen3-TTS voice-clone generation (`qwen-tts==0.1.1`), the baseline
for `voiceclone speak`.

Run from the repository root with the reference environment (scripts/reference/setup_venv.sh)::

    # once: a randomly initialised checkpoint with the real 0.6B shapes (~1.8 GB, ignored by git)
    .reference-venv/bin/python scripts/reference/make_fixtures.py --full-size .big-fixtures/qwen3-tts-0.6b-random

    .reference-venv/bin/python scripts/reference/bench_speak.py \\
        --model .big-fixtures/qwen3-tts-0.6b-random --ref-audio tests/fixtures/audio/ref24k.wav \\
        --text "The quick brown fox jumps over the lazy dog." --frames 50 --threads 2 \\
        --out-json /tmp/bench_speak_official.json

What is timed
-------------
* `load_s`: `Qwen3TTSModel.from_pretrained(MODEL, dtype=float32 (--dtype), device_map="cpu")`
  (weights, processor, speech tokenizer).
* `wall_s`: ONE call of the official
  `generate_voice_clone(text, language, ref_audio=WAV, x_vector_only_mode=True, do_sample=False,
  subtalker_dosample=False, max_new_tokens=N+1)`, i.e. greedy x-vector cloning with the wrapper's
  defaults otherwise (streaming text, `non_streaming_mode=False`; `repetition_penalty` from
  `generation_config.json`, 1.05).  `generate(max_new_tokens=N+1)` yields at most N frames (docs/model.md §14:
  the last code-0 pick never gets its sub-codes), so exactly N frames come out unless the talker
  picks EOS earlier (then `stopped_by_eos` is true and `frames` < N).  The call includes, and the
  JSON breaks it down into (each wrapped with a timer, nothing else changed):
    - `prompt_s`: `create_voice_clone_prompt` (read the WAV, codec encode, x-vector);
    - `talker_s`: `model.generate` (prompt build, prefill, the talker + code-predictor loop);
    - `decode_s`: `speech_tokenizer.decode` of the generated codes.
* `frames_per_s` = frames / wall_s, `talker_frames_per_s` = frames / talker_s,
  `audio_s` = returned samples / 24000, `rtf` = wall_s / audio_s (< 1: faster than real time),
  `peak_rss_mb` = `resource.getrusage(RUSAGE_SELF).ru_maxrss` (the whole process: load included).

No warm-up call by default (`--warmup-frames K` runs one K-frame generate first, not timed).
torch uses `--threads` intra-op threads (`torch.set_num_threads`).  The result is printed as one
JSON line on stdout and written to `--out-json`; diagnostics go to stderr.

The checkpoint is random (no real one can be downloaded here): `--full-size` keeps the official
init (N(0, 0.02)) and a tiny random codec in `speech_tokenizer/` (so `decode_s` is not the real
codec's cost; `scripts/reference/bench_codec.py` covers that).  The talker and code predictor have
the real 0.6B shapes, so `talker_s` is the real per-frame cost; the generated codes are meaningless.
The Rust benchmark (`scripts/bench/speak.sh`) must load the same directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Timer:
    """Wraps obj.name (an instance attribute shadowing the method) to accumulate its wall time."""

    def __init__(self, obj, name: str, keep_result: bool = False):
        self.obj, self.name, self.seconds, self.calls, self.result = obj, name, 0.0, 0, None
        orig = getattr(obj, name)

        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            out = orig(*a, **kw)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            if keep_result:
                self.result = out
            return out

        setattr(obj, name, wrapped)

    def close(self) -> None:
        delattr(self.obj, self.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="official model directory (e.g. .big-fixtures/qwen3-tts-0.6b-random)")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ref-audio", required=True, help="reference WAV for the x-vector")
    ap.add_argument("--frames", type=int, required=True, help="N: frames to generate (max_new_tokens = N + 1)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--language", default="Auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--warmup-frames", type=int, default=0, help="run one untimed generate of K frames first")
    args = ap.parse_args()

    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    load0 = os.getloadavg()[0]

    t0 = time.perf_counter()
    tts = Qwen3TTSModel.from_pretrained(str(Path(args.model)), dtype=dtype, device_map="cpu")
    load_s = time.perf_counter() - t0
    _err(f"loaded {args.model} in {load_s:.1f} s ({args.dtype}, {torch.get_num_threads()} threads, "
         f"attention {tts.model.config._attn_implementation})")

    def call(frames: int):
        return tts.generate_voice_clone(
            text=args.text,
            language=args.language,
            ref_audio=str(Path(args.ref_audio)),
            x_vector_only_mode=True,
            do_sample=False,
            subtalker_dosample=False,
            max_new_tokens=frames + 1,
        )

    if args.warmup_frames > 0:
        t0 = time.perf_counter()
        call(args.warmup_frames)
        _err(f"warm-up ({args.warmup_frames} frames): {time.perf_counter() - t0:.1f} s")

    timers = dict(
        prompt=_Timer(tts, "create_voice_clone_prompt"),
        talker=_Timer(tts.model, "generate", keep_result=True),
        decode=_Timer(tts.model.speech_tokenizer, "decode"),
    )
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            wavs, sr = call(args.frames)
    finally:
        for t in timers.values():
            t.close()
    wall_s = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0

    codes_list, _ = timers["talker"].result
    frames = int(codes_list[0].shape[0])
    wav = np.asarray(wavs[0])
    audio_s = len(wav) / sr
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    result = dict(
        impl="official qwen-tts 0.1.1 (torch, CPU)",
        model=str(args.model),
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        text=args.text,
        language=args.language,
        ref_audio=str(args.ref_audio),
        frames_requested=args.frames,
        max_new_tokens=args.frames + 1,
        frames=frames,
        stopped_by_eos=frames < args.frames,
        load_s=round(load_s, 3),
        wall_s=round(wall_s, 3),
        prompt_s=round(timers["prompt"].seconds, 3),
        talker_s=round(timers["talker"].seconds, 3),
        decode_s=round(timers["decode"].seconds, 3),
        frames_per_s=round(frames / wall_s, 3),
        talker_frames_per_s=round(frames / timers["talker"].seconds, 3),
        audio_s=round(audio_s, 3),
        rtf=round(wall_s / audio_s, 3) if audio_s > 0 else None,
        peak_rss_mb=round(peak_rss_mb, 1),
        process_cpu_s=round(cpu_s, 3),
        warmup_frames=args.warmup_frames,
        loadavg_before=round(load0, 2),
        loadavg_after=round(os.getloadavg()[0], 2),
        torch=torch.__version__,
        cpu_count=os.cpu_count(),
        machine=platform.machine(),
    )
    if frames < args.frames:
        _err(f"EOS after {frames} frames (fewer than the {args.frames} requested)")
    if result["loadavg_after"] > args.threads:
        _err(f"1-min load average {result['loadavg_after']} > {args.threads} threads: other jobs shared the CPU")
    line = json.dumps(result)
    print(line, flush=True)
    Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
