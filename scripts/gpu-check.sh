#!/usr/bin/env bash
# The prepared check for a machine with an NVIDIA GPU (docs/distributed.md §10), within 8
# minutes on one GPU, without network. On the GPU machine, from the bundle that
# scripts/release/gpu_bundle.sh prepares (docs/distributed.md §10 says how to call it):
#   bash .gpu-bundle/run.sh                 # OUT=DIR for the summary and the JSON
# or in the repository root with a CUDA build at hand:
#   BIN=path/to/voiceclone OUT=DIR scripts/gpu-check.sh
# BIN is a release build with --features cuda,nccl; CUDA 13 and NCCL libraries must be on
# LD_LIBRARY_PATH (the bundle's run.sh finds them in the machine's Python). python3 with numpy or
# torch writes the random models; the FSDP2 anchor needs the official package (the bundle's
# wheels give it).
#
# DRY_RUN=1 runs the same script on the CPU (CI does, scripts/ci/gpu_check_dry_run.sh): BIN a CPU
# build, --cpu-ranks N for --gpus N, the driver's memory queries skipped, a 15 M "small" model
# for the 0.6B-shaped one, and no verdict from the comparisons whose limits are a GPU's.
#
# Checks in order of worth, one summary line each ($OUT/summary.txt, and $OUT/summary.json); a
# check that would start after BUDGET seconds (default 420) is skipped and says so:
#  1. forward/backward parity on both fixture models: the first step's loss (forward) and
#     gradient norm (backward) of --gpus 1 on the GPU against --cpu-ranks 1 on the CPU, both on
#     the autograd backend (bf16 storage; the GPU also computes in bf16);
#  2. the single-device GPU path against --gpus 1 (NCCL with one rank);
#  3. --gpus 1 on a 0.6B-shaped random model: step time, frames/s, peak device memory of the
#     rank process (from nvidia-smi);
#  4. overlap (docs/distributed.md §4.6): --prefetch 0 against --prefetch 1 on the 0.6B-shaped
#     model, the same losses and gradient norms bit for bit, and both step times (NCCL's
#     collectives of a world of one run on their own stream too);
#  5. the anchor: PyTorch's FSDP2 (`fully_shard` per decoder layer) over the official modules on
#     the same model and batch, bf16 (scripts/reference/bench_train.py --fsdp2): its step time
#     and peak memory beside check 3's;
#  6. a --gpus 1 run SIGKILLed after its first checkpoint resumes and finishes;
#  7. `speak` on the GPU (frames/s);
#  8. LoRA (docs/training.md §13): check 1's parity with --lora-rank 8 after three steps (a
#     fresh adapter is the base model, so the steps are what differs), and on the 0.6B-shaped
#     model with --lora-rank 16 the step time and the plan against the driver's peak;
#  9. the memory plan (docs/training.md §6.9) against the driver's peak device memory of the
#     rank process, for each memory mode on the 0.6B-shaped model (two steps each);
# 10. the parity tests of tests/it/gpu_parity.rs, when cargo and nvcc are present.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${BUDGET:-420}
DRY=${DRY_RUN:-0}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
OUT=${OUT:-$WORK/out}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
summary() { echo "$*" | tee -a "$SUMMARY"; }
# due N: whether check N may start within the budget (else its line says it was skipped).
due() {
  local t=$(($(date +%s) - START))
  if ((t > BUDGET)); then
    summary "CHECK $1: SKIP (the time budget of $BUDGET s was spent, $t s in)"
    return 1
  fi
}

if [[ $DRY == 1 ]]; then
  GPUS=--cpu-ranks
  MODEL_KIND=model-small
  # Utterances of the big model's workspace, and steps of its runs: a CPU's few.
  BIG_FRAMES=12
  BIG_STEPS=2
  echo "dry run on the CPU: --cpu-ranks for --gpus, the small model for the 0.6B-shaped one"
else
  GPUS=--gpus
  MODEL_KIND=model-0.6b
  BIG_FRAMES=100
  BIG_STEPS=4
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
if [ -z "${BIN:-}" ]; then
  cargo build --release --features cuda,nccl --quiet
  BIN=$PWD/target/release/voiceclone
