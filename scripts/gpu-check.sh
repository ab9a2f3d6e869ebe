#!/usr/bin/env bash
# The prepared check for a machine with an NVIDIA GPU (docs/distributed.md §10), within 10
# minutes on one GPU, without network. Run it in the repository root:
#   BIN=path/to/voiceclone scripts/gpu-check.sh
# BIN is a release build with --features cuda,nccl (build it where CUDA 13.0 is, e.g. with
# scripts/release/build_cuda.sh, which prints its path); with
# BIN unset and cargo and nvcc present, it is built here. CUDA 13 and NCCL libraries must be on
# LD_LIBRARY_PATH (docs/architecture.md §9.2). python3 with numpy writes the 0.6B-shaped model.
# Checks, one summary line each at the end:
#  1. forward/backward parity on both fixture models: the first step's loss (forward) and
#     gradient norm (backward) of --gpus 1 on the GPU against --cpu-ranks 1 on the CPU, both on
#     the autograd backend (bf16 storage; the GPU also computes in bf16);
#  2. the single-device GPU path against --gpus 1 (NCCL with one rank);
#  3. --gpus 1 on a 0.6B-shaped random model: step time, frames/s, peak device memory of the
#     rank process (from nvidia-smi);
#  4. a --gpus 1 run SIGKILLed after its first checkpoint resumes and finishes;
#  5. `speak` on the GPU (frames/s);
#  6. the parity tests of tests/it/gpu_parity.rs, when cargo is present;
#  7. the memory plan (docs/training.md §6.9) against the driver's peak device memory of the
#     rank process, for each memory mode on the 0.6B-shaped model (two steps each);
#  8. LoRA (docs/training.md §13): check 1's parity with --lora-rank 8 after three steps (a
#     fresh adapter is the base model, so the steps are what differs), and on the 0.6B-shaped
#     model with --lora-rank 16 the step time and the plan against the driver's peak.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SUMMARY=$WORK/summary.txt
: >"$SUMMARY"
summary() { echo "$*" | tee -a "$SUMMARY"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -z "${BIN:-}" ]; then
  cargo build --release --features cuda,nccl --quiet
  BIN=$PWD/target/release/voiceclone
fi
"$BIN" --version 2>/dev/null || true

make_ws() { # make_ws DIR MODEL FRAMES: a workspace with synthetic codes and an x-vector
  python3 scripts/bench/synthetic.py workspace "$1" "$2" "$3"
}
metric() { # metric WS STEP KEY
  python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(r[int(sys.argv[2])-1][sys.argv[3]])" \
    "$1/checkpoints/metrics.jsonl" "$2" "$3"
}
rel() { python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'{abs(a-b)/abs(b):.2e}')" "$1" "$2"; }
below() { python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)" "$1" "$2"; }
TRAIN=(train --batch-size 4 --grad-accum 2 --no-shuffle --no-export --backend autograd)
planned() { # planned FLAGS...: the plan's device bytes (first mode) of a --gpus 1 run of $WORK/big
  "$BIN" --workdir "$WORK/big" "${TRAIN[@]}" --gpus 1 --plan --json "$@" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["modes"][0]["gpu_bytes"])'
}
peak_of() { # peak_of STEPS FLAGS...: STEPS steps of $WORK/big on --gpus 1 under nvidia-smi; prints
  # the driver's peak device bytes of any process (0 if none was seen)
  local steps=$1 smi
  shift
  rm -rf "$WORK/big/checkpoints"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 100 >"$WORK/mem.txt" &
  smi=$!
  "$BIN" --workdir "$WORK/big" "${TRAIN[@]}" --max-steps "$steps" --save-every 0 --gpus 1 \
    --memory manual "$@" >/dev/null 2>&1 || true
  kill "$smi" || true
  python3 - "$WORK/mem.txt" <<'EOF2'
import sys
peak = 0
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak = max(peak, int(parts[1]) * 2**20)
print(peak)
EOF2
}

