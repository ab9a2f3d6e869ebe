"""The stage-by-stage references of a loaded fixture model (``refs/<model>.*``, ``refs/audio.*``,
``refs/tokenizer_cases.json``), each a ``ref_*`` function that takes the official model and returns
tensors + JSON data.

* ``ref_tokenizer``: the tokenizer cases through the official processor, checked against an independent
  standard Qwen2 tokenization, with the ids the mistral-regex patch would give where they differ;
* ``ref_mel``: the log-mel the speaker encoder sees; ``ref_xvector``: the x-vector;
* ``ref_talker``: the talker prefill (inputs, hidden states, logits) captured inside the official
  ``generate_voice_clone``, single and left-padded batch, with every greedy decision replayed;
* ``ref_code_predictor``: teacher-forced logits and greedy generation of the code predictor.

The speak references and the codec references are in ``speak_refs.py`` and ``tiny_codec.py``.  Used by
``make_fixtures.py``; the heavy packages are bound by ``bind_stack`` after argument parsing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from fixture_audio import AUDIO_WAV
from official import CP_VOCAB_SIZE, NUM_CODE_GROUPS, write_json
from speak_refs import _Capture, _margin

# Texts used by the references.
SINGLE_TEXT = "Hello world."
BATCH_TEXTS = ["Hi there, this is a batch.", "The quick brown fox jumps over the lazy dog!"]
BATCH_LANGUAGES = ["English", "Auto"]
REF_TEXT = "Okay. Yeah. I resent you. I love you."
INSTRUCT_TEXT = "Speak slowly, in a warm and calm voice."
TOKENIZER_TEXTS = [
    ("digits", "12345 and 3.14"),
    ("camel_case", "CamelCaseWordsLikeThis"),
    ("mixed_case", "camelCase getHTTPResponse iPhone McDonald's"),
    ("contractions", "I'm can't they'll we've"),
    ("contractions_upper", "I'M HE'S THEY'LL"),
    ("unicode", "Grüße, ça va? 你好，世界。 Привет"),
    ("nfc", "cafe\u0301 vs caf\u00e9"),
    ("emoji", "👍🏽 🎉🎉"),
    ("crlf_tabs", "a\r\nb\n\nc\td"),
    ("spaces", "  leading and trailing  "),
    ("multi_spaces", "multiple    spaces\n  \n end"),
    ("slashes_newline", "path/to/file\n/next"),
    ("punct_newlines", "x=1;\n/* c */\n\n// end./\n"),
    ("combining_marks", "नमस्ते दुनिया, สวัสดี"),
    ("special_literal", "<|im_start|>assistant\nHi<|im_end|>"),
    ("tts_special_literal", "<tts_text_bos>x<tts_text_eod><tts_pad>"),
    ("empty", ""),
]


def bind_stack(s: dict) -> None:
    """Binds the official stack's names used below (`s` = `official.import_stack()`, which the scripts
    call after parsing their arguments, so that --help works without the heavy packages)."""
    global torch, mel_spectrogram
    torch, mel_spectrogram = s["torch"], s["mel_spectrogram"]


def ref_tokenizer(tts, std_tok, model_dir: Path) -> list[dict]:
    """Tokenizer cases through the official processor (what `_tokenize_texts` calls)."""
    cases = list(TOKENIZER_TEXTS) + [
        ("assistant_prompt", tts._build_assistant_text(SINGLE_TEXT)),
        ("assistant_prompt_batch0", tts._build_assistant_text(BATCH_TEXTS[0])),
        ("assistant_prompt_batch1", tts._build_assistant_text(BATCH_TEXTS[1])),
        ("ref_prompt", tts._build_ref_text(REF_TEXT)),
        ("instruct_prompt", tts._build_instruct_text(INSTRUCT_TEXT)),
    ]
    patched = _regex_patched_processor(model_dir)
    out = []
    for name, text in cases:
        ids = tts._tokenize_texts([text])[0]
        ids = ids.reshape(-1).tolist()
        std = std_tok.encode(text, add_special_tokens=False).ids
        assert ids == std, f"official processor differs from the standard Qwen2 tokenization for {name}: {ids} vs {std}"
        entry = dict(name=name, text=text, ids=ids)
        pids = patched(text=[text], return_tensors="pt", padding=True)["input_ids"].reshape(-1).tolist()
        if pids != ids:
            entry["ids_mistral_regex_patched"] = pids
        out.append(entry)
    return out


def _regex_patched_processor(model_dir: Path):
    """The processor an official local-dir load gives when config.json says transformers 4.57.3."""
    from transformers import AutoProcessor

    with tempfile.TemporaryDirectory() as tmp:
        for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            shutil.copy2(model_dir / f, Path(tmp) / f)
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg["transformers_version"] = "4.57.3"
        write_json(Path(tmp) / "config.json", cfg)
        proc = AutoProcessor.from_pretrained(tmp, fix_mistral_regex=True)
    assert getattr(proc.tokenizer, "fix_mistral_regex", False), "expected the regex patch to apply"
    return proc


def ref_mel(audio) -> dict:
    # Exactly as `extract_speaker_embedding` calls it.
    mel = mel_spectrogram(
        torch.from_numpy(audio).unsqueeze(0),
        n_fft=1024,
        num_mels=128,
        sampling_rate=24000,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12000,
    ).transpose(1, 2)
    n = len(audio)
    assert mel.shape == (1, 1 + (n + 768 - 1024) // 256, 128), mel.shape
    return {"audio.mel": mel[0].contiguous()}


def ref_xvector(tts, audio) -> torch.Tensor:
    return tts.model.extract_speaker_embedding(audio, sr=24000).detach().clone()


def _check_talker_decisions(cap: _Capture, eos: int, vocab: int) -> tuple[list, list[float]]:
    """Replays the official logits processors (repetition penalty 1.05 over generated code-0 ids,
    min_new_tokens=2, suppress 2048..3071 except EOS) on the captured talker logits; returns the
    greedy code-0 ids per row and the top-1/top-2 margins."""
    bsz = cap.talker_calls[0]["logits"].shape[0]
    history = [[] for _ in range(bsz)]
    margins = []
    for step, rec in enumerate(cap.talker_calls):
        logits = rec["logits"][:, -1, :].float().clone()
        for b in range(bsz):
            s = logits[b]
            for t in set(history[b]):
                s[t] = s[t] * 1.05 if s[t] < 0 else s[t] / 1.05
            if step < 2:
                s[eos] = float("-inf")
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[vocab - 1024:] = True
            mask[eos] = False
            s[mask] = float("-inf")
            history[b].append(int(torch.argmax(s)))
            margins.append(_margin(s))
    return history, margins


def ref_talker(tts, texts: list[str], languages: list[str], prefix: str, max_new_tokens: int = 3):
    """Prefill capture inside the official generate_voice_clone (x-vector only, streaming text)."""
    cap = _Capture(tts)
    try:
        torch.manual_seed(0)
        tts.generate_voice_clone(
            text=texts if len(texts) > 1 else texts[0],
            language=languages if len(languages) > 1 else languages[0],
            ref_audio=str(AUDIO_WAV),
            x_vector_only_mode=True,
            non_streaming_mode=False,
            do_sample=False,
            subtalker_dosample=False,
            max_new_tokens=max_new_tokens,
        )
    finally:
        cap.close()
    pre = cap.talker_calls[0]
    tcfg = tts.model.config.talker_config
    c0_hist, tmargins = _check_talker_decisions(cap, tcfg.codec_eos_token_id, tcfg.vocab_size)
    codes_list, _ = cap.generated
    # Code predictor decisions inside the loop (greedy, raw logits).
    cmargins = [_margin(l[b]) for l in cap.cp_calls for b in range(l.shape[0])]
    n_frames = [int(c.shape[0]) for c in codes_list]
    for b, c in enumerate(codes_list):
        assert c.shape[0] <= max_new_tokens - 1
        assert c[:, 0].tolist() == c0_hist[b][: c.shape[0]], "replayed talker greedy picks differ from the official codes"
    cp_steps = len(cap.cp_calls)
    assert cp_steps == (NUM_CODE_GROUPS - 1) * (max_new_tokens - 1), cp_steps
    for f in range(max_new_tokens - 1):
        picks = torch.stack([torch.argmax(cap.cp_calls[f * 15 + j], dim=-1) for j in range(15)], dim=1)
        for b, c in enumerate(codes_list):
            if f < c.shape[0]:
                assert c[f, 1:].tolist() == picks[b].tolist(), "predictor greedy picks differ from official codes"

    input_ids = [tts._tokenize_texts([tts._build_assistant_text(t)])[0].reshape(-1) for t in texts]
    tensors = {
        f"{prefix}.inputs_embeds": pre["inputs_embeds"],
        f"{prefix}.attention_mask": pre["attention_mask"].to(torch.int64),
        f"{prefix}.hidden": pre["hidden"],
        f"{prefix}.hidden_states": pre["hidden_states"],
        f"{prefix}.logits": pre["logits"],
        f"{prefix}.trailing_text_hidden": pre["trailing_text_hidden"],
        f"{prefix}.tts_pad_embed": pre["tts_pad_embed"].reshape(-1),
    }
    for b, ids in enumerate(input_ids):
        tensors[f"{prefix}.input_ids.{b}"] = ids.to(torch.int64)
        tensors[f"{prefix}.codes.{b}"] = codes_list[b].to(torch.int64).reshape(-1, NUM_CODE_GROUPS)
    meta = dict(
        texts=texts,
        languages=languages,
        input_ids=[i.tolist() for i in input_ids],
        prompt_lengths=pre["attention_mask"].sum(-1).tolist(),
        max_new_tokens=max_new_tokens,
        greedy_code0=c0_hist,
        codes=[c.tolist() for c in codes_list],
        frames=n_frames,
        min_margin_talker=min(tmargins),
        min_margin_code_predictor=min(cmargins),
    )
    return tensors, meta, pre


def ref_code_predictor(tts, h: torch.Tensor, seed: int):
    """Teacher-forced logits (forward_sub_talker_finetune) and greedy generation (as the talker calls it)."""
    talker = tts.model.talker
    gen = torch.Generator().manual_seed(seed)
    frame = torch.randint(0, CP_VOCAB_SIZE, (NUM_CODE_GROUPS,), generator=gen)
    with torch.no_grad():
        tf_logits, _ = talker.forward_sub_talker_finetune(frame[None], h[None])
        tf_logits = tf_logits[0]
        # Manual check of the documented input layout.
        embeds = [h[None], talker.get_input_embeddings()(frame[:1])]
        embeds += [talker.code_predictor.get_input_embeddings()[i - 1](frame[i : i + 1]) for i in range(1, 15)]
        x = talker.code_predictor.small_to_mtp_projection(torch.cat(embeds, 0)[None])
        hid = talker.code_predictor.model(inputs_embeds=x).last_hidden_state[0]
        manual = torch.stack([talker.code_predictor.lm_head[j](hid[j + 1]) for j in range(15)])
        assert torch.allclose(manual, tf_logits, atol=1e-5, rtol=0), (manual - tf_logits).abs().max()

        c0 = frame[:1]
        res = talker.code_predictor.generate(
            inputs_embeds=torch.cat((h[None, None], talker.get_input_embeddings()(c0[None])), dim=1),
            max_new_tokens=NUM_CODE_GROUPS - 1,
            do_sample=False,
            top_p=1.0,
            top_k=50,
            temperature=0.9,
            output_hidden_states=True,
            return_dict_in_generate=True,
            output_logits=True,
        )
    greedy = res.sequences[0]
    glogits = torch.stack([l[0] for l in res.logits])
    assert greedy.shape == (15,) and torch.equal(greedy, glogits.argmax(-1))
    margins = [_margin(l) for l in glogits] + [_margin(l) for l in tf_logits]
    tensors = {
        "cp.h": h.clone(),
        "cp.frame": frame.to(torch.int64),
        "cp.teacher_forced_logits": tf_logits.contiguous(),
        "cp.greedy_codes": greedy.to(torch.int64),
    }
    meta = dict(frame=frame.tolist(), c0=int(c0[0]), greedy_codes=greedy.tolist(), min_margin=min(margins),
                min_margin_greedy=min(margins[:15]))
    return tensors, meta