fi
"$BIN" --version 2>/dev/null || true

make_ws() { # make_ws DIR MODEL FRAMES: a workspace with synthetic codes and an x-vector
  python3 scripts/bench/synthetic.py workspace "$1" "$2" "$3"
}
metric() { # metric WS STEP KEY
  python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; r=[x for x in r if 'frames' in x]; print(r[int(sys.argv[2])-1][sys.argv[3]])" \
    "$1/checkpoints/metrics.jsonl" "$2" "$3"
}
median_step() { # median_step WS: the median step time after the first step
  python3 -c "import json,statistics,sys; r=[json.loads(l) for l in open(sys.argv[1])]; r=[x['seconds'] for x in r if 'frames' in x][1:]; print(f'{statistics.median(r):.3f}')" \
    "$1/checkpoints/metrics.jsonl"
}
rel() { python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'{abs(a-b)/abs(b):.2e}')" "$1" "$2"; }
below() { python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)" "$1" "$2"; }
# No samples: the runs are timed and compared, not listened to.
TRAIN=(train --batch-size 4 --grad-accum 2 --no-shuffle --no-export --backend autograd --samples false)
# watch_memory FILE: the driver's per-process memory every 100 ms into FILE (nothing on a dry
# run); prints the watcher's pid.
watch_memory() {
  if [[ $DRY == 1 ]]; then
    : >"$1"
    sleep 600 >/dev/null &
  else
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 100 >"$1" &
  fi
  echo $!
}
peak_bytes() { # peak_bytes FILE: the largest per-process memory seen, in bytes (0 if none)
  python3 - "$1" <<'EOF2'
import sys
peak = 0
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak = max(peak, int(parts[1]) * 2**20)
print(peak)
EOF2
}
planned() { # planned FLAGS...: the plan's device bytes (first mode) of a one-rank run of $WORK/big
  "$BIN" --workdir "$WORK/big" "${TRAIN[@]}" "$GPUS" 1 --plan --json "$@" |
    python3 -c 'import json, sys; m = json.load(sys.stdin)["modes"][0]; print(m["gpu_bytes"] or m["host_bytes"])'
}
peak_of() { # peak_of STEPS FLAGS...: STEPS steps of $WORK/big on one rank; prints the driver's
  # peak device bytes of any process (0 if none was seen, and on a dry run)
  local steps=$1 smi
  shift
  rm -rf "$WORK/big/checkpoints"
  smi=$(watch_memory "$WORK/mem.txt")
  "$BIN" --workdir "$WORK/big" "${TRAIN[@]}" --max-steps "$steps" --save-every 0 "$GPUS" 1 \
    --memory manual "$@" >/dev/null 2>&1 || true
  kill "$smi" || true
  peak_bytes "$WORK/mem.txt"
}
verdict() { # verdict CONDITION-STATUS: PASS or FAIL, or DRY (no verdict) on a dry run for GPU limits
  if [[ $DRY == 1 ]]; then echo DRY; elif [[ $1 == 0 ]]; then echo PASS; else echo FAIL; fi
}

if due 1; then
  echo "== 1. forward/backward parity, GPU (bf16) against CPU (f32 arithmetic on bf16 storage)"
  for m in tiny-0b6 tiny-1b7; do
    make_ws "$WORK/g-$m" "tests/fixtures/$m" 8
    make_ws "$WORK/c-$m" "tests/fixtures/$m" 8
    "$BIN" --workdir "$WORK/g-$m" "${TRAIN[@]}" --max-steps 1 "$GPUS" 1 >/dev/null
    "$BIN" --workdir "$WORK/c-$m" "${TRAIN[@]}" --max-steps 1 --cpu-ranks 1 >/dev/null
    lf=$(rel "$(metric "$WORK/g-$m" 1 loss)" "$(metric "$WORK/c-$m" 1 loss)")
    gf=$(rel "$(metric "$WORK/g-$m" 1 grad_norm)" "$(metric "$WORK/c-$m" 1 grad_norm)")
    if below "$lf" 3e-2 && below "$gf" 3e-2; then r=PASS; else r=FAIL; fi
    summary "CHECK 1 parity $m: $r (loss rel $lf, grad norm rel $gf; limit 3e-2, bf16 activations)"
  done
