#!/usr/bin/env bash
# No-regression check: this tree against an older commit, side by side in one run, on the
# speak, train, training step and codec work (docs/performance.md §11).
#
#   scripts/bench/regression.sh 9547a80          # best of 3 alternating rounds
#   ROUNDS=5 FRAMES=40 scripts/bench/regression.sh 9547a80
#
# The old commit is checked out into a git worktree under OLD_TARGET and built in release mode
# there (kept between runs, so a second run builds nothing); this tree is built into target/.
# The timed rounds wait up to five minutes for the builds' load to settle. Both sides then run the same three jobs, alternating old / new in
# every round, each as a whole process (loading included):
#   speak  `voiceclone speak --greedy --max-frames FRAMES` on the 0.6B-shaped random model
#          (MODEL, bf16-stored) cloning the fixture reference clip, in every precision both
#          commits know (PRECISIONS, default "f32 bf16-weights");
#   train  `examples/profile_train MODEL` (forward and backward of the training graph's parts;
#          the sum of the parts it prints);
#   step   the single-device trainer's whole optimizer step: `voiceclone train` on STEP_MODEL
#          (default the medium model of scripts/bench/train.sh) and STEP_DATA, batch 2, no
#          held-out set, one untimed step then STEPS timed ones (the sum of their `seconds` in
#          checkpoints/metrics.jsonl: loading and checkpoint writing are outside);
#   codec  `examples/bench_codec` on a full-size random codec (CODEC, made once by
#          `scripts/reference/bench_codec.py --make-full-size`): encode + decode of
#          SECONDS_OF_AUDIO of the fixture speech (the sum of both times it prints).
# Each side's best time is reported with the ratio old/new (> 1: this tree is faster).
#
# The machine must be quiet: the script reads the 1-minute load average first and stops when it
# is 0.5 or more (FORCE=1 runs anyway and says so in the output).
#
# Environment: MODEL (default .big-fixtures/qwen3-tts-0.6b-random; make it with
# `scripts/reference/make_fixtures.py --full-size`), CODEC (default .big-fixtures/codec-full), FRAMES (30), SECONDS_OF_AUDIO (20), ROUNDS (3),
# PRECISIONS, THREADS (RAYON_NUM_THREADS of every job; default every core), OLD_TARGET
# (default target/regression), STEP_MODEL, STEP_DATA (default .big-fixtures/train-medium and
# train-rows.jsonl: `scripts/reference/bench_train.py --make-model` / `--make-data`), STEPS (6),
# ONLY (the jobs to run, e.g. ONLY="step"; default all), FORCE.
#
# SMOKE=1 (scripts/bench/smoke.sh): this tree against itself (OLD_COMMIT defaults to HEAD and is
# only resolved): no worktree and no build, both sides run BIN (the test build) and the examples
# beside it, on the tiny fixture model and its codec, 4 frames, 1 s of audio, profile_train on
# 16 frames once, one timed training step on 4 rows, one round.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/quiet.sh
source scripts/bench/model.sh

if is_smoke; then
    OLD_REV=${1:-HEAD}
    MODEL=${MODEL:-$SMOKE_MODEL}
    CODEC=${CODEC:-$SMOKE_MODEL/speech_tokenizer}
    FRAMES=${FRAMES:-4}
    SECONDS_OF_AUDIO=${SECONDS_OF_AUDIO:-1}
    ROUNDS=${ROUNDS:-1}
    # profile_train's frames and talker length, each part timed once after its warm-up.
    PROFILE_ARGS=(16 16)
    export REPS=1
    STEP_MODEL=${STEP_MODEL:-$SMOKE_MODEL}
    STEP_DATA=${STEP_DATA:-}
    STEPS=${STEPS:-1}
else
    OLD_REV=${1:?usage: scripts/bench/regression.sh OLD_COMMIT}
    MODEL=${MODEL:-.big-fixtures/qwen3-tts-0.6b-random}
    CODEC=${CODEC:-.big-fixtures/codec-full}
    FRAMES=${FRAMES:-30}
    SECONDS_OF_AUDIO=${SECONDS_OF_AUDIO:-20}
    ROUNDS=${ROUNDS:-3}
    PROFILE_ARGS=()
    STEP_MODEL=${STEP_MODEL:-.big-fixtures/train-medium}
    STEP_DATA=${STEP_DATA:-.big-fixtures/train-rows.jsonl}
    STEPS=${STEPS:-6}
