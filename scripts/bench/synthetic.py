#!/usr/bin/env python3
"""Synthetic inputs of the scripts that train without real data (scripts/gpu-check.sh,
scripts/bench/memory.sh, scripts/bench/overlap.sh); no network, standard library (and numpy or
torch, whichever is there, for the random weights).

  synthetic.py workspace DIR MODEL FRAMES   a workspace: 16 utterances of FRAMES frames with
                                            synthetic codes, an x-vector, voiceclone.toml
  synthetic.py model-0.6b SRC DST           a 0.6B-shaped random checkpoint (bf16) in DST, with
                                            the tokenizer and speaker encoder of fixture SRC
  synthetic.py model-medium SRC DST         the 61 M "medium" shape of scripts/reference/
                                            bench_train.py (real vocabularies, hidden 256, 4 + 2
                                            layers), the same way
  synthetic.py model-small SRC DST          real vocabularies, hidden 64, 2 + 1 layers (the CPU
                                            dry run of scripts/gpu-check.sh)
"""
import json
import os
import random
import shutil
import struct
import sys


def workspace(argv):
    ws, model, frames = argv[0], os.path.abspath(argv[1]), int(argv[2])
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


def random_bf16(n, seed):
    """`n` bf16 values of N(0, 0.02), as little-endian bytes: numpy where it is installed,
    else torch (a GPU machine's Python may have only torch)."""
    try:
        import numpy as np
    except ImportError:
        import ctypes
        try:
            import torch
        except ImportError:
            sys.exit("synthetic.py: random weights need numpy or torch (pip install numpy)")
        g = torch.Generator().manual_seed(seed)
        t = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).contiguous()
        return ctypes.string_at(t.data_ptr(), n * 2)
    v = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * 0.02
    return (v.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16 by truncation


# Talker and code-predictor sizes of the generated models.
SHAPES = {
    "model-0.6b": (dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=128, intermediate_size=3072, text_hidden_size=2048), [24, 20, 20],
                   dict(hidden_size=1024, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=128, intermediate_size=3072)),
    # scripts/reference/bench_train.py's MEDIUM_SPEC.
    "model-medium": (dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, intermediate_size=768, text_hidden_size=256), [12, 10, 10],
                     dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, intermediate_size=768)),
    # The CPU dry run of scripts/gpu-check.sh: every command and flag of the big-model checks,
    # at a size two CPU cores train in a second.
    "model-small": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=192, text_hidden_size=64), [4, 2, 2],
                    dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=192)),
}


def model(kind, argv):
    src, dst = argv[0], argv[1]
    os.makedirs(dst)
    c = json.load(open(f"{src}/config.json"))
    t = c["talker_config"]; cp = t["code_predictor_config"]
    talker, mrope, predictor = SHAPES[kind]
    t.update(talker)
    t["rope_scaling"]["mrope_section"] = mrope
    cp.update(predictor)
    # The fixture's small speaker encoder, its last layer widened to the talker's hidden size.
    c["speaker_encoder_config"]["enc_dim"] = t["hidden_size"]
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
    shapes["speaker_encoder.fc.weight"] = [t["hidden_size"], fc_in, 1]
    shapes["speaker_encoder.fc.bias"] = [t["hidden_size"]]
    header, off, blobs = {}, 0, []
    for seed, (name, shape) in enumerate(shapes.items()):
        count = 1
        for d in shape:
            count *= d
        b = random_bf16(count, seed)
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


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ["workspace", *SHAPES]:
        sys.exit(__doc__)
    if sys.argv[1] == "workspace":
        workspace(sys.argv[2:])
    else:
        model(sys.argv[1], sys.argv[2:])
