#!/usr/bin/env python3
"""Training benchmark of the official Qwen3-TTS modules (`qwen-tts==0.1.1`, PyTorch) on the corrected
fine-tuning objective (docs/model.md §10.3), the baseline for `voiceclone train`.

The objective, batch layout and x-vector handling are those of `scripts/reference/make_train_refs.py` (imported
from `scripts/reference/sft_recipe.py`, which both use): `L = L_talker + 0.3 · L_sub` with `text_projection`
applied, a single label shift and the hidden that predicted code 0 feeding the code predictor; right-padded
batches of docs/model.md §10.2.

Three modes (run from the repository root with the reference environment, made by scripts/reference/setup_venv.sh)::

    # 1. a random "medium" model in the official layout (bf16 model.safetensors; tokenizer files and
    #    speech_tokenizer/ are relative symlinks into tests/fixtures/tiny-0b6/)
    .reference-venv/bin/python scripts/reference/bench_train.py --make-model .big-fixtures/train-medium

    # 2. synthetic training rows (JSONL: text + random audio_codes), the same file for both trainers
    .reference-venv/bin/python scripts/reference/bench_train.py --make-data .big-fixtures/train-rows.jsonl \\
        [--rows 64] [--min-frames 50] [--max-frames 150] [--seed 7]

    # 3. the benchmark
    .reference-venv/bin/python scripts/reference/bench_train.py --model DIR --data JSONL \\
        (--ref-xvector FILE.safetensors | --ref-audio WAV) [--batch-size 2] [--steps 10] [--warmup 2] \\
        [--threads N] [--lr 2e-5] [--dtype float32] [--device cpu] [--save-xvector FILE] [--out-json FILE]

Benchmark arguments
-------------------
--model DIR          official model directory (Base, with a speaker encoder if --ref-audio is used);
                     loaded with `Qwen3TTSModel.from_pretrained(DIR, dtype=<--dtype>, device_map=<--device>)`
                     (attention `sdpa`); load not timed.
--data JSONL         one object per line with at least `text` and `audio_codes` ([[16 ints] per frame]);
                     other keys (`audio`, `ref_audio`, `language`) are ignored.  Texts are tokenized once
                     before timing (official processor, `_build_assistant_text(text)` ids minus the last 5).
--ref-xvector FILE   safetensors with tensor `speaker_embedding` (H,) — the x-vector used at position 6 of
                     every sample; or
--ref-audio WAV      24 kHz WAV; the x-vector is computed once with the model's official speaker encoder
                     (`extract_speaker_embedding`, frozen).  --save-xvector FILE writes it as
                     `speaker_embedding` so the Rust trainer can use the identical vector.
--batch-size B       rows per step.  Batches are consecutive rows in file order, no shuffle: step i
                     (counting warm-up steps) uses rows (i·B + j) mod n_rows, j = 0..B-1 — the Rust side
                     feeds the same batches with the same row order.
--warmup W           untimed steps first (default 2), then --steps N timed steps (default 10); every step
                     is a full optimizer step (warm-up steps update the weights too).
--threads T          torch intra-op threads (default: every core this process may run on).
--lr LR              AdamW learning rate (default 2e-5, the official CLI default).
--dtype              float32 (default; fp32 weights, grads and AdamW state) or bfloat16 (pure bf16 like the
                     official recipe; logits are upcast to fp32 for the cross-entropy).
--device             cpu (default) or cuda.
--fsdp2              shard the talker with PyTorch's FSDP2 (`fully_shard`): every decoder layer of
                     the talker and of the code predictor a unit, each module the objective calls
                     outside them (embeddings, text projection, the predictor's decoder and heads)
                     one, the talker the root; a process group of this process alone (nccl on
                     cuda, gloo on the cpu), unless torchrun's RANK / WORLD_SIZE say otherwise.
                     The anchor of `voiceclone train --gpus 1` (scripts/gpu-check.sh).
--out-json FILE      also write the result JSON there (it is always printed on stdout as one line).

Per step: zero grads; build the batch tensors (not tokenization); forward; backward;
`clip_grad_norm_(trained, 1.0)` (the returned pre-clip norm is recorded); `AdamW(trained, lr,
betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)` step.  Trained = every `talker.*` parameter (talker,
text_projection, codec_head, code predictor); the speaker encoder is frozen.  No gradient accumulation,
no LR schedule.

Output (JSON): `frames_per_s` (codec frames of the timed steps / their wall time), `s_per_step` (mean,
also `s_per_step_median`), `peak_rss_mb` (`ru_maxrss` of the process, includes the model load; with
cuda also `cuda_peak_mb`), `final_loss` (the loss of the last step, computed before its update), the
per-step `losses`, `grad_norms`, `step_seconds`, `frames`, and the settings.

The Rust side (someone else's `scripts/bench/train.sh`) should run `voiceclone train` on the same model
directory, the same JSONL and the same x-vector file, batch size, steps/warm-up, lr, weight decay 0.01,
clip 1.0, fp32, the same thread count, and report frames/s and s/step; the first step's loss must match
`losses[0]` here to ~1e-5 relative (same weights, same batch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import official  # noqa: E402  (model builders and the loader shared with the fixtures)
import sft_recipe as sft  # noqa: E402  (batch builder + corrected objective)

REPO = HERE.parents[1]

# "medium": like the 0.6B in structure (talker hidden == predictor hidden, so small_to_mtp_projection is
# Identity), real vocabularies (text 151936, codec 3072, predictor 2048) and ids; small widths/depths.
MEDIUM_SPEC = dict(
    size="0b6",
    seed=3000,
    hidden=256,
    intermediate=768,
    layers=4,
    heads=4,
    kv_heads=2,
    head_dim=64,
    mrope_section=[12, 10, 10],  # sums to head_dim / 2
    text_hidden=256,
    cp_hidden=256,
    cp_intermediate=768,
    cp_layers=2,
    cp_heads=4,
    cp_kv_heads=2,
    cp_head_dim=64,
)

SENTENCES = [
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage.",
    "Four hours of steady work faced us.",
    "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.",
    "A rod is used to catch pink salmon.",
]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# --make-model / --make-data
# --------------------------------------------------------------------------------------------


def make_model(dest: Path) -> None:
    official.import_stack()
    spec = dict(MEDIUM_SPEC, speaker=official.TINY_SPEAKER)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = official.build_config_dict(spec)
    model = official.build_tts_model(spec, cfg, seed=spec["seed"], randomize=False)  # official init N(0, 0.02)
    n_params = sum(p.numel() for p in model.parameters())
    n_talker = sum(p.numel() for n, p in model.named_parameters() if n.startswith("talker."))
    official.save_bf16(model, dest / "model.safetensors")
    del model
    official.write_json(dest / "config.json", cfg)
    official.write_json(dest / "generation_config.json", official.GENERATION_CONFIG)
    official.write_json(dest / "tokenizer_config.json", official.tokenizer_config_dict())
    tiny = official.FIXTURES / "tiny-0b6"
    for f in ("vocab.json", "merges.txt", "speech_tokenizer"):
        official.link_or_copy(tiny / f, dest / f, False)
    official.verify_config_roundtrip(dest, cfg)
    _log(f"wrote {dest}: {n_params / 1e6:.2f} M parameters ({n_talker / 1e6:.2f} M trained talker.*), "
         f"model.safetensors {(dest / 'model.safetensors').stat().st_size / 1e6:.1f} MB")


def make_data(path: Path, rows: int, min_frames: int, max_frames: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with path.open("w", encoding="utf-8") as f:
        for i in range(rows):
            n_sent = rng.randint(1, 3)
            text = " ".join(rng.choice(SENTENCES) for _ in range(n_sent))
            t = rng.randint(min_frames, max_frames)
            total += t
            codes = [[rng.randrange(2048) for _ in range(16)] for _ in range(t)]
            row = dict(audio="tests/fixtures/audio/ref24k.wav", text=text, audio_codes=codes,
                       ref_audio="tests/fixtures/audio/ref24k.wav", language="english")
            f.write(json.dumps(row) + "\n")
    _log(f"wrote {path}: {rows} rows, {total} frames (audio/ref_audio are placeholders; codes are random)")


# --------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if "text" not in r or "audio_codes" not in r:
                raise SystemExit(f"{path}:{lineno}: a row needs `text` and `audio_codes`")
            rows.append(r)
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def shard_with_fsdp2(torch, talker, device: str):
    """FSDP2 over the talker (see --fsdp2): every module the objective calls is a unit of its own
    or inside one, so that FSDP's hooks gather each before it runs, and the root is a module whose
    forward is the whole objective (FSDP2 runs its root first). Returns (the objective, the
    backend)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    class Objective(torch.nn.Module):
        def __init__(self, talker):
            super().__init__()
            self.talker = talker

        def forward(self, batch, xvec):
            return sft.corrected_objective(self.talker, batch, xvec)

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group(backend, rank=int(os.environ.get("RANK", "0")),
                                world_size=int(os.environ.get("WORLD_SIZE", "1")))
    cp = talker.code_predictor
    units = [*talker.model.layers, *cp.model.layers, *cp.get_input_embeddings(), *cp.lm_head,
             talker.model.text_embedding, talker.model.codec_embedding, talker.text_projection]
    if any(True for _ in cp.small_to_mtp_projection.parameters()):
        units.append(cp.small_to_mtp_projection)
    for m in units:
        fully_shard(m)
    fully_shard(cp.model)
    root = Objective(talker)
    fully_shard(root)
    return root, backend