fi
PRECISIONS=${PRECISIONS:-"f32 bf16-weights"}
THREADS=${THREADS:-$(nproc)}
OLD_TARGET=${OLD_TARGET:-target/regression}
TEXT="The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet forest."
REF=tests/fixtures/audio/ref24k.wav
OUT=$(mktemp -d)
mkdir -p "$OUT/ws"
trap 'rm -rf "$OUT"' EXIT

old_sha=$(git rev-parse --verify "$OLD_REV^{commit}")
new_sha=$(git rev-parse HEAD)
[[ -n $(git status --porcelain --untracked-files=no) ]] && new_sha="$new_sha (with uncommitted changes)"
# Whether ONLY (default: every job) asks for job family $1.
wants() { [[ -z ${ONLY:-} || " $ONLY " == *" $1 "* || " $ONLY " == *" $1:"* ]]; }
if wants codec && [[ ! -f $CODEC/model.safetensors ]]; then
    echo "error: $CODEC/model.safetensors is missing (scripts/reference/bench_codec.py --make-full-size $CODEC)" >&2
    exit 1
fi
if { wants speak || wants train; } && [[ ! -f $MODEL/model.safetensors ]]; then
    echo "error: $MODEL/model.safetensors is missing (scripts/reference/make_fixtures.py --full-size $MODEL)" >&2
    exit 1
fi

if is_smoke; then
    smoke_bin
    examples=$(smoke_examples)
    [[ -x $examples/profile_train && -x $examples/bench_codec ]] ||
        { echo "error: examples/profile_train or examples/bench_codec missing in $examples" >&2; exit 1; }
    # Both sides: the directory of the test build (voiceclone, examples/).
    OLD_DIR=$(dirname "$BIN")
    NEW_DIR=$OLD_DIR
    [[ $old_sha == $(git rev-parse HEAD) ]] ||
        echo "== SMOKE=1 builds nothing: the old side is this tree's build too, not $old_sha" >&2
else
    echo "== building the old commit $old_sha (release, into $OLD_TARGET)" >&2
    mkdir -p "$OLD_TARGET"
    OLD_TARGET=$(cd "$OLD_TARGET" && pwd)
    # A fixed place for the old tree, so that a second run finds its build up to date.
    OLD_TREE=$OLD_TARGET/tree
    if [[ $(git -C "$OLD_TREE" rev-parse HEAD 2>/dev/null) != "$old_sha" ]]; then
        git worktree remove --force "$OLD_TREE" 2>/dev/null || rm -rf "$OLD_TREE"
        git worktree prune
        git worktree add --detach --quiet "$OLD_TREE" "$old_sha"
    fi
    (cd "$OLD_TREE" && CARGO_TARGET_DIR=$OLD_TARGET cargo build --release --quiet --locked \
        --bin voiceclone --example profile_train --example bench_codec)
    echo "== building this tree (release)" >&2
    cargo build --release --quiet --locked --bin voiceclone --example profile_train --example bench_codec
    OLD_DIR=$OLD_TARGET/release
    NEW_DIR=target/release

    # The builds above load the machine: give the load average up to five minutes to settle.
    for _ in $(seq 30); do
        python3 -c "import sys; sys.exit(0 if float(open('/proc/loadavg').read().split()[0]) < 0.5 else 1)" &&
            break
        sleep 10
    done
fi
require_quiet "before the timed rounds"

# Seconds of one job; `$1` is the side's profile directory (voiceclone, examples/).
job_speak() { # dir precision
    local start end
    start=$(date +%s.%N)
    RAYON_NUM_THREADS=$THREADS "$1/voiceclone" --workdir "$OUT/ws" speak "$TEXT" \
        -o "$OUT/speak.wav" --overwrite --model "$MODEL" --ref-audio "$REF" --greedy \
        --max-frames "$FRAMES" --precision "$2" >"$OUT/job.out" 2>"$OUT/job.err" || {
        cat "$OUT/job.err" >&2
        exit 1
    }
    end=$(date +%s.%N)
    python3 -c "print(f'{$end - $start:.3f}')"
}
job_train() { # dir
    RAYON_NUM_THREADS=$THREADS "$1/examples/profile_train" "$MODEL" "${PROFILE_ARGS[@]}" \
        >"$OUT/job.out" 2>"$OUT/job.err" || {
        cat "$OUT/job.err" >&2
        exit 1
    }
    grep -q ' ms$' "$OUT/job.out" || { echo "error: no \"<part> <ms> ms\" line from profile_train" >&2; exit 1; }
    # Lines "<part> <ms> ms": the sum of the parts, in seconds.
    awk '$NF == "ms" { s += $(NF-1) } END { printf "%.3f\n", s / 1000 }' "$OUT/job.out"
}
job_step() { # dir
    local ws=$OUT/step-ws
    rm -rf "$ws"
    BIN=$1/voiceclone train_steps "$ws" "$STEP_MODEL" "$STEP_DATA" \
        "$OUT/xvector/data/speaker.safetensors" 2 $((1 + STEPS)) env RAYON_NUM_THREADS="$THREADS"
    # The step lines (evaluation lines carry val_loss) after the first: their seconds summed.
    python3 - "$ws/checkpoints/metrics.jsonl" "$STEPS" <<'PY'
import json, sys
steps = [m for m in map(json.loads, open(sys.argv[1])) if "val_loss" not in m]
want = int(sys.argv[2]) + 1
if len(steps) != want:
    sys.exit(f"error: voiceclone train ran {len(steps)} steps, not {want}")
print("%.3f" % sum(m["seconds"] for m in steps[1:]))
PY
}
job_codec() { # dir
    RAYON_NUM_THREADS=$THREADS "$1/examples/bench_codec" --codec "$CODEC" \
        --audio "$REF" --seconds "$SECONDS_OF_AUDIO" >"$OUT/job.out" 2>"$OUT/job.err" || {
        cat "$OUT/job.err" >&2
        exit 1
    }
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%.3f" % (r["encode_seconds"] + r["decode_seconds"]))' \
        "$OUT/job.out"
}

