#!/usr/bin/env bash
# The prepared check for a machine with an NVIDIA GPU (docs/distributed.md §10), within 10
# minutes on one GPU, without network. Run it in the repository root:
#   BIN=path/to/voiceclone scripts/gpu-check.sh
# BIN is a release build with --features cuda,nccl (build it where CUDA 13.0 is, e.g. with the
# environment of scripts/check_cuda_build.sh: `cargo build --release --features cuda,nccl`); with
# BIN unset and cargo and nvcc present, it is built here. CUDA 13 and NCCL libraries must be on
# LD_LIBRARY_PATH (docs/architecture.md §9.2). python3 with numpy writes the 0.6B-shaped model.
# Checks, one summary line each at the end:
#  1. forward/backward parity on both fixture models: the first step's loss (forward) and
#     gradient norm (backward) of --gpus 1 on the GPU against --cpu-ranks 1 on the CPU, both on
#     the autograd backend (bf16 storage; the GPU also computes in bf16);
#  2. the single-device GPU path against --gpus 1 (NCCL with one rank);
#  3. --gpus 1 on a 0.6B-shaped random model: step time, frames/s, peak device memory of the
#     rank process (from nvidia-smi);
#  4. a --gpus 1 run SIGKILLed after its first checkpoint resumes and finishes;
#  5. `speak` on the GPU (frames/s);
#  6. the parity tests of tests/it/gpu_parity.rs, when cargo is present.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SUMMARY=$WORK/summary.txt
: >"$SUMMARY"
summary() { echo "$*" | tee -a "$SUMMARY"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -z "${BIN:-}" ]; then
  cargo build --release --features cuda,nccl --quiet
  BIN=$PWD/target/release/voiceclone
fi
"$BIN" --version 2>/dev/null || true

