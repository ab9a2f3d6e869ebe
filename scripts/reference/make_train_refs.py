#!/usr/bin/env python3
"""Reference values of the corrected fine-tuning objective (docs/model.md §10.3) computed with the official modules.

What it writes (for each committed fixture model ``tests/fixtures/<model>``, ``<model>`` = ``tiny-0b6``,
``tiny-1b7``)::

    tests/fixtures/refs/<model>.train.json          texts, rows, layout, losses, grad norms, f64 check
    tests/fixtures/refs/<model>.train.safetensors   the batch tensors, inputs_embeds, losses, a few grads

``tests/fixtures/README.md`` (section *Training references*) documents every key.

How
---
* Loads the directory with the official loader, ``Qwen3TTSModel.from_pretrained(dir, dtype=torch.float32,
  device_map="cpu")`` (attention ``sdpa``), one thread, deterministic algorithms.
* x-vector: ``model.extract_speaker_embedding`` (the official speaker encoder, frozen) on
  ``tests/fixtures/audio/ref24k.wav`` read as ``librosa.load(sr=None)`` (int16 / 32768), detached.
* A fixed batch of 2 raw rows (``FIXTURE_ROWS``: text + synthetic codes, ``torch.randint`` with a fixed
  seed) goes through the official dataset's path: ``_tokenize_texts(_build_assistant_text(text))[:, :-5]``
  and a re-implementation of ``finetuning/dataset.py::collate_fn`` (lag_num -1, right padding; the
  official file is not in the wheel; its code is reproduced in ``build_batch`` with the same tensor
  names and values).
* The corrected objective (``corrected_objective``), i.e. the official ``sft_12hz.py`` forward with its
  bugs fixed (docs/model.md §10.3):
    - ``E = text_projection(text_embedding(text_ids)) * text_mask + codec_embedding(codec_ids) *
      codec_embedding_mask``; ``E[:, 6] += x-vector`` (the codec part of position 6 is masked, so
      position 6 = ``tts_pad_e + x-vector``, exactly the inference prompt, docs/model.md §6);
      ``E += Σ_{i=1..15} cp.codec_embedding[i-1](codes_i) * codec_mask`` (frame positions);
    - ``talker(inputs_embeds=E[:, :-1], attention_mask=attention_mask[:, :-1])`` (the official
      ``Qwen3TTSTalkerForConditionalGeneration.forward``, prefill path; positions from the mask = 0..n-1),
      final-norm hidden ``H``, ``logits = codec_head(H)``;
    - ``L_talker`` = mean cross-entropy over every label of the batch, hidden at p predicts
      ``labels[p+1]`` (single shift);
    - ``L_sub``: for every frame (b, k) the hidden that *predicted* its code 0 (``H[b, p_k]``,
      ``p_k`` = frame position − 1, i.e. ``codec_mask[:, 1:]``), predictor input
      ``[H[p_k], codec_embedding(c0), cp_emb[0](c1) … cp_emb[13](c14)]`` → ``small_to_mtp_projection``
      → predictor → ``lm_head[j]`` at position j+1 (the internals of the official
      ``forward_sub_talker_finetune`` / ``code_predictor.forward_finetune`` without their shifted loss);
      ``L_sub`` = mean over all frames of the batch and j = 0..14 of CE(logits_j, c_{j+1});
    - ``L = L_talker + 0.3 * L_sub``; backward; gradients of every ``talker.*`` parameter.
* Cross-checks (asserted): the embedding prefix equals the prompt the official ``generate`` builds for
  x-vector-only voice cloning, ``language="Auto"``, ``non_streaming_mode=True`` (layout B, docs/model.md §6) up to
  and including the bos position; the sub-talker logits equal ``forward_sub_talker_finetune``'s.
* The same objective in float64 (``talker.double()``; RMSNorm and RoPE, which the official code forces to
  float32, patched to run in float64 for that pass only) gives the f32-vs-f64 agreement recorded in the JSON.

Usage (from the repository root; the reference environment of ``scripts/reference/setup_venv.sh``)::

    .reference-venv/bin/python scripts/reference/make_train_refs.py            # both models
    .reference-venv/bin/python scripts/reference/make_train_refs.py --models tiny-1b7

Re-run it whenever ``scripts/reference/make_fixtures.py`` regenerates the fixture weights; with the same package
versions the output is bit-for-bit reproducible.  The batch builder, the objective and the float64 patch
are in ``scripts/reference/sft_recipe.py`` beside this script (what ``bench_train.py``, ``make_lora_refs.py``
and the checks import too); this script keeps the fixture batch, the cross-checks and the recording.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys

from official import FIXTURES, load_official
import sft_recipe as sft  # the official recipe's batch and the corrected objective, shared with the benchmarks and checks
from sft_recipe import (
    IGNORE_INDEX,
    NUM_CODE_GROUPS,
    SUB_LOSS_WEIGHT,
    build_batch,
    corrected_objective,
    float64_numerics,
    run_objective,
    tokenize_row_text,
    trained_parameters,
    xvector_from_wav,
)

REFS = FIXTURES / "refs"
REF_WAV = FIXTURES / "audio" / "ref24k.wav"
MODELS = ["tiny-0b6", "tiny-1b7"]

CODES_SEED = 4242

# The fixture batch: two rows of different text lengths and frame counts; row 0 ends up shorter
# (11 + 3 + 7 = 21 positions) than row 1 (11 + 8 + 4 = 23), so it is right-padded by 2.
FIXTURE_TEXTS = ["Hello world.", "Hi there, this is a batch."]
FIXTURE_FRAMES = [7, 4]
# Paths relative to tests/fixtures/.  `audio` is not read when `audio_codes` is present (the codes are
# synthetic, not the encoding of that file); `language` is read but never used by the official dataset
# (the layout always has the auto-language prefix).
ROW_AUDIO = "audio/ref24k.wav"
ROW_REF_AUDIO = "audio/ref24k.wav"
ROW_LANGUAGE = "english"

# A short optimisation trajectory (checks the optimizer: AdamW as torch implements it, global-norm clipping).
TRAIN_STEPS = 3
TRAIN_LR = 1e-3  # large enough that the updates show in float32
ADAMW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP_NORM = 1.0
TRAIN_DELTA_KEYS = [
    "talker.codec_head.weight",
    "talker.text_projection.linear_fc2.weight",
    "talker.model.norm.weight",
    "talker.model.layers.1.mlp.down_proj.weight",
    "talker.code_predictor.model.layers.1.mlp.gate_proj.weight",
]

# Every float tensor recorded is float32; `GRAD_KEYS` grads are stored in full.
GRAD_KEYS = [
    "talker.codec_head.weight",
    "talker.text_projection.linear_fc1.weight",
    "talker.text_projection.linear_fc2.weight",
    "talker.text_projection.linear_fc2.bias",
    "talker.model.norm.weight",
    "talker.model.layers.0.self_attn.q_proj.weight",
    "talker.model.layers.0.input_layernorm.weight",
    "talker.code_predictor.lm_head.0.weight",
    "talker.code_predictor.model.layers.0.self_attn.k_proj.weight",
    "talker.code_predictor.model.norm.weight",
    "talker.code_predictor.small_to_mtp_projection.weight",  # tiny-1b7 only
    "talker.code_predictor.small_to_mtp_projection.bias",  # tiny-1b7 only
]
# Embedding tables: only the rows the batch touches are stored (ids + rows).
GRAD_ROW_KEYS = {
    "talker.model.text_embedding.weight": "text",
    "talker.model.codec_embedding.weight": "codec",
    "talker.code_predictor.model.codec_embedding.0.weight": "cp0",
    "talker.code_predictor.model.codec_embedding.14.weight": "cp14",
}

REDUCTIONS = {
    "loss_talker": (
        "sum over every label of the batch (all rows, every frame position and the EOS position) of "
        "CE(codec_head(H[b, p]), labels[b, p + 1]) divided by the number of labels N_talker = Σ_b (T_b + 1); "
        "H = final-norm hidden of the talker run on inputs_embeds[:, :S-1]; CE = -log_softmax over the "
        "3072 codec logits (no suppression, no label smoothing)"
    ),
    "loss_sub": (
        "sum over every frame (b, k) of the batch and j = 0..14 of CE(lm_head[j](P_{b,k}[j + 1]), "
        "codes[b, k, j + 1]) divided by N_sub = 15 · Σ_b T_b; P_{b,k} = code-predictor final-norm output of "
        "the 16-position causal pass over small_to_mtp_projection([H[b, p_k], codec_embedding(codes[b,k,0]), "
        "cp.codec_embedding[0](codes[b,k,1]), …, cp.codec_embedding[13](codes[b,k,14])]), positions 0..15, "
        "p_k = 8 + Lt_b + 1 + k"
    ),
    "loss": "loss_talker + 0.3 · loss_sub (one scalar for the whole batch; no per-sample averaging)",
    "grad_norm": (
        "sqrt(Σ over every trained parameter of Σ grad²) of d loss / d θ, before any clipping; trained "
        "parameters = every talker.* parameter (trained_parameters); accumulated in float64 from the "
        "float32 gradients"
    ),
    "grad_norms": "per-parameter sqrt(Σ grad²), float64 accumulation of the float32 gradient",
}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def import_stack(threads: int = 1, deterministic: bool = True) -> dict:
    """The official stack (`sft_recipe.import_stack`, which binds it there), bound here too (after argparse
    so --help works without it): the functions below use torch by its plain name. Returns the stack
    ({name: object})."""
    global torch, safetensors_save
    s = sft.import_stack(threads=threads, deterministic=deterministic)
    torch, safetensors_save = s["torch"], s["safetensors_save"]
    return s


# --------------------------------------------------------------------------------------------
# Cross-check: the prompt prefix equals the official inference prompt (layout B, language auto)
# --------------------------------------------------------------------------------------------


class _StopGenerate(Exception):
    pass


def official_prompt_embeds(tts, text: str, xvec):
    """inputs_embeds the official `generate` passes to `talker.generate` for x-vector-only voice cloning,
    language Auto, non_streaming_mode=True (the SFT layout)."""
    captured = {}
    talker = tts.model.talker

    def fake_generate(*args, **kwargs):
        captured.update(kwargs)
        raise _StopGenerate()

    talker.generate = fake_generate
    try:
        input_ids = tts._tokenize_texts([tts._build_assistant_text(text)])
        prompt = dict(ref_code=[None], ref_spk_embedding=[xvec], x_vector_only_mode=[True], icl_mode=[False])
        with contextlib.suppress(_StopGenerate):
            tts.model.generate(input_ids=input_ids, voice_clone_prompt=prompt, languages=["Auto"], non_streaming_mode=True)
    finally:
        del talker.generate
    return captured["inputs_embeds"][0].detach()


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def fixture_codes() -> list:
    gen = torch.Generator().manual_seed(CODES_SEED)
    return [torch.randint(0, 2048, (t, NUM_CODE_GROUPS), generator=gen, dtype=torch.long) for t in FIXTURE_FRAMES]


def fixture_rows(codes) -> list[dict]:
    return [
        dict(audio=ROW_AUDIO, text=t, audio_codes=c.tolist(), ref_audio=ROW_REF_AUDIO, language=ROW_LANGUAGE)
        for t, c in zip(FIXTURE_TEXTS, codes)
    ]


def looked_up_rows(batch: dict, kind: str):
    """Sorted ids of the embedding rows the batch looks up under a non-zero mask (the rows stored in
    grad_rows.*); every other row's gradient is exactly 0."""
    if kind == "text":
        ids = batch["text_ids"][batch["text_mask"]]
    elif kind == "codec":
        ids = batch["codec_ids"][batch["codec_embedding_mask"]]
    else:  # cp<i>: cp.codec_embedding[i] embeds code group i + 1 of every frame
        i = int(kind[2:])
        ids = batch["codec_ids_full"][batch["codec_mask"]][:, i + 1]
    return torch.unique(ids)