fi

if due 2; then
  echo "== 2. the single-device path against one rank"
  make_ws "$WORK/s" tests/fixtures/tiny-0b6 8
  "$BIN" --workdir "$WORK/s" "${TRAIN[@]}" --max-steps 1 >/dev/null
  lf=$(rel "$(metric "$WORK/s" 1 loss)" "$(metric "$WORK/g-tiny-0b6" 1 loss)")
  gf=$(rel "$(metric "$WORK/s" 1 grad_norm)" "$(metric "$WORK/g-tiny-0b6" 1 grad_norm)")
  if below "$lf" 1e-2 && below "$gf" 1e-2; then r=PASS; else r=FAIL; fi
  summary "CHECK 2 single device vs $GPUS 1: $r (loss rel $lf, grad norm rel $gf; limit 1e-2)"
fi

MODEL=$WORK/random-$MODEL_KIND
python3 scripts/bench/synthetic.py "$MODEL_KIND" tests/fixtures/tiny-0b6 "$MODEL"
make_ws "$WORK/big" "$MODEL" "$BIG_FRAMES"
# The 0.6B-shaped runs: one rank, batch 4 × 2, BIG_STEPS steps (the first not timed).
big_run() { # big_run WS FLAGS...: BIG_STEPS steps of a copy of $WORK/big in WS
  rm -rf "$1"
  cp -r "$WORK/big" "$1"
  local ws=$1
  shift
  "$BIN" --workdir "$ws" "${TRAIN[@]}" --max-steps "$BIG_STEPS" --save-every 0 "$GPUS" 1 "$@"
}

if due 3; then
  echo "== 3. one rank on the $MODEL_KIND model"
  smi=$(watch_memory "$WORK/mem.txt")
  big_run "$WORK/b3" | tail -n 3
  kill "$smi" || true
  s=$(median_step "$WORK/b3")
  fps=$(python3 -c "import json,statistics,sys; r=[json.loads(l) for l in open(sys.argv[1])]; r=[x for x in r if 'frames' in x][1:]; print(f\"{statistics.median(x['frames']/x['seconds'] for x in r):.0f}\")" "$WORK/b3/checkpoints/metrics.jsonl")
  peak=$(peak_bytes "$WORK/mem.txt")
  STEP3=$s
  PEAK3=$peak
  summary "CHECK 3 $MODEL_KIND $GPUS 1: PASS (step $s s, $fps frames/s, peak device memory $((peak / 1048576)) MiB)"
fi

if due 4; then
  echo "== 4. overlap: --prefetch 0 against --prefetch 1"
  big_run "$WORK/p0" --prefetch 0 >/dev/null
  big_run "$WORK/p1" --prefetch 1 >/dev/null
  same=$(python3 - "$WORK/p0" "$WORK/p1" <<'EOF2'
import json, sys
def rows(ws):
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, open(f"{ws}/checkpoints/metrics.jsonl"))
            if "frames" in r]
print("yes" if rows(sys.argv[1]) == rows(sys.argv[2]) else "no")
EOF2
)
  if [[ $same == yes ]]; then r=PASS; else r=FAIL; fi
  summary "CHECK 4 overlap: $r (losses and gradient norms equal bit for bit: $same; step $(median_step "$WORK/p0") s with --prefetch 0, $(median_step "$WORK/p1") s with --prefetch 1)"
fi