make_ws() { # make_ws DIR MODEL FRAMES: a workspace with synthetic codes and an x-vector
  python3 - "$1" "$2" "$3" <<'EOF'
import json, os, random, struct, sys
ws, model, frames = sys.argv[1], os.path.abspath(sys.argv[2]), int(sys.argv[3])
os.makedirs(f"{ws}/data", exist_ok=True)
cfg = json.load(open(f"{model}/config.json"))
hidden = cfg["talker_config"]["hidden_size"]
rnd = random.Random(7)
with open(f"{ws}/data/train.jsonl", "w") as f:
    for i in range(16):
        codes = [[(i * 7 + k * 3 + g * 5) % 13 + 100 * g for g in range(16)] for k in range(frames)]
        f.write(json.dumps({"audio": f"a{i}.wav", "text": "The quick brown fox jumps over the lazy dog.",
                            "ref_audio": "r.wav", "audio_codes": codes}) + "\n")
x = struct.pack(f"<{hidden}f", *[rnd.gauss(0, 1) for _ in range(hidden)])
h = json.dumps({"speaker_embedding": {"dtype": "F32", "shape": [hidden], "data_offsets": [0, len(x)]}}).encode()
h += b" " * ((8 - len(h) % 8) % 8)
open(f"{ws}/data/speaker.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + x)
open(f"{ws}/voiceclone.toml", "w").write(f'[model]\nbase = "{model}"\n')
EOF
}
metric() { # metric WS STEP KEY
  python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(r[int(sys.argv[2])-1][sys.argv[3]])" \
    "$1/checkpoints/metrics.jsonl" "$2" "$3"
}
rel() { python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'{abs(a-b)/abs(b):.2e}')" "$1" "$2"; }
below() { python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)" "$1" "$2"; }
TRAIN=(train --batch-size 4 --grad-accum 2 --no-shuffle --no-export --backend autograd)

echo "== 1. forward/backward parity, GPU (bf16) against CPU (f32 arithmetic on bf16 storage)"
for m in tiny-0b6 tiny-1b7; do
  make_ws "$WORK/g-$m" "tests/fixtures/$m" 8
  make_ws "$WORK/c-$m" "tests/fixtures/$m" 8
  "$BIN" --workdir "$WORK/g-$m" "${TRAIN[@]}" --max-steps 1 --gpus 1 >/dev/null
  "$BIN" --workdir "$WORK/c-$m" "${TRAIN[@]}" --max-steps 1 --cpu-ranks 1 >/dev/null
  lf=$(rel "$(metric "$WORK/g-$m" 1 loss)" "$(metric "$WORK/c-$m" 1 loss)")
  gf=$(rel "$(metric "$WORK/g-$m" 1 grad_norm)" "$(metric "$WORK/c-$m" 1 grad_norm)")
  if below "$lf" 3e-2 && below "$gf" 3e-2; then r=PASS; else r=FAIL; fi
  summary "CHECK 1 parity $m: $r (loss rel $lf, grad norm rel $gf; limit 3e-2, bf16 activations)"
done

echo "== 2. the single-device GPU path against --gpus 1"
make_ws "$WORK/s" tests/fixtures/tiny-0b6 8
"$BIN" --workdir "$WORK/s" "${TRAIN[@]}" --max-steps 1 >/dev/null
lf=$(rel "$(metric "$WORK/s" 1 loss)" "$(metric "$WORK/g-tiny-0b6" 1 loss)")
gf=$(rel "$(metric "$WORK/s" 1 grad_norm)" "$(metric "$WORK/g-tiny-0b6" 1 grad_norm)")
if below "$lf" 1e-2 && below "$gf" 1e-2; then r=PASS; else r=FAIL; fi
summary "CHECK 2 single GPU vs --gpus 1: $r (loss rel $lf, grad norm rel $gf; limit 1e-2)"

MODEL=$WORK/qwen3-tts-0.6b-random
echo "== 3. --gpus 1 on a 0.6B-shaped random model"
python3 - tests/fixtures/tiny-0b6 "$MODEL" <<'EOF'
import json, os, shutil, struct, sys
import numpy as np
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
c = json.load(open(f"{src}/config.json"))
t = c["talker_config"]; cp = t["code_predictor_config"]
t.update(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
         head_dim=128, intermediate_size=3072, text_hidden_size=2048)
t["rope_scaling"]["mrope_section"] = [24, 20, 20]
cp.update(hidden_size=1024, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
          head_dim=128, intermediate_size=3072)
# The fixture's small speaker encoder, its last layer widened to the talker's hidden size.
c["speaker_encoder_config"]["enc_dim"] = 1024
json.dump(c, open(f"{dst}/config.json", "w"), indent=1)
for f in ["generation_config.json", "tokenizer_config.json", "vocab.json", "merges.txt"]:
    shutil.copy(f"{src}/{f}", dst)
os.symlink(os.path.abspath(f"{src}/speech_tokenizer"), f"{dst}/speech_tokenizer")
h, th = t["hidden_size"], t["text_hidden_size"]
shapes = {"talker.model.text_embedding.weight": [t["text_vocab_size"], th],
          "talker.model.codec_embedding.weight": [t["vocab_size"], h],
          "talker.model.norm.weight": [h], "talker.codec_head.weight": [t["vocab_size"], h],
          "talker.text_projection.linear_fc1.weight": [th, th], "talker.text_projection.linear_fc1.bias": [th],
          "talker.text_projection.linear_fc2.weight": [h, th], "talker.text_projection.linear_fc2.bias": [h],
          "talker.code_predictor.model.norm.weight": [cp["hidden_size"]]}
def layer(p, c):
    hh, n, kv, hd, i = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]
    return {f"{p}.self_attn.q_proj.weight": [n * hd, hh], f"{p}.self_attn.k_proj.weight": [kv * hd, hh],
            f"{p}.self_attn.v_proj.weight": [kv * hd, hh], f"{p}.self_attn.o_proj.weight": [hh, n * hd],
            f"{p}.self_attn.q_norm.weight": [hd], f"{p}.self_attn.k_norm.weight": [hd],
            f"{p}.mlp.gate_proj.weight": [i, hh], f"{p}.mlp.up_proj.weight": [i, hh],
            f"{p}.mlp.down_proj.weight": [hh, i], f"{p}.input_layernorm.weight": [hh],
            f"{p}.post_attention_layernorm.weight": [hh]}
for i in range(t["num_hidden_layers"]):
    shapes.update(layer(f"talker.model.layers.{i}", t))
for i in range(cp["num_hidden_layers"]):
    shapes.update(layer(f"talker.code_predictor.model.layers.{i}", cp))
for j in range(t["num_code_groups"] - 1):
    shapes[f"talker.code_predictor.model.codec_embedding.{j}.weight"] = [cp["vocab_size"], h]
    shapes[f"talker.code_predictor.lm_head.{j}.weight"] = [cp["vocab_size"], cp["hidden_size"]]
