#!/usr/bin/env bash
# Sharded training on CPU ranks (docs/distributed.md §7, docs/performance.md §9): per-rank peak
# resident memory and step time of `voiceclone train --cpu-ranks N` for N = 1, 2, 4 on a
# 0.6B-shaped random model, in full (ZeRO-3) mode by default.
#
#   scripts/bench/fsdp.sh [MODEL_DIR] [SHARD] [STEPS]
#
# MODEL_DIR defaults to .big-fixtures/qwen3-tts-0.6b-random, which
# `python scripts/reference/make_fixtures.py --full-size .big-fixtures/qwen3-tts-0.6b-random` writes (see
# its docstring for the Python environment). The data are synthetic: 24 utterances of 60 frames
# (4.8 s) with a short sentence each, batch 2 × 4 micro-batches per step. Every rank's peak memory
# is printed by rank 0 at the end of each run; the step time is the median of steps 2..STEPS from
# checkpoints/metrics.jsonl. Check that the machine is otherwise idle: the ranks share its cores.
#
# SMOKE=1 (scripts/bench/smoke.sh): the tiny fixture model (MODEL_DIR's default), N = 1, 2,
# 2 steps of 8-frame utterances, BIN the test build, nothing built.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/smoke.sh
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if is_smoke; then
  MODEL=${1:-$SMOKE_MODEL}
  STEPS=${3:-2}
  RANKS="1 2"
  FRAMES=8
else
  MODEL=${1:-.big-fixtures/qwen3-tts-0.6b-random}
  STEPS=${3:-4}
  RANKS="1 2 4"
  FRAMES=60
fi
SHARD=${2:-full}
[ -f "$MODEL/config.json" ] || {
  echo "no model in $MODEL: run scripts/reference/make_fixtures.py --full-size $MODEL first" >&2
  exit 1
}
MODEL=$(cd "$MODEL" && pwd)
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
if is_smoke; then
  smoke_bin
else
  cargo build --release --quiet
  BIN=$PWD/target/release/voiceclone
fi

python3 - "$WORK/template" "$MODEL" "$FRAMES" <<'EOF'
import json, os, random, struct, sys
ws, model, frames = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(f"{ws}/data", exist_ok=True)
cfg = json.load(open(f"{model}/config.json"))
hidden = cfg["talker_config"]["hidden_size"]
vocab = cfg["talker_config"]["code_predictor_config"]["vocab_size"]
rnd = random.Random(7)
texts = ["The quick brown fox jumps over the lazy dog.", "Good morning, how are you today?",
         "Numbers like forty two are spoken too.", "Another line of text for the voice."]
with open(f"{ws}/data/train.jsonl", "w") as f:
    for i in range(24):
        codes = [[rnd.randrange(vocab) for _ in range(16)] for _ in range(frames)]
        f.write(json.dumps({"audio": f"data/segments/{i:04}.wav", "text": texts[i % 4],
                            "ref_audio": "data/ref.wav", "audio_codes": codes}) + "\n")
x = [rnd.gauss(0, 1) for _ in range(hidden)]
data = struct.pack(f"<{hidden}f", *x)
header = json.dumps({"speaker_embedding": {"dtype": "F32", "shape": [hidden],
                     "data_offsets": [0, len(data)]}}).encode()
header += b" " * ((8 - len(header) % 8) % 8)
with open(f"{ws}/data/speaker.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + data)
with open(f"{ws}/voiceclone.toml", "w") as f:
    f.write(f'[model]\nbase = "{model}"\n')
EOF

printf '\n%-6s %-8s %12s %s\n' ranks shard "step (s)" "peak RSS per rank"
for N in $RANKS; do
  ws="$WORK/ws-$N"
  cp -r "$WORK/template" "$ws"
  out=$("$BIN" --workdir "$ws" train --cpu-ranks "$N" --shard "$SHARD" --batch-size 2 \
    --grad-accum 4 --max-steps "$STEPS" --save-every 0 --no-shuffle --no-export 2>&1) || {
    echo "$out" >&2
    exit 1
  }
  step=$(python3 - "$ws/checkpoints/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{statistics.median(r['seconds'] for r in rows[1:] or rows):.2f}")
EOF
)
  peaks=$(echo "$out" | sed -n 's/^peak resident memory: //p')
  state=$(echo "$out" | sed -n 's/.*take at most \([0-9]*\) bytes on a rank.*/\1/p')
  parsed "the peak resident memory" "$peaks"
  parsed "the state bytes per rank" "$state"
  printf '%-6s %-8s %12s %s (state %s bytes)\n' "$N" "$SHARD" "$step" "$peaks" "$state"
  rm -rf "$ws"
done
