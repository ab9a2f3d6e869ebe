#!/usr/bin/env bash
# Training throughput, voiceclone vs a PyTorch loop over the official modules, side by side in one
# run (docs/performance.md §1).
#
#   scripts/bench/train.sh                    # medium random model, batch 2, 2 warm-up + 10 timed steps
#   ROUNDS=3 STEPS=20 scripts/bench/train.sh
#
# Both sides train the same model directory (MODEL_DIR, a random "medium" model in the official
# layout made once by `scripts/reference/bench_train.py --make-model`), on the same JSONL rows
# (DATA, made once by `--make-data`), with the same x-vector (computed by the official speaker
# encoder on tests/fixtures/audio/ref24k.wav and handed to voiceclone as data/speaker.safetensors),
# the same batches in the same order (consecutive rows, no shuffle: voiceclone `--no-shuffle`,
# `--grad-accum 1`), fp32 on the CPU, lr 2e-5, weight decay 0.01, clip 1.0, the same thread count.
# Every step is a full optimizer step (forward, backward, clipping, AdamW); the first WARMUP steps
# are not timed. Throughput = codec frames of the timed steps / their wall time (voiceclone's
# per-step `seconds` from checkpoints/metrics.jsonl; checkpoint writing is outside the steps).
# Rounds alternate official / voiceclone; the best of each side is reported (the machine is
# shared), with the ratio voiceclone / official (> 1: voiceclone is faster).
#
# Sanity checks: both sides see the same frame counts per step, and the first step's loss (same
# weights, same batch, before any update) agrees to 1e-5 relative.
#
# Environment: PYTHON (torch + qwen-tts; default .reference-venv/bin/python, made by
# scripts/reference/setup_venv.sh), MODEL_DIR (default .big-fixtures/train-medium),
# DATA (default .big-fixtures/train-rows.jsonl), BATCH (2),
# WARMUP (2), STEPS (10), ROUNDS (1), THREADS (both sides; default: every core).
#
# SMOKE=1 (scripts/bench/smoke.sh): the tiny fixture model (MODEL_DIR's default), 4 rows of 8-12
# frames written to a temporary file, 1 warm-up + 1 timed step; BIN the test build, nothing
# built. The official side only where PYTHON has the official package; without it the x-vector
# is a random one (scripts/bench/synthetic.py), the sanity checks have nothing to compare and
# the table shows voiceclone's line alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/model.sh

PYTHON=${PYTHON:-.reference-venv/bin/python}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
if is_smoke; then
    MODEL_DIR=${MODEL_DIR:-$SMOKE_MODEL} DATA=${DATA:-$OUT/rows.jsonl} WARMUP=${WARMUP:-1}
    STEPS=${STEPS:-1} DATA_ARGS=(--rows 4 --min-frames 8 --max-frames 12)
else
    MODEL_DIR=${MODEL_DIR:-.big-fixtures/train-medium} DATA=${DATA:-.big-fixtures/train-rows.jsonl}
    WARMUP=${WARMUP:-2} STEPS=${STEPS:-10} DATA_ARGS=()
fi
BATCH=${BATCH:-2}
ROUNDS=${ROUNDS:-1}
THREADS=${THREADS:-$(nproc)}

REFERENCE=1
reference_side "$PYTHON" "torch, qwen_tts" || REFERENCE=0
if is_smoke; then
    smoke_bin
else
    echo "== building voiceclone (release)" >&2
    cargo build --release --quiet
    BIN=target/release/voiceclone
fi
if [[ ! -f $MODEL_DIR/config.json ]]; then
    echo "== writing a random medium model to $MODEL_DIR (once)" >&2
    "$PYTHON" scripts/reference/bench_train.py --make-model "$MODEL_DIR"
fi
if [[ ! -f $DATA ]]; then
    echo "== writing synthetic training rows to $DATA (once)" >&2
    # --make-data needs no package: the machine's Python 3 where the reference is absent.
    py=$PYTHON
    ((REFERENCE)) || py=python3
    "$py" scripts/reference/bench_train.py --make-data "$DATA" "${DATA_ARGS[@]}"
fi
ROWS=$(grep -c . "$DATA")
if (( ROWS % BATCH != 0 )); then
    echo "error: $DATA has $ROWS rows, not a multiple of BATCH=$BATCH (the batch orders would differ)" >&2
    exit 1
fi

official() {  # $1 = round
    local xv=()
    if [[ -f $OUT/xvector.safetensors ]]; then
        xv=(--ref-xvector "$OUT/xvector.safetensors")
    else
        xv=(--ref-audio tests/fixtures/audio/ref24k.wav --save-xvector "$OUT/xvector.safetensors")
    fi
    "$PYTHON" scripts/reference/bench_train.py --model "$MODEL_DIR" --data "$DATA" "${xv[@]}" \
        --batch-size "$BATCH" --warmup "$WARMUP" --steps "$STEPS" --threads "$THREADS" \
        --lr 2e-5 --dtype float32 --device cpu --out-json "$OUT/official-$1.json" >/dev/null
}

