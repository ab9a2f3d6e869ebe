#!/usr/bin/env bash
# The prepared check for a machine with an NVIDIA GPU (docs/distributed.md §10): run it there in
# the repository root, with a CUDA 13 runtime and NCCL on LD_LIBRARY_PATH.
#  1. release build with --features cuda,nccl (or use BIN=path/to/prebuilt/voiceclone);
#  2. the parity tests on CUDA (tests/it/gpu_parity.rs, ignored in builds without cuda; bf16
#     tolerances);
#  3. a 4-step training run with --gpus 1 (NCCL, one rank) and one on the single-device path: the
#     same losses within bf16 tolerance;
#  4. step time, frames/s and peak GPU memory of a --gpus 1 run on the 0.6B-shaped random model
#     (MODEL_DIR, default .big-fixtures/qwen3-tts-0.6b-random; skipped when absent);
#  5. `speak` frames/s on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR=${MODEL_DIR:-.big-fixtures/qwen3-tts-0.6b-random}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -z "${BIN:-}" ]; then
  cargo build --release --features cuda,nccl --quiet
  BIN=$PWD/target/release/voiceclone
fi

echo "== parity tests on CUDA"
if command -v cargo >/dev/null; then
  cargo test --release --features cuda,nccl,test-hooks --test it -- gpu_parity --nocapture 2>&1 |
    grep -E "rel|of their scale|test result"
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
make_ws() { # make_ws DIR MODEL: a workspace with synthetic codes and x-vector
  python3 - "$1" "$2" <<'EOF'
import json, os, random, struct, sys
ws, model = sys.argv[1], os.path.abspath(sys.argv[2])
os.makedirs(f"{ws}/data", exist_ok=True)
cfg = json.load(open(f"{model}/config.json"))
hidden = cfg["talker_config"]["hidden_size"]
vocab = cfg["talker_config"]["code_predictor_config"]["vocab_size"]
rnd = random.Random(7)
with open(f"{ws}/data/train.jsonl", "w") as f:
    for i in range(32):
        codes = [[rnd.randrange(vocab) for _ in range(16)] for _ in range(100)]
        f.write(json.dumps({"audio": f"a{i}.wav", "text": "The quick brown fox jumps over the lazy dog.",
                            "ref_audio": "r.wav", "audio_codes": codes}) + "\n")
x = struct.pack(f"<{hidden}f", *[rnd.gauss(0, 1) for _ in range(hidden)])
h = json.dumps({"speaker_embedding": {"dtype": "F32", "shape": [hidden], "data_offsets": [0, len(x)]}}).encode()
h += b" " * ((8 - len(h) % 8) % 8)
open(f"{ws}/data/speaker.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + x)
open(f"{ws}/voiceclone.toml", "w").write(f'[model]\nbase = "{model}"\n')
EOF
}
TRAIN=(train --batch-size 4 --grad-accum 2 --max-steps 4 --save-every 0 --no-shuffle --no-export)

echo "== --gpus 1 (NCCL) against the single-device path (tiny-0b6)"
make_ws "$WORK/a" tests/fixtures/tiny-0b6
make_ws "$WORK/b" tests/fixtures/tiny-0b6
"$BIN" --workdir "$WORK/a" "${TRAIN[@]}" --gpus 1 | tail -n 3
"$BIN" --workdir "$WORK/b" "${TRAIN[@]}" | tail -n 2
python3 - "$WORK/a" "$WORK/b" <<'EOF'
import json, sys
a, b = ([json.loads(l) for l in open(f"{d}/checkpoints/metrics.jsonl")] for d in sys.argv[1:])
worst = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
print(f"losses --gpus 1 vs single device: worst relative difference {worst:.2e} over {len(a)} steps")
EOF

if [ -f "$MODEL_DIR/config.json" ]; then
  echo "== 0.6B-shaped model, --gpus 1: step time, frames/s, peak GPU memory"
  make_ws "$WORK/c" "$MODEL_DIR"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$WORK/mem.txt" &
  SMI=$!
  "$BIN" --workdir "$WORK/c" "${TRAIN[@]}" --gpus 1 | tail -n 4
  kill $SMI
  python3 - "$WORK/c/checkpoints/metrics.jsonl" "$WORK/mem.txt" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
s = statistics.median(r["seconds"] for r in rows)
f = statistics.median(r["frames"] / r["seconds"] for r in rows)
mem = max(int(x) for x in open(sys.argv[2]) if x.strip().isdigit())
print(f"step {s:.3f} s, {f:.0f} frames/s, peak GPU memory {mem} MiB")
EOF
  echo "== speak on the GPU (0.6B-shaped model, 50 greedy frames)"
  "$BIN" --workdir "$WORK/c" speak "The quick brown fox jumps over the lazy dog." -o "$WORK/out.wav" \
    --model "$MODEL_DIR" --ref-audio tests/fixtures/audio/ref24k.wav --greedy --max-frames 50 2>&1 |
    tail -n 2
else
  echo "no $MODEL_DIR: the 0.6B-shaped measurements are skipped"
fi
