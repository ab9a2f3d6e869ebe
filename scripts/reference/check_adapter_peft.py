#!/usr/bin/env python3
"""Check that PEFT loads an adapter directory written by ``voiceclone export --adapter-only`` onto the official
model, and that it computes what the merged export does (docs/training.md §13).

Usage (from the repository root; the reference environment of ``scripts/reference/setup_venv.sh``)::

    .reference-venv/bin/python scripts/reference/check_adapter_peft.py ADAPTER_DIR --base BASE_DIR [--merged MODEL_DIR]

What is checked (exit status 1 with a message on the first failure):

* ``PeftModel.from_pretrained(Qwen3TTSModel.from_pretrained(BASE, float32).model, ADAPTER_DIR)`` loads, wraps
  exactly the modules of ``adapter_config.json``, and every adapter and saved-module parameter equals the file's
  tensor bit for bit (nothing was left at PEFT's random start);
* on the fixture batch of ``scripts/reference/make_train_refs.py`` with the adapter's first speaker x-vector
  (``speakers.safetensors``): the talker's logits with the adapter unmerged against PEFT's ``merge_and_unload()``
  in float32 — within 1e-5 of the logits' largest magnitude;
* with ``--merged`` (``voiceclone export`` of the same checkpoint, bf16): every weight of the merged export equals
  PEFT's merged float32 weight rounded to bf16 (within one bf16 step: the f32 sums may round to the neighbour), and
  the logits with the export's weights are reported against PEFT's merged logits (bf16 storage limits them).

Prints one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_train_refs as base  # noqa: E402  (the fixture batch)
import official  # noqa: E402
import sft_recipe as sft  # noqa: E402  (the batch builder and the corrected objective)


def fail(msg: str) -> None:
    print(f"check_adapter_peft: {msg}", file=sys.stderr)
    raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("adapter", type=Path)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--merged", type=Path)
    args = ap.parse_args()
    torch = base.import_stack()["torch"]
    from peft import PeftModel
    from safetensors import safe_open
    from safetensors.torch import load_file

    tts = official.load_official(args.base)
    cfg = tts.model.config
    with safe_open(str(args.adapter / "speakers.safetensors"), "pt") as f:
        xvec = f.get_tensor("speaker_embeddings")[0].float()
    rows = base.fixture_rows(base.fixture_codes())
    text_ids = [sft.tokenize_row_text(tts, r["text"]) for r in rows]
    batch = sft.build_batch(cfg, text_ids, [torch.tensor(r["audio_codes"]) for r in rows])
    xvecs = xvec.reshape(1, -1).expand(batch["text_ids"].shape[0], -1).contiguous()

    acfg = json.loads((args.adapter / "adapter_config.json").read_text())
    model = PeftModel.from_pretrained(tts.model, str(args.adapter))
    model.eval()
    file = load_file(str(args.adapter / "adapter_model.safetensors"))
    wrapped = sorted(n for n, m in tts.model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    if wrapped != sorted(acfg["target_modules"]):
        fail(f"PEFT wrapped {len(wrapped)} modules, the config names {len(acfg['target_modules'])}")
    params = dict(model.named_parameters())
    checked = 0
    for key, want in file.items():
        name = key.removeprefix("base_model.model.")
        module, _, leaf = name.rpartition(".")
        if ".lora_" in name:
            peft_name = f"base_model.model.{module}.default.{leaf}"
        else:
            peft_name = f"base_model.model.{module}.modules_to_save.default.{leaf}"
        got = params.get(peft_name)
        if got is None:
            fail(f"PEFT has no parameter {peft_name} for {key}")
        if not torch.equal(got.detach(), want):
            fail(f"{peft_name} differs from the file's {key}")
        checked += 1
    with torch.no_grad():
        unmerged = sft.corrected_objective(tts.model.talker, batch, xvecs, keep=True)
        merged_model = model.merge_and_unload()
        merged = sft.corrected_objective(merged_model.talker, batch, xvecs, keep=True)
    scale = float(merged["logits"].abs().max())
    d = float((unmerged["logits"] - merged["logits"]).abs().max()) / scale
    if d > 1e-5:
        fail(f"unmerged and merged logits differ by {d:.2e} of their largest")
    out = dict(
        adapters=len(wrapped),
        tensors_checked=checked,
        loss_unmerged=unmerged["loss"].item(),
        loss_merged=merged["loss"].item(),
        logits_unmerged_vs_merged=d,
    )
    if args.merged:
        ours = load_file(str(args.merged / "model.safetensors"))
        worst = 0.0
        sd = merged_model.state_dict()
        for m in wrapped:
            w = sd[f"{m}.weight"]
            mine = ours[f"{m}.weight"].float()
            bf = w.to(torch.bfloat16).float()
            step = bf.abs().clamp_min(1e-30) / 128
            e = float(((mine - bf).abs() / step).max())
            worst = max(worst, e)
            if e > 1.0:
                fail(f"{m}: the merged export differs from PEFT's merge by {e:.2f} bf16 steps")
        with torch.no_grad():
            for n, p in merged_model.named_parameters():
                if n.startswith("talker.") and n in ours:
                    p.copy_(ours[n].float())
            exported = sft.corrected_objective(merged_model.talker, batch, xvecs, keep=True)
        out.update(
            merged_export_worst_bf16_steps=worst,
            logits_export_vs_peft_merged=float((exported["logits"] - merged["logits"]).abs().max()) / scale,
            loss_export=exported["loss"].item(),
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
