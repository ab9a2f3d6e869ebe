#!/usr/bin/env bash
# Adapter voices on one shared base against merged models (docs/serving.md §7), on the
# 0.6B-shaped random model (scripts/bench/synthetic.py), on the CPU:
#
# 1. Two LoRA runs (rank R, default 16, different seeds, STEPS optimizer steps each) in two
#    workspaces; each is exported alone (`export --adapter-only`, voices alice and bob) and
#    alice's also merged (`export`).
# 2. Two servers: `serve --model merged-alice` (one merged model) and `serve --adapter alice
#    --adapter bob` (the base once, both adapters beside it).
# 3. `scripts/bench/serve_client.py voices`: one greedy request of FRAMES frames at a time, rounds
#    alternating merged alice / adapter alice / adapter bob, best of ROUNDS: the real-time factor
#    of each and its ratio to the merged model's; then each server's resident memory.
#
#   scripts/bench/serve_adapters.sh
#   R=16 FRAMES=50 ROUNDS=3 PRECISION=bf16-weights scripts/bench/serve_adapters.sh
#
# The machine must be quiet before the timed requests (load average < 0.5,
# docs/performance.md §1; FORCE=1 runs anyway and says so). BIN: the voiceclone binary (default: build
# target/release/voiceclone). PYTHON: a python3 with numpy (default .test-assets/venv/bin/python).
#
# SMOKE=1 (scripts/bench/smoke.sh): the tiny fixture model, rank 4, one step on 8-frame
# utterances, requests of 4 frames, one round; BIN the test build, nothing built.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/bench/quiet.sh
if is_smoke; then
  R=${R:-4} FRAMES=${FRAMES:-4} ROUNDS=${ROUNDS:-1} TRAIN_FRAMES=8
else
  R=${R:-16} FRAMES=${FRAMES:-50} ROUNDS=${ROUNDS:-3} TRAIN_FRAMES=20
fi
STEPS=${STEPS:-1}
PRECISION=${PRECISION:-bf16-weights}
PYTHON=${PYTHON:-.test-assets/venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
if is_smoke; then
  smoke_bin
elif [[ -z ${BIN:-} ]]; then
  echo "== building voiceclone (release)" >&2
  cargo build --release --quiet --bin voiceclone
  BIN=$PWD/target/release/voiceclone
fi
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do
    kill -TERM "$p" 2>/dev/null && wait "$p" 2>/dev/null || true
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

MODEL=$WORK/model
if is_smoke; then
  MODEL=$SMOKE_MODEL
else
  "$PYTHON" scripts/bench/synthetic.py model-0.6b tests/fixtures/tiny-0b6 "$MODEL"
fi
for who in alice bob; do
  ws=$WORK/ws-$who
  "$PYTHON" scripts/bench/synthetic.py workspace "$ws" "$MODEL" "$TRAIN_FRAMES"
  seed=1
  [[ $who == bob ]] && seed=2
  echo "== training $who's adapters (rank $R, $STEPS step(s))"
  "$BIN" --workdir "$ws" train --lora-rank "$R" --max-steps "$STEPS" --batch-size 1 \
    --grad-accum 1 --lr 1e-3 --warmup-steps 0 --seed "$seed" --no-export >"$WORK/train-$who.txt" 2>&1 || {
    cat "$WORK/train-$who.txt" >&2
    exit 1
  }
  "$BIN" --workdir "$ws" export --adapter-only --speaker-name "$who" -o "$WORK/$who" >/dev/null
done
"$BIN" --workdir "$WORK/ws-alice" export --speaker-name alice -o "$WORK/merged-alice" >/dev/null
du -sh "$WORK/alice" "$WORK/merged-alice" | sed 's/^/== /'

# start LABEL ARGS...: starts a server, sets URL and PID.
start() {
  local label=$1
  shift
  mkdir -p "$WORK/srv-$label"
  "$BIN" --workdir "$WORK/srv-$label" serve --port 0 --precision "$PRECISION" "$@" \
    >"$WORK/srv-$label/out" 2>"$WORK/srv-$label/err" &
  PID=$!
  PIDS+=("$PID")
  for _ in $(seq 1200); do
    grep -q "listening on http://" "$WORK/srv-$label/out" 2>/dev/null && break
    kill -0 "$PID" 2>/dev/null || {
      cat "$WORK/srv-$label/err" >&2
      exit 1
    }
    sleep 0.1
  done
  URL=$(sed -n 's/.*listening on \(http:\/\/[^ ]*\).*/\1/p' "$WORK/srv-$label/out")
  parsed "the address of the $label server" "$URL"
  grep -E "^(loaded|adapter)" "$WORK/srv-$label/err" | sed "s/^/== $label: /"
}
start merged --model "$WORK/merged-alice"
MERGED_URL=$URL MERGED_PID=$PID
start shared --adapter "$WORK/alice" --adapter "$WORK/bob"
SHARED_URL=$URL SHARED_PID=$PID

wait_quiet 180
require_quiet "before the timed requests"
echo "== $LOAD_NOTE ($(nproc) cores); precision $PRECISION, $FRAMES frames per request, best of $ROUNDS"
python3 scripts/bench/serve_client.py voices --frames "$FRAMES" --rounds "$ROUNDS" \
  "merged alice,$MERGED_URL,$MERGED_PID,alice" \
  "adapter alice,$SHARED_URL,$SHARED_PID,alice" \
  "adapter bob,$SHARED_URL,$SHARED_PID,bob"
