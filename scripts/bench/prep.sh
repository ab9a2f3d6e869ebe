#!/usr/bin/env bash
# Benchmark: `voiceclone prep` against a Python baseline doing the same job the usual way
# (scripts/bench/prep_baseline.py: faster-whisper with the same Whisper tiny.en weights in
# CTranslate2 form, soxr resampling), on the same real speech, model load included on both
# sides. faster-whisper runs at compute_type int8 (its fastest CPU setting) and float32;
# voiceclone with the same weights as ggml Q8_0 (its recommended file) and f16.
#
# Every round runs each side once, in alternating order; the best wall time of the rounds
# counts. Prints audio-seconds per wall-second, the ratios against both baselines, the word
# error rate of every side against the assets' transcripts (scripts/bench/prep_wer.py), and the
# load average before and after. Refuses to run on a busy machine (1-minute load average
# above 1) unless --allow-busy is given; timings from a busy machine are not comparable.
#
# Usage: scripts/bench/prep.sh [--rounds N] [--set NAME]... [--allow-busy] [ASSETS_DIR]
#   --set NAME   speech set under ASSETS_DIR/speech (default bench5: 400 s of 16 kHz WAV;
#                prep2: 190 s in nine formats and rates); repeatable
#   --rounds N   rounds per set (default 3)
#
# SMOKE=1 (scripts/bench/smoke.sh): one round on a set of one clip (the first 16 kHz WAV of
# prep2 that is not a concatenation, with its transcript); nothing fetched or built (BIN, the
# test build; the assets CI fetched); the faster-whisper side only where the assets' venv has
# the --bench packages (CI does not install them), else the table shows voiceclone's sides alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/smoke.sh

rounds=3
rounds_given=0
sets=()
allow_busy=0
assets=""
while (($#)); do
    case "$1" in
        --rounds) rounds=$2; rounds_given=1; shift 2 ;;
        --set) sets+=("$2"); shift 2 ;;
        --allow-busy) allow_busy=1; shift ;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option: $1" >&2; exit 2 ;;
        *) assets=$1; shift ;;
    esac
done
assets=${assets:-$PWD/.test-assets}
py="$assets/venv/bin/python"
q8="$assets/whisper/ggml-tiny.en-q8_0.bin"
f16="$assets/whisper/ggml-tiny.en.bin"
ct2="$assets/whisper/ct2-tiny.en"
threads=$(nproc)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
speech=$assets/speech
# Each round runs every side; even rounds in the second order.
sides=(voiceclone-q8_0 faster-whisper-int8 voiceclone-f16 faster-whisper-float32)
sides_even=(faster-whisper-int8 voiceclone-q8_0 faster-whisper-float32 voiceclone-f16)
if is_smoke; then
    [[ -x $py && -f $q8 && -f $f16 ]] ||
        { echo "error: no test assets in $assets: run scripts/assets/fetch_test_assets.sh" >&2; exit 1; }
    smoke_bin
    ((rounds_given)) || rounds=1
    clip=$(awk -F'\t' '$1 !~ /_mix_/ && $1 ~ /_wav16k\.wav$/ { print; exit }' "$speech/prep2/transcripts.tsv")
    parsed "a single 16 kHz WAV clip of $speech/prep2/transcripts.tsv" "$clip"
    speech=$work/speech
    mkdir -p "$speech/smoke"
    cp "$assets/speech/prep2/${clip%%$'\t'*}" "$speech/smoke/"
    printf '%s\n' "$clip" >"$speech/smoke/transcripts.tsv"
    sets=(smoke)
    reference_side "$py" "faster_whisper, librosa, soxr, soundfile" \
        "scripts/assets/fetch_test_assets.sh --bench installs them" ||
        { sides=(voiceclone-q8_0 voiceclone-f16); sides_even=(voiceclone-f16 voiceclone-q8_0); }
