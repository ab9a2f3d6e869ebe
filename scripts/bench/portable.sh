#!/usr/bin/env bash
# What portability costs (docs/architecture.md §9.4, docs/performance.md §1): `prep` and `speak`
# with three builds side by side, in alternating rounds, best of ROUNDS:
#
#   native    glibc, ggml compiled for this machine (GGML_NATIVE=ON: -march=native)
#   portable  glibc, ggml for the x86-64-v3 baseline of .cargo/config.toml (the default build)
#   static    the release binary of scripts/release/release.sh (musl, the same baseline)
#
# prep: the bench5 set (400 s of real 16 kHz speech) with Whisper tiny.en Q8_0, model load
# included. speak: a 0.6B-shaped random checkpoint (scripts/bench/synthetic.py model-0.6b), greedy,
# FRAMES frames, the time speak reports (voice preparation, generation, decoding). Ratios are
# native time / other time (above 1: faster than native). The builds are made first: native in
# target/native (a copy of target/release with whisper.cpp rebuilt), so this takes a while the
# first time.
#
#   scripts/bench/portable.sh            # ROUNDS=3 FRAMES=40; FORCE=1 on a busy machine
#
# SMOKE=1 (scripts/bench/smoke.sh): the three builds cannot be made in seconds, so BIN (the test
# build) stands for all three and the native build's check is left out; prep of the fixture
# clip (2.6 s), speak of 4 frames on the tiny fixture model, one round.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/quiet.sh

if is_smoke; then
    ROUNDS=${ROUNDS:-1} FRAMES=${FRAMES:-4}
else
    ROUNDS=${ROUNDS:-3} FRAMES=${FRAMES:-40}
fi
assets=${VOICECLONE_TEST_ASSETS:-$PWD/.test-assets}
py=$assets/venv/bin/python
q8=$assets/whisper/ggml-tiny.en-q8_0.bin
speech=$assets/speech/bench5
[[ -f $q8 && -d $speech ]] || { echo "error: run scripts/assets/fetch_test_assets.sh first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if is_smoke; then
    smoke_bin
    declare -A bin=([native]=$BIN [portable]=$BIN [static]=$BIN)
    speech=$work/speech
    mkdir -p "$speech"
    cp tests/fixtures/audio/ref24k.wav "$speech/"
    model=$SMOKE_MODEL
    prep_what="the fixture clip"
else
    cargo build --locked --release >&2
    if [[ ! -x target/native/release/voiceclone ]] || [[ target/release/voiceclone -nt target/native/release/voiceclone ]]; then
        # Everything but whisper.cpp is the same: copy the portable build, rebuild whisper-rs-sys
        # (cargo does not see GGML_NATIVE change) and what depends on it.
        rm -rf target/native
        mkdir -p target/native
        cp -a target/release target/native/release
        GGML_NATIVE=ON cargo clean --locked --release --target-dir target/native -p whisper-rs-sys >&2
        GGML_NATIVE=ON cargo build --locked --release --target-dir target/native >&2
    fi
    static=$(bash scripts/release/release.sh | tail -n 1)
    declare -A bin=([native]=target/native/release/voiceclone [portable]=target/release/voiceclone [static]=$static)
    grep -q "compiled for: native" <("${bin[native]}" --version) || { echo "error: the native build is not native" >&2; exit 1; }
    model=$work/model
    "$py" scripts/bench/synthetic.py model-0.6b tests/fixtures/tiny-0b6 "$model" >&2
    prep_what="400 s of speech"
fi

wait_quiet 300
require_quiet "before"
before=$LOAD_NOTE
: >"$work/results"
sides=(native portable static)
for ((r = 1; r <= ROUNDS; r++)); do
    order=("${sides[@]}")
    ((r % 2)) || order=(static portable native)
    for side in "${order[@]}"; do
        out=$work/$side-$r
        mkdir -p "$out"
        start=$(date +%s.%N)
        "${bin[$side]}" --workdir "$out" prep "$speech" --whisper-model "$q8" --language en >"$out.prep.log" 2>&1 ||
            { cat "$out.prep.log" >&2; exit 1; }
        end=$(date +%s.%N)
        echo "prep $side $(python3 -c "print($end - $start)")" >>"$work/results"
        "${bin[$side]}" speak "The quick brown fox jumps over the lazy dog, and runs far away." \
            --model "$model" --ref-audio tests/fixtures/audio/ref24k.wav --greedy \
            --max-frames "$FRAMES" -o "$out.wav" >"$out.speak.log" 2>&1 || { cat "$out.speak.log" >&2; exit 1; }
        t=$(sed -n 's/.* of audio in \([0-9.]*\) s .*/\1/p' "$out.speak.log")
        parsed "speak's time ($side)" "$t"
        echo "speak $side $t" >>"$work/results"
        tail -n 2 "$work/results" | sed "s/^/  round $r: /" >&2
    done
done
after="load average $(cut -d' ' -f1 /proc/loadavg) after"
python3 - "$work/results" "$ROUNDS" "$before" "$after" "$FRAMES" "$prep_what" <<'PY'
import sys
results, rounds, before, after, frames, prep_what = sys.argv[1:7]
best = {}
for line in open(results):
    task, side, t = line.split()
    best.setdefault((task, side), []).append(float(t))
print(f"best of {rounds} alternating rounds; {before}; {after}")
print(f"prep: {prep_what}, tiny.en Q8_0, model load included; "
      f"speak: 0.6B-shaped model, {frames} frames, generation and decoding")
for task in ("prep", "speak"):
    native = min(best[(task, "native")])
    for side in ("native", "portable", "static"):
        runs = best[(task, side)]
        print(f"  {task:5} {side:9} best {min(runs):7.2f} s   native/this {native / min(runs):5.3f}"
              f"   runs {' '.join(f'{x:.2f}' for x in runs)}")
PY
