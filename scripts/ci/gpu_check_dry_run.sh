#!/usr/bin/env bash
# The CPU dry run of scripts/gpu-check.sh (docs/distributed.md §10): the same script with a CPU
# build, --cpu-ranks for --gpus, the driver's memory queries skipped and the small model for the
# 0.6B-shaped one, so that the script itself — its commands, flags, paths and parsing — cannot be
# what fails on the GPU. Its checks' verdicts hold on the CPU (parity, overlap, resume, speak);
# the memory comparisons whose limits are a GPU's print DRY.
#   scripts/ci/gpu_check_dry_run.sh          # BIN=path/to/voiceclone (default: the test build)
set -euo pipefail
cd "$(dirname "$0")/../.."
# The random models need numpy (or torch).
python3 -c 'import numpy' 2>/dev/null || python3 -m pip install --quiet numpy
if [[ -z ${BIN:-} ]]; then
  cargo build --locked --quiet --features test-hooks --bin voiceclone
  BIN=$PWD/target/debug/voiceclone
fi
OUT=${OUT:-$(mktemp -d)}
DRY_RUN=1 BUDGET=${BUDGET:-100000} BIN=$BIN OUT=$OUT bash scripts/gpu-check.sh
echo "dry run: $OUT/summary.txt, $OUT/summary.json"
