"""Speak references of the fixtures (``refs/<model>.speak.*``) and the EOS calibration they rely on.

* The speak cases (``SPEAK_CASES``; ``CUSTOM_CASES`` for the CustomVoice fixture): greedy
  ``generate_voice_clone`` / ``generate_custom_voice`` calls through the official wrappers
  (``speak_call``).
* Capture and replay: forward hooks on the talker and the code predictor during a generate call
  (``_Capture``, ``_SpeakCapture``); the official logits processors replayed on the captured logits
  (``_replay_speak_talker``), so that every greedy decision is checked and its top-1/top-2 margin
  (``_margin``) is known; ``ref_speak`` records codes, waveforms, prompts, frame counts and EOS steps
  and checks the prompt layout (docs/model.md §6) and the frame / EOS bookkeeping (docs/model.md §7,
  docs/model.md §14).
* EOS calibration: with random weights the talker never picks EOS, so its ``codec_head`` row is chosen
  from EOS-free probe runs (``probe_speak``) such that some cases stop by EOS and others run to
  ``max_new_tokens`` (``reppen_candidates``, ``_predict_eos``, ``calibrate_eos``, ``set_eos_row``).

Used by ``make_fixtures.py`` (which also records its talker references with ``_Capture``); the heavy
packages are bound by ``bind_stack`` after argument parsing.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from fixture_audio import AUDIO_WAV
from official import FIXTURES, NUM_CODE_GROUPS, write_json
from official import log as _log

REFS = FIXTURES / "refs"

MARGIN_MIN = 0.05  # required top-1/top-2 gap of every greedy decision recorded (logit units)

# Speak references (refs/<model>.speak.*): greedy `generate_voice_clone` / `generate_custom_voice`.
SPEAK_REF_TEXT = "The birch canoe slid on the smooth planks."  # what ref24k.wav says (ICL ref_text)
SPEAK_TEXT = "Good morning, everyone."
SPEAK_SHORT_TEXT = "Hi!"
SPEAK_LONG_TEXT = (
    "Four hours of steady work faced us. The wide road shimmered in the hot sun, and the boy was there when the sun rose."
)
SPEAK_REPPEN_TEXTS = [
    SPEAK_TEXT,
    "Hello world.",
    "It's a nice day.",
    "A large size in stockings is hard to sell.",
    "The quick brown fox jumps over the lazy dog!",
    "Glue the sheet to the dark blue background.",
    "Four hours of steady work faced us.",
    "The boy was there when the sun rose.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage.",
    "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.",
    "The soft cushion broke the man's fall.",
    "The salt breeze came across from the sea.",
    "The girl at the booth sold fifty bonds.",
    "The small pup gnawed a hole in the sock.",
]
SPEAK_MAX_NEW_TOKENS = 11  # -> at most 10 frames (docs/model.md §14); keeps the recorded waveforms small
SPEAK_CASES = [
    dict(name="xvec_auto", texts=[SPEAK_TEXT], languages=["Auto"], mode="xvec", non_streaming_mode=False,
         repetition_penalty=1.0),
    dict(name="xvec_english", texts=[SPEAK_TEXT], languages=["English"], mode="xvec", non_streaming_mode=False,
         repetition_penalty=1.0),
    dict(name="xvec_nonstreaming", texts=[SPEAK_TEXT], languages=["Auto"], mode="xvec", non_streaming_mode=True,
         repetition_penalty=1.0),
    # texts: the first of SPEAK_REPPEN_TEXTS for which the penalty changes a greedy code-0 pick and
    # an EOS row scale qualifies (`reppen_candidates`, `calibrate_eos`)
    dict(name="xvec_reppen", texts=None, languages=["Auto"], mode="xvec", non_streaming_mode=False,
         repetition_penalty=1.05),
    dict(name="icl_long_text", texts=[SPEAK_LONG_TEXT], languages=["Auto"], mode="icl", ref_text=SPEAK_REF_TEXT,
         non_streaming_mode=False, repetition_penalty=1.0, expect_branch="text_longer"),
    dict(name="icl_short_text", texts=[SPEAK_SHORT_TEXT], languages=["Auto"], mode="icl", ref_text=SPEAK_REF_TEXT,
         non_streaming_mode=False, repetition_penalty=1.0, expect_branch="codes_longer"),
    # streaming x-vector prompts have the same length for any text, so the rows' prompts differ by the
    # language prefix (English: 4 codec ids, Auto: 3): row 1 is left-padded by one position; the
    # trailing texts differ in length (row 0's is padded with tts_pad_embed)
    dict(name="batch2", texts=[SPEAK_SHORT_TEXT, SPEAK_LONG_TEXT], languages=["English", "Auto"], mode="xvec",
         non_streaming_mode=False, repetition_penalty=1.0),
]
# Speak cases of the CustomVoice fixture (speakers: `make_fixtures.CUSTOM_SPEAKERS`).
CUSTOM_CASES = [
    dict(name="alice_auto", texts=[SPEAK_TEXT], languages=["Auto"], speaker="alice", repetition_penalty=1.05),
    dict(name="alice_english", texts=[SPEAK_TEXT], languages=["English"], speaker="alice", repetition_penalty=1.05),
    dict(name="bob_auto", texts=[SPEAK_TEXT], languages=["Auto"], speaker="bob", repetition_penalty=1.05),
    # dialect rule (docs/model.md §6): language auto/chinese + a dialect speaker -> think prefix with the dialect id
    dict(name="carol_dialect_auto", texts=[SPEAK_TEXT], languages=["Auto"], speaker="carol", repetition_penalty=1.05),
]
# EOS calibration (see `calibrate_eos`): the talker's codec_head row EOS (2150) is replaced by a scaled
# direction so that greedy generation stops by EOS in some speak cases and runs to max_new_tokens in others.
EOS_SCALE_GRID = [round(1.04**k, 6) for k in range(0, 160)]
EOS_DIRECTIONS = 64  # row directions tried: the initialised row, then seeded random ones
EOS_PREDICT_SAFETY = 0.5  # predicted gaps involving EOS must exceed this (logit units; prediction error ~1e-4)


def bind_stack(s: dict) -> None:
    """Binds the official stack's names used below (`s` = `official.import_stack()`, which the scripts
    call after parsing their arguments, so that --help works without the heavy packages)."""
    global np, torch, safetensors_save
    np, torch, safetensors_save = s["np"], s["torch"], s["safetensors_save"]



# --------------------------------------------------------------------------------------------
# Capture of a generate call and the greedy decisions' margins
# --------------------------------------------------------------------------------------------


class _Capture:
    """Forward hooks on the talker and the code predictor during one generate call."""

    def __init__(self, tts):
        self.talker_calls = []
        self.cp_calls = []
        self.generated = None
        self.handles = [
            tts.model.talker.register_forward_hook(self._talker_hook, with_kwargs=True),
            tts.model.talker.code_predictor.register_forward_hook(self._cp_hook, with_kwargs=True),
        ]
        self._orig_generate = tts.model.generate
        self._tts = tts

        def wrapped(*a, **kw):
            res = self._orig_generate(*a, **kw)
            self.generated = res
            return res

        tts.model.generate = wrapped

    def _talker_hook(self, module, args, kwargs, output):
        rec = dict(logits=output.logits.detach().clone())
        if len(self.talker_calls) == 0:
            assert kwargs["inputs_embeds"].shape[1] > 1, "first talker call must be the prefill"
            rec.update(
                inputs_embeds=kwargs["inputs_embeds"].detach().clone(),
                attention_mask=kwargs["attention_mask"].detach().clone(),
                hidden_states=torch.stack([h.detach().clone() for h in output.hidden_states[0]]),
                hidden=output.hidden_states[0][-1].detach().clone(),
                trailing_text_hidden=kwargs["trailing_text_hidden"].detach().clone(),
                tts_pad_embed=kwargs["tts_pad_embed"].detach().clone(),
            )
        self.talker_calls.append(rec)

    def _cp_hook(self, module, args, kwargs, output):
        self.cp_calls.append(output.logits[:, -1, :].detach().clone())

    def close(self):
        for h in self.handles:
            h.remove()
        del self._tts.model.generate  # back to the class method


def _margin(x) -> float:
    top = torch.topk(x.double(), 2).values
    return float(top[0] - top[1])


# --------------------------------------------------------------------------------------------
# Speak references: greedy generation through the official wrappers (refs/<model>.speak.*)
# --------------------------------------------------------------------------------------------


def _speak_case(case: dict, mode: str | None = None) -> dict:
    """A case with every field filled in (CUSTOM_CASES: mode "custom", the wrapper's default
    non_streaming_mode True)."""
    c = dict(case)
    if mode is not None:
        c["mode"] = mode
    if c["mode"] == "custom":
        c.setdefault("non_streaming_mode", True)
    c.setdefault("ref_text", None)
    c.setdefault("speaker", None)
    c.setdefault("max_new_tokens", SPEAK_MAX_NEW_TOKENS)
    return c


def speak_cases(custom: bool) -> list[dict]:
    return [_speak_case(c, "custom") for c in CUSTOM_CASES] if custom else [_speak_case(c) for c in SPEAK_CASES]


def speak_call(tts, case: dict):
    """The official call of a speak case: `generate_voice_clone` (ref_audio = ref24k.wav) or
    `generate_custom_voice`, greedy (`do_sample=False, subtalker_dosample=False`), explicit
    `max_new_tokens` and `repetition_penalty`; `non_streaming_mode` is passed only when it differs
    from the wrapper's default (False for voice clone, True for custom voice)."""
    texts, langs = case["texts"], case["languages"]
    kw = dict(
        text=texts if len(texts) > 1 else texts[0],
        language=langs if len(langs) > 1 else langs[0],
        do_sample=False,
        subtalker_dosample=False,
        max_new_tokens=case["max_new_tokens"],
        repetition_penalty=case["repetition_penalty"],
    )
    if case["mode"] == "custom":
        fn = tts.generate_custom_voice
        kw["speaker"] = case["speaker"]
    else:
        fn = tts.generate_voice_clone
        kw.update(ref_audio=str(AUDIO_WAV), x_vector_only_mode=case["mode"] == "xvec")
        if case["mode"] == "icl":
            kw["ref_text"] = case["ref_text"]
    if case["non_streaming_mode"] != inspect.signature(fn).parameters["non_streaming_mode"].default:
        kw["non_streaming_mode"] = case["non_streaming_mode"]
    torch.manual_seed(0)
    return fn(**kw)


