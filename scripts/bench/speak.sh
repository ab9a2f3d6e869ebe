#!/usr/bin/env bash
# Synthesis speed, `voiceclone speak` vs the official Python package, side by side in one run
# (docs/performance.md §1, §2 and §3).
#
#   scripts/bench/speak.sh                       # 50 frames, 1 and 2 threads, best of 3 rounds
#   FRAMES=80 ROUNDS=2 THREADS="2" scripts/bench/speak.sh
#
# Both sides load the same randomly initialised checkpoint with the real 0.6B shapes, stored in
# bf16 like the released ones (made once by `scripts/reference/make_fixtures.py --full-size`, ~1.8 GB,
# ignored by git), clone the same reference clip from its x-vector and speak the same text
# greedily (so both generate exactly FRAMES frames), in the same streaming-text layout with the
# model's repetition penalty. Sides: the official package (`scripts/reference/bench_speak.py`, one
# `generate_voice_clone` call) in float32 AND bfloat16, and `voiceclone speak --greedy
# --max-frames N` in each precision of PRECISIONS (`bf16-weights`, `q8`, `q4`). Timed: voice preparation + generation + decoding,
# model loading excluded on both sides; for voiceclone also the whole process (loading included).
# Peak memory is the whole process's maximum RSS. Ratios are against the FASTER official setting
# at the same thread count.
#
# The machine must be quiet: the script reads the 1-minute load average first and stops when it
# is 0.5 or more (FORCE=1 runs anyway and says so in the output). Rounds alternate the sides;
# each side's best time is reported. A STREAM-like probe (`examples/bandwidth.rs`) measures the
# memory read bandwidth at each thread count; from it and the bytes of weights a frame reads
# (printed by `speak`), each voiceclone precision gets its bandwidth-bound limit in frames/s and
# its achieved GB/s (weights of all frames / call time: a lower bound, the call also prepares the
# voice and decodes).
#
# Environment: PYTHON (torch + qwen-tts; default .reference-venv/bin/python, made by
# scripts/reference/setup_venv.sh), MODEL (default .big-fixtures/qwen3-tts-0.6b-random),
# PRECISIONS ("bf16-weights q8 q4"), OFFICIAL (1; 0 leaves the official side out, as when only
# voiceclone's kernel paths are compared), FRAMES (50), ROUNDS (3), THREADS ("1 2"), TEXT, FORCE.
# VOICECLONE_ISA (e.g. avx2) narrows voiceclone's kernels to a CPU class below this machine's
# (docs/performance.md §2.6); the table names the paths `voiceclone --version` reports.
#
# SMOKE=1 (scripts/bench/smoke.sh): the tiny fixture model, 8 frames, one thread, one round, a
# 16 MiB bandwidth probe; BIN the test build and examples/bandwidth beside it, nothing built;
# the official side only where PYTHON has the official package, else the table shows
# voiceclone's rows alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/quiet.sh

PYTHON=${PYTHON:-.reference-venv/bin/python}
if is_smoke; then
    MODEL=${MODEL:-$SMOKE_MODEL} FRAMES=${FRAMES:-8} ROUNDS=${ROUNDS:-1} THREADS=${THREADS:-1}
    BANDWIDTH_ARGS=(--mib 16 --rounds 1)
else
    MODEL=${MODEL:-.big-fixtures/qwen3-tts-0.6b-random} FRAMES=${FRAMES:-50} ROUNDS=${ROUNDS:-3}
    THREADS=${THREADS:-"1 2"}
    BANDWIDTH_ARGS=(--mib 2048 --rounds 5)
fi
TEXT=${TEXT:-"The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet forest."}
REF=tests/fixtures/audio/ref24k.wav
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

require_quiet "before starting"

PRECISIONS=${PRECISIONS:-"bf16-weights q8 q4"}
SIDES="official-float32 official-bfloat16 $PRECISIONS"
if [[ ${OFFICIAL:-1} == 0 ]] || ! reference_side "$PYTHON" "torch, qwen_tts"; then
    SIDES=$PRECISIONS
fi
if [[ ! -f $MODEL/model.safetensors ]]; then
    echo "== writing the 0.6B-shaped random model to $MODEL (once)" >&2
    "$PYTHON" scripts/reference/make_fixtures.py --full-size "$MODEL"
fi
if is_smoke; then
    smoke_bin
    EXAMPLES=$(smoke_examples)
else
    echo "== building voiceclone (release)" >&2
    cargo build --release --quiet --bin voiceclone --example bandwidth
    BIN=target/release/voiceclone
    EXAMPLES=target/release/examples
fi

run_official() { # dtype threads
    "$PYTHON" scripts/reference/bench_speak.py --model "$MODEL" --ref-audio "$REF" --text "$TEXT" \
        --frames "$FRAMES" --threads "$2" --dtype "$1" --out-json "$OUT/official.json" >/dev/null \
        2>"$OUT/official.err" || {
        cat "$OUT/official.err" >&2
        exit 1
    }
    "$PYTHON" - "$OUT/official.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['wall_s']:.3f} {r['frames']} {r['audio_s']:.3f} {r['peak_rss_mb']:.0f} - 0")
EOF
}