def _gnorm(g) -> float:
    return float(g.detach().double().pow(2).sum().sqrt())


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def train_trajectory(tts, batch, xvec, f64: bool) -> dict:
    """TRAIN_STEPS optimizer steps on the fixture batch: loss, backward, clip_grad_norm_(1.0), AdamW step."""
    talker = tts.model.talker
    params = trained_parameters(tts)
    dtype = torch.float64 if f64 else torch.float32
    talker.to(dtype)
    init = {n: p.detach().clone() for n, p in params}
    opt = torch.optim.AdamW([p for _, p in params], lr=TRAIN_LR, **ADAMW)
    losses, gnorms = [], []
    with float64_numerics(talker) if f64 else contextlib.nullcontext():
        for _ in range(TRAIN_STEPS):
            opt.zero_grad(set_to_none=True)
            res = corrected_objective(talker, batch, xvec.to(dtype))
            res["loss"].backward()
            gnorms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in params], CLIP_NORM)))
            opt.step()
            losses.append(res["loss"].item())
        with torch.no_grad():
            loss_after = corrected_objective(talker, batch, xvec.to(dtype))["loss"].item()
    deltas = {n: (p.detach() - init[n]) for n, p in params}
    return dict(losses=losses, grad_norms_preclip=gnorms, loss_after=loss_after, deltas=deltas)