echo "== 1. forward/backward parity, GPU (bf16) against CPU (f32 arithmetic on bf16 storage)"
for m in tiny-0b6 tiny-1b7; do
  make_ws "$WORK/g-$m" "tests/fixtures/$m" 8
  make_ws "$WORK/c-$m" "tests/fixtures/$m" 8
  "$BIN" --workdir "$WORK/g-$m" "${TRAIN[@]}" --max-steps 1 --gpus 1 >/dev/null
  "$BIN" --workdir "$WORK/c-$m" "${TRAIN[@]}" --max-steps 1 --cpu-ranks 1 >/dev/null
  lf=$(rel "$(metric "$WORK/g-$m" 1 loss)" "$(metric "$WORK/c-$m" 1 loss)")
  gf=$(rel "$(metric "$WORK/g-$m" 1 grad_norm)" "$(metric "$WORK/c-$m" 1 grad_norm)")
  if below "$lf" 3e-2 && below "$gf" 3e-2; then r=PASS; else r=FAIL; fi
  summary "CHECK 1 parity $m: $r (loss rel $lf, grad norm rel $gf; limit 3e-2, bf16 activations)"
done

echo "== 2. the single-device GPU path against --gpus 1"
make_ws "$WORK/s" tests/fixtures/tiny-0b6 8
"$BIN" --workdir "$WORK/s" "${TRAIN[@]}" --max-steps 1 >/dev/null
lf=$(rel "$(metric "$WORK/s" 1 loss)" "$(metric "$WORK/g-tiny-0b6" 1 loss)")
gf=$(rel "$(metric "$WORK/s" 1 grad_norm)" "$(metric "$WORK/g-tiny-0b6" 1 grad_norm)")
if below "$lf" 1e-2 && below "$gf" 1e-2; then r=PASS; else r=FAIL; fi
summary "CHECK 2 single GPU vs --gpus 1: $r (loss rel $lf, grad norm rel $gf; limit 1e-2)"