run_rust() { # precision threads
    local precision=$1 threads=$2 start end
    start=$(date +%s.%N)
    /usr/bin/time -v env RAYON_NUM_THREADS="$threads" "$BIN" --workdir "$OUT" speak "$TEXT" \
        -o "$OUT/rust-$precision.wav" --overwrite --model "$MODEL" --ref-audio "$REF" --greedy \
        --max-frames "$FRAMES" --precision "$precision" >"$OUT/rust.out" 2>"$OUT/rust.err" || {
        cat "$OUT/rust.err" >&2
        exit 1
    }
    end=$(date +%s.%N)
    local secs audio frames rss whole mb
    secs=$(sed -n 's/.* of audio in \([0-9.]*\) s.*/\1/p' "$OUT/rust.err")
    audio=$(sed -n 's/^\([0-9.]*\) s of audio in .*/\1/p' "$OUT/rust.err")
    frames=$(sed -n 's/.*s, \([0-9]*\) frames.*/\1/p' "$OUT/rust.out")
    rss=$(sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\)/\1/p' "$OUT/rust.err")
    mb=$(sed -n 's/.*, \([0-9.]*\) MB read per frame.*/\1/p' "$OUT/rust.err")
    parsed "the call time of voiceclone $precision" "$secs"
    parsed "the audio seconds of voiceclone $precision" "$audio"
    parsed "the frame count of voiceclone $precision" "$frames"
    parsed "GNU time's peak RSS of voiceclone $precision" "$rss"
    parsed "the MB read per frame of voiceclone $precision" "$mb"
    whole=$(python3 -c "print(f'{$end - $start:.3f}')")
    echo "$secs $frames $audio $((rss / 1024)) $whole $mb"
}

declare -A TIMES WHOLE FRAMES_OF AUDIO RSS MB BW BW_L3
for threads in $THREADS; do
    line=$(RAYON_NUM_THREADS=$threads "$EXAMPLES/bandwidth" "${BANDWIDTH_ARGS[@]}")
    BW[$threads]=$(sed -n 's/.*read \([0-9.]*\) GB\/s from memory.*/\1/p' <<<"$line")
    BW_L3[$threads]=$(sed -n 's/.*, \([0-9.]*\) GB\/s from a 64 MiB.*/\1/p' <<<"$line")
    parsed "the memory bandwidth ($threads threads)" "${BW[$threads]}"
    parsed "the L3 bandwidth ($threads threads)" "${BW_L3[$threads]}"
    echo "== bandwidth probe, $line" >&2
done
for ((round = 1; round <= ROUNDS; round++)); do
    for threads in $THREADS; do
        for side in $SIDES; do
            echo "== round $round, $threads thread(s): $side" >&2
            case $side in
            official-*) line=$(run_official "${side#official-}" "$threads") ;;
            *) line=$(run_rust "$side" "$threads") ;;
            esac
            read -r secs frames audio rss whole mb <<<"$line"
            key="$side/$threads"
            TIMES[$key]+="$secs"$'\n'
            WHOLE[$key]+="$whole"$'\n'
            FRAMES_OF[$key]=$frames
            AUDIO[$key]=$audio
            RSS[$key]=$rss
            MB[$key]=$mb
        done
    done
done

best() { sort -n | head -1; }
printf '\n%s greedy frames of %s, best of %s alternating round(s); %s\n' \
    "$FRAMES" "$MODEL" "$ROUNDS" "$LOAD_NOTE"
printf 'end of run: load average %s\n' "$(cut -d' ' -f1 /proc/loadavg)"
printf 'voiceclone %s\n' "$("$BIN" --version | grep -E '^ *(cpu|kernels):' | sed 's/^ *//' | paste -sd ';')"
printf '%-3s %-26s %8s %9s %6s %9s %8s %9s %10s %9s %11s\n' thr side "call s" frames/s RTF \
    "peak MiB" "vs best" "whole s" "whole/call" "GB/s" "limit f/s"
for threads in $THREADS; do
    ref=none # no official side (SMOKE=1 without the reference environment)
    if [[ $SIDES == official-* ]]; then
        f32t=$(printf '%s' "${TIMES[official-float32/$threads]}" | best)
        bf16t=$(printf '%s' "${TIMES[official-bfloat16/$threads]}" | best)
        ref=$(python3 -c "print(min($f32t, $bf16t))")
    fi
    for side in $SIDES; do
        key="$side/$threads"
        t=$(printf '%s' "${TIMES[$key]}" | best)
        w=$(printf '%s' "${WHOLE[$key]}" | best)
        python3 - "$threads" "$side" "$t" "${FRAMES_OF[$key]}" "${AUDIO[$key]}" "${RSS[$key]}" \
            "$ref" "$w" "${MB[$key]}" "${BW[$threads]}" <<'EOF'
import sys
thr, side, t, frames, audio, rss, ref, whole, mb, bw = sys.argv[1:]
# Times print with 2 decimals: a smoke run's few frames can read 0.00.
t, frames, audio, rss = max(float(t), 1e-3), int(frames), float(audio), float(rss)
name = f"official {side[9:]}" if side.startswith("official-") else f"voiceclone {side}"
vs = f"{float(ref) / t:7.2f}x" if ref != "none" else f"{'-':>8}"
row = f"{thr:<3} {name:<26} {t:8.2f} {frames / t:9.2f} {t / audio:6.2f} {rss:9.0f} {vs}"
if side.startswith("official-"):
    row += f" {'':>9} {'':>10} {'':>9} {'':>11}"
else:
    whole, mb, bw = float(whole), float(mb), float(bw)
    row += f" {whole:9.2f} {whole / t:10.2f} {mb * frames / 1e3 / t:9.1f} {bw * 1e3 / mb:11.2f}"
print(row)
EOF
    done
    printf '    (memory read bandwidth %s GB/s, 64 MiB from L3 %s GB/s, %s thread(s))\n' \
        "${BW[$threads]}" "${BW_L3[$threads]}" "$threads"
done
for threads in $THREADS; do
    for side in $SIDES; do
        if [[ ${FRAMES_OF[$side/$threads]} != "$FRAMES" ]]; then
            echo "warning: $side ($threads threads) generated ${FRAMES_OF[$side/$threads]} frames, not $FRAMES" >&2
        fi
    done
done
