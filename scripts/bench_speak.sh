#!/usr/bin/env bash
# Synthesis speed, `voiceclone speak` vs the official Python package, side by side in one run
# (docs/performance.md §1, §2).
#
#   scripts/bench_speak.sh                     # 50 frames, 2 threads, one round
#   FRAMES=80 ROUNDS=2 scripts/bench_speak.sh
#
# Both sides load the same randomly initialised checkpoint with the real 0.6B shapes (docs/model.md §2;
# made once by `scripts/make_fixtures.py --full-size`, ~1.8 GB, ignored by git), clone the same
# reference clip from its x-vector, speak the same text greedily (so both generate exactly the
# same number of frames: FRAMES), in the same streaming-text layout with the model's
# repetition penalty. The official side is one `generate_voice_clone` call
# (scripts/bench_speak_official.py); the Rust side is `voiceclone speak --greedy --max-frames N`
# in each precision: `f32` (the official arithmetic) and `bf16-weights` (the CPU default:
# checkpoint-exact bf16 matrices, f32 arithmetic). Timed: voice preparation + generation +
# decoding, model loading excluded, on both sides. Peak memory is the whole process's maximum
# RSS (loading included), compared with the f32 size of the weights the process loads.
# Rounds alternate official / Rust; the best time of each is reported (the machine is shared:
# the minimum is the least disturbed measurement).
#
# Environment: PYTHON (torch + qwen-tts; default /work/fixtures-venv/bin/python), MODEL (default
# .big-fixtures/qwen3-tts-0.6b-random), FRAMES (default 50), ROUNDS (default 1), THREADS (both
# sides; default 2), TEXT.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-/work/fixtures-venv/bin/python}
MODEL=${MODEL:-.big-fixtures/qwen3-tts-0.6b-random}
FRAMES=${FRAMES:-50}
ROUNDS=${ROUNDS:-1}
THREADS=${THREADS:-2}
TEXT=${TEXT:-"The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet forest."}
REF=tests/fixtures/audio/ref24k.wav
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

if ! "$PYTHON" -c 'import torch, qwen_tts' 2>/dev/null; then
    echo "error: $PYTHON lacks torch / qwen-tts (see scripts/make_fixtures.py for the setup)" >&2
    exit 1
fi
if [[ ! -f $MODEL/model.safetensors ]]; then
    echo "== writing the 0.6B-shaped random model to $MODEL (once)" >&2
    "$PYTHON" scripts/make_fixtures.py --full-size "$MODEL"
fi
echo "== building voiceclone (release)" >&2
cargo build --release --quiet --bin voiceclone
BIN=target/release/voiceclone

run_official() {
    "$PYTHON" scripts/bench_speak_official.py --model "$MODEL" --ref-audio "$REF" --text "$TEXT" \
        --frames "$FRAMES" --threads "$THREADS" --out-json "$OUT/official.json" >/dev/null
    "$PYTHON" - "$OUT/official.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['wall_s']:.3f} {r['frames']} {r['audio_s']:.3f} {r['peak_rss_mb']:.0f}")
EOF
}

run_rust() {
    local precision=$1
    /usr/bin/time -v env RAYON_NUM_THREADS="$THREADS" "$BIN" --workdir "$OUT" speak "$TEXT" \
        -o "$OUT/rust-$precision.wav" --overwrite --model "$MODEL" --ref-audio "$REF" --greedy \
        --max-frames "$FRAMES" --precision "$precision" >"$OUT/rust.out" 2>"$OUT/rust.err" || {
        cat "$OUT/rust.err" >&2
        exit 1
    }
    local secs audio frames rss
    secs=$(sed -n 's/.* of audio in \([0-9.]*\) s.*/\1/p' "$OUT/rust.err")
    audio=$(sed -n 's/^\([0-9.]*\) s of audio in .*/\1/p' "$OUT/rust.err")
    frames=$(sed -n 's/.*s, \([0-9]*\) frames.*/\1/p' "$OUT/rust.out")
    rss=$(sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\)/\1/p' "$OUT/rust.err")
    echo "$secs $frames $audio $((rss / 1024))"
}

best() { sort -n | head -1; }
declare -A TIMES FRAMES_OF AUDIO RSS
for ((round = 1; round <= ROUNDS; round++)); do
    for side in official f32 bf16-weights; do
        echo "== round $round: $side" >&2
        if [[ $side == official ]]; then line=$(run_official); else line=$(run_rust "$side"); fi
        read -r secs frames audio rss <<<"$line"
        TIMES[$side]+="$secs"$'\n'
        FRAMES_OF[$side]=$frames
        AUDIO[$side]=$audio
        RSS[$side]=$rss
    done
done

WEIGHTS_MB=$("$PYTHON" - "$MODEL/model.safetensors" <<'EOF'
import json, struct, sys
# f32 size of every tensor in the checkpoint (what an f32 load of the model holds).
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
elems = 0
for k, v in header.items():
    if k != "__metadata__":
        c = 1
        for d in v["shape"]:
            c *= d
        elems += c
print(f"{elems * 4 / 2**20:.0f}")
EOF
)

official=$(printf '%s' "${TIMES[official]}" | best)
printf '\n%s frames of %s, %s threads, best of %s round(s); f32 weights of the checkpoint: %s MiB\n' \
    "$FRAMES" "$MODEL" "$THREADS" "$ROUNDS" "$WEIGHTS_MB"
printf '%-22s %8s %7s %9s %7s %10s %9s %12s\n' side seconds frames frames/s RTF "peak MiB" "x weights" "vs official"
for side in official f32 bf16-weights; do
    t=$(printf '%s' "${TIMES[$side]}" | best)
    python3 - "$side" "$t" "${FRAMES_OF[$side]}" "${AUDIO[$side]}" "${RSS[$side]}" "$WEIGHTS_MB" "$official" <<'EOF'
import sys
side, t, frames, audio, rss, weights, official = sys.argv[1:]
t, frames, audio, rss, weights, official = float(t), int(frames), float(audio), float(rss), float(weights), float(official)
name = "official (torch f32)" if side == "official" else f"voiceclone {side}"
print(f"{name:<22} {t:8.2f} {frames:7d} {frames / t:9.2f} {t / audio:7.2f} {rss:10.0f} {rss / weights:9.2f} {official / t:11.2f}x")
EOF
done
for side in f32 bf16-weights; do
    if [[ ${FRAMES_OF[$side]} != "${FRAMES_OF[official]}" ]]; then
        echo "warning: $side generated ${FRAMES_OF[$side]} frames, the official side ${FRAMES_OF[official]}" >&2
    fi
done