JOBS=()
for p in $PRECISIONS; do JOBS+=("speak:$p"); done
JOBS+=(train step codec)
if [[ -n ${ONLY:-} ]]; then
    wanted=()
    for job in "${JOBS[@]}"; do
        [[ " $ONLY " == *" ${job%%:*} "* || " $ONLY " == *" $job "* ]] && wanted+=("$job")
    done
    ((${#wanted[@]})) || { echo "error: ONLY=\"$ONLY\" names none of: ${JOBS[*]}" >&2; exit 1; }
    JOBS=("${wanted[@]}")
fi
# The training step's inputs: its rows (a few short ones in smoke mode) and a random x-vector of
# the model's width, the same for both sides.
if [[ " ${JOBS[*]} " == *" step "* ]]; then
    if [[ -z $STEP_DATA ]]; then
        STEP_DATA=$OUT/step-rows.jsonl
        python3 scripts/reference/bench_train.py --make-data "$STEP_DATA" --rows 4 \
            --min-frames 8 --max-frames 12 >/dev/null
    fi
    [[ -f $STEP_DATA ]] || { echo "error: $STEP_DATA is missing (scripts/reference/bench_train.py --make-data)" >&2; exit 1; }
    python3 scripts/bench/synthetic.py workspace "$OUT/xvector" "$STEP_MODEL" 1 >/dev/null
fi
declare -A BEST
run_job() { # side target job
    local t
    case $3 in
        speak:*) t=$(job_speak "$2" "${3#speak:}") ;;
        train) t=$(job_train "$2") ;;
        step) t=$(job_step "$2") ;;
        codec) t=$(job_codec "$2") ;;
    esac
    echo "   round $round $1 $3: $t s" >&2
    local key="$1 $3"
    if [[ -z ${BEST[$key]:-} ]] || python3 -c "import sys; sys.exit(0 if $t < ${BEST[$key]} else 1)"; then
        BEST[$key]=$t
    fi
}
for ((round = 1; round <= ROUNDS; round++)); do
    for job in "${JOBS[@]}"; do
        # Alternate which side goes first, so neither always runs on a warmer cache.
        if ((round % 2)); then
            run_job old "$OLD_DIR" "$job"
            run_job new "$NEW_DIR" "$job"
        else
            run_job new "$NEW_DIR" "$job"
            run_job old "$OLD_DIR" "$job"
        fi
    done
done

echo
echo "no-regression check, $(nproc) cores, RAYON_NUM_THREADS=$THREADS, $LOAD_NOTE; best of $ROUNDS alternating rounds"
echo "old: $old_sha"
echo "new: $new_sha"
printf '%-20s %10s %10s %10s\n' job "old s" "new s" "old/new"
for job in "${JOBS[@]}"; do
    o=${BEST["old $job"]}
    n=${BEST["new $job"]}
    printf '%-20s %10.3f %10.3f %10.2f\n' "$job" "$o" "$n" "$(python3 -c "print($o / $n if $n else float('nan'))")"
done
echo "(speak: $FRAMES frames on $MODEL, whole process; train: profile_train's parts; step: $STEPS optimizer steps of voiceclone train on $STEP_MODEL; codec: encode + decode of $SECONDS_OF_AUDIO s)"