if due 5; then
  echo "== 5. the anchor: PyTorch FSDP2 over the official modules, same model and batch"
  if [[ $DRY == 1 ]]; then dev=cpu; else dev=cuda; fi
  if python3 -c 'import qwen_tts, librosa' 2>/dev/null; then
    if python3 scripts/reference/bench_train.py --model "$MODEL" --data "$WORK/big/data/train.jsonl" \
      --ref-xvector "$WORK/big/data/speaker.safetensors" --batch-size 4 --steps "$BIG_STEPS" --warmup 1 \
      --dtype bfloat16 --device "$dev" --fsdp2 --out-json "$OUT/fsdp2.json" >/dev/null 2>"$WORK/fsdp2.err"; then
      summary "CHECK 5 FSDP2 anchor: PASS ($(python3 - "$OUT/fsdp2.json" "${STEP3:-nan}" "${PEAK3:-0}" <<'EOF2'
import json, sys
d = json.load(open(sys.argv[1]))
ours, peak = float(sys.argv[2]), int(sys.argv[3])
mem = f", peak {d['cuda_peak_mb']:.0f} MiB against voiceclone's {peak / 2**20:.0f} MiB" if "cuda_peak_mb" in d else ""
# voiceclone's step is batch 4 × 2 micro-batches, the anchor's one batch of 4.
print(f"PyTorch FSDP2 {d['s_per_step_median']:.3f} s per batch of 4, voiceclone {ours / 2:.3f} s per batch of 4{mem}")
EOF2
))"
    else
      summary "CHECK 5 FSDP2 anchor: FAIL ($(tail -n 2 "$WORK/fsdp2.err" | tr '\n' ' '))"
    fi
  else
    summary "CHECK 5 FSDP2 anchor: SKIP (the official package does not import in this python3: the bundle's wheels give it)"
  fi
fi

if due 6; then
  echo "== 6. a one-rank run killed after its first checkpoint resumes"
  make_ws "$WORK/k" tests/fixtures/tiny-0b6 8
  "$BIN" --workdir "$WORK/k" "${TRAIN[@]}" --max-steps 6 --save-every 2 "$GPUS" 1 >/dev/null 2>&1 &
  LAUNCHER=$!
  for _ in $(seq 600); do [ -e "$WORK/k/checkpoints/step-0000002/index.json" ] && break; sleep 0.1; done
  pkill -KILL -f -- "--workdir $WORK/k" || true
  wait $LAUNCHER || true
  if "$BIN" --workdir "$WORK/k" "${TRAIN[@]}" --max-steps 6 --save-every 2 "$GPUS" 1 >"$WORK/k.out" 2>&1 &&
    grep -q "resuming from checkpoints/step-" "$WORK/k.out"; then
    summary "CHECK 6 SIGKILL + resume: PASS ($(grep -o 'resuming from [^ ]*' "$WORK/k.out"), final loss $(metric "$WORK/k" 6 loss))"
  else
    summary "CHECK 6 SIGKILL + resume: FAIL ($(tail -n 3 "$WORK/k.out" | tr '\n' ' '))"
  fi
fi

if due 7; then
  echo "== 7. speak (the $MODEL_KIND model, the workspace's x-vector, 50 greedy frames)"
  if "$BIN" --workdir "$WORK/big" speak "The quick brown fox jumps over the lazy dog." -o "$WORK/out.wav" \
    --greedy --max-frames 50 >"$WORK/speak.out" 2>&1; then
    summary "CHECK 7 speak: PASS ($(grep -Eo '^wrote [^:]*: .*frames|real-time factor [0-9.]+' "$WORK/speak.out" | sed 's/^wrote [^:]*: //' | paste -sd ' '))"
  else
    summary "CHECK 7 speak: FAIL ($(tail -n 2 "$WORK/speak.out" | tr '\n' ' '))"
  fi
fi

