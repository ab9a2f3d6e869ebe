"""The tiny 12 Hz speech tokenizer of the fixtures (``tests/fixtures/tiny-0b6/speech_tokenizer``) and its references.

* ``TINY_CODEC``: the real codec's structure and frame geometry with tiny widths (``official.codec_spec``
  overrides of the shipped config).
* ``build_tiny_codec``: initialised with fixed seeds, then its encoder codebooks are built against the
  latents of every input the references encode, so that no nearest-neighbour lookup is a near-tie
  (the RVQ helpers replay Mimi's residual VQ in float64 with the gap of every lookup), and its last
  decoder conv is scaled so that some of clip1's decode exercises the clamp.
* ``ref_codec``: ``refs/codec.*``, encode / decode through the official wrapper
  (``Qwen3TTSTokenizer``) on the re-loaded directory, with intermediates captured by hooks.
* ``write_speech_tokenizer``: a random codec without data-dependent codebooks (``--full-size``).

Used by ``make_fixtures.py``; the heavy packages are bound by ``bind_stack`` after argument parsing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fixture_audio import CODEC_CLIPS
from official import (
    FIXTURES,
    codec_codebooks,
    codec_config_dict,
    codec_spec,
    init_codec_weights,
    new_codec_model,
    write_codec_dir,
)

# Tiny 12 Hz speech tokenizer with the real structure and frame geometry (docs/model.md §2, §9): 24 kHz,
# 1920 samples per frame (encoder SEANet 8*6*5*4 = 960 -> 25 Hz, downsample x2; decoder 2*2 * 8*5*4*3),
# encoder with all 32 quantizers (1 semantic + 31 acoustic; the wrapper keeps the first 16) x 2048
# entries, decoder with 16 quantizers x 2048 entries, every layer type of the real codec, tiny widths.
# Ratios kept from the real config: SEANet channels num_filters*2^k, last conv 16*num_filters ->
# hidden (1024 -> 512), decoder head_dim * heads != hidden (64*16 != 512), latent_dim = 2 * hidden,
# decoder codebook entries codebook_dim // 2 wide (512 // 2 = 256 real).
TINY_CODEC = codec_spec(
    encoder=dict(
        hidden_size=16,
        num_filters=2,  # SEANet channels 2 -> 4 -> 8 -> 16 -> 32, then 32 -> hidden 16
        codebook_dim=6,  # = vector_quantization_hidden_dimension (both 256 real); 6 keeps 32 codebooks small
        # num_quantizers stays 32: HF Mimi computes all 32, the wrapper keeps 16 (docs/model.md §14)
        vector_quantization_hidden_dimension=6,
        upsample_groups=16,  # only used by Mimi's upsample, which the Qwen encoder deletes
        num_hidden_layers=2,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    ),
    decoder=dict(
        codebook_dim=4,  # NOT an __init__ parameter (kwargs); entries are codebook_dim // 2 = 2 wide
        hidden_size=16,
        latent_dim=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,  # NOT an __init__ parameter (kwargs); q dim 4*8 = 32 != hidden 16, like 16*64 != 512
        intermediate_size=32,
        num_hidden_layers=2,
        # num_semantic_quantizers, semantic_codebook_size (docs/model.md §13 Q6) stay as shipped:
        # the code reads neither
        vector_quantization_hidden_dimension=4,  # unused by the code
        decoder_dim=32,  # 32 -> 16 -> 8 -> 4 -> 2 channels through the 4 upsampling blocks (real 1536 -> 96)
    ),
)

# Codec references (refs/codec.*): the two clips of `fixture_audio.CODEC_CLIPS`, and a > 300-frame decode
# crossing the 300-frame chunk boundary (chunk 300, left context 25; docs/model.md §9.2).
CODEC_SEED = 77
LONG_DECODE_FRAMES = 330
LONG_DECODE_TAIL_FROM = 290  # refs keep wav[290*1920:] (chunk boundary at frame 300) + every 32nd sample
LONG_DECODE_STRIDE = 32
CODEC_GAP_MIN = 1e-4  # asserted: (d2^2 - d1^2) / (|r|^2 + |e1|^2) for every recorded NN lookup
CODEC_GAP_TARGET = 1e-3  # codebook entries behind a smaller gap are re-drawn while building
CODEC_CLIP_TARGET = 0.02  # fraction of pre-clamp clip1 decode samples with |y| > 1 (exercises the clamp)


def bind_stack(s: dict) -> None:
    """Binds the official stack's names used below (`s` = `official.import_stack()`, which the scripts
    call after parsing their arguments, so that --help works without the heavy packages)."""
    global np, torch, Qwen3TTSTokenizer
    np, torch, Qwen3TTSTokenizer = s["np"], s["torch"], s["Qwen3TTSTokenizer"]


# --------------------------------------------------------------------------------------------
# The codec: init, near-tie-free encoder codebooks, decoder output scale
# --------------------------------------------------------------------------------------------


def _encoder_latent(model, x):
    """Encoder up to the quantizer, exactly as `MimiModel._encode_frame` runs it: returns
    (seanet, transformer, latent) for input (B, 1, samples)."""
    enc = model.encoder
    seanet = enc.encoder(x)
    tr = enc.encoder_transformer(seanet.transpose(1, 2), return_dict=True).last_hidden_state
    latent = enc.downsample(tr.transpose(1, 2))
    return seanet, tr, latent


def _nn_with_gaps(r, embed):
    """Nearest neighbour of every row of r (N, D) among embed (K, D) in float64, with the relative
    gap (d2^2 - d1^2) / (|r|^2 + |e1|^2) between the best and second-best squared distances."""
    r64, e64 = r.double(), embed.double()
    d = ((r64[:, None, :] - e64[None, :, :]) ** 2).sum(-1)
    top = torch.topk(d, 2, dim=1, largest=False)
    d1, d2 = top.values[:, 0], top.values[:, 1]
    idx = top.indices[:, 0]
    gap = (d2 - d1) / ((r64**2).sum(-1) + (e64[idx] ** 2).sum(-1))
    return idx, top.indices[:, 1], gap


def _mimi_embed(embed_sum, usage):
    return embed_sum / usage.clamp(min=1e-5)[:, None]  # MimiEuclideanCodebook.embed (epsilon 1e-5)


def _rvq_replay(x, codebooks):
    """Residual VQ as MimiResidualVectorQuantizer.encode computes it (f32 residuals), rows of x
    (N, D); returns codes (N, L) and the relative NN gaps (N, L)."""
    r = x.clone()
    codes, gaps = [], []
    for embed_sum, usage in codebooks:
        embed = _mimi_embed(embed_sum, usage)
        idx, _, gap = _nn_with_gaps(r, embed)
        codes.append(idx)
        gaps.append(gap)
        r = r - embed[idx]
    return torch.stack(codes, 1), torch.stack(gaps, 1)


def _build_rvq_codebooks(x, n_layers: int, scale: float, gen) -> tuple[list, int]:
    """Codebooks for one residual VQ, layer by layer, such that every lookup of the rows of x
    (N, D) has a relative gap >= CODEC_GAP_TARGET: the two entries behind any smaller gap are
    re-drawn.  Entries N(0, scale^2), every layer the same scale, so the residual stays O(scale)
    instead of collapsing towards float32 noise (8-dim codebooks would otherwise shrink it ~0.5x
    per layer)."""
    out, redrawn = [], 0
    r = x.clone()
    dim = x.shape[1]
    for _ in range(n_layers):
        usage = 0.5 + torch.rand(2048, generator=gen)
        base = torch.randn(2048, dim, generator=gen) * scale
        for _ in range(1000):
            embed_sum = base * usage[:, None]
            embed = _mimi_embed(embed_sum, usage)
            idx, idx2, gap = _nn_with_gaps(r, embed)
            bad = gap < CODEC_GAP_TARGET
            if not bool(bad.any()):
                break
            rows = torch.unique(torch.cat([idx[bad], idx2[bad]]))
            base[rows] = torch.randn(len(rows), dim, generator=gen) * scale
            redrawn += len(rows)
        else:
            raise SystemExit("could not build near-tie-free codebooks")
        out.append((embed_sum, usage))
        r = r - embed[idx]
    return out, redrawn


def build_tiny_codec(clips: dict, seed: int) -> tuple[dict, dict, dict]:
    """The tiny codec: init, then encoder codebooks built against the latents of every input
    the references encode (clip1, clip2, and the right-padded batch of both), then the last
    decoder conv scaled so that ~2 % of clip1's pre-clamp decode lies outside [-1, 1].
    Returns (config dict, f32 state dict, build info)."""
    cfg = codec_config_dict(TINY_CODEC)
    model = new_codec_model(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    init_codec_weights(model, gen)
    q = model.encoder.quantizer
    sem, aco = q.semantic_residual_vector_quantizer, q.acoustic_residual_vector_quantizer
    info = {}
    with torch.no_grad():
        # every (input, kept frames) pair the references will quantize
        a1, a2 = clips["clip1"], clips["clip2"]
        batch = torch.zeros(2, max(len(a1), len(a2)))
        batch[0, : len(a1)] = torch.from_numpy(a1)
        batch[1, : len(a2)] = torch.from_numpy(a2)
        inputs = [(torch.from_numpy(a)[None, None], [-(-len(a) // 1920)]) for a in (a1, a2)]
        inputs.append((batch[:, None], [-(-len(a1) // 1920), -(-len(a2) // 1920)]))
        xs, xa = [], []
        for x, keep in inputs:
            seanet, tr, latent = _encoder_latent(model, x)
            ps, pa = sem.input_proj(latent), aco.input_proj(latent)
            for b, n in enumerate(keep):
                xs.append(ps[b, :, :n].T)
                xa.append(pa[b, :, :n].T)
            info.setdefault("rms", {}).setdefault("seanet", float(seanet.pow(2).mean().sqrt()))
            info["rms"].setdefault("transformer", float(tr.pow(2).mean().sqrt()))
            info["rms"].setdefault("latent", float(latent.pow(2).mean().sqrt()))
        xs, xa = torch.cat(xs), torch.cat(xa)
        s_scale, a_scale = float(xs.pow(2).mean().sqrt()), float(xa.pow(2).mean().sqrt())
        sem_cbs, n1 = _build_rvq_codebooks(xs, len(sem.layers), s_scale, gen)
        aco_cbs, n2 = _build_rvq_codebooks(xa, len(aco.layers), a_scale, gen)
        enc_cbs, _ = codec_codebooks(model)
        for (emb, usage), (new_emb, new_usage) in zip(enc_cbs, sem_cbs + aco_cbs):
            emb.copy_(new_emb)
            usage.copy_(new_usage)
        info.update(codebook_scale=dict(semantic=s_scale, acoustic=a_scale), entries_redrawn=n1 + n2)

        # decoder output scale: clip1's codes (replayed) through the decoder, pre-clamp quantile
        n1f = -(-len(a1) // 1920)
        c_sem, _ = _rvq_replay(xs[:n1f], sem_cbs)
        c_aco, _ = _rvq_replay(xa[:n1f], aco_cbs[:15])
        codes = torch.cat([c_sem, c_aco], 1).T[None]  # (1, 16, T)
        final = model.decoder.decoder[-1]
        y = final(_decoder_trunk(model.decoder, codes))
        k = 1.0 / float(torch.quantile(y.abs().flatten(), 1.0 - CODEC_CLIP_TARGET))
        final.conv.weight.mul_(k)
        final.conv.bias.mul_(k)
        info.update(final_conv_scale=k, preclamp_rms_after_scaling=float((k * y).pow(2).mean().sqrt()))
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    return cfg, sd, info


def _decoder_trunk(dec, codes):
    """Qwen3TTSTokenizerV2Decoder.forward up to (not including) the last conv."""
    hidden = dec.quantizer.decode(codes)
    hidden = dec.pre_conv(hidden).transpose(1, 2)
    hidden = dec.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
    for blocks in dec.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in dec.decoder[:-1]:
        hidden = block(hidden)
    return hidden


def write_speech_tokenizer(dst: Path, seed: int, cfg: dict | None = None) -> None:
    """A random codec (no data-dependent codebooks; used by --full-size)."""
    cfg = cfg or codec_config_dict(TINY_CODEC)
    model = new_codec_model(cfg, seed)
    init_codec_weights(model, torch.Generator().manual_seed(seed))
    write_codec_dir(dst, cfg, {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()})


# --------------------------------------------------------------------------------------------
# Codec references (refs/codec.*)
# --------------------------------------------------------------------------------------------


class _Hooks:
    """Forward hooks that record module outputs (one entry per call)."""

    def __init__(self):
        self.rec, self.handles = {}, []

    def add(self, module, key: str, pick=lambda o: o):
        def hook(_m, _a, out):
            self.rec.setdefault(key, []).append(pick(out).detach().clone())

        self.handles.append(module.register_forward_hook(hook))

    def wrap_method(self, obj, name: str, key: str):
        orig = getattr(obj, name)

        def wrapped(*a, **kw):
            out = orig(*a, **kw)
            self.rec.setdefault(key, []).append(out.detach().clone())
            return out

        setattr(obj, name, wrapped)
        self.handles.append(_Restore(obj, name))

    def reset(self):
        self.rec = {}

    def close(self):
        for h in self.handles:
            h.remove()


class _Restore:
    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def remove(self):
        delattr(self.obj, self.name)  # back to the class method


def _codec_gaps(model, proj_s, proj_a, codes32, n_keep: int):
    """Replays the 32 NN lookups of every frame (rows of the captured input projections) in
    float64, checks them against the official codes, returns the relative gaps (frames, 32)."""
    q = model.encoder.quantizer
    sem = [(l.codebook.embed_sum, l.codebook.cluster_usage) for l in q.semantic_residual_vector_quantizer.layers]
    aco = [(l.codebook.embed_sum, l.codebook.cluster_usage) for l in q.acoustic_residual_vector_quantizer.layers]
    xs, xa = proj_s[:, :n_keep].T, proj_a[:, :n_keep].T
    c_s, g_s = _rvq_replay(xs, sem)
    c_a, g_a = _rvq_replay(xa, aco)
    codes, gaps = torch.cat([c_s, c_a], 1), torch.cat([g_s, g_a], 1)
    assert torch.equal(codes, codes32[:n_keep]), "float64 NN replay disagrees with the official codes"
    return gaps


def ref_codec(codec_dir: Path, saved: dict, clips: dict) -> tuple[dict, dict]:
    """Codec references through the official wrapper (`Qwen3TTSTokenizer.encode/decode`) on the
    re-loaded directory, float32, plus intermediates captured with hooks."""
    tok = Qwen3TTSTokenizer.from_pretrained(str(codec_dir), dtype=torch.float32, device_map="cpu")
    model = tok.model
    sd = model.state_dict()
    assert set(sd) == set(saved), set(sd) ^ set(saved)
    for k, v in saved.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v), k
    enc, dec = model.encoder, model.decoder
    assert enc.upsample is None and enc.decoder is None and enc.decoder_transformer is None
    assert int(tok.feature_extractor.sampling_rate) == 24000
    tensors, meta = {}, dict(
        attn_implementation=dict(encoder=model.config.encoder_config._attn_implementation,
                                 decoder=model.config.decoder_config._attn_implementation),
        config=dict(encoder={k: TINY_CODEC["encoder"][k] for k in (
            "hidden_size", "num_filters", "num_hidden_layers", "num_attention_heads", "head_dim",
            "intermediate_size", "codebook_size", "codebook_dim", "num_quantizers", "num_semantic_quantizers",
            "upsampling_ratios", "sliding_window")},
            decoder={k: TINY_CODEC["decoder"][k] for k in (
            "codebook_dim", "hidden_size", "latent_dim", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "num_hidden_layers", "num_quantizers", "sliding_window", "upsample_rates",
            "upsampling_ratios", "decoder_dim")}),
    )
    h = _Hooks()
    h.add(enc.encoder, "seanet")
    h.add(enc.encoder_transformer, "transformer", lambda o: o[0])
    h.add(enc.downsample, "downsample")
    h.add(enc.quantizer.semantic_residual_vector_quantizer.input_proj, "proj_s")
    h.add(enc.quantizer.acoustic_residual_vector_quantizer.input_proj, "proj_a")
    all_gaps, kept_gaps = [], []
    clip_meta, enc_out = {}, {}
    try:
        with torch.inference_mode():
            for c in CODEC_CLIPS:
                name, path = c["name"], FIXTURES / "audio" / c["wav"]
                audio = clips[name]
                n = len(audio)
                h.reset()
                out = tok.encode(str(path))  # a path: librosa.load(sr=None), 24 kHz -> no resampling
                enc_out[name] = out
                (codes,) = out.audio_codes
                frames = -(-n // 1920)
                assert codes.shape == (frames, 16) and codes.dtype == torch.int64, codes.shape
                # all 32 quantizers, as MimiModel.encode computes them (the wrapper keeps 16)
                codes32 = enc.encode(torch.from_numpy(audio)[None, None], return_dict=True).audio_codes[0].T
                assert torch.equal(codes32[:, :16], codes)
                rec = {k: v[0] for k, v in h.rec.items()}
                gaps = _codec_gaps(model, rec["proj_s"][0], rec["proj_a"][0], codes32, frames)
                all_gaps.append(gaps)
                kept_gaps.append(gaps[:, :16])
                tensors[f"encode.{name}.codes"] = codes.contiguous()
                if name == "clip1":
                    tensors[f"encode.{name}.seanet"] = rec["seanet"].contiguous()
                    tensors[f"encode.{name}.transformer"] = rec["transformer"].contiguous()
                    tensors[f"encode.{name}.latent"] = rec["downsample"].contiguous()
                    tensors[f"encode.{name}.semantic_proj"] = rec["proj_s"].contiguous()
                    tensors[f"encode.{name}.acoustic_proj"] = rec["proj_a"].contiguous()
                    tensors[f"encode.{name}.codes_all"] = codes32.contiguous()
                else:
                    tensors[f"encode.{name}.latent"] = rec["downsample"].contiguous()
                clip_meta[name] = dict(
                    wav=f"audio/{c['wav']}",
                    wav_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                    samples=n,
                    seconds=n / 24000,
                    whole_frames=n % 1920 == 0,
                    frames=frames,
                    seanet_frames=int(rec["seanet"].shape[-1]),
                    first_samples=[float(x) for x in audio[:8]],
                    made_from=f"espeak-ng -v {c['voice']} -s {c['speed']} {c['text']!r} -> librosa resample to 24 kHz "
                    f"(soxr_hq) -> trim silence (top_db 40) -> first {c['seconds']} s -> peak {c['peak']} -> 16-bit PCM",
                    codes=codes.tolist(),
                    min_rel_gap_kept=float(gaps[:, :16].min()),
                    min_rel_gap_all32=float(gaps.min()),
                )

            # right-padded batch of both clips (the wrapper pads to the batch max, keeps ceil(n/1920) frames)
            h.reset()
            paths = [str(FIXTURES / "audio" / c["wav"]) for c in CODEC_CLIPS]
            out = tok.encode(paths)
            rec = {k: v[0] for k, v in h.rec.items()}
            padded = max(len(clips[c["name"]]) for c in CODEC_CLIPS)
            batch_meta = dict(padded_samples=padded)
            batch = np.stack([np.pad(clips[c["name"]], (0, padded - len(clips[c["name"]]))) for c in CODEC_CLIPS])
            codes32_b = enc.encode(torch.from_numpy(batch)[:, None], return_dict=True).audio_codes
            for b, c in enumerate(CODEC_CLIPS):
                codes = out.audio_codes[b]
                single = tensors[f"encode.{c['name']}.codes"]
                assert codes.shape == single.shape
                assert torch.equal(codes32_b[b, :16, : codes.shape[0]].T, codes)
                gaps = _codec_gaps(model, rec["proj_s"][b], rec["proj_a"][b], codes32_b[b].T, codes.shape[0])
                kept_gaps.append(gaps[:, :16])
                all_gaps.append(gaps)
                tensors[f"encode.batch.codes.{b}"] = codes.contiguous()
                diff = (codes != single).any(-1).nonzero().flatten().tolist()
                batch_meta[f"row{b}"] = dict(frames=int(codes.shape[0]), frames_differing_from_single_encode=diff)
            meta["encode_batch"] = batch_meta
            meta["clips"] = clip_meta

            # (b) decode clip1's codes through the wrapper, with intermediates
            h.close()
            h = _Hooks()
            h.wrap_method(dec.quantizer, "decode", "quantized")
            h.add(dec.pre_conv, "pre_conv")
            h.add(dec.pre_transformer, "pre_transformer", lambda o: o.last_hidden_state)
            h.add(dec.upsample[0][1], "upsample.0")
            h.add(dec.upsample[1][1], "upsample.1")
            h.add(dec.decoder[0], "decoder.0")
            h.add(dec.decoder[1], "decoder.1")
            h.add(dec.decoder[-1], "preclamp")
            wavs, sr = tok.decode(enc_out["clip1"])
            assert sr == 24000 and len(wavs) == 1
            wav = torch.from_numpy(wavs[0])
            n1 = tensors["encode.clip1.codes"].shape[0]
            assert wav.shape == (n1 * 1920,), wav.shape
            rec = {k: v for k, v in h.rec.items()}
            assert all(len(v) == 1 for v in rec.values()), "clip1 decode must be one chunk"
            rec = {k: v[0] for k, v in rec.items()}
            pre = rec["preclamp"].reshape(-1)
            assert torch.equal(pre.clamp(-1, 1), wav)
            for k in ("quantized", "pre_conv", "pre_transformer", "upsample.0", "upsample.1", "decoder.0", "decoder.1"):
                tensors[f"decode.clip1.{k}"] = rec[k].contiguous()
            tensors["decode.clip1.wav_preclamp"] = pre.contiguous()
            tensors["decode.clip1.wav"] = wav.contiguous()
            clipped = float((pre.abs() > 1).float().mean())
            # batched decode (pad -1) of both clips: row 0 vs the single decode
            wavs_b, _ = tok.decode([{"audio_codes": tensors[f"encode.{c['name']}.codes"]} for c in CODEC_CLIPS])
            meta["decode_clip1"] = dict(
                frames=n1,
                samples=int(wav.shape[0]),
                fraction_clamped=clipped,
                max_abs_preclamp=float(pre.abs().max()),
                rms=float(wav.pow(2).mean().sqrt()),
                batched_decode_row0_max_abs_diff=float(np.abs(wavs_b[0] - wavs[0]).max()),
                batched_decode_lengths=[int(w.shape[0]) for w in wavs_b],
            )

            # (c) > 300 frames: chunked decode (chunk 300, left context 25)
            h.reset()
            gen = torch.Generator().manual_seed(CODEC_SEED + LONG_DECODE_FRAMES)
            codes = torch.randint(0, 2048, (LONG_DECODE_FRAMES, 16), generator=gen)
            wavs, _ = tok.decode({"audio_codes": codes})
            wav = torch.from_numpy(wavs[0])
            assert wav.shape == (LONG_DECODE_FRAMES * 1920,)
            pts = h.rec["pre_transformer"]
            assert [p.shape[1] for p in pts] == [300, 25 + LONG_DECODE_FRAMES - 300], [p.shape for p in pts]
            single = dec(codes.T[None])[0, 0]  # one pass, no chunking (what a naive port computes)
            b = 300 * 1920
            tail_from = LONG_DECODE_TAIL_FROM * 1920
            tensors["decode.long.codes"] = codes.contiguous()
            tensors["decode.long.pre_transformer.chunk0"] = pts[0].contiguous()
            tensors["decode.long.pre_transformer.chunk1"] = pts[1].contiguous()
            tensors["decode.long.wav_tail"] = wav[tail_from:].contiguous()
            tensors[f"decode.long.wav_stride{LONG_DECODE_STRIDE}"] = wav[::LONG_DECODE_STRIDE].contiguous()
            meta["decode_long"] = dict(
                frames=LONG_DECODE_FRAMES,
                samples=int(wav.shape[0]),
                codes_seed=CODEC_SEED + LONG_DECODE_FRAMES,
                chunks=[dict(frames=[0, 300], context=0), dict(frames=[275, LONG_DECODE_FRAMES], context=25)],
                wav_tail_from_sample=tail_from,
                sum=float(wav.double().sum()),
                sum_abs=float(wav.double().abs().sum()),
                max_abs=float(wav.abs().max()),
                fraction_clamped=float((wav.abs() >= 1).float().mean()),
                single_pass_max_abs_diff_before_300=float((single[:b] - wav[:b]).abs().max()),
                single_pass_max_abs_diff_from_300=float((single[b:] - wav[b:]).abs().max()),
            )
    finally:
        h.close()
    kept = torch.cat([g.flatten() for g in kept_gaps])
    allg = torch.cat([g.flatten() for g in all_gaps])
    meta["min_rel_gap"] = dict(
        definition="(d2^2 - d1^2) / (|r|^2 + |e1|^2): best vs second-best squared distance of each nearest-neighbour "
        "lookup (r = residual entering the quantizer layer, e1 = chosen entry), float64 replay of the official f32 "
        "inputs; over clip1, clip2 and both batch rows",
        kept_16=float(kept.min()),
        all_32=float(allg.min()),
        lookups_kept=int(kept.numel()),
        asserted_min=CODEC_GAP_MIN,
    )
    assert float(kept.min()) >= CODEC_GAP_MIN and float(allg.min()) >= CODEC_GAP_MIN, meta["min_rel_gap"]
    meta["tensors"] = {k: dict(shape=list(v.shape), dtype=str(v.dtype).replace("torch.", "")) for k, v in sorted(tensors.items())}
    return tensors, meta
