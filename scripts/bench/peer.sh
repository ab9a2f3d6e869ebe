#!/usr/bin/env bash
# CPU synthesis, `voiceclone speak` vs the C++ peer qwentts.cpp (ggml, its Q8_0 and Q4_K_M GGUFs),
# side by side in one run (docs/performance.md §1 and §2).
#
#   PEER_DIR=... PEER_Q8_0=... PEER_Q4_K_M=... PEER_CODEC=... scripts/bench/peer.sh
#   ROUNDS=5 PRECISIONS="q8 q4 bf16-weights" scripts/bench/peer.sh      # (with the PEER_* above)
#
# What users compare when they want speech on a CPU: the whole process, from start to the WAV
# written, loading included, as a command line runs it. Both sides load the same randomly
# initialised checkpoint with the real 0.6B shapes (scripts/reference/make_fixtures.py
# --full-size, as speak.sh) with the full-size random codec put on it (as speak_stream.sh: the
# checkpoint's own is a small one and decoding is part of the whole), the peer through its own
# conversion of both (scripts/bench/peer_setup.sh: its convert.py, then its quantize to Q8_0 and
# Q4_K_M; the tokenizer GGUF at Q8_0, the pairing of its README), clone the same reference clip
# from its x-vector alone (no transcript) and speak the same English text greedily, capped at
# FRAMES frames (the random model does not end early; a side that does is flagged). Sides: the peer's `qwen-tts --greedy
# --max-new N --ref-wav` for each GGUF, and `voiceclone speak --greedy --max-frames N
# --ref-audio --x-vector-only` for each precision of PRECISIONS that `voiceclone speak --help`
# lists (the others are skipped, saying so). Both at THREADS threads: RAYON_NUM_THREADS for ours;
# the peer has no thread option (it takes half the logical CPUs), so peer_setup.sh patches in a
# QWENTTS_N_THREADS override and the count the peer prints is checked. Its greedy skips the
# repetition penalty, ours applies the model's: the same work per frame either way.
#
# Reported per side: the best whole-process wall time of ROUNDS rounds (the sides alternate in
# each round), frames, audio seconds, the whole process's peak RSS, each side's own timing of the
# call (ours: voice preparation + generation + decoding; the peer's `[Perf] Total`: not the same
# span, shown for where the load time goes, not compared), and the peer's time divided by this
# side's (above 1: faster than that peer GGUF). The CPU path of voiceclone (`voiceclone
# --version`) and the peer's commit are printed with the table.
#
# The machine must be quiet (scripts/bench/quiet.sh: stops at a 1-minute load average of 0.5 or
# more unless FORCE=1, which marks the figures as disturbed). Load hurts the peer far more than
# us: ggml's threads wait for each other at every graph node, so a thread that loses its core
# stalls the rest (on a 2-core machine under other builds its 2 threads ran slower than 1).
#
# Environment: PEER_DIR (the peer's build directory, holding qwen-tts), PEER_Q8_0 and PEER_Q4_K_M
# (its talker GGUFs), PEER_CODEC (its tokenizer GGUF), PEER_SRC (its source, for the commit;
# default PEER_DIR/..), MODEL (default .big-fixtures/qwen3-tts-0.6b-random), CODEC (default
# .big-fixtures/codec-full, `scripts/reference/bench_codec.py --make-full-size`; `own` keeps the
# model's own: then the peer's GGUFs must be of that one too, peer_setup.sh's CODEC), PRECISIONS
# ("q8 q4"), FRAMES (50), ROUNDS (3), THREADS (2), TEXT, BIN (default: the release build, made
# here), FORCE. peer_setup.sh prints the PEER_* of its build.
#
# SMOKE=1 (scripts/bench/smoke.sh): the tiny fixture model and its codec, 8 frames, one round, one
# thread; BIN the test build, nothing built. The peer side runs only where PEER_DIR is set and holds qwen-tts
# (CI has no peer build: then the table shows voiceclone's rows alone and says the peer was
# skipped); its GGUFs are then not the tiny model's, so even its parse is all a smoke run shows.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/quiet.sh
source scripts/bench/model.sh

if is_smoke; then
    MODEL=${MODEL:-$SMOKE_MODEL} CODEC=${CODEC:-own} FRAMES=${FRAMES:-8} ROUNDS=${ROUNDS:-1}
    THREADS=${THREADS:-1}
else
    MODEL=${MODEL:-.big-fixtures/qwen3-tts-0.6b-random} CODEC=${CODEC:-.big-fixtures/codec-full}
    FRAMES=${FRAMES:-50} ROUNDS=${ROUNDS:-3} THREADS=${THREADS:-2}
