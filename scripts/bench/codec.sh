#!/usr/bin/env bash
# Codec speed, Rust vs the official Python package, side by side in one run (docs/performance.md §1).
#
#   scripts/bench/codec.sh                 # 60 s of real speech, 1 round
#   ROUNDS=3 SECONDS_OF_AUDIO=90 scripts/bench/codec.sh
#
# Both sides load the same full-size random codec (docs/model.md §2 shapes, made once by
# `scripts/reference/bench_codec.py --make-full-size`), read the same 24 kHz 16-bit WAV (real
# speech from .test-assets/speech/bench5, resampled once to 24 kHz with librosa and written to
# disk, so both get identical samples), loop it to the same length, warm up on 2 s, and time one
# encode of the whole input and one decode of its codes. The official side runs with the codec in
# float32 and in bfloat16 (its `dtype` argument; bf16 decodes faster on AVX-512-BF16 CPUs), and
# ratios are against the faster of the two. Rounds alternate official f32 / official bf16 / Rust;
# the best time of each side is reported (the minimum is the least disturbed measurement), as
# throughput (audio seconds per wall second) and as Rust/official ratios (> 1: Rust is faster).
# The machine must be quiet: the 1-minute load average must be under 0.5 (FORCE=1 runs anyway and
# says so).
#
# First, a parity check at full size on the same speech (PARITY_SECONDS, default 8): the codes of
# both sides must be identical and the Rust decode of the official codes within 2e-3 of the
# official decode (docs/model.md §14).
#
# Environment: PYTHON (a Python with torch + qwen-tts; default .reference-venv/bin/python, made
# by scripts/reference/setup_venv.sh), CODEC_DIR (default .big-fixtures/codec-full),
# SECONDS_OF_AUDIO (default 60), ROUNDS (default 1),
# THREADS (both sides; default: every core), PARITY_SECONDS (0 skips the check; ROUNDS=0 runs
# only the check), FORCE.
#
# SMOKE=1 (scripts/bench/smoke.sh): the fixture's small codec, 2 s of audio, parity on 1 s, one
# round, examples/bench_codec beside BIN (the test build), the WAV in a temporary folder; the
# official side (parity, both dtypes) only where PYTHON has the official package, else the
# table shows the Rust side alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/quiet.sh

PYTHON=${PYTHON:-.reference-venv/bin/python}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
if is_smoke; then
    CODEC_DIR=${CODEC_DIR:-tests/fixtures/tiny-0b6/speech_tokenizer}
    SECONDS_OF_AUDIO=${SECONDS_OF_AUDIO:-2}
    PARITY_SECONDS=${PARITY_SECONDS:-1}
    WAV=$OUT/speech24k.wav
else
    CODEC_DIR=${CODEC_DIR:-.big-fixtures/codec-full}
    SECONDS_OF_AUDIO=${SECONDS_OF_AUDIO:-60}
    PARITY_SECONDS=${PARITY_SECONDS:-8}
    WAV=.big-fixtures/bench/speech24k.wav
fi
ROUNDS=${ROUNDS:-1}
THREADS=${THREADS:-$(nproc)}

require_quiet "before starting"
REFERENCE=1
reference_side "$PYTHON" "torch, qwen_tts, librosa" || REFERENCE=0

if is_smoke; then
    smoke_bin
    EXAMPLES=$(smoke_examples)
else
    echo "== building the Rust benchmark (release)" >&2
    cargo build --release --quiet --example bench_codec
    EXAMPLES=target/release/examples
fi

if [[ ! -f $CODEC_DIR/config.json || ! -f $CODEC_DIR/model.safetensors ]]; then
    echo "== writing a full-size random codec to $CODEC_DIR (once)" >&2
    "$PYTHON" scripts/reference/bench_codec.py --make-full-size "$CODEC_DIR"
fi

if [[ ! -f $WAV && $REFERENCE == 0 ]]; then
    # Smoke without librosa: the fixture clip, already 24 kHz 16-bit.
    cp tests/fixtures/audio/ref24k.wav "$WAV"
elif [[ ! -f $WAV ]]; then
    echo "== writing $WAV (bench5 speech, resampled to 24 kHz once)" >&2
    mkdir -p "$(dirname "$WAV")"
    "$PYTHON" - "$WAV" "$SECONDS_OF_AUDIO" <<'EOF'
import glob, sys
import librosa, numpy as np, soundfile as sf
out, seconds = sys.argv[1], float(sys.argv[2])
clips = sorted(glob.glob(".test-assets/speech/bench5/*.wav"))
if not clips:
    sys.exit("no .test-assets/speech/bench5/*.wav: run scripts/assets/fetch_test_assets.sh")
parts, total = [], 0.0
for c in clips:  # enough real speech that the benchmark does not loop
    y, sr = librosa.load(c, sr=None, mono=True)
    parts.append(y)
    total += len(y) / sr
    if total >= seconds + 5:
        break
y = librosa.resample(np.concatenate(parts), orig_sr=sr, target_sr=24000)  # soxr_hq, as the official pipeline
sf.write(out, np.clip(y, -1.0, 1.0), 24000, subtype="PCM_16")
print(f"{len(y) / 24000:.1f} s of speech from {len(parts)} clips", file=sys.stderr)
EOF
fi