else
    ((${#sets[@]})) || sets=(bench5)
    bash scripts/assets/fetch_test_assets.sh --bench "$assets" >&2
    cargo build --release --locked >&2
    BIN=./target/release/voiceclone
fi

load1() { cut -d' ' -f1 /proc/loadavg; }
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
if "$py" -c "import sys; sys.exit(0 if float('$(load1)') <= 1.0 else 1)"; then
    :
elif is_smoke; then
    load_before+=" (SMOKE=1: not a measurement)"
elif ((allow_busy)); then
    echo "warning: load average $load_before: the machine is busy, timings are not comparable" >&2
else
    echo "error: load average $load_before: the machine is busy (1-minute load above 1); wait for" \
         "a quiet moment or pass --allow-busy" >&2
    exit 1
fi

# run SIDE SET ROUND: one timed run; appends "set side round wall utterances wer" to results.
run() {
    local side=$1 set=$2 round=$3 input="$speech/$2" out="$work/$1-$2-$3" start end
    mkdir -p "$out"
    start=$(date +%s.%N)
    case "$side" in
        voiceclone-q8_0|voiceclone-f16)
            local model=$q8
            [[ $side == voiceclone-f16 ]] && model=$f16
            "$BIN" --workdir "$out" prep "$input" \
                --whisper-model "$model" --language en >"$out.log" 2>&1
            manifest="$out/data/train.jsonl" ;;
        faster-whisper-int8|faster-whisper-float32)
            "$py" scripts/bench/prep_baseline.py "$input" "$out" --model "$ct2" \
                --threads "$threads" --compute-type "${side#faster-whisper-}" >"$out.log" 2>&1
            manifest="$out/train.jsonl" ;;
    esac
    end=$(date +%s.%N)
    local wer
    wer=$("$py" scripts/bench/prep_wer.py "$manifest" "$input/transcripts.tsv")
    echo "$set $side $round $("$py" -c "print($end - $start)") $(wc -l <"$manifest") $wer" \
        >>"$work/results"
    echo "  $set round $round: $side $(tail -n 1 "$work/results" | cut -d' ' -f4) s" >&2
}

for set in "${sets[@]}"; do
    for ((r = 1; r <= rounds; r++)); do
        # Alternate the order so that neither side always runs first (caches, clocks).
        if ((r % 2)); then order=("${sides[@]}"); else order=("${sides_even[@]}"); fi
        for side in "${order[@]}"; do run "$side" "$set" "$r"; done
    done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

"$py" - "$work/results" "$speech" "$threads" "$rounds" "$load_before" "$load_after" <<'PY'
import json, pathlib, sys, wave

try:
    import soundfile as sf
    def seconds(p):
        return sf.info(str(p)).duration
except ImportError:  # the test assets' venv without --bench (SMOKE=1 in CI): WAV only
    def seconds(p):
        with wave.open(str(p)) as w:
            return w.getnframes() / w.getframerate()

results, speech, threads, rounds, before, after = sys.argv[1:7]
rows = {}
for line in open(results):
    set_, side, _round, wall, utts, wer = line.split(" ", 5)
    best = rows.setdefault((set_, side), {"wall": float("inf"), "walls": []})
    best["walls"].append(float(wall))
    best["wall"] = min(best["wall"], float(wall))
    best["utts"], best["wer"] = int(utts), json.loads(wer)
print(f"{threads} threads, best of {rounds} alternating rounds, model load included")
print(f"load average before: {before}, after: {after}")
for set_ in dict.fromkeys(s for s, _ in rows):
    d = pathlib.Path(speech) / set_
    audio = sum(seconds(p) for p in d.iterdir() if p.suffix != ".tsv")
    print(f"\n{set_}: {audio:.1f} s of speech")
    print(f"  {'side':24} {'best s':>8} {'audio-s/s':>10} {'vs int8':>8} {'vs f32':>8} {'WER':>7}  utterances  all runs (s)")
    # No baseline without the --bench packages (SMOKE=1 only): its ratios print as "-".
    int8 = rows.get((set_, "faster-whisper-int8"), {}).get("wall")
    f32 = rows.get((set_, "faster-whisper-float32"), {}).get("wall")
    ratio = lambda base, wall: f"{base / wall:7.2f}x" if base else f"{'-':>8}"
    for (s, side), r in rows.items():
        if s != set_:
            continue
        w = r["wer"]
        runs = " ".join(f"{x:.2f}" for x in r["walls"])
        print(f"  {side:24} {r['wall']:8.2f} {audio / r['wall']:10.1f} {ratio(int8, r['wall'])} "
              f"{ratio(f32, r['wall'])} {100 * w['wer']:6.2f}%  {r['utts']:10d}  {runs}")
PY