fi
PRECISIONS=${PRECISIONS:-"q8 q4"}
TEXT=${TEXT:-"The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet forest."}
REF=tests/fixtures/audio/ref24k.wav
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

require_quiet "before starting"
require_model "$MODEL"
SPEAK_MODEL=$MODEL
if [[ $CODEC != own ]]; then
    model_with_codec "$MODEL" "$CODEC" "$OUT/model"
    SPEAK_MODEL=$OUT/model
fi
ensure_bin
BIN=$(realpath "$BIN")

# Our precisions: those of PRECISIONS that `speak --help` lists in its --precision values.
help=$("$BIN" speak --help | sed -n '/--precision/,/^$/p')
OURS=()
for p in $PRECISIONS; do
    if [[ $help =~ [[:space:],]$p([[:space:],\(]|$) ]]; then
        OURS+=("$p")
    else
        echo "== voiceclone speak has no --precision $p: skipped" >&2
    fi
done
if ((${#OURS[@]} == 0)); then
    echo "error: none of PRECISIONS ($PRECISIONS) is a precision of $BIN speak" >&2
    exit 1
fi

# The peer side: its build and GGUFs, or (SMOKE=1 without PEER_DIR) none.
PEERS=()
PEER_NOTE="peer: skipped (SMOKE=1 without PEER_DIR)"
if is_smoke && [[ -z ${PEER_DIR:-} ]]; then
    echo "== SMOKE=1: no peer side: PEER_DIR is unset (CI has no qwentts.cpp build;" \
        "scripts/bench/peer_setup.sh makes one)" >&2
else
    how="scripts/bench/peer_setup.sh builds the peer and converts the model, and prints these"
    if [[ ! -x ${PEER_DIR:-}/qwen-tts ]]; then
        echo "error: PEER_DIR (${PEER_DIR:-unset}) holds no qwen-tts ($how)" >&2
        exit 1
    fi
    for v in PEER_Q8_0 PEER_Q4_K_M PEER_CODEC; do
        if [[ ! -f ${!v:-} ]]; then
            echo "error: $v (${!v:-unset}) is no file ($how)" >&2
            exit 1
        fi
    done
    PEERS=(Q8_0 Q4_K_M)
    PEER_SRC=${PEER_SRC:-$PEER_DIR/..}
    commit=$(git -C "$PEER_SRC" log -1 --format='%H %cs' 2>/dev/null || echo "unknown (not a git checkout)")
    PEER_NOTE="peer: qwentts.cpp $commit ($(realpath "$PEER_DIR")/qwen-tts)"
fi
echo "$TEXT" >"$OUT/text.txt"

# Each run prints "whole-s frames audio-s peak-MiB own-s".
timed() { # LOG COMMAND...: runs it under GNU time, prints "whole-s peak-KiB"
    local log=$1 start end
    shift
    start=$(date +%s.%N)
    /usr/bin/time -v "$@" >"$log.out" 2>"$log" || {
        cat "$log" >&2
        exit 1
    }
    end=$(date +%s.%N)
    echo "$(python3 -c "print(f'{$end - $start:.3f}')") $(sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\)/\1/p' "$log")"
}

run_ours() { # precision threads
    local t whole rss secs audio frames
    t=$(timed "$OUT/ours.err" env RAYON_NUM_THREADS="$2" "$BIN" --workdir "$OUT" \
        speak "$TEXT" -o "$OUT/ours-$1.wav" --overwrite --model "$SPEAK_MODEL" --ref-audio "$REF" \
        --x-vector-only --language english --greedy --max-frames "$FRAMES" --precision "$1")
    read -r whole rss <<<"$t"
    secs=$(sed -n 's/.* of audio in \([0-9.]*\) s.*/\1/p' "$OUT/ours.err")
    audio=$(sed -n 's/^\([0-9.]*\) s of audio in .*/\1/p' "$OUT/ours.err")
    frames=$(sed -n 's/.*s, \([0-9]*\) frames.*/\1/p' "$OUT/ours.err.out")
    parsed "the call time of voiceclone $1" "$secs"
    parsed "the audio seconds of voiceclone $1" "$audio"
    parsed "the frame count of voiceclone $1" "$frames"
    parsed "GNU time's peak RSS of voiceclone $1" "$rss"
    echo "$whole $frames $audio $((rss / 1024)) $secs"
}

run_peer() { # Q8_0|Q4_K_M threads
    local gguf=PEER_$1 t whole rss threads frames audio own
    t=$(timed "$OUT/peer.err" env QWENTTS_N_THREADS="$2" "$PEER_DIR/qwen-tts" \
        --model "${!gguf}" --codec "$PEER_CODEC" --ref-wav "$REF" --lang English --greedy \
        --max-new "$FRAMES" -o "$OUT/peer-$1.wav" <"$OUT/text.txt")
    read -r whole rss <<<"$t"
    threads=$(sed -n 's/.*(CPU threads: \([0-9]*\)).*/\1/p' "$OUT/peer.err" | head -1)
    frames=$(sed -n 's/.*\[Perf\] Total .* ms (\([0-9]*\) frames.*/\1/p' "$OUT/peer.err")
    own=$(sed -n 's/.*\[Perf\] Total \([0-9.]*\) ms (.*/\1/p' "$OUT/peer.err")
    audio=$(sed -n 's/.*\[Pipeline\] Wrote [0-9]* samples (\([0-9.]*\) s).*/\1/p' "$OUT/peer.err")
    parsed "the CPU thread count of the peer $1" "$threads"
    parsed "the frame count of the peer $1" "$frames"
    parsed "the [Perf] Total of the peer $1" "$own"
    parsed "the audio seconds of the peer $1" "$audio"
    parsed "GNU time's peak RSS of the peer $1" "$rss"
    if [[ $threads != "$2" ]]; then
        echo "error: the peer ran $threads CPU threads, not $2: its QWENTTS_N_THREADS patch" \
            "(scripts/bench/peer_setup.sh) is missing from $PEER_DIR" >&2
        exit 1
    fi
    echo "$whole $frames $audio $((rss / 1024)) $(python3 -c "print(f'{$own / 1e3:.3f}')")"
}

SIDES=()
for p in "${OURS[@]}"; do SIDES+=("ours-$p"); done
for p in "${PEERS[@]}"; do SIDES+=("peer-$p"); done
declare -A WHOLE OWN FRAMES_OF AUDIO RSS
for ((round = 1; round <= ROUNDS; round++)); do
    # Alternating: each round runs the sides in turn, the order reversed every other round so
    # that neither side always follows the other's page-cache and frequency state.
    order=("${SIDES[@]}")
    if ((round % 2 == 0)); then
        for ((i = ${#SIDES[@]} - 1, j = 0; i >= 0; i--, j++)); do order[j]=${SIDES[i]}; done
    fi
    for side in "${order[@]}"; do
        echo "== round $round, $THREADS thread(s): $side" >&2
        case $side in
        ours-*) line=$(run_ours "${side#ours-}" "$THREADS") ;;
        peer-*) line=$(run_peer "${side#peer-}" "$THREADS") ;;
        esac
        read -r whole frames audio rss own <<<"$line"
        WHOLE[$side]+="$whole"$'\n'
        OWN[$side]+="$own"$'\n'
        FRAMES_OF[$side]=$frames
        AUDIO[$side]=$audio
        RSS[$side]=$rss
    done
done

best() { sort -n | head -1; }
printf '\n%s greedy frames of %s (codec: %s), x-vector clone of %s, %s thread(s), best of %s alternating round(s); %s\n' \
    "$FRAMES" "$MODEL" "$CODEC" "$REF" "$THREADS" "$ROUNDS" "$LOAD_NOTE"
printf 'end of run: load average %s\n' "$(cut -d' ' -f1 /proc/loadavg)"
"$BIN" --version | sed -n '1p;/^cpu:/p;/^kernels:/p'
echo "$PEER_NOTE"
declare -A PEER_BEST
for p in "${PEERS[@]}"; do PEER_BEST[$p]=$(printf '%s' "${WHOLE[peer-$p]}" | best); done
header=$(printf '%-22s %8s %7s %8s %9s %7s' side "whole s" frames "audio s" "peak MiB" "own s")
for p in "${PEERS[@]}"; do header+=$(printf ' %10s' "$p/this"); done
echo "$header"
for side in "${SIDES[@]}"; do
    w=$(printf '%s' "${WHOLE[$side]}" | best)
    o=$(printf '%s' "${OWN[$side]}" | best)
    case $side in
    ours-*) name="voiceclone ${side#ours-}" ;;
    peer-*) name="qwentts.cpp ${side#peer-}" ;;
    esac
    row=$(printf '%-22s %8.2f %7s %8.2f %9s %7.2f' "$name" "$w" "${FRAMES_OF[$side]}" "${AUDIO[$side]}" \
        "${RSS[$side]}" "$o")
    for p in "${PEERS[@]}"; do
        row+=$(python3 -c "print(f' {${PEER_BEST[$p]} / max($w, 1e-3):9.2f}x')")
    done
    echo "$row"
done
for side in "${SIDES[@]}"; do
    if [[ ${FRAMES_OF[$side]} != "$FRAMES" ]]; then
        echo "warning: $side generated ${FRAMES_OF[$side]} frames, not $FRAMES" >&2
    fi
done