if [[ $PARITY_SECONDS != 0 && $REFERENCE == 1 ]]; then
    echo "== parity at full size: first $PARITY_SECONDS s of the speech" >&2
    "$PYTHON" - "$CODEC_DIR" "$WAV" "$PARITY_SECONDS" "$OUT" "$THREADS" 2>"$OUT/parity.log" <<'EOF' \
        || { cat "$OUT/parity.log" >&2; exit 1; }
import sys
import numpy as np, soundfile as sf, torch
from qwen_tts import Qwen3TTSTokenizer
codec_dir, wav_path, seconds, out, threads = sys.argv[1:6]
torch.set_num_threads(int(threads))
tok = Qwen3TTSTokenizer.from_pretrained(codec_dir, dtype=torch.float32, device_map="cpu")
wav, sr = sf.read(wav_path, dtype="float32")  # int16 / 32768, as librosa and the Rust reader
assert sr == 24000, sr
wav = wav[: int(float(seconds) * sr)]
enc = tok.encode(wav, sr=sr)
dec, _ = tok.decode(enc)
open(f"{out}/samples", "w").write(str(len(wav)))
np.ascontiguousarray(enc.audio_codes[0].numpy().astype("<i8")).tofile(f"{out}/codes.i64")
np.ascontiguousarray(dec[0].astype("<f4")).tofile(f"{out}/wav.f32")
EOF
    "$EXAMPLES/bench_codec" --codec "$CODEC_DIR" --audio "$WAV" --parity "$OUT" \
        >"$OUT/parity.json"
    cat "$OUT/parity.json" >&2
fi

if [[ $ROUNDS == 0 ]]; then
    exit 0 # parity check only
fi

for round in $(seq 1 "$ROUNDS"); do
    for dtype in float32 bfloat16; do
        ((REFERENCE)) || continue
        echo "== round $round/$ROUNDS: official $dtype (torch, $THREADS threads)" >&2
        "$PYTHON" scripts/reference/bench_codec.py --bench "$CODEC_DIR" --audio "$WAV" \
            --seconds "$SECONDS_OF_AUDIO" --threads "$THREADS" --dtype "$dtype" \
            2>"$OUT/official_$dtype.$round.log" >"$OUT/official_$dtype.$round.json" \
            || { cat "$OUT/official_$dtype.$round.log" >&2; exit 1; }
        grep -E '^threads=' "$OUT/official_$dtype.$round.log" >&2 || true
    done
    echo "== round $round/$ROUNDS: rust ($THREADS threads)" >&2
    RAYON_NUM_THREADS=$THREADS "$EXAMPLES/bench_codec" --codec "$CODEC_DIR" \
        --audio "$WAV" --seconds "$SECONDS_OF_AUDIO" >"$OUT/rust.$round.json"
done

# Python 3 of the machine: the table needs no package (the official side may be absent, SMOKE=1).
python3 - "$OUT" "$ROUNDS" "$LOAD_NOTE" "$REFERENCE" <<'EOF'
import json, sys
out, rounds, load_note, reference = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
def load(side):
    runs = [json.loads(open(f"{out}/{side}.{r}.json").read().strip().splitlines()[-1]) for r in range(1, rounds + 1)]
    best = {k: min(r[k] for r in runs) for k in ("encode_seconds", "decode_seconds")}
    frames = {r["frames"] for r in runs}
    assert len(frames) == 1, frames
    return runs[0]["audio_seconds"], frames.pop(), best, runs
def rt(t):  # times print with 3 decimals: a smoke run's toy codec can read 0.000
    return audio_r / t if t > 0 else float("inf")
audio_r, frames_r, rust, runs_r = load("rust")
f32 = bf16 = runs_f = runs_b = None
if reference:
    audio_f, frames_f, f32, runs_f = load("official_float32")
    audio_b, frames_b, bf16, runs_b = load("official_bfloat16")
    assert audio_f == audio_b == audio_r and frames_f == frames_b == frames_r, (audio_f, audio_b, audio_r)
print(f"audio: {audio_r:.1f} s, {frames_r} frames; best of {rounds} round(s) each; {load_note}")
print(f"{'':8} {'official float32':>22} {'official bfloat16':>22} {'rust':>22} {'rust/faster official':>21}")
speedup = {"encode": None, "decode": None}
for step in ("encode", "decode"):
    r = rust[f"{step}_seconds"]
    if reference:
        o32, o16 = f32[f"{step}_seconds"], bf16[f"{step}_seconds"]
        best = min(o32, o16)
        speedup[step] = round(best / r, 3) if r > 0 else None
        cells = " ".join(f"{t:8.2f} s {rt(t):7.2f}x RT" for t in (o32, o16, r))
        print(f"{step:8} {cells} {rt(r) / rt(best):20.2f}x")
    else:
        print(f"{step:8} {'-':>22} {'-':>22} {r:8.2f} s {rt(r):7.2f}x RT {'-':>21}")
try:
    parity = json.load(open(f"{out}/parity.json"))
    print(f"parity (first {parity['frames']} frames): codes differing {parity['codes_differing']}, "
          f"decoded audio max abs diff {parity['wav_max_abs_diff']:.2e}")
except FileNotFoundError:
    parity = None
print(json.dumps({"audio_seconds": audio_r, "frames": frames_r, "parity": parity, "load": load_note,
                  "official_float32": runs_f, "official_bfloat16": runs_b, "rust": runs_r,
                  "encode_speedup": speedup["encode"], "decode_speedup": speedup["decode"]}))
EOF