class _SpeakCapture(_Capture):
    """_Capture plus the last-position final hidden of every talker call (EOS calibration) and the
    voice-clone prompt items the wrapper builds (ICL reference codes, x-vectors)."""

    def __init__(self, tts):
        super().__init__(tts)
        self.prompt_items = None
        orig = tts.create_voice_clone_prompt

        def wrapped(*a, **kw):
            self.prompt_items = orig(*a, **kw)
            return self.prompt_items

        tts.create_voice_clone_prompt = wrapped

    def _talker_hook(self, module, args, kwargs, output):
        super()._talker_hook(module, args, kwargs, output)
        self.talker_calls[-1]["h_last"] = output.hidden_states[0][-1][:, -1].detach().clone()

    def close(self):
        super().close()
        del self._tts.create_voice_clone_prompt  # back to the class method


def run_speak_case(tts, case: dict):
    cap = _SpeakCapture(tts)
    try:
        wavs, sr = speak_call(tts, case)
    finally:
        cap.close()
    assert sr == 24000
    return cap, wavs


def _replay_speak_talker(cap: _SpeakCapture, case: dict, eos: int, vocab: int) -> list[dict]:
    """Replays the official talker logits processors per row on the captured logits: repetition
    penalty over the row's generated code-0 ids (HF skips it at 1.0), min_new_tokens=2 (EOS -inf at
    steps 0, 1), suppression of vocab-1024..vocab-1 except EOS; greedy pick; a row stops at its
    first EOS.  Per row: picks, eos_step, margins, and for `calibrate_eos` the two best non-EOS
    processed logits and the final hidden at every step."""
    pen = case["repetition_penalty"]
    bsz = cap.talker_calls[0]["logits"].shape[0]
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[vocab - 1024:] = True
    suppress[eos] = False
    rows = [dict(c0=[], eos_step=None, margins=[], top2=[], h=[]) for _ in range(bsz)]
    for step, rec in enumerate(cap.talker_calls):
        logits = rec["logits"][:, -1, :].float()
        for b, r in enumerate(rows):
            if r["eos_step"] is not None:
                continue  # HF feeds a finished row EOS (pad_token_id = eos); trimmed afterwards
            s = logits[b].clone()
            if pen != 1.0:
                for t in set(r["c0"]):
                    s[t] = s[t] * pen if s[t] < 0 else s[t] / pen
            if step < 2:
                s[eos] = float("-inf")
            s[suppress] = float("-inf")
            pick = int(torch.argmax(s))
            r["margins"].append(_margin(s))
            s_no_eos = s.clone()
            s_no_eos[eos] = float("-inf")
            r["top2"].append([float(x) for x in torch.topk(s_no_eos, 2).values])
            r["h"].append(rec["h_last"][b])
            r["c0"].append(pick)
            if pick == eos:
                r["eos_step"] = step
    return rows


