#!/usr/bin/env bash
# `voiceclone serve` under concurrent streams, and a bounded load test (docs/serving.md §6,
# docs/performance.md §1 for the rules of measurement).
#
#   scripts/bench/serve.sh            # 0.6B-shaped random model, CPU: 1, 2, 4, 8 streams
#   STREAMS="1 4" FRAMES=30 scripts/bench/serve.sh
#   scripts/bench/serve.sh load       # 200 requests from 8 clients, some hanging up, some malformed
#
# The server loads the model once (MODEL, default .big-fixtures/qwen3-tts-0.6b-random: the
# bf16-stored random checkpoint with the real 0.6B shapes that `scripts/reference/make_fixtures.py
# --full-size` writes for scripts/bench/speak.sh) and clones the reference clip from its x-vector (the
# workspace's data/ref.wav). `scripts/bench/serve_client.py bench` then sends, for each N in STREAMS, N
# simultaneous greedy requests of exactly FRAMES frames as 16-bit PCM and reports time to first
# audio, the per-stream real-time factor (stream time / audio time) and the aggregate audio
# seconds generated per second, best of ROUNDS; the last lines give each aggregate as a multiple
# of one stream's. `load` runs `serve_client.py load` instead: every well-formed request must be
# answered, every malformed one must get 400, and the server's resident memory is printed idle
# before, at its peak, and idle after.
#
# The machine must be quiet for `bench`: the 1-minute load average must be below 0.5 (FORCE=1
# runs anyway and says so). `load` checks behaviour, not speed, and runs on a busy machine too.
#
# CODEC=DIR serves MODEL with the speech tokenizer in DIR instead of its own (the model's files
# linked into the temporary workspace, removed at exit). For `bench` the default is
# `.big-fixtures/codec-full`, the codec of the real size (`scripts/reference/bench_codec.py
# --make-full-size` writes it): the small random codec of the default model leaves out the
# decoding that limits a CPU server (docs/performance.md §10.2). CODEC=own (the default of `load`) serves the model's own.
#
# Environment: MODEL, CODEC, STREAMS ("1 2 4 8"), FRAMES (50; load: 20), ROUNDS (2), PRECISION (auto:
# bf16-weights for the bf16 checkpoint; or f32, q8), CHUNK (the server's --stream-chunk-frames;
# default its own), THREADS (RAYON_NUM_THREADS of the server;
# default all cores), MAX_BATCH (8), REQUESTS (200), CLIENTS (8) and PASSES (2) for load, BIN (default: build
# target/release/voiceclone), FORCE.
#
# SMOKE=1 (scripts/bench/smoke.sh), either mode: the tiny fixture model with its own codec, 4
# frames; bench: STREAMS "1 2", one round; load: 18 requests (every kind of request once at
# least) from 2 clients, one pass; BIN the test build, nothing built.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/model.sh

MODE=${1:-bench}
if is_smoke; then
    MODEL=${MODEL:-$SMOKE_MODEL} STREAMS=${STREAMS:-"1 2"} ROUNDS=${ROUNDS:-1} FRAMES=${FRAMES:-4}
    CODEC=${CODEC:-own} REQUESTS=${REQUESTS:-18} CLIENTS=${CLIENTS:-2} PASSES=${PASSES:-1}
fi
MODEL=${MODEL:-.big-fixtures/qwen3-tts-0.6b-random}
STREAMS=${STREAMS:-"1 2 4 8"}
ROUNDS=${ROUNDS:-2}
PRECISION=${PRECISION:-auto}
MAX_BATCH=${MAX_BATCH:-8}
REF=tests/fixtures/audio/ref24k.wav
case $MODE in
bench) FRAMES=${FRAMES:-50} CODEC=${CODEC:-.big-fixtures/codec-full} ;;
load) FRAMES=${FRAMES:-20} CODEC=${CODEC:-own} ;;
*)
    echo "usage: scripts/bench/serve.sh [bench|load]" >&2
    exit 2
    ;;
esac

if [[ $MODE == bench ]]; then
    source scripts/bench/quiet.sh
    require_quiet "before starting"
    echo "== $LOAD_NOTE"
fi
require_model "$MODEL"
ensure_bin

WS=$(mktemp -d)
SERVER=""
cleanup() {
    if [[ -n $SERVER ]] && kill -0 "$SERVER" 2>/dev/null; then
        kill -TERM "$SERVER"
        wait "$SERVER" || true
    fi
    rm -rf "$WS"
}
trap cleanup EXIT
if [[ $CODEC != own ]]; then
    model_with_codec "$MODEL" "$CODEC" "$WS/with-codec"
    echo "== $MODEL with the speech tokenizer of $CODEC"
    MODEL=$WS/with-codec
fi
mkdir -p "$WS/data"
cp "$REF" "$WS/data/ref.wav"
if [[ -n ${THREADS:-} ]]; then export RAYON_NUM_THREADS=$THREADS; fi
CHUNK_ARGS=()
if [[ -n ${CHUNK:-} ]]; then CHUNK_ARGS=(--stream-chunk-frames "$CHUNK"); fi
"$BIN" --workdir "$WS" serve --port 0 --model "$MODEL" --precision "$PRECISION" \
    --max-batch "$MAX_BATCH" --max-queue 64 "${CHUNK_ARGS[@]}" >"$WS/serve.out" 2>"$WS/serve.err" &
SERVER=$!
for _ in $(seq 1200); do
    grep -q "listening on http://" "$WS/serve.out" 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || {
        cat "$WS/serve.err" >&2
        exit 1
    }
    sleep 0.1
done
URL=$(sed -n 's/.*listening on \(http:\/\/[^ ]*\).*/\1/p' "$WS/serve.out")
[[ -n $URL ]] || {
    echo "error: the server did not start" >&2
    cat "$WS/serve.err" >&2
    exit 1
}
grep -E "^(loading|loaded)" "$WS/serve.err" || true
echo "== $URL, $(nproc) cores, RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-all}, max batch $MAX_BATCH"
if [[ $MODE == bench ]]; then
    python3 scripts/bench/serve_client.py bench "$URL" --streams "$STREAMS" --frames "$FRAMES" \
        --rounds "$ROUNDS"
else
    python3 scripts/bench/serve_client.py load "$URL" --requests "${REQUESTS:-200}" \
        --clients "${CLIENTS:-8}" --frames "$FRAMES" --pid "$SERVER" --passes "${PASSES:-2}"
fi
kill -TERM "$SERVER"
if wait "$SERVER"; then
    echo "== server stopped on SIGTERM, exit 0"
else
    echo "error: the server exited with $? on SIGTERM" >&2
    tail -5 "$WS/serve.err" >&2
    exit 1
fi
SERVER=""