rust() {  # $1 = round
    local ws=$OUT/ws-$1
    train_steps "$ws" "$MODEL_DIR" "$DATA" "$OUT/xvector.safetensors" "$BATCH" \
        $((WARMUP + STEPS)) env RAYON_NUM_THREADS="$THREADS" /usr/bin/time -f '%M' -o "$ws/maxrss"
}

if ((!REFERENCE)); then
    # The x-vector the official encoder would have written: a random one of the model's width.
    python3 scripts/bench/synthetic.py workspace "$OUT/xvector-ws" "$MODEL_DIR" 1
    cp "$OUT/xvector-ws/data/speaker.safetensors" "$OUT/xvector.safetensors"
fi
for r in $(seq 1 "$ROUNDS"); do
    if ((REFERENCE)); then
        echo "== round $r: official (PyTorch)" >&2
        official "$r"
    fi
    echo "== round $r: voiceclone" >&2
    rust "$r"
done

# The machine's Python 3: the table needs no package.
python3 - "$OUT" "$ROUNDS" "$WARMUP" "$BATCH" "$STEPS" "$THREADS" "$REFERENCE" <<'PY'
import json, sys
out, rounds, warmup, batch, steps, threads = sys.argv[1], *map(int, sys.argv[2:7])
reference = sys.argv[7] == "1"
best_o = best_r = None
for r in range(1, rounds + 1):
    # Step lines only (an evaluation's line has no frames).
    m = [json.loads(l) for l in open(f"{out}/ws-{r}/checkpoints/metrics.jsonl")]
    m = [x for x in m if "frames" in x]
    frames_r = [x["frames"] for x in m]
    if len(m) != warmup + steps:
        sys.exit(f"voiceclone ran {len(m)} steps, not {warmup} + {steps}")
    t = m[warmup:]
    fps_r = sum(x["frames"] for x in t) / sum(x["seconds"] for x in t)
    spp_r = sum(x["seconds"] for x in t) / len(t)
    rss_r = int(open(f"{out}/ws-{r}/maxrss").read().split()[-1]) / 1024
    if best_r is None or fps_r > best_r[0]:
        best_r = (fps_r, spp_r, rss_r)
    if not reference:
        print(f"round {r}: voiceclone {fps_r:.1f} frames/s ({spp_r:.2f} s/step, peak RSS {rss_r:.0f} MB); "
              f"no official side (SMOKE=1)", file=sys.stderr)
        continue
    o = json.load(open(f"{out}/official-{r}.json"))
    if frames_r != o["frames"]:
        sys.exit(f"different batches: frames per step {frames_r} vs official {o['frames']}")
    rel = abs(m[0]["loss"] - o["losses"][0]) / abs(o["losses"][0])
    if rel > 1e-5:
        sys.exit(f"first-step loss differs: {m[0]['loss']} vs official {o['losses'][0]} (rel {rel:.2e})")
    print(f"round {r}: official {o['frames_per_s']:.1f} frames/s ({o['s_per_step']:.2f} s/step, "
          f"peak RSS {o['peak_rss_mb']:.0f} MB); voiceclone {fps_r:.1f} frames/s ({spp_r:.2f} s/step, "
          f"peak RSS {rss_r:.0f} MB); first-step loss rel diff {rel:.1e}", file=sys.stderr)
    if best_o is None or o["frames_per_s"] > best_o[0]:
        best_o = (o["frames_per_s"], o["s_per_step"], o["peak_rss_mb"], o["trained_parameters"])
if reference:
    print(f"model: {best_o[3] / 1e6:.1f} M trained parameters, fp32, CPU, {o['threads']} threads, "
          f"batch {o['batch_size']}, {o['steps']} timed steps after {warmup} warm-up")
    print(f"official (PyTorch): {best_o[0]:8.1f} frames/s  {best_o[1]:6.2f} s/step  peak RSS {best_o[2]:6.0f} MB")
else:
    print(f"model: fp32, CPU, {threads} threads, batch {batch}, {steps} timed steps after {warmup} warm-up")
    print(f"official (PyTorch): {'-':>8} (no reference environment)")
print(f"voiceclone:         {best_r[0]:8.1f} frames/s  {best_r[1]:6.2f} s/step  peak RSS {best_r[2]:6.0f} MB")
if reference:
    print(f"ratio voiceclone / official: {best_r[0] / best_o[0]:.2f}")
PY
