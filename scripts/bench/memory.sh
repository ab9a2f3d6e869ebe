#!/usr/bin/env bash
# What each memory mode of training takes on the CPU (docs/training.md §6.5, §6.6, §6.7, §6.8;
# its figures are in docs/training.md §11): one device, a 0.6B-shaped random model
# (scripts/bench/synthetic.py), 16 utterances of FRAMES frames, batch 2 × 2 micro-batches, STEPS optimizer steps per run. For every mode it prints the optimizer
# state the trainer reports at start (masters, moments, gradients), the peak resident memory of
# the process (GNU time), and what the memory plan (`train --plan`, docs/training.md §6.9)
# predicted for it, with the ratio plan / measured; one line per mode.
#
#   scripts/bench/memory.sh [FRAMES] [STEPS]      (defaults 60 and 2)
#
# Two steps, because the first under-reads: the moments start as zero pages the allocator never
# touched, resident only once the first update writes them; the second step's backward pass is
# the steady state the plan describes.
#
# AUTOGRAD=1 adds runs of the autograd backend. BIN: the voiceclone binary (default: cargo
# build, the optimized dev profile). PYTHON: a python3
# with numpy (default: .test-assets/venv/bin/python, else python3). Needs about 20 GB of memory
# for the fp32 runs; start it on an otherwise idle machine so nothing else is paged out.
#
# SMOKE=1 (scripts/bench/smoke.sh): every mode (AUTOGRAD=1's too when set) on the tiny fixture
# model, 8-frame utterances, 2 steps; BIN the test build, nothing built.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/smoke.sh
if is_smoke; then
  FRAMES=${1:-8}
else
  FRAMES=${1:-60}
fi
STEPS=${2:-2}
PYTHON=${PYTHON:-.test-assets/venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
if is_smoke; then
  smoke_bin
elif [ -z "${BIN:-}" ]; then
  cargo build --quiet
  BIN=$PWD/target/debug/voiceclone
fi
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
MODEL=$WORK/model
if is_smoke; then
  MODEL=$SMOKE_MODEL
else
  "$PYTHON" scripts/bench/synthetic.py model-0.6b tests/fixtures/tiny-0b6 "$MODEL"
fi

run() { # run LABEL ARGS...: one training run, its state line and peak RSS
  local label=$1
  shift
  local ws=$WORK/ws
  rm -rf "$ws"
  "$PYTHON" scripts/bench/synthetic.py workspace "$ws" "$MODEL" "$FRAMES"
  /usr/bin/time -v "$BIN" --workdir "$ws" train --batch-size 2 --grad-accum 2 --no-shuffle \
    --no-export --max-steps "$STEPS" --save-every 0 "$@" >"$WORK/out.txt" 2>"$WORK/time.txt" || {
    cat "$WORK/out.txt" "$WORK/time.txt" >&2
    exit 1
  }
  local state rss plan
  state=$(grep -m1 '^optimizer state: ' "$WORK/out.txt" | sed 's/^optimizer state: //' || true)
  rss=$(awk -F: '/Maximum resident set size/ {printf "%.2f", $2 / 1e6}' "$WORK/time.txt")
  plan=$("$BIN" --workdir "$ws" train --plan --json --batch-size 2 --grad-accum 2 "$@" |
    "$PYTHON" -c 'import json, sys; print("%.2f" % (json.load(sys.stdin)["modes"][0]["host_bytes"] / 1e9))')
  parsed "the optimizer state line ($label)" "$state"
  parsed "the peak RSS of GNU time ($label)" "$rss"
  printf '%-40s state %s; peak RSS %s GB; plan %s GB (plan/RSS %s)\n' "$label" "$state" "$rss" \
    "$plan" "$(awk -v p="$plan" -v r="$rss" 'BEGIN {printf "%.3f", p / r}')"
}

run "kernels fp32"
run "kernels int8" --optimizer-state int8
run "kernels bf16-compensated" --optimizer-state bf16-compensated
run "kernels fp32 --recompute layers" --recompute layers
run "kernels fp32 --reduce-dtype bf16" --reduce-dtype bf16
# The autograd path (bf16 storage, what CUDA runs) computes in f32 on the CPU and keeps its whole
# graph: its fp32 run of this model needs more than 24 GB. Offloading changes nothing on the CPU
# (the host is the device).
if [ "${AUTOGRAD:-0}" = 1 ]; then
  run "autograd fp32" --backend autograd
  run "autograd int8" --backend autograd --optimizer-state int8
  run "autograd fp32 --recompute layers" --backend autograd --recompute layers
fi