def ref_model(name: str) -> None:
    model_dir = FIXTURES / name
    _log(f"{name}: loading {model_dir}")
    tts = load_official(model_dir)
    cfg = tts.model.config
    talker = tts.model.talker
    talker.train()
    for m in talker.modules():
        assert not (isinstance(m, torch.nn.Dropout) and m.p > 0), m
    assert cfg.talker_config.attention_dropout == 0 and cfg.talker_config.code_predictor_config.attention_dropout == 0
    params = trained_parameters(tts)
    param_names = [n for n, _ in params]
    attn_impl = tts.model.config._attn_implementation

    torch.manual_seed(0)
    xvec = xvector_from_wav(tts, REF_WAV)
    codes = fixture_codes()
    rows = fixture_rows(codes)
    text_ids = [tokenize_row_text(tts, r["text"]) for r in rows]
    row_codes = [torch.tensor(r["audio_codes"], dtype=torch.long) for r in rows]
    batch = build_batch(cfg, text_ids, row_codes)
    B, S = batch["text_ids"].shape
    xvecs = xvec.reshape(1, -1).expand(B, -1).contiguous()

    # ---- float32 (the reference) ----
    res, grads = run_objective(tts, params, batch, xvec)
    loss = res["loss"].item()
    loss_t = res["loss_talker"].item()
    loss_s = res["loss_sub"].item()
    grad_norms = {n: _gnorm(g) for n, g in grads.items()}
    grad_norm = float(sum(v * v for v in grad_norms.values()) ** 0.5)
    zero_grad = [n for n, v in grad_norms.items() if v == 0.0]
    _log(f"{name}: f32 loss {loss:.8g} (talker {loss_t:.8g}, sub {loss_s:.8g}), grad norm {grad_norm:.8g}")

    # sanity: reductions by hand
    n_lab = sum(l["T"] + 1 for l in batch["layout"])
    n_fr = sum(l["T"] for l in batch["layout"])
    ce_t = res["ce_talker"].detach()
    assert int((res["targets"] != IGNORE_INDEX).sum()) == n_lab
    assert abs(float(ce_t.sum()) / n_lab - loss_t) <= 1e-6 * abs(loss_t)
    assert abs(float(res["ce_sub"].detach().sum()) / (15 * n_fr) - loss_s) <= 1e-6 * abs(loss_s)
    for b, l in enumerate(batch["layout"]):
        tg = res["targets"][b]
        assert tg[l["hidden_positions"]].tolist() == row_codes[b][:, 0].tolist() + [cfg.talker_config.codec_eos_token_id]
        assert (tg != IGNORE_INDEX).nonzero().reshape(-1).tolist() == l["hidden_positions"]

    with torch.no_grad():
        # the official forward_sub_talker_finetune gives the same logits
        off_logits, _ = talker.forward_sub_talker_finetune(res["codes_sub"], res["h_sub"])
        d_sub = float((off_logits - res["sub_logits"]).abs().max())
        assert d_sub <= 1e-5, d_sub
        # the talker model alone (no get_rope_index) gives the same hidden at every real position
        H2 = talker.model(inputs_embeds=res["E"][:, :-1], attention_mask=batch["attention_mask"][:, :-1], use_cache=False).last_hidden_state
        am = batch["attention_mask"][:, :-1].bool()
        d_h = float((H2 - res["H"])[am].abs().max())
        assert d_h <= 1e-5, d_h
        # the embedding prefix is the official inference prompt (layout B, language auto)
        prompt_diffs = []
        for b, l in enumerate(batch["layout"]):
            pe = official_prompt_embeds(tts, FIXTURE_TEXTS[b], xvec)
            n_prompt = l["bos"] + 1
            assert pe.shape[0] == n_prompt, (pe.shape, n_prompt)
            d = float((pe - res["E"][b, :n_prompt]).abs().max())
            prompt_diffs.append(d)
            assert d <= 1e-5 * max(1.0, float(pe.abs().max())), (b, d)

    # ---- float64 ----
    talker.double()
    with float64_numerics(talker):
        res64, grads64 = run_objective(tts, params, batch, xvec.double())
    talker.float()
    gn64 = {n: _gnorm(g) for n, g in grads64.items()}
    grad_norm64 = float(sum(v * v for v in gn64.values()) ** 0.5)
    rel_param = {n: _rel(grad_norms[n], gn64[n]) for n in param_names if gn64[n] > 0}
    worst_param = max(rel_param, key=rel_param.get)
    max_abs_grad_diff = {n: float((grads[n].double() - grads64[n]).abs().max()) for n in param_names}
    f64 = dict(
        how="talker.double(), the official RMSNorm / RoPE (which force float32) patched to run in float64, "
        "same x-vector (the float32 one), same batch",
        loss=res64["loss"].item(),
        loss_talker=res64["loss_talker"].item(),
        loss_sub=res64["loss_sub"].item(),
        grad_norm=grad_norm64,
        rel_diff_loss=_rel(loss, res64["loss"].item()),
        rel_diff_loss_talker=_rel(loss_t, res64["loss_talker"].item()),
        rel_diff_loss_sub=_rel(loss_s, res64["loss_sub"].item()),
        rel_diff_grad_norm=_rel(grad_norm, grad_norm64),
        max_rel_diff_param_grad_norm=rel_param[worst_param],
        max_rel_diff_param_grad_norm_at=worst_param,
        max_abs_diff_inputs_embeds=float((res["E"].double() - res64["E"]).abs().max()),
        max_abs_diff_talker_logits=float((res["logits"].double() - res64["logits"]).abs().max()),
        max_abs_diff_sub_logits=float((res["sub_logits"].double() - res64["sub_logits"]).abs().max()),
        max_abs_diff_grad=max(max_abs_grad_diff.values()),
        max_abs_diff_grad_at=max(max_abs_grad_diff, key=max_abs_grad_diff.get),
        max_abs_grad=max(float(g.abs().max()) for g in grads.values()),
        grad_norms=gn64,
    )
    _log(
        f"{name}: f64 loss {f64['loss']:.10g}, grad norm {grad_norm64:.10g}; f32 rel diff loss "
        f"{f64['rel_diff_loss']:.2e}, grad norm {f64['rel_diff_grad_norm']:.2e}, worst param grad norm "
        f"{f64['max_rel_diff_param_grad_norm']:.2e} ({worst_param})"
    )
    assert f64["rel_diff_loss"] < 1e-6 and f64["rel_diff_grad_norm"] < 1e-5, f64

    # ---- a short optimisation trajectory, float32 and float64 (fresh weights each) ----
    del tts
    tr32 = train_trajectory(load_official(model_dir), batch, xvec, f64=False)
    tr64 = train_trajectory(load_official(model_dir), batch, xvec, f64=True)
    dn32 = {n: _gnorm(d) for n, d in tr32["deltas"].items()}
    dn64 = {n: _gnorm(d) for n, d in tr64["deltas"].items()}
    rel_dn = {n: _rel(dn32[n], dn64[n]) for n in dn32 if dn64[n] > 0}
    worst_dn = max(rel_dn, key=rel_dn.get)
    dd = {n: float((tr32["deltas"][n].double() - tr64["deltas"][n]).abs().max()) for n in dn32}
    train_steps = dict(
        how=f"{TRAIN_STEPS} steps on this batch from the fixture weights: zero grads; loss (the objective above); "
        f"backward; torch.nn.utils.clip_grad_norm_(trained, {CLIP_NORM}) (global L2 norm over every trained "
        "parameter; grads scaled by clip/(norm+1e-6) when norm > clip); torch.optim.AdamW(trained, "
        f"lr={TRAIN_LR}, betas={ADAMW['betas']}, eps={ADAMW['eps']}, weight_decay={ADAMW['weight_decay']}) step "
        "(p -= lr·wd·p; m = β1 m + (1-β1) g; v = β2 v + (1-β2) g²; p -= (lr / (1-β1^t)) · m / (sqrt(v)/sqrt(1-β2^t) + eps))",
        steps=TRAIN_STEPS,
        lr=TRAIN_LR,
        betas=list(ADAMW["betas"]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
        clip=CLIP_NORM,
        losses=tr32["losses"],
        losses_note="losses[t] = loss before update t (losses[0] = loss above)",
        grad_norms_preclip=tr32["grad_norms_preclip"],
        loss_after=tr32["loss_after"],
        loss_after_note=f"loss after the {TRAIN_STEPS} updates",
        delta_norms=dn32,
        delta_norms_note=f"per-parameter sqrt(Σ (θ_after - θ_before)²) after the {TRAIN_STEPS} updates",
        delta_tensors=[k for k in TRAIN_DELTA_KEYS if k in tr32["deltas"]],
        float64=dict(
            losses=tr64["losses"],
            loss_after=tr64["loss_after"],
            grad_norms_preclip=tr64["grad_norms_preclip"],
            rel_diff_loss_after=_rel(tr32["loss_after"], tr64["loss_after"]),
            max_rel_diff_grad_norm_preclip=max(_rel(a, b) for a, b in zip(tr32["grad_norms_preclip"], tr64["grad_norms_preclip"])),
            max_rel_diff_delta_norm=rel_dn[worst_dn],
            max_rel_diff_delta_norm_at=worst_dn,
            max_abs_diff_delta=max(dd.values()),
            max_abs_diff_delta_at=max(dd, key=dd.get),
            delta_tensors_max_abs_diff={k: dd[k] for k in TRAIN_DELTA_KEYS if k in dd},
        ),
    )
    assert tr32["losses"][0] == loss, (tr32["losses"][0], loss)
    _log(
        f"{name}: {TRAIN_STEPS} AdamW steps: losses {tr32['losses']} -> {tr32['loss_after']:.8g}; f64 rel diff "
        f"{train_steps['float64']['rel_diff_loss_after']:.2e}, worst delta norm {rel_dn[worst_dn]:.2e} ({worst_dn})"
    )

    # ---- tensors ----
    t = {
        "batch.text_ids": batch["text_ids"],
        "batch.codec_ids": batch["codec_ids"],
        "batch.text_mask": batch["text_mask"].to(torch.int64),
        "batch.codec_embedding_mask": batch["codec_embedding_mask"].to(torch.int64),
        "batch.codec_mask": batch["codec_mask"].to(torch.int64),
        "batch.attention_mask": batch["attention_mask"],
        "batch.codes": batch["codes"],
        "batch.labels": batch["labels"],
        "batch.xvector": xvecs.float(),
        "inputs_embeds": res["E"].detach().float(),
        "hidden": res["H"].detach().float(),
        "loss": res["loss"].detach().float().reshape(()),
        "loss_talker": res["loss_talker"].detach().float().reshape(()),
        "loss_sub": res["loss_sub"].detach().float().reshape(()),
        "loss_talker.per_label": ce_t.float(),
        "loss_sub.per_term": res["ce_sub"].detach().float(),
        "grad_norm": torch.tensor(grad_norm, dtype=torch.float32),
    }
    grad_keys = [k for k in GRAD_KEYS if k in grads]
    for k in grad_keys:
        t[f"grad.{k}"] = grads[k].float()
    row_ids = {}
    for k, kind in GRAD_ROW_KEYS.items():
        g = grads[k]
        ids = looked_up_rows(batch, kind)
        rest = torch.ones(g.shape[0], dtype=torch.bool)
        rest[ids] = False
        assert not bool(g[rest].any()), f"{k}: rows the batch never looks up have a gradient"
        t[f"grad_rows.{k}.ids"] = ids.to(torch.int64)
        t[f"grad_rows.{k}"] = g[ids].float()
        row_ids[k] = dict(rows=len(ids), zero_rows=[int(i) for i in ids if not bool(g[i].any())])
    for k in train_steps["delta_tensors"]:
        t[f"train_steps.delta.{k}"] = tr32["deltas"][k].float()
    t = {k: v.contiguous() for k, v in t.items()}
    safetensors_save(t, str(REFS / f"{name}.train.safetensors"), metadata={"format": "pt"})

    model_sha = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    meta = dict(
        model=name,
        model_safetensors_sha256=model_sha,
        loaded_with='Qwen3TTSModel.from_pretrained(dir, dtype=torch.float32, device_map="cpu")',
        attn_implementation=attn_impl,
        torch_threads=1,
        deterministic_algorithms=True,
        objective="corrected SFT objective, docs/model.md §10.3 / docs/training.md §2.1: L = L_talker + 0.3 · L_sub",
        sub_loss_weight=SUB_LOSS_WEIGHT,
        reductions=REDUCTIONS,
        xvector=dict(
            source="model.extract_speaker_embedding(librosa.load('audio/ref24k.wav', sr=None), sr=24000), float32, detached",
            note="both rows use the same x-vector (one reference clip, as the official README recommends); batch.xvector repeats it per row",
        ),
        texts=FIXTURE_TEXTS,
        rows=rows,
        rows_note=(
            "the raw JSONL rows (one object per line) that produce this batch, in order; paths relative to "
            "tests/fixtures/; `audio` is not read (audio_codes given; the codes are synthetic: torch.randint(0, 2048, "
            f"(T, 16), generator=torch.Generator().manual_seed({CODES_SEED})) for T = {FIXTURE_FRAMES} in turn); "
            "`language` is read but ignored by the official dataset (auto-language prefix always); `ref_audio` gives the x-vector"
        ),
        text_ids=text_ids,
        text_ids_note="official processor ids of `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`, last 5 dropped: role (3) + text (Lt)",
        T=[l["T"] for l in batch["layout"]],
        Lt=[l["Lt"] for l in batch["layout"]],
        seq_lens=[l["seq_len"] for l in batch["layout"]],
        S=S,
        talker_input_len=S - 1,
        n_labels=n_lab,
        n_frames=n_fr,
        loss=loss,
        loss_talker=loss_t,
        loss_sub=loss_s,
        grad_norm=grad_norm,
        trained_parameters=param_names,
        n_trained_parameters=int(sum(p.numel() for _, p in params)),
        frozen="speaker_encoder.* (x-vector detached); the codec is not part of the model",
        grad_norms=grad_norms,
        zero_grad_parameters=zero_grad,
        grad_tensors=grad_keys,
        grad_row_tensors=row_ids,
        float64=f64,
        train_steps=train_steps,
        checks=dict(
            prompt_prefix_max_abs_diff=prompt_diffs,
            prompt_prefix_note="E[b, :bos+1] vs the inputs_embeds of the official generate() for x-vector-only cloning, "
            "language Auto, non_streaming_mode=True (layout B, docs/model.md §6)",
            sub_logits_vs_forward_sub_talker_finetune=d_sub,
            hidden_talker_model_vs_talker_forward=d_h,
        ),
        layout=dict(
            description=(
                "per sample b (0-based positions): 0..2 role tokens (text channel only); 3,4,5 tts_pad + codec "
                "nothink 2155 / think_bos 2156 / think_eos 2157; 6 tts_pad + x-vector (codec channel masked, the "
                "x-vector is added instead); 7 tts_bos + codec pad 2148; 8..8+Lt-1 text tokens + codec pad; 8+Lt "
                "tts_eos + codec pad; 8+Lt+1 tts_pad + codec bos 2149; 8+Lt+2+k (k < T) tts_pad + frame k "
                "(codec_embedding(code0) + Σ_{i=1..15} cp.codec_embedding[i-1](code_i)); 8+Lt+2+T tts_pad + codec "
                "eos 2150; seq_len = 11+Lt+T; then right padding (every channel masked, inputs_embeds 0) to "
                "S = max seq_len; the talker runs on positions 0..S-2"
            ),
            labels="batch.labels[b, p] = the codec id input at p for the T frame positions (code 0) and the eos position "
            "(2150), -100 elsewhere (official collate convention); the hidden at p is trained on labels[b, p+1]",
            codec_ids="codec channel ids; 0 where the codec channel is masked (positions 0..2, 6, padding), like the official collate",
            text_ids="text channel ids; 0 on padding (text_mask 0)",
            masks="int64 0/1: text_mask = text channel present (0..seq_len-1); codec_embedding_mask = codec channel "
            "present (3..seq_len-1 except 6); codec_mask = frame positions (8+Lt+2 .. 8+Lt+2+T-1); attention_mask = 0..seq_len-1",
            codes="batch.codes[b, k] = the 16 codes of frame k (k < T_b), 0 beyond T_b",
            samples=batch["layout"],
        ),
        tensors={k: dict(shape=list(v.shape), dtype=str(v.dtype).replace("torch.", "")) for k, v in sorted(t.items())},
    )
    (REFS / f"{name}.train.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    _log(f"{name}: wrote refs/{name}.train.json, refs/{name}.train.safetensors")
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    args = ap.parse_args()
    import_stack()
    REFS.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in args.models:
        m = ref_model(name)
        summary[name] = dict(
            loss=m["loss"],
            loss_talker=m["loss_talker"],
            loss_sub=m["loss_sub"],
            grad_norm=m["grad_norm"],
            f64_rel_diff_loss=m["float64"]["rel_diff_loss"],
            f64_rel_diff_grad_norm=m["float64"]["rel_diff_grad_norm"],
            f64_max_rel_diff_param_grad_norm=m["float64"]["max_rel_diff_param_grad_norm"],
        )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