def bench(args) -> dict:
    torch = sft.import_stack(threads=args.threads, deterministic=False)["torch"]
    from safetensors.torch import load_file, save_file

    dtype = dict(float32=torch.float32, bfloat16=torch.bfloat16)[args.dtype]
    dev = args.device
    torch.manual_seed(0)
    t0 = time.perf_counter()
    tts = official.load_official(Path(args.model), dtype=dtype, device=dev)
    load_s = time.perf_counter() - t0
    cfg = tts.model.config
    talker = tts.model.talker
    talker.train()
    objective = lambda batch, xvec: sft.corrected_objective(talker, batch, xvec)  # noqa: E731
    fsdp = None
    if args.fsdp2:
        objective, fsdp = shard_with_fsdp2(torch, talker, dev)
    params = [p for _, p in sft.trained_parameters(tts)]
    n_trained = sum(p.numel() for p in params)

    if args.ref_xvector:
        xvec = load_file(args.ref_xvector)["speaker_embedding"].reshape(-1)
    else:
        if tts.model.speaker_encoder is None:
            raise SystemExit(f"{args.model}: no speaker encoder (not a Base model); pass --ref-xvector")
        xvec = sft.xvector_from_wav(tts, Path(args.ref_audio)).float().cpu()
    if xvec.shape[0] != cfg.talker_config.hidden_size:
        raise SystemExit(f"x-vector has {xvec.shape[0]} values, the talker hidden size is {cfg.talker_config.hidden_size}")
    if args.save_xvector:
        save_file({"speaker_embedding": xvec.float().contiguous()}, args.save_xvector)
    xvec = xvec.to(dev)

    rows = read_rows(Path(args.data))
    text_ids = [sft.tokenize_row_text(tts, r["text"]) for r in rows]
    codes = [torch.tensor(r["audio_codes"], dtype=torch.long) for r in rows]
    for i, c in enumerate(codes):
        if c.ndim != 2 or c.shape[1] != 16 or c.shape[0] == 0:
            raise SystemExit(f"{args.data}: row {i}: audio_codes must be a non-empty list of 16-int frames, got {tuple(c.shape)}")

    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    n = len(rows)
    B = args.batch_size
    total_steps = args.warmup + args.steps
    rss_loaded = rss_mb()
    _log(f"loaded {args.model} in {load_s:.1f} s ({n_trained / 1e6:.2f} M trained parameters, RSS {rss_loaded:.0f} MB); "
         f"{n} rows, batch {B}, {args.warmup} warm-up + {args.steps} timed steps, {torch.get_num_threads()} threads, "
         f"{args.dtype} on {dev}")

    def sync():
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    losses, gnorms, times, frames, seqlens = [], [], [], [], []
    for step in range(total_steps):
        idx = [(step * B + j) % n for j in range(B)]
        sync()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        batch = sft.build_batch(cfg, [text_ids[i] for i in idx], [codes[i] for i in idx])
        res = objective(batch, xvec)
        res["loss"].backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if hasattr(gn, "full_tensor"):  # FSDP2: a DTensor
            gn = gn.full_tensor()
        opt.step()
        loss = res["loss"].item()
        sync()
        dt = time.perf_counter() - t
        f = sum(int(codes[i].shape[0]) for i in idx)
        losses.append(loss)
        gnorms.append(float(gn))
        times.append(dt)
        frames.append(f)
        seqlens.append(batch["S"])
        _log(f"step {step}{' (warm-up)' if step < args.warmup else ''}: rows {idx[0]}..{idx[-1]}, {f} frames, "
             f"S {batch['S']}, loss {loss:.5f} (talker {res['loss_talker'].item():.5f}, sub {res['loss_sub'].item():.5f}), "
             f"grad norm {float(gn):.4f}, {dt:.3f} s")
    timed_t = times[args.warmup:]
    timed_f = frames[args.warmup:]
    out = dict(
        impl="official qwen-tts 0.1.1 modules (PyTorch" + (f", FSDP2 over {fsdp})" if fsdp else ")"),
        model=str(args.model),
        data=str(args.data),
        rows=n,
        batch_size=B,
        warmup=args.warmup,
        steps=args.steps,
        threads=torch.get_num_threads(),
        dtype=args.dtype,
        device=dev,
        lr=args.lr,
        weight_decay=0.01,
        clip=1.0,
        trained_parameters=n_trained,
        load_seconds=load_s,
        frames_per_s=sum(timed_f) / sum(timed_t) if timed_t else None,
        s_per_step=statistics.fmean(timed_t) if timed_t else None,
        s_per_step_median=statistics.median(timed_t) if timed_t else None,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        rss_after_load_mb=rss_loaded,
        final_loss=losses[-1],
        losses=losses,
        grad_norms=gnorms,
        step_seconds=times,
        frames=frames,
        seq_lens=seqlens,
        torch_version=torch.__version__,
    )
    if dev.startswith("cuda"):
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu"] = torch.cuda.get_device_name()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-model", metavar="DIR", help="write a random medium model (official layout) to DIR and exit")
    ap.add_argument("--make-data", metavar="JSONL", help="write synthetic training rows to JSONL and exit")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--min-frames", type=int, default=50)
    ap.add_argument("--max-frames", type=int, default=150)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", metavar="DIR")
    ap.add_argument("--data", metavar="JSONL")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--ref-xvector", metavar="FILE", help="safetensors with tensor speaker_embedding (H,)")
    g.add_argument("--ref-audio", metavar="WAV", help="24 kHz WAV for the official speaker encoder")
    ap.add_argument("--save-xvector", metavar="FILE")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fsdp2", action="store_true", help="shard the talker with PyTorch's FSDP2 (see the docstring)")
    ap.add_argument("--out-json", metavar="FILE")
    args = ap.parse_args()
    if args.make_model:
        make_model(Path(args.make_model).resolve())
        return
    if args.make_data:
        make_data(Path(args.make_data), args.rows, args.min_frames, args.max_frames, args.seed)
        return
    if not (args.model and args.data and (args.ref_xvector or args.ref_audio)):
        ap.error("the benchmark needs --model, --data and one of --ref-xvector / --ref-audio")
    if args.batch_size < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--batch-size and --steps must be >= 1, --warmup >= 0")
    with contextlib.redirect_stdout(sys.stderr):  # qwen_tts prints notices on stdout; keep it for the JSON line
        out = bench(args)
    line = json.dumps(out)
    print(line, flush=True)
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
