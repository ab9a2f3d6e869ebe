"""The official fine-tuning recipe's batch and the corrected objective (docs/model.md §10.2, §10.3), on the official modules.

What the training references (``make_train_refs.py``, ``make_lora_refs.py``), the training benchmark
(``bench_train.py``) and the checks (``check_adapter_peft.py``, ``check_export.py``) share, kept apart from
the references themselves so that each of them imports only the recipe:

* the x-vector of a reference clip as the official dataset gets it (``xvector_from_wav``);
* the batch of the official ``finetuning/dataset.py`` (``tokenize_row_text``: ``__getitem__``'s text ids;
  ``build_batch``: a re-implementation of ``collate_fn`` with lag_num -1 and right padding, with the same
  tensor names and values; the official file is not in the wheel);
* the corrected objective, i.e. the official ``sft_12hz.py`` forward with its bugs fixed
  (``embed_inputs``, ``sub_talker_logits``, ``corrected_objective``; ``trained_parameters``: every
  ``talker.*`` parameter; ``run_objective``: one evaluation with the gradients);
* ``float64_numerics``: the official RMSNorm and RoPE, which force float32, run in float64 for a
  float64 pass.

``make_train_refs.py`` documents the objective term by term.  The heavy packages are bound by
``import_stack`` (called by the scripts after parsing their arguments, so that ``--help`` works without torch).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import official  # the official stack the scripts here share

SUB_LOSS_WEIGHT = 0.3  # docs/model.md §10.3 (commit 680d4e9)
NUM_CODE_GROUPS = 16
IGNORE_INDEX = -100
SPEAKER_POS = 6  # position of the x-vector (auto-language prefix, docs/model.md §10.2)


def import_stack(threads: int = 1, deterministic: bool = True) -> dict:
    """The official stack (`official.import_stack`), bound here too (after argparse so --help works
    without it): the functions below use torch & co by their plain names. Returns the stack
    ({name: object})."""
    global np, torch, F, librosa, modeling
    s = official.import_stack(threads=threads, deterministic=deterministic)
    np, torch, F, librosa, modeling = s["np"], s["torch"], s["F"], s["librosa"], s["modeling"]
    return s


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def read_wav_24k(path: Path):
    """Exactly how the official wrappers read a path: librosa.load(sr=None) (int16 / 32768 for 16-bit PCM)."""
    audio, sr = librosa.load(str(path), sr=None, mono=True)
    if sr != 24000:
        raise SystemExit(f"{path}: {sr} Hz; the speaker encoder wants 24 kHz audio")
    return audio.astype(np.float32)


def xvector_from_wav(tts, path: Path):
    with torch.no_grad():
        return tts.model.extract_speaker_embedding(read_wav_24k(path), sr=24000).detach().clone()


# --------------------------------------------------------------------------------------------
# Batch (finetuning/dataset.py: __getitem__ + collate_fn, lag_num = -1)
# --------------------------------------------------------------------------------------------


def tokenize_row_text(tts, text: str) -> list[int]:
    """`TTSDataset.__getitem__`: tokenize(_build_assistant_text(text))[:, :-5] = role (3) + text tokens (Lt)."""
    ids = tts._tokenize_texts([tts._build_assistant_text(text)])[0].reshape(-1).tolist()
    assert ids[:3] == [151644, 77091, 198] and ids[-5:] == [151645, 198, 151644, 77091, 198], ids
    return ids[:-5]


def build_batch(cfg, text_ids: list[list[int]], codes: list) -> dict:
    """Right-padded batch exactly like the official `collate_fn` (docs/model.md §10.2).

    text_ids[b]: role + text ids (length L_b = 3 + Lt_b); codes[b]: (T_b, 16) int64 tensor.
    Returns int64 / bool tensors named like the official batch plus `codes` (B, Tmax, 16) and `layout`.
    """
    tc = cfg.talker_config
    B = len(text_ids)
    lens = [len(t) + c.shape[0] for t, c in zip(text_ids, codes)]
    S = max(lens) + 8
    t_max = max(c.shape[0] for c in codes)
    text_ch = torch.zeros((B, S), dtype=torch.long)
    codec_ch = torch.zeros((B, S), dtype=torch.long)
    codec_full = torch.zeros((B, S, NUM_CODE_GROUPS), dtype=torch.long)
    codes_pad = torch.zeros((B, t_max, NUM_CODE_GROUPS), dtype=torch.long)
    text_mask = torch.zeros((B, S), dtype=torch.bool)
    codec_emb_mask = torch.zeros((B, S), dtype=torch.bool)
    codec_mask = torch.zeros((B, S), dtype=torch.bool)
    attention_mask = torch.zeros((B, S), dtype=torch.long)
    labels = torch.full((B, S), IGNORE_INDEX, dtype=torch.long)
    layout = []
    for b, (tid, c) in enumerate(zip(text_ids, codes)):
        L = len(tid)
        Lt = L - 3
        T = c.shape[0]
        assert c.shape == (T, NUM_CODE_GROUPS) and T >= 1, c.shape
        n = 8 + L + T
        # text channel
        text_ch[b, :3] = torch.tensor(tid[:3])
        text_ch[b, 3:7] = cfg.tts_pad_token_id
        text_ch[b, 7] = cfg.tts_bos_token_id
        text_ch[b, 8 : 8 + Lt] = torch.tensor(tid[3:], dtype=torch.long)
        text_ch[b, 8 + Lt] = cfg.tts_eos_token_id
        text_ch[b, 8 + Lt + 1 : n] = cfg.tts_pad_token_id
        text_mask[b, :n] = True
        # codec channel
        codec_ch[b, 3:8] = torch.tensor([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id, 0, tc.codec_pad_id])
        codec_ch[b, 8 : 8 + Lt + 1] = tc.codec_pad_id
        codec_ch[b, 8 + Lt + 1] = tc.codec_bos_id
        f0 = 8 + Lt + 2
        codec_ch[b, f0 : f0 + T] = c[:, 0]
        codec_ch[b, f0 + T] = tc.codec_eos_token_id
        labels[b, f0 : f0 + T] = c[:, 0]
        labels[b, f0 + T] = tc.codec_eos_token_id
        codec_full[b, f0 : f0 + T] = c
        codes_pad[b, :T] = c
        codec_emb_mask[b, 3:n] = True
        codec_emb_mask[b, SPEAKER_POS] = False
        codec_mask[b, f0 : f0 + T] = True
        attention_mask[b, :n] = 1
        assert n == 8 + Lt + 3 + T
        layout.append(
            dict(
                L=L,
                Lt=Lt,
                T=T,
                seq_len=n,
                role=[0, 3],
                codec_prefix=[3, 6],
                speaker=SPEAKER_POS,
                tts_bos=7,
                text=[8, 8 + Lt],
                tts_eos=8 + Lt,
                bos=8 + Lt + 1,
                frames=[f0, f0 + T],
                eos=f0 + T,
                padding=[n, S],
                label_positions=list(range(f0, f0 + T + 1)),
                hidden_positions=list(range(f0 - 1, f0 + T)),
                sub_hidden_positions=list(range(f0 - 1, f0 - 1 + T)),
            )
        )
    return dict(
        text_ids=text_ch,
        codec_ids=codec_ch,
        codec_ids_full=codec_full,
        codes=codes_pad,
        text_mask=text_mask,
        codec_embedding_mask=codec_emb_mask,
        codec_mask=codec_mask,
        attention_mask=attention_mask,
        labels=labels,
        layout=layout,
        S=S,
    )


# --------------------------------------------------------------------------------------------
# The corrected objective
# --------------------------------------------------------------------------------------------


def embed_inputs(talker, batch: dict, xvec):
    """inputs_embeds (B, S, H) of the corrected forward (text_projection applied, x-vector at 6)."""
    dt = talker.codec_head.weight.dtype
    tm = batch["text_mask"].unsqueeze(-1).to(dt)
    cm = batch["codec_embedding_mask"].unsqueeze(-1).to(dt)
    fm = batch["codec_mask"].unsqueeze(-1).to(dt)
    text_e = talker.text_projection(talker.model.text_embedding(batch["text_ids"])) * tm
    codec_e = talker.model.codec_embedding(batch["codec_ids"]) * cm
    B, S, H = codec_e.shape
    spk = torch.zeros((B, S, H), dtype=dt, device=codec_e.device)
    spk[:, SPEAKER_POS] = xvec.to(dt).reshape(-1, H).expand(B, H)
    E = text_e + (codec_e + spk)
    full = batch["codec_ids_full"]
    cp_emb = talker.code_predictor.get_input_embeddings()
    for i in range(1, NUM_CODE_GROUPS):
        E = E + cp_emb[i - 1](full[:, :, i]) * fm
    return E


def sub_talker_logits(talker, codes, hidden):
    """`forward_sub_talker_finetune` without its (shifted) loss: (N, 16) codes, (N, H) hiddens -> (N, 15, 2048)."""
    embeds = [hidden.unsqueeze(1)]
    for i in range(NUM_CODE_GROUPS - 1):
        if i == 0:
            embeds.append(talker.get_input_embeddings()(codes[:, :1]))
        else:
            embeds.append(talker.code_predictor.get_input_embeddings()[i - 1](codes[:, i : i + 1]))
    embeds = torch.cat(embeds, dim=1)
    return talker.code_predictor.forward_finetune(inputs_embeds=embeds, labels=None, use_cache=False).logits


def _ce(logits, targets, ignore_index=IGNORE_INDEX, reduction="mean"):
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()  # like transformers' ForCausalLMLoss
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


def corrected_objective(talker, batch: dict, xvec, keep: bool = False) -> dict:
    """L = L_talker + 0.3 L_sub (docs/model.md §10.3, corrected).  Returns the loss tensors (graph attached)."""
    dev = talker.codec_head.weight.device
    b = {k: (v.to(dev) if hasattr(v, "to") else v) for k, v in batch.items()}
    E = embed_inputs(talker, b, xvec.to(dev))
    out = talker(
        inputs_embeds=E[:, :-1],
        attention_mask=b["attention_mask"][:, :-1],
        use_cache=False,
        output_hidden_states=True,
    )
    H = out.hidden_states[0][-1]  # final-norm hidden (B, S-1, H)
    logits = out.logits  # (B, S-1, 3072)
    targets = b["labels"][:, 1:]
    V = logits.shape[-1]
    loss_talker = _ce(logits.reshape(-1, V), targets.reshape(-1))
    sel = b["codec_mask"][:, 1:]  # hidden positions p_k (predicted code 0 of frame k)
    h_sub = H[sel]
    codes_sub = b["codec_ids_full"][b["codec_mask"]]
    sub_logits = sub_talker_logits(talker, codes_sub, h_sub)
    Vs = sub_logits.shape[-1]
    loss_sub = _ce(sub_logits.reshape(-1, Vs), codes_sub[:, 1:].reshape(-1))
    loss = loss_talker + SUB_LOSS_WEIGHT * loss_sub
    res = dict(loss=loss, loss_talker=loss_talker, loss_sub=loss_sub, n_frames=int(sel.sum()))
    if keep:
        res.update(
            E=E,
            H=H,
            logits=logits,
            targets=targets,
            h_sub=h_sub,
            codes_sub=codes_sub,
            sub_logits=sub_logits,
            ce_talker=_ce(logits.reshape(-1, V), targets.reshape(-1), reduction="none").reshape(targets.shape),
            ce_sub=_ce(sub_logits.reshape(-1, Vs), codes_sub[:, 1:].reshape(-1), reduction="none").reshape(-1, 15),
        )
    return res


def trained_parameters(tts) -> list:
    """(name, parameter) of every trained parameter: all of `talker.*` (speaker encoder frozen)."""
    out = []
    for name, p in tts.model.named_parameters():
        if name.startswith("talker."):
            p.requires_grad_(True)
            out.append((name, p))
        else:
            p.requires_grad_(False)
    return out


# --------------------------------------------------------------------------------------------
# float64 pass: the official RMSNorm and RoPE force float32; run them in float64 instead
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def float64_numerics(talker):
    saved = {}

    def rms_forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def inv_freq64(mod):
        cfg = mod.config
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def talker_rope_forward(self, x, position_ids):
        inv = inv_freq64(self)[None, None, :, None].expand(3, position_ids.shape[1], -1, 1)
        pos = position_ids[:, :, None, :].to(torch.float64)
        freqs = (inv @ pos).transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def rope_forward(self, x, position_ids):
        inv = inv_freq64(self)[None, :, None].expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].to(torch.float64)
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    patches = [
        (modeling.Qwen3TTSRMSNorm, "forward", rms_forward),
        (modeling.Qwen3TTSTalkerRotaryEmbedding, "forward", talker_rope_forward),
        (modeling.Qwen3TTSRotaryEmbedding, "forward", rope_forward),
    ]
    for cls, name, fn in patches:
        saved[(cls, name)] = cls.__dict__[name]
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)


# --------------------------------------------------------------------------------------------
# One evaluation with gradients
# --------------------------------------------------------------------------------------------


def run_objective(tts, params, batch, xvec) -> tuple[dict, dict]:
    """Grads cleared, the corrected objective (`keep=True`), backward: returns the detached results and
    {name: gradient} of `params` (zeros for a parameter that got no gradient)."""
    talker = tts.model.talker
    for _, p in params:
        p.grad = None
    res = corrected_objective(talker, batch, xvec, keep=True)
    res["loss"].backward()
    res = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in res.items()}
    grads = {}
    for name, p in params:
        grads[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    return res, grads