if due 8; then
  echo "== 8. LoRA"
  LORA=(--lora-rank 8 --lora-full talker.codec_head.weight --lr 1e-3 --warmup-steps 0)
  make_ws "$WORK/lg" tests/fixtures/tiny-0b6 8
  make_ws "$WORK/lc" tests/fixtures/tiny-0b6 8
  "$BIN" --workdir "$WORK/lg" "${TRAIN[@]}" "${LORA[@]}" --max-steps 3 "$GPUS" 1 >/dev/null
  "$BIN" --workdir "$WORK/lc" "${TRAIN[@]}" "${LORA[@]}" --max-steps 3 --cpu-ranks 1 >/dev/null
  lf=$(rel "$(metric "$WORK/lg" 3 loss)" "$(metric "$WORK/lc" 3 loss)")
  gf=$(rel "$(metric "$WORK/lg" 3 grad_norm)" "$(metric "$WORK/lc" 3 grad_norm)")
  if below "$lf" 3e-2 && below "$gf" 3e-2; then r=PASS; else r=FAIL; fi
  summary "CHECK 8 LoRA parity tiny-0b6, step 3: $r (loss rel $lf, grad norm rel $gf; limit 3e-2)"
  plan=$(planned --lora-rank 16)
  peak=$(peak_of "$BIG_STEPS" --lora-rank 16)
  python3 - "$plan" "$peak" "$WORK/big/checkpoints/metrics.jsonl" "$(verdict 0)" "$SUMMARY" <<'EOF2'
import json, sys
plan, peak, dry = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4] == "DRY"
try:
    steps = [r for r in map(json.loads, open(sys.argv[3])) if "frames" in r][1:]
    step = sum(s["seconds"] for s in steps) / len(steps)
except (OSError, ZeroDivisionError, KeyError):
    step = float("nan")
ratio = plan / peak if peak else float("nan")
r = "DRY" if dry else "PASS" if 0.9 <= ratio <= 1.1 and step == step else "FAIL"
line = (f"CHECK 8 LoRA R=16 big model: {r} (step {step:.3f} s, plan {plan / 1e9:.2f} GB, "
        f"driver peak {peak / 1e9:.2f} GB, ratio {ratio:.3f}; limit 10 %)")
print(line); open(sys.argv[5], "a").write(line + "\n")
EOF2
fi

if due 9; then
  echo "== 9. the memory plan against the driver's peak, per mode (two steps each)"
  for mode in "" "--optimizer-state int8" "--optimizer-state bf16-compensated" \
    "--offload optimizer" "--recompute layers" "--reduce-dtype bf16"; do
    # shellcheck disable=SC2086 # $mode is a list of flags
    plan=$(planned $mode)
    # shellcheck disable=SC2086
    peak=$(peak_of 2 $mode)
    python3 - "$plan" "$peak" "${mode:-fp32}" "$(verdict 0)" "$SUMMARY" <<'EOF2'
import sys
plan, peak, dry = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4] == "DRY"
ratio = plan / peak if peak else float("nan")
r = "DRY" if dry else "PASS" if 0.9 <= ratio <= 1.1 else "FAIL"
line = (f"CHECK 9 plan vs peak {sys.argv[3]}: {r} (plan {plan / 1e9:.2f} GB, driver peak "
        f"{peak / 1e9:.2f} GB, ratio {ratio:.3f}; limit 10 %)")
print(line); open(sys.argv[5], "a").write(line + "\n")
EOF2
  done
fi

if [[ $DRY != 1 ]] && command -v cargo >/dev/null && command -v nvcc >/dev/null && due 10; then
  echo "== 10. parity tests on CUDA"
  if cargo test --release --features cuda,nccl,test-hooks --test it -- gpu_parity 2>&1 | tee "$WORK/t.out" |
    grep -q "test result: ok"; then r=PASS; else r=FAIL; fi
  summary "CHECK 10 gpu_parity tests: $r"
fi
echo "== summary ($(($(date +%s) - START)) s)"
cat "$SUMMARY"
python3 - "$SUMMARY" "$OUT/summary.json" "$(($(date +%s) - START))" <<'EOF2'
import json, re, sys
checks = []
for line in open(sys.argv[1]):
    m = re.match(r"CHECK (\d+) ([^:]*): (\w+)(?: \((.*)\))?$", line.strip())
    if m:
        checks.append(dict(check=int(m[1]), name=m[2], result=m[3], detail=m[4] or ""))
json.dump(dict(seconds=int(sys.argv[3]), checks=checks), open(sys.argv[2], "w"), indent=1)
EOF2
# A dry run fails on what would fail on a GPU: a check that could not run its commands.
if grep -q ": FAIL" "$SUMMARY"; then exit 1; fi
