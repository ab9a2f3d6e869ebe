#!/usr/bin/env bash
# Benchmark: `voiceclone prep` against a Python baseline doing the same job the usual way
# (faster-whisper with the same tiny.en weights in CTranslate2 form, soxr resampling), on the
# same >= 5 minutes of real speech, in one run. Prints audio-seconds per wall-second for each
# and the ratio. Usage: scripts/bench_prep.sh [ASSETS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
assets=${1:-$PWD/.test-assets}
bash scripts/fetch_test_assets.sh --bench "$assets" >&2
cargo build --release --locked >&2
input="$assets/speech/bench5"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
threads=$(nproc)

# voiceclone: the whole job, model load included, fresh workspace.
mkdir -p "$work/vc"
start=$(date +%s.%N)
./target/release/voiceclone --workdir "$work/vc" prep "$input" \
  --whisper-model "$assets/whisper/ggml-tiny.en.bin" --language en >"$work/vc.log"
end=$(date +%s.%N)
vc_wall=$(python3 -c "print($end - $start)")
audio=$("$assets/venv/bin/python" - "$input" <<'PY'
import sys, pathlib, soundfile as sf
print(sum(sf.info(str(p)).duration for p in pathlib.Path(sys.argv[1]).iterdir() if p.suffix != ".tsv"))
PY
)
vc_utts=$(wc -l <"$work/vc/data/train.jsonl")

# Baseline.
base_json=$("$assets/venv/bin/python" scripts/bench_prep_baseline.py "$input" "$work/py" \
  --model "$assets/whisper/ct2-tiny.en" --threads "$threads" | tail -n 1)
base_wall=$(echo "$base_json" | "$assets/venv/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["wall_seconds"])')
base_utts=$(echo "$base_json" | "$assets/venv/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["utterances"])')

"$assets/venv/bin/python" - "$audio" "$vc_wall" "$base_wall" "$vc_utts" "$base_utts" "$threads" <<'PY'
import sys
audio, vc, base = map(float, sys.argv[1:4])
vc_utts, base_utts, threads = sys.argv[4:7]
print(f"audio: {audio:.1f} s of speech, {threads} threads")
print(f"voiceclone prep : {vc:7.2f} s wall  {audio / vc:7.1f} audio-s/s  ({vc_utts} utterances)")
print(f"python baseline : {base:7.2f} s wall  {audio / base:7.1f} audio-s/s  ({base_utts} utterances)")
print(f"ratio (voiceclone / baseline throughput): {base / vc:.2f}x")
PY
