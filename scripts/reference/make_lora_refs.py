#!/usr/bin/env python3
"""Reference values of LoRA fine-tuning (docs/training.md §13) computed with PEFT on the official modules.

What it writes (for each committed fixture model ``tests/fixtures/<model>``)::

    tests/fixtures/refs/<model>.lora.json          configuration, losses, gradient norms, per-tensor norms
    tests/fixtures/refs/<model>.lora.safetensors   the adapters' first values, their gradients, their
                                                   values after the AdamW steps

How
---
* The fixture batch and x-vector of ``scripts/reference/make_train_refs.py`` and the corrected objective of
  ``scripts/reference/sft_recipe.py`` (imported), on the official model loaded in float32.
* ``peft.get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[every q/k/v/o and
  gate/up/down projection of the talker's and the code predictor's decoder layers], lora_dropout=0,
  bias="none"))``; ``talker.codec_head.weight`` is trained fully beside the adapters (voiceclone's
  ``train.lora_full``), everything else frozen.
* The adapters start from voiceclone's first values, not PEFT's random ones: ``lora_A`` drawn exactly as
  ``crates/vc-train/src/step/lora.rs`` draws it (SplitMix64 seeded with ``train.seed`` XOR the FNV-1a hash of the factor's
  name, uniform in ±1/sqrt(in), rounded to float32), ``lora_B`` zero (PEFT's own start).  The script writes
  the ``lora_A`` values it used (``init.<name>``) so that the Rust test checks our initialization gives the
  same bits.
* Loss and gradients of the first step (``lora_B = 0``: the loss is the base model's, every ``lora_A``
  gradient is zero), then TRAIN_STEPS steps of loss, backward, clip_grad_norm_(1.0), torch AdamW, as
  ``make_train_refs.py``'s trajectory, and the loss after them.

Usage (from the repository root; the reference environment of ``scripts/reference/setup_venv.sh``,
which includes ``peft``)::

    .reference-venv/bin/python scripts/reference/make_lora_refs.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_train_refs as base  # noqa: E402  (the fixture batch and the optimisation settings)
import official  # noqa: E402
import sft_recipe as sft  # noqa: E402  (the batch builder and the corrected objective)

RANK = 4
ALPHA = 8.0
SEED = 1234  # configs/default.toml train.seed
FULL = ["talker.codec_head.weight"]
PROJECTIONS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
DECODERS = ["talker.model.layers.", "talker.code_predictor.model.layers."]
MASK = (1 << 64) - 1


def adaptable(name: str) -> bool:
    for d in DECODERS:
        if name.startswith(d):
            layer, _, proj = name[len(d):].partition(".")
            return layer.isdigit() and proj in PROJECTIONS
    return False


class SplitMix64:
    def __init__(self, seed: int):
        self.state = seed & MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def next_f64(self) -> float:
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def fnv1a(name: str) -> int:
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def first_lora_a(name: str, rank: int, inp: int):
    import numpy as np

    rng = SplitMix64(SEED ^ fnv1a(name))
    bound = 1.0 / inp ** 0.5
    vals = [(2.0 * rng.next_f64() - 1.0) * bound for _ in range(rank * inp)]
    return np.asarray(vals, dtype=np.float64).astype(np.float32).reshape(rank, inp)


def ref_model(name: str) -> None:
    torch = base.torch
    from peft import LoraConfig, get_peft_model
    import peft

    model_dir = base.FIXTURES / name
    base._log(f"{name}: loading {model_dir}")
    tts = official.load_official(model_dir)
    cfg = tts.model.config
    torch.manual_seed(0)
    xvec = sft.xvector_from_wav(tts, base.REF_WAV)
    rows = base.fixture_rows(base.fixture_codes())
    text_ids = [sft.tokenize_row_text(tts, r["text"]) for r in rows]
    row_codes = [torch.tensor(r["audio_codes"], dtype=torch.long) for r in rows]
    batch = sft.build_batch(cfg, text_ids, row_codes)
    B = batch["text_ids"].shape[0]
    xvecs = xvec.reshape(1, -1).expand(B, -1).contiguous()

    with torch.no_grad():
        base_loss = sft.corrected_objective(tts.model.talker, batch, xvecs)["loss"].item()

    targets = sorted(n for n, _ in tts.model.named_modules() if adaptable(n))
    lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(tts.model, lcfg)
    talker = tts.model.talker  # PEFT wraps the modules in place
    init = {}
    with torch.no_grad():
        for m in targets:
            mod = talker.get_submodule(m[len("talker."):])
            a = mod.lora_A["default"].weight
            init[f"{m}.lora_A.weight"] = torch.from_numpy(first_lora_a(f"{m}.lora_A.weight", a.shape[0], a.shape[1]))
            a.copy_(init[f"{m}.lora_A.weight"])
            mod.lora_B["default"].weight.zero_()
    params = []
    for n, p in peft_model.named_parameters():
        ours = n.removeprefix("base_model.model.").replace(".default.", ".")
        if ".lora_" in ours or ours in FULL:
            p.requires_grad_(True)
            params.append((ours, p))
        else:
            p.requires_grad_(False)
    params.sort()
    names = [n for n, _ in params]
    expected = sorted([f"{m}.lora_A.weight" for m in targets] + [f"{m}.lora_B.weight" for m in targets] + FULL)
    assert names == expected, (names[:4], expected[:4])

    res, grads = sft.run_objective(tts, params, batch, xvecs)
    loss0 = res["loss"].item()
    assert loss0 == base_loss, (loss0, base_loss)  # B = 0: the base model exactly
    grad_norm = float(sum(g.double().pow(2).sum() for g in grads.values()).sqrt())

    start = {n: p.detach().clone() for n, p in params}
    opt = torch.optim.AdamW([p for _, p in params], lr=base.TRAIN_LR, **base.ADAMW)
    losses, gnorms = [], []
    for _ in range(base.TRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        r = sft.corrected_objective(talker, batch, xvecs)
        r["loss"].backward()
        gnorms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in params], base.CLIP_NORM)))
        opt.step()
        losses.append(r["loss"].item())
    with torch.no_grad():
        loss_after = sft.corrected_objective(talker, batch, xvecs)["loss"].item()

    tensors = {}
    for n, a in init.items():
        tensors[f"init.{n}"] = a.contiguous()
    for n, g in grads.items():
        tensors[f"grad.{n}"] = g.detach().float().contiguous()
    for n, p in params:
        tensors[f"after.{n}"] = p.detach().float().contiguous()
    out_st = base.REFS / f"{name}.lora.safetensors"
    base.safetensors_save(tensors, str(out_st))
    info = {
        "model": name,
        "peft": peft.__version__,
        "torch": torch.__version__,
        "rank": RANK,
        "alpha": ALPHA,
        "seed": SEED,
        "full": FULL,
        "targets": targets,
        "trained": names,
        "base_loss": base_loss,
        "loss": loss0,
        "loss_talker": res["loss_talker"].item(),
        "loss_sub": res["loss_sub"].item(),
        "grad_norm": grad_norm,
        "grad_norms": {n: float(g.double().pow(2).sum().sqrt()) for n, g in grads.items()},
        "train_steps": {
            "lr": base.TRAIN_LR,
            "weight_decay": base.ADAMW["weight_decay"],
            "clip": base.CLIP_NORM,
            "losses": losses,
            "grad_norms_preclip": gnorms,
            "loss_after": loss_after,
            "delta_norms": {n: float((p.detach() - start[n]).double().pow(2).sum().sqrt()) for n, p in params},
        },
    }
    out_json = base.REFS / f"{name}.lora.json"
    out_json.write_text(json.dumps(info, indent=1) + "\n")
    base._log(
        f"{name}: {len(targets)} adapters; loss {loss0:.8g} (= base); grad norm {grad_norm:.6g}; "
        f"{base.TRAIN_STEPS} AdamW steps: {losses} -> {loss_after:.8g}; wrote {out_json.name}, {out_st.name}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=base.MODELS)
    args = ap.parse_args()
    base.import_stack()
    for m in args.models:
        ref_model(m)


if __name__ == "__main__":
    main()
