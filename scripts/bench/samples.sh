#!/usr/bin/env bash
# What an evaluation costs (docs/training.md §14.4), for docs/usage.md §5: on the 0.6B-shaped random
# model (scripts/bench/synthetic.py: the real talker and code predictor, the fixture's small speech
# tokenizer and speaker encoder unless CODEC names another tokenizer), on the CPU, at the
# defaults (batch 4 × 8 micro-batches, an evaluation at every checkpoint, train.save_every = 50):
#
#   - one optimizer step (its `seconds` in metrics.jsonl),
#   - one evaluation with samples (two held-out utterances of FRAMES frames, each spoken up to
#     1.5 × FRAMES frames, with the WER by the Whisper model WHISPER) and one without
#     (`--samples false`: the validation loss alone), their `seconds` in metrics.jsonl,
#   - the evaluation's share of a run: eval / (save_every × step + eval).
#
# Each run trains one step from the same start, and evaluates after it; ROUNDS rounds alternate
# samples on / off, the best of each is reported. Needs about 18 GB (a full fine-tune of the
# 0.6B on the CPU); start it on a quiet machine (it refuses a busy one unless FORCE=1,
# docs/performance.md §1).
#
#   scripts/bench/samples.sh
#   ROUNDS=2 FRAMES=60 CODEC=.big-fixtures/codec-full scripts/bench/samples.sh
#
# BIN: the voiceclone binary (default: cargo build, the optimized dev profile). PYTHON: a python3
# with numpy (default .test-assets/venv/bin/python, else python3). WHISPER: a ggml Whisper model
# (default .test-assets/whisper/ggml-tiny.en-q8_0.bin; a missing file: no WER).
#
# SMOKE=1 (scripts/bench/smoke.sh): the tiny fixture model, 8-frame utterances, one round, BIN
# the test build, nothing built.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/bench/quiet.sh
source scripts/bench/model.sh
ROUNDS=${ROUNDS:-1}
if is_smoke; then
  FRAMES=${FRAMES:-8}
else
  FRAMES=${FRAMES:-60}
fi
SAVE_EVERY=${SAVE_EVERY:-50}
CODEC=${CODEC:-own}
WHISPER=${WHISPER:-$PWD/.test-assets/whisper/ggml-tiny.en-q8_0.bin}
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

MODEL=$WORK/model
if is_smoke; then
  MODEL=$SMOKE_MODEL
  shape="the tiny fixture model"
else
  "$PYTHON" scripts/bench/synthetic.py model-0.6b tests/fixtures/tiny-0b6 "$MODEL"
  shape="0.6B-shaped random model"
fi
if [[ $CODEC != own ]]; then
  model_with_codec "$MODEL" "$CODEC" "$WORK/with-codec"
  MODEL=$WORK/with-codec
fi
echo "== $shape, speech tokenizer: $CODEC; $FRAMES-frame utterances; Whisper: $WHISPER"
require_quiet "before the first run"
echo "== $LOAD_NOTE"

run() { # run NAME SAMPLES
  local ws=$WORK/$1
  rm -rf "$ws"
  "$PYTHON" scripts/bench/synthetic.py workspace "$ws" "$MODEL" "$FRAMES"
  printf '[prep]\nwhisper_model = "%s"\n' "$WHISPER" >>"$ws/voiceclone.toml"
  "$BIN" --workdir "$ws" train --max-steps 1 --samples "$2" --no-export >"$ws.log" 2>&1 \
    || { cat "$ws.log"; exit 1; }
  "$PYTHON" - "$ws/checkpoints/metrics.jsonl" <<'PY'
import json, sys
step = evals = None
for line in open(sys.argv[1]):
    m = json.loads(line)
    if "val_loss" in m:
        evals = m
    else:
        step = m
n = len(evals.get("samples") or [])
frames = sum(s["frames"] for s in evals.get("samples") or [])
print(f"{step['seconds']:.3f} {evals['seconds']:.3f} {n} {frames}")
PY
}

best_step="" best_on="" best_off="" samples="" frames=""
for round in $(seq "$ROUNDS"); do
  read -r step on n f < <(run on true)
  read -r step2 off _ _ < <(run off false)
  echo "round $round: step ${step} s / ${step2} s, evaluation with $n samples ($f frames) ${on} s, without ${off} s"
  best_step=$(printf '%s\n' $best_step $step $step2 | sort -g | head -1)
  best_on=$(printf '%s\n' $best_on $on | sort -g | head -1)
  best_off=$(printf '%s\n' $best_off $off | sort -g | head -1)
  samples=$n frames=$f
done
python3 - "$best_step" "$best_on" "$best_off" "$SAVE_EVERY" "$samples" "$frames" <<'PY'
import sys
step, on, off, every = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
n, frames = sys.argv[5], sys.argv[6]
print(f"optimizer step at the defaults: {step:.1f} s")
print(f"evaluation: {on:.1f} s with {n} samples ({frames} frames; samples {on - off:.1f} s), "
      f"{off:.1f} s for the validation loss alone")
for what, e in (("with samples", on), ("validation loss alone", off)):
    share = e / (every * step + e)
    print(f"share of a run, an evaluation every {every} steps, {what}: {100 * share:.2f} %")
PY