def _codec_prefix(tts, language: str, speaker: str | None) -> list[int]:
    """docs/model.md §6: the think/language codec ids (with the CustomVoice dialect rule)."""
    tc = tts.model.config.talker_config
    lang_id = None if language.lower() == "auto" else tc.codec_language_id[language.lower()]
    if language.lower() in ("chinese", "auto") and speaker and tc.spk_is_dialect[speaker.lower()] is not False:
        lang_id = tc.codec_language_id[tc.spk_is_dialect[speaker.lower()]]
    if lang_id is None:
        return [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    return [tc.codec_think_id, tc.codec_think_bos_id, lang_id, tc.codec_think_eos_id]


def ref_speak(tts, cases: list[dict]) -> tuple[dict, list[dict], list]:
    """Speak references: every case through the official wrapper; codes, waveforms, prompts and
    trailing texts per row, the ICL reference codes; checks the replayed greedy decisions, the
    prompt layout (docs/model.md §6) and the frame / EOS bookkeeping (docs/model.md §7, §14).  Returns (tensors,
    JSON list, per-case replayed rows for `calibrate_eos`)."""
    tcfg = tts.model.config.talker_config
    eos, vocab = tcfg.codec_eos_token_id, tcfg.vocab_size
    tensors, out, replays = {}, [], []
    for case in cases:
        name, mnt, mode = case["name"], case["max_new_tokens"], case["mode"]
        cap, wavs = run_speak_case(tts, case)
        rows = _replay_speak_talker(cap, case, eos, vocab)
        replays.append((case, rows))
        codes_list, _ = cap.generated
        bsz = len(case["texts"])
        assert len(rows) == len(codes_list) == len(wavs) == bsz
        # frame / EOS bookkeeping: a row stops at its first EOS (frames = eos_step), else
        # max_new_tokens code-0 picks of which the last never gets sub-codes (frames = mnt - 1)
        n_calls = len(cap.talker_calls)
        if all(r["eos_step"] is not None for r in rows):
            assert n_calls == max(r["eos_step"] for r in rows) + 1, n_calls
        else:
            assert n_calls == mnt, n_calls
        assert len(cap.cp_calls) == (NUM_CODE_GROUPS - 1) * (n_calls - 1), len(cap.cp_calls)

        pre = cap.talker_calls[0]
        emb, mask = pre["inputs_embeds"], pre["attention_mask"]
        trailing, pad_e = pre["trailing_text_hidden"], pre["tts_pad_embed"].reshape(-1)
        input_ids = [tts._tokenize_texts([tts._build_assistant_text(t)])[0].reshape(-1) for t in case["texts"]]
        ref_ids = ref_codes = None
        if mode == "icl":
            ref_ids = tts._tokenize_texts([tts._build_ref_text(case["ref_text"])])[0].reshape(-1)
            ref_codes = cap.prompt_items[0].ref_code
            assert all(torch.equal(it.ref_code, ref_codes) for it in cap.prompt_items)
            tensors[f"{name}.ref_codes"] = ref_codes.to(torch.int64).contiguous()
        branch = None
        row_meta, tm_all, cm_all = [], [], []
        for b, r in enumerate(rows):
            codes = codes_list[b].to(torch.int64).reshape(-1, NUM_CODE_GROUPS)
            frames = r["eos_step"] if r["eos_step"] is not None else mnt - 1
            assert len(r["c0"]) == (r["eos_step"] + 1 if r["eos_step"] is not None else mnt)
            assert codes.shape[0] == frames, (name, b, codes.shape, frames)
            assert codes[:, 0].tolist() == r["c0"][:frames], "replayed talker greedy picks differ from the official codes"
            cm = []
            for f in range(frames):
                for j in range(NUM_CODE_GROUPS - 1):
                    lg = cap.cp_calls[f * (NUM_CODE_GROUPS - 1) + j][b]
                    assert int(torch.argmax(lg)) == int(codes[f, j + 1]), "predictor greedy pick differs from official codes"
                    cm.append(_margin(lg))
            tm_all += r["margins"]
            cm_all += cm
            r["cp_margins"] = [min(cm[f * (NUM_CODE_GROUPS - 1):(f + 1) * (NUM_CODE_GROUPS - 1)]) for f in range(frames)]

            # prompt layout (docs/model.md §6) and trailing text length
            prefix = _codec_prefix(tts, case["languages"][b], case["speaker"])
            n_codec = len(prefix) + 1 + 2  # prefix ++ [speaker] ++ [pad, bos]
            lt = int(input_ids[b].numel()) - 8  # text tokens between "<|im_start|>assistant\n" and "<|im_end|>\n<|im_start|>assistant\n"
            length = 3 + n_codec - 1
            if mode == "icl":
                text_blk = int(ref_ids.numel()) - 5 + lt + 1
                codec_blk = int(ref_codes.shape[0]) + 1
                if case["non_streaming_mode"]:
                    length, n_trail = length + text_blk + codec_blk, 1
                else:
                    branch = "text_longer" if text_blk > codec_blk else "codes_longer"
                    length += codec_blk
                    n_trail = text_blk - codec_blk if branch == "text_longer" else 1
            elif case["non_streaming_mode"]:
                length, n_trail = length + lt + 2, 1
            else:
                length, n_trail = length + 1, lt
            n_pad = emb.shape[1] - length
            assert mask[b].tolist() == [0] * n_pad + [1] * length, (name, b, mask[b].tolist(), length)
            assert not emb[b, :n_pad].any()
            prompt = emb[b, n_pad:]
            spk_pos = 3 + len(prefix)  # the speaker slot: tts_pad_e + speaker vector
            if mode == "custom":
                spk = tts.model.talker.get_input_embeddings().weight[tcfg.spk_id[case["speaker"].lower()]]
            else:
                # one prompt item for the whole batch when one ref_audio is given (the wrapper repeats it)
                spk = cap.prompt_items[b if len(cap.prompt_items) > 1 else 0].ref_spk_embedding
            assert torch.allclose(prompt[spk_pos] - pad_e, spk, atol=1e-5), (prompt[spk_pos] - pad_e - spk).abs().max()
            assert torch.equal(trailing[b, n_trail:], pad_e.expand(trailing.shape[1] - n_trail, -1))
            wav = torch.from_numpy(wavs[b]).to(torch.float32)
            rm = dict(frames=frames, eos_step=r["eos_step"], wav_samples=int(wav.shape[0]), code0=r["c0"],
                      prompt_length=length, left_padding=n_pad, trailing_length=n_trail, codec_prefix=prefix,
                      min_margin_talker=min(r["margins"]), min_margin_code_predictor=min(cm) if cm else None)
            if mode == "icl":
                # generate_voice_clone decodes ref_codes ++ codes and drops int(T_ref / total * samples) samples
                t_ref, total = int(ref_codes.shape[0]), int(ref_codes.shape[0]) + frames
                cut = int(t_ref / max(total, 1) * (total * 1920))
                assert wav.shape[0] == total * 1920 - cut, (wav.shape, total, cut)
                rm.update(decoded_frames=total, wav_cut_samples=cut)
            else:
                assert wav.shape[0] == frames * 1920
            if bsz > 1:
                (single,), _ = tts.model.speech_tokenizer.decode([{"audio_codes": codes}])
                rm["batched_decode_vs_single_max_abs_diff"] = float(np.abs(single - wavs[b]).max()) if frames else 0.0
            row_meta.append(rm)
            tensors[f"{name}.{b}.codes"] = codes.contiguous()
            tensors[f"{name}.{b}.wav"] = wav.contiguous()
            tensors[f"{name}.{b}.prompt_embeds"] = prompt.contiguous()
            tensors[f"{name}.{b}.trailing_text"] = trailing[b, :n_trail].contiguous()
        if mode == "icl" and not case["non_streaming_mode"]:
            assert branch == case["expect_branch"], (name, branch)
        penalty_effect = None
        if "min_frames" in case:
            # the same call with repetition_penalty=1.0: the penalty must change an output frame
            plain = dict(case, repetition_penalty=1.0)
            pcap, _ = run_speak_case(tts, plain)
            prow = _replay_speak_talker(pcap, plain, eos, vocab)[0]
            first = next(i for i, (x, y) in enumerate(zip(rows[0]["c0"], prow["c0"])) if x != y)
            assert first < row_meta[0]["frames"], (name, first, row_meta[0]["frames"])
            penalty_effect = dict(code0_without_penalty=prow["c0"], first_step_changed_by_penalty=first)
        entry = dict(
            name=name,
            texts=case["texts"],
            languages=case["languages"],
            mode=mode,
            ref_audio=None if mode == "custom" else str(AUDIO_WAV.relative_to(FIXTURES)),
            ref_text=case["ref_text"],
            non_streaming_mode=case["non_streaming_mode"],
            repetition_penalty=case["repetition_penalty"],
            max_new_tokens=mnt,
            rows=row_meta,
            icl_branch=branch,
            min_margin=min(tm_all + cm_all),
            min_margin_talker=min(tm_all),
            min_margin_code_predictor=min(cm_all) if cm_all else None,
            input_ids=[i.tolist() for i in input_ids],
            talker_calls=n_calls,
        )
        if penalty_effect:
            entry.update(penalty_effect)
        if mode == "custom":
            entry.update(speaker=case["speaker"], speaker_codec_id=tcfg.spk_id[case["speaker"].lower()],
                         speaker_is_dialect=tcfg.spk_is_dialect[case["speaker"].lower()])
        if mode == "icl":
            entry.update(ref_ids=ref_ids.tolist(), ref_frames=int(ref_codes.shape[0]))
        out.append(entry)
    return tensors, out, replays


def write_speak_refs(name: str, tensors: dict, cases: list[dict]) -> None:
    safetensors_save({k: v.contiguous() for k, v in tensors.items()}, str(REFS / f"{name}.speak.safetensors"))
    write_json(REFS / f"{name}.speak.json", cases)
    summary = {c["name"]: [(r["frames"], r["eos_step"]) for r in c["rows"]] for c in cases}
    _log(f"{name}: speak cases (frames, eos_step) {json.dumps(summary)}")


# --------------------------------------------------------------------------------------------
# EOS calibration
# --------------------------------------------------------------------------------------------


def probe_speak(tts, cases: list[dict]) -> list:
    """The speak cases with the codec_head EOS row set to zero in memory (EOS logit 0, never the
    greedy pick: asserted): the EOS-free trajectories `calibrate_eos` works on."""
    eos = tts.model.config.talker_config.codec_eos_token_id
    w = tts.model.talker.codec_head.weight
    with torch.no_grad():
        keep = w[eos].clone()
        w[eos] = 0.0
    try:
        _, _, replays = ref_speak(tts, cases)
    finally:
        with torch.no_grad():
            w[eos] = keep
    for case, rows in replays:
        assert all(r["eos_step"] is None for r in rows), f"{case['name']}: EOS picked with a zero EOS row"
    return replays


def reppen_candidates(tts, case: dict) -> list[tuple]:
    """The repetition-penalty case with each text of SPEAK_REPPEN_TEXTS (in order) for which the
    penalty changes a greedy code-0 pick of an output frame (EOS-free probe runs with and without
    the penalty) and every decision up to that frame has a margin >= MARGIN_MIN, with its probe
    replay; `min_frames` makes `calibrate_eos` keep that frame."""
    out = []
    for text in SPEAK_REPPEN_TEXTS:
        c = dict(case, texts=[text])
        (_, with_pen), (_, without) = probe_speak(tts, [c, dict(c, repetition_penalty=1.0)])
        a, b = with_pen[0]["c0"], without[0]["c0"]
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None or step > c["max_new_tokens"] - 2:
            continue
        r = with_pen[0]
        if min(r["margins"][: step + 1] + r["cp_margins"][: step + 1]) >= MARGIN_MIN:
            c = dict(c, min_frames=step + 1)
            out.append((c, with_pen))
    return out


def _predict_eos(r: dict, rows_eos) -> tuple:
    """For one replayed row of a probe run (EOS row zero, so EOS never won; the row ran to
    max_new_tokens) and candidate codec_head EOS rows `rows_eos` (S, H): per candidate, the step at
    which greedy picks EOS first (-1: never), the smallest top-1/top-2 gap that involves EOS
    (|EOS logit - best other logit| where EOS is among the best two; inf if none) and the smallest
    margin of every decision that would be recorded (talker picks up to the stop, sub-codes of
    the frames kept)."""
    e = torch.stack(r["h"]).double() @ rows_eos.double().T  # (T, S) predicted EOS logits
    t1 = torch.tensor([a for a, _ in r["top2"]], dtype=torch.float64)[:, None]
    t2 = torch.tensor([b for _, b in r["top2"]], dtype=torch.float64)[:, None]
    n_steps, inf = e.shape[0], float("inf")
    steps = torch.arange(n_steps)[:, None]
    involved = (steps >= 2) & (e > t2)  # min_new_tokens=2; EOS among the best two
    fire = involved & (e > t1)
    has = fire.any(0)
    stop = torch.where(has, fire.int().argmax(0), torch.full_like(has, n_steps - 1, dtype=torch.long))
    kept = steps <= stop[None, :]
    gap = (e - t1).abs()
    margins = torch.where(involved, gap, (t1 - t2).expand_as(e))
    margin = torch.where(kept, margins, torch.full_like(e, inf)).min(0).values
    close = torch.where(kept & involved, gap, torch.full_like(e, inf)).min(0).values
    cp = torch.tensor([inf] + r["cp_margins"], dtype=torch.float64).cummin(0).values  # cp[f] = min over frames < f
    frames = torch.where(has, stop, torch.full_like(stop, n_steps - 1))
    margin = torch.minimum(margin, cp[frames])
    return torch.where(has, stop, torch.full_like(stop, -1)), close, margin


def calibrate_eos(replays: list, rp_candidates: list, u_row, seed: int) -> dict | None:
    """Chooses codec_head row EOS from the probe trajectories: row = bf16(scale * direction) with
    direction 0 the initialised row and then EOS_DIRECTIONS - 1 seeded N(0, 1) directions of the
    same norm, scale in EOS_SCALE_GRID.  For each direction, and for each repetition-penalty
    candidate text (`reppen_candidates`), a scale qualifies if it (1) keeps the predicted EOS logit
    EOS_PREDICT_SAFETY away from the best other logit wherever EOS is among the best two, (2) gives
    every decision that will be recorded a margin >= MARGIN_MIN, (3) stops every row that picks
    EOS at step 4..max_new_tokens-2 (>= 4 frames, and never at the last step, where EOS and
    max_new_tokens give the same frames), stops at least two rows (one a single-row voice-clone
    case) by EOS and lets at least two rows run to max_new_tokens, (4) stops the two batch rows at
    different steps, (5) keeps `min_frames` frames of the penalty case.  The first direction and
    candidate with a qualifying scale win; among their scales the most balanced split between
    EOS-stopped and full-length rows, then the most EOS rows, then the largest EOS gap.  Returns
    None if nothing qualifies (the caller re-draws the weights)."""
    gen = torch.Generator().manual_seed(seed)
    u = u_row.float()
    scales = torch.tensor(EOS_SCALE_GRID, dtype=torch.float32)
    for k in range(EOS_DIRECTIONS):
        d = u if k == 0 else torch.randn(u.shape, generator=gen) * (u.norm() / u.numel() ** 0.5)
        rows_eos = (scales[:, None] * d[None, :]).to(torch.bfloat16)
        def predict(rows):
            return [[x.tolist() for x in _predict_eos(r, rows_eos.float())] for r in rows]

        base = [(c, predict(rows)) for c, rows in replays]
        for rp_case, rp_rows in rp_candidates:
            preds = base + [(rp_case, predict(rp_rows))]
            best = None
            for j in range(len(EOS_SCALE_GRID)):
                outcome = [(c, [p[0][j] for p in ps]) for c, ps in preds]
                close = min(p[1][j] for _, ps in preds for p in ps)
                margin = min(p[2][j] for _, ps in preds for p in ps)
                if close < EOS_PREDICT_SAFETY or margin < MARGIN_MIN:
                    continue
                stops = [(c, s) for c, ss in outcome for s in ss if s >= 0]
                n_full = sum(s < 0 for _, ss in outcome for s in ss)
                if any(s < 4 or s > c["max_new_tokens"] - 2 for c, s in stops):
                    continue
                single = [c for c, ss in outcome if len(ss) == 1 and c["mode"] != "custom" and ss[0] >= 0]
                if len(stops) < 2 or not single or n_full < 2:
                    continue
                if not all(len(set(ss)) > 1 for _, ss in outcome if len(ss) > 1):
                    continue
                if not all(s < 0 or s >= c.get("min_frames", 0) for c, ss in outcome for s in ss):
                    continue
                key = (min(len(stops), n_full), len(stops), close)
                if best is None or key > best[0]:
                    best = (key, j, outcome, close, margin)
            if best is not None:
                _, j, outcome, close, margin = best
                return dict(direction=k, scale=EOS_SCALE_GRID[j], row=rows_eos[j], reppen_case=rp_case,
                            predicted_min_distance=close, predicted_min_margin=margin,
                            predicted={c["name"]: [None if s < 0 else s for s in ss] for c, ss in outcome})
    return None


def set_eos_row(model_dir: Path, saved: dict, eos: int, row) -> dict:
    """Rewrites model.safetensors with codec_head row EOS = `row` (bf16)."""
    saved = dict(saved)
    w = saved["talker.codec_head.weight"].clone()
    w[eos] = row.to(torch.bfloat16)
    saved["talker.codec_head.weight"] = w
    safetensors_save(saved, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return saved
