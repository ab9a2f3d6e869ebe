#!/usr/bin/env bash
# `voiceclone speak -o -` as a listener gets it: time to first audio and the time the whole
# utterance takes, with the default audio chunks and with every frame alone
# (docs/serving.md §4.1, docs/performance.md §10.6; rules: docs/performance.md §1).
#
#   scripts/bench/speak_stream.sh            # 0.6B-shaped random model, full-size codec, q8
#   CHUNKS="32 16 1" ROUNDS=3 scripts/bench/speak_stream.sh
#
# Each run speaks the same text greedily for exactly FRAMES frames (the random model stops at
# the frame limit) to /dev/null, cloning the fixture clip from its x-vector, and prints the
# summary `speak` writes: frames, chunks, first audio after the end of loading, total time. The
# settings in CHUNKS (`--stream-chunk-frames` values) alternate within each of ROUNDS rounds,
# and each run waits for the load average to fall below 0.5 first (its own previous run raises
# it); the load average before each run is printed with it.
#
# Environment: MODEL (default .big-fixtures/qwen3-tts-0.6b-random, see scripts/bench/speak.sh),
# CODEC (default .big-fixtures/codec-full, `scripts/reference/bench_codec.py --make-full-size`
# writes it; `own` keeps the model's), PRECISION (q8), FRAMES (100), ROUNDS (2), CHUNKS ("32 1"),
# BIN (default: build target/release/voiceclone), FORCE (run on a busy machine, and say so).
#
# SMOKE=1 (scripts/bench/smoke.sh): the tiny fixture model with its own codec, 8 frames, one
# round of both chunk settings; BIN the test build, nothing built.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/quiet.sh
source scripts/bench/model.sh

if is_smoke; then
    MODEL=${MODEL:-$SMOKE_MODEL} CODEC=${CODEC:-own} FRAMES=${FRAMES:-8} ROUNDS=${ROUNDS:-1}
fi
MODEL=${MODEL:-.big-fixtures/qwen3-tts-0.6b-random}
CODEC=${CODEC:-.big-fixtures/codec-full}
PRECISION=${PRECISION:-q8}
FRAMES=${FRAMES:-100}
ROUNDS=${ROUNDS:-2}
CHUNKS=${CHUNKS:-"32 1"}
TEXT="This is a sentence that is long enough to need about eight seconds of speech, spoken in \
the cloned voice."

require_model "$MODEL"
ensure_bin

WS=$(mktemp -d)
trap 'rm -rf "$WS"' EXIT
if [[ $CODEC != own ]]; then
    model_with_codec "$MODEL" "$CODEC" "$WS/with-codec"
    echo "== $MODEL with the speech tokenizer of $CODEC, $PRECISION, $FRAMES frames, $(nproc) cores"
    MODEL=$WS/with-codec
fi
mkdir -p "$WS/data"
cp tests/fixtures/audio/ref24k.wav "$WS/data/ref.wav"

for round in $(seq "$ROUNDS"); do
    for chunk in $CHUNKS; do
        [[ ${FORCE:-0} == 1 ]] || wait_quiet 300
        require_quiet "before the run"
        "$BIN" --workdir "$WS" speak "$TEXT" --model "$MODEL" --precision "$PRECISION" --greedy \
            --max-frames "$FRAMES" --stream-chunk-frames "$chunk" -o - 2>"$WS/err" >/dev/null || {
            cat "$WS/err" >&2
            exit 1
        }
        summary=$(grep -o 'streamed to standard output.*' "$WS/err" || true)
        parsed "speak's summary line (streamed to standard output ...)" "$summary"
        echo "round $round, chunks up to $chunk frames ($LOAD_NOTE): $summary"
    done
done
