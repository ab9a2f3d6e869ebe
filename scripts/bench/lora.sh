#!/usr/bin/env bash
# LoRA against a full fine-tune (docs/training.md §13), for docs/usage.md §5:
#
# 1. `table`: trained values and state bytes of the released models' shapes (configs/models/) for a
#    full fine-tune and for adapters of rank 8, 16 and 32 (default targets, nothing trained
#    fully), from `voiceclone train --plan --json` (reads config.json only): the checkpoint
#    (fp32 masters and moments, 12 bytes per trained value) and what one GPU holds for the
#    optimizer (masters, moments and gradients), and the plan's total for one GPU at the default
#    batch with `--recompute layers`.
# 2. `steps`: the step time of LoRA (rank R, default 16) against a full fine-tune on the
#    0.6B-shaped random model (scripts/bench/synthetic.py), one device, the CPU kernels, side by side:
#    rounds alternate full / LoRA, STEPS optimizer steps each (batch 2 × 2 micro-batches of
#    FRAMES-frame utterances), the first step of a run not counted; the best mean step time of
#    each side is reported with the ratio. Needs about 18 GB for the full fine-tune's run; start
#    it on a quiet machine (it refuses a busy one unless FORCE=1, docs/performance.md §1).
#
#   scripts/bench/lora.sh [table|steps|all]      (default all)
#   ROUNDS=2 STEPS=3 FRAMES=60 R=16 scripts/bench/lora.sh steps
#
# BIN: the voiceclone binary (default: cargo build, the optimized dev profile). PYTHON: a python3
# with numpy (default .test-assets/venv/bin/python, else python3).
#
# SMOKE=1 (scripts/bench/smoke.sh): the whole table (it is instant); `steps` on the tiny fixture
# model, one round of 2 steps of 8-frame utterances, rank 4; BIN the test build, nothing built.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/bench/quiet.sh
WHAT=${1:-all}
if is_smoke; then
  ROUNDS=${ROUNDS:-1} STEPS=${STEPS:-2} FRAMES=${FRAMES:-8} R=${R:-4}
else
  ROUNDS=${ROUNDS:-2} STEPS=${STEPS:-3} FRAMES=${FRAMES:-60} R=${R:-16}
fi
PYTHON=${PYTHON:-.test-assets/venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
if is_smoke; then
  smoke_bin
elif [ -z "${BIN:-}" ]; then
  cargo build --quiet
  BIN=$PWD/target/debug/voiceclone
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

table() {
  for size in 0.6b 1.7b; do
    for r in 0 8 16 32; do
      "$BIN" --workdir "$WORK" train --plan --json --model "configs/models/qwen3-tts-12hz-$size-base" \
        --gpus 1 --gpu-memory 1000 --recompute layers --lora-rank "$r" >"$WORK/$size-$r.json"
    done
  done
  python3 - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
print("| model | trained | values | checkpoint | optimizer on the GPU | plan, one GPU (recompute) |")
print("|---|---|---|---|---|---|")
for size in ["0.6b", "1.7b"]:
    for r in [0, 8, 16, 32]:
        p = json.load(open(f"{work}/{size}-{r}.json"))
        m = next(m for m in p["modes"] if m["optimizer_state"] == "fp32" and m["offload"] == "none")
        g = m["gpu"]
        values = g["masters"] / 4
        what = "full fine-tune" if r == 0 else f"LoRA R = {r}"
        print(f"| {size.upper()} | {what} | {values / 1e6:.1f} M | {12 * values / 1e6:.0f} MB | "
              f"{(g['masters'] + g['moments'] + g['gradients']) / 1e9:.2f} GB | {m['gpu_bytes'] / 1e9:.1f} GB |")
PY
}

steps() {
  local model=$WORK/model
  if is_smoke; then
    model=$SMOKE_MODEL
  else
    "$PYTHON" scripts/bench/synthetic.py model-0.6b tests/fixtures/tiny-0b6 "$model"
  fi
  wait_quiet 180
  require_quiet "before the first run"
  echo "$LOAD_NOTE ($(nproc) cores); $STEPS steps of batch 2 × 2, $FRAMES frames per utterance"
  run() { # run LABEL ARGS...: prints the mean step time of steps 2.. and the state line
    local label=$1
    shift
    local ws=$WORK/ws
    rm -rf "$ws"
    "$PYTHON" scripts/bench/synthetic.py workspace "$ws" "$model" "$FRAMES"
    "$BIN" --workdir "$ws" train --batch-size 2 --grad-accum 2 --no-shuffle --no-export \
      --max-steps "$STEPS" --save-every 0 --memory manual "$@" >"$WORK/out.txt" 2>&1 || {
      cat "$WORK/out.txt" >&2
      exit 1
    }
    local state
    state=$(grep -m1 '^optimizer state: ' "$WORK/out.txt" || true)
    parsed "the optimizer state line of $label" "$state"
    python3 - "$ws/checkpoints/metrics.jsonl" "$label" "$state" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [s for s in steps if "seconds" in s][1:]
print(f"{sys.argv[2]} {sum(s['seconds'] for s in steps) / len(steps):.3f} {sys.argv[3]}")
PY
  }
  : >"$WORK/times"
  for round in $(seq "$ROUNDS"); do
    run full >>"$WORK/times"
    run "lora-$R" --lora-rank "$R" >>"$WORK/times"
    tail -2 "$WORK/times"
  done
  python3 - "$WORK/times" <<'PY'
import sys
best = {}
for line in open(sys.argv[1]):
    label, secs, state = line.split(" ", 2)
    if label not in best or float(secs) < best[label][0]:
        best[label] = (float(secs), state.strip())
(full, fs), (lora, ls) = best["full"], next(v for k, v in best.items() if k != "full")
print(f"full fine-tune: {full:.2f} s per step ({fs})")
print(f"LoRA:           {lora:.2f} s per step ({ls})")
print(f"LoRA step time / full: {lora / full:.3f} (best of each side)")
PY
}

case $WHAT in
  table) table ;;
  steps) steps ;;
  all) table && steps ;;
  *) echo "usage: $0 [table|steps|all]" >&2; exit 2 ;;
esac