tiny = open(f"{src}/model.safetensors", "rb").read()
n = struct.unpack("<Q", tiny[:8])[0]
tiny_header = json.loads(tiny[8:8 + n])
kept = {k: v for k, v in tiny_header.items()
        if k.startswith("speaker_encoder.") and not k.startswith("speaker_encoder.fc.")}
fc_in = tiny_header["speaker_encoder.fc.weight"]["shape"][1]
shapes["speaker_encoder.fc.weight"] = [1024, fc_in, 1]
shapes["speaker_encoder.fc.bias"] = [1024]
rng = np.random.default_rng(0)
header, off, blobs = {}, 0, []
for name, shape in shapes.items():
    v = (rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02)
    b = (v.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16 by truncation
    header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + len(b)]}
    off += len(b); blobs.append(b)
for name, info in kept.items():
    a, e = info["data_offsets"]
    b = tiny[8 + n + a:8 + n + e]
    header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [off, off + len(b)]}
    off += len(b); blobs.append(b)
hj = json.dumps(header).encode(); hj += b" " * ((8 - len(hj) % 8) % 8)
with open(f"{dst}/model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(hj))); f.write(hj)
    for b in blobs: f.write(b)
EOF
make_ws "$WORK/big" "$MODEL" 100
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 >"$WORK/mem.txt" &
SMI=$!
"$BIN" --workdir "$WORK/big" "${TRAIN[@]}" --max-steps 4 --save-every 0 --gpus 1 | tail -n 3
kill $SMI || true
python3 - "$WORK/big/checkpoints/metrics.jsonl" "$WORK/mem.txt" "$SUMMARY" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
s = statistics.median(r["seconds"] for r in rows)
f = statistics.median(r["frames"] / r["seconds"] for r in rows)
peak = {}
for line in open(sys.argv[2]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak[parts[0]] = max(peak.get(parts[0], 0), int(parts[1]))
line = (f"CHECK 3 0.6B-shaped --gpus 1: PASS (step {s:.3f} s, {f:.0f} frames/s, peak device memory "
        f"per rank process {sorted(peak.values(), reverse=True)} MiB)")
print(line); open(sys.argv[3], "a").write(line + "\n")
EOF

echo "== 4. a --gpus 1 run killed after its first checkpoint resumes"
make_ws "$WORK/k" tests/fixtures/tiny-0b6 8
"$BIN" --workdir "$WORK/k" "${TRAIN[@]}" --max-steps 6 --save-every 2 --gpus 1 >/dev/null 2>&1 &
LAUNCHER=$!
for _ in $(seq 600); do [ -e "$WORK/k/checkpoints/step-0000002/index.json" ] && break; sleep 0.1; done
pkill -KILL -f -- "--workdir $WORK/k" || true
wait $LAUNCHER || true
if "$BIN" --workdir "$WORK/k" "${TRAIN[@]}" --max-steps 6 --save-every 2 --gpus 1 >"$WORK/k.out" 2>&1 &&
  grep -q "resuming from checkpoints/step-" "$WORK/k.out"; then
  summary "CHECK 4 SIGKILL + resume: PASS ($(grep -o 'resuming from [^ ]*' "$WORK/k.out"), final loss $(metric "$WORK/k" 6 loss))"
else
  summary "CHECK 4 SIGKILL + resume: FAIL ($(tail -n 3 "$WORK/k.out" | tr '\n' ' '))"
fi

echo "== 5. speak on the GPU (0.6B-shaped model, the workspace's x-vector, 50 greedy frames)"
if "$BIN" --workdir "$WORK/big" speak "The quick brown fox jumps over the lazy dog." -o "$WORK/out.wav" \
  --greedy --max-frames 50 >"$WORK/speak.out" 2>&1; then
  summary "CHECK 5 speak on the GPU: PASS ($(grep -Eo '[0-9.]+ frames/s' "$WORK/speak.out" | tail -n 1))"
else
  summary "CHECK 5 speak on the GPU: FAIL ($(tail -n 2 "$WORK/speak.out" | tr '\n' ' '))"
fi

if command -v cargo >/dev/null && command -v nvcc >/dev/null; then
  echo "== 6. parity tests on CUDA"
  if cargo test --release --features cuda,nccl,test-hooks --test it -- gpu_parity 2>&1 | tee "$WORK/t.out" |
    grep -q "test result: ok"; then r=PASS; else r=FAIL; fi
  summary "CHECK 6 gpu_parity tests: $r"
fi
echo "== summary ($(($(date +%s) - START)) s)"
cat "$SUMMARY"