MODEL=$WORK/qwen3-tts-0.6b-random
echo "== 3. --gpus 1 on a 0.6B-shaped random model"
python3 scripts/bench/synthetic.py model-0.6b tests/fixtures/tiny-0b6 "$MODEL"
make_ws "$WORK/big" "$MODEL" 100
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 >"$WORK/mem.txt" &
SMI=$!
"$BIN" --workdir "$WORK/big" "${TRAIN[@]}" --max-steps 4 --save-every 0 --gpus 1 | tail -n 3
kill $SMI || true
python3 - "$WORK/big/checkpoints/metrics.jsonl" "$WORK/mem.txt" "$SUMMARY" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
s = statistics.median(r["seconds"] for r in rows)
f = statistics.median(r["frames"] / r["seconds"] for r in rows)
peak = {}
for line in open(sys.argv[2]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak[parts[0]] = max(peak.get(parts[0], 0), int(parts[1]))
line = (f"CHECK 3 0.6B-shaped --gpus 1: PASS (step {s:.3f} s, {f:.0f} frames/s, peak device memory "
        f"per rank process {sorted(peak.values(), reverse=True)} MiB)")
print(line); open(sys.argv[3], "a").write(line + "\n")
EOF

echo "== 4. a --gpus 1 run killed after its first checkpoint resumes"
make_ws "$WORK/k" tests/fixtures/tiny-0b6 8
"$BIN" --workdir "$WORK/k" "${TRAIN[@]}" --max-steps 6 --save-every 2 --gpus 1 >/dev/null 2>&1 &
LAUNCHER=$!
for _ in $(seq 600); do [ -e "$WORK/k/checkpoints/step-0000002/index.json" ] && break; sleep 0.1; done
pkill -KILL -f -- "--workdir $WORK/k" || true
wait $LAUNCHER || true
if "$BIN" --workdir "$WORK/k" "${TRAIN[@]}" --max-steps 6 --save-every 2 --gpus 1 >"$WORK/k.out" 2>&1 &&
  grep -q "resuming from checkpoints/step-" "$WORK/k.out"; then
  summary "CHECK 4 SIGKILL + resume: PASS ($(grep -o 'resuming from [^ ]*' "$WORK/k.out"), final loss $(metric "$WORK/k" 6 loss))"
else
  summary "CHECK 4 SIGKILL + resume: FAIL ($(tail -n 3 "$WORK/k.out" | tr '\n' ' '))"
fi

echo "== 5. speak on the GPU (0.6B-shaped model, the workspace's x-vector, 50 greedy frames)"
if "$BIN" --workdir "$WORK/big" speak "The quick brown fox jumps over the lazy dog." -o "$WORK/out.wav" \
  --greedy --max-frames 50 >"$WORK/speak.out" 2>&1; then
  summary "CHECK 5 speak on the GPU: PASS ($(grep -Eo '[0-9.]+ frames/s' "$WORK/speak.out" | tail -n 1))"
else
  summary "CHECK 5 speak on the GPU: FAIL ($(tail -n 2 "$WORK/speak.out" | tr '\n' ' '))"
fi

echo "== 7. the memory plan against the driver's peak, per mode (0.6B-shaped, two steps)"
for mode in "" "--optimizer-state int8" "--optimizer-state bf16-compensated" \
  "--offload optimizer" "--recompute layers" "--reduce-dtype bf16"; do
  # shellcheck disable=SC2086 # $mode is a list of flags
  plan=$(planned $mode)
  # shellcheck disable=SC2086
  peak=$(peak_of 2 $mode)
  python3 - "$plan" "$peak" "${mode:-fp32}" "$SUMMARY" <<'EOF2'
import sys
plan, peak = int(sys.argv[1]), int(sys.argv[2])
ratio = plan / peak if peak else float("nan")
r = "PASS" if 0.9 <= ratio <= 1.1 else "FAIL"
line = (f"CHECK 7 plan vs peak {sys.argv[3]}: {r} (plan {plan / 1e9:.2f} GB, driver peak "
        f"{peak / 1e9:.2f} GB, ratio {ratio:.3f}; limit 10 %)")
print(line); open(sys.argv[4], "a").write(line + "\n")
EOF2
done

echo "== 8. LoRA on the GPU"
LORA=(--lora-rank 8 --lora-full talker.codec_head.weight --lr 1e-3 --warmup-steps 0)
make_ws "$WORK/lg" tests/fixtures/tiny-0b6 8
make_ws "$WORK/lc" tests/fixtures/tiny-0b6 8
"$BIN" --workdir "$WORK/lg" "${TRAIN[@]}" "${LORA[@]}" --max-steps 3 --gpus 1 >/dev/null
"$BIN" --workdir "$WORK/lc" "${TRAIN[@]}" "${LORA[@]}" --max-steps 3 --cpu-ranks 1 >/dev/null
lf=$(rel "$(metric "$WORK/lg" 3 loss)" "$(metric "$WORK/lc" 3 loss)")
gf=$(rel "$(metric "$WORK/lg" 3 grad_norm)" "$(metric "$WORK/lc" 3 grad_norm)")
if below "$lf" 3e-2 && below "$gf" 3e-2; then r=PASS; else r=FAIL; fi
summary "CHECK 8 LoRA parity tiny-0b6, step 3: $r (loss rel $lf, grad norm rel $gf; limit 3e-2)"
plan=$(planned --lora-rank 16)
peak=$(peak_of 4 --lora-rank 16)
python3 - "$plan" "$peak" "$WORK/big/checkpoints/metrics.jsonl" "$SUMMARY" <<'EOF2'
import json, sys
plan, peak = int(sys.argv[1]), int(sys.argv[2])
try:
    steps = [json.loads(l) for l in open(sys.argv[3])][1:]
    step = sum(s["seconds"] for s in steps) / len(steps)
except (OSError, ZeroDivisionError, KeyError):
    step = float("nan")
ratio = plan / peak if peak else float("nan")
r = "PASS" if 0.9 <= ratio <= 1.1 and step == step else "FAIL"
line = (f"CHECK 8 LoRA R=16 0.6B-shaped --gpus 1: {r} (step {step:.3f} s, plan {plan / 1e9:.2f} GB, "
        f"driver peak {peak / 1e9:.2f} GB, ratio {ratio:.3f}; limit 10 %)")
print(line); open(sys.argv[4], "a").write(line + "\n")
EOF2

if command -v cargo >/dev/null && command -v nvcc >/dev/null; then
  echo "== 6. parity tests on CUDA"
  if cargo test --release --features cuda,nccl,test-hooks --test it -- gpu_parity 2>&1 | tee "$WORK/t.out" |
    grep -q "test result: ok"; then r=PASS; else r=FAIL; fi
  summary "CHECK 6 gpu_parity tests: $r"
fi
echo "== summary ($(($(date +%s) - START)) s)"
cat "$SUMMARY"
