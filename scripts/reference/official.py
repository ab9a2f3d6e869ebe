#!/usr/bin/env python3
"""The official Qwen3-TTS stack (`qwen-tts==0.1.1`) and the model directories built with it: what
the fixture generators and the official-side benchmarks in this folder share.

* `import_stack()` imports torch, transformers and the official classes (late, so that `--help`
  works without them) and pins the numerics the fixtures rely on (one thread, deterministic
  algorithms); it returns the imported names so that a script can bind them too.
* The constants of the real checkpoints (docs/model.md §2, §3.1): vocabularies, codec token ids,
  languages, the added-token block, `generation_config.json`.
* `config.json` with every field (`build_config_dict`, checked against the official config
  classes), the talker's deterministic init (`init_weights`), `build_tts_model`, `save_bf16`,
  `tokenizer_config_dict`, `load_official`.
* The speech tokenizer: the shipped `speech_tokenizer/config.json` values (`CODEC_FULL`), smaller
  variants of it (`codec_spec`), its config with every field (`codec_config_dict`), a model from
  it (`new_codec_model`) with O(1) activations in every block (`init_codec_weights`), and its
  directory in the official layout (`write_codec_dir`).

Run everything here with the reference environment's Python (`.reference-venv/bin/python`, made
by `scripts/reference/setup_venv.sh`).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

# The names `import_stack` binds in this module (and returns): the heavy packages and the
# official classes the builders below use.
STACK_NAMES = (
    "np", "torch", "F", "librosa", "sf", "safetensors_save", "safetensors_load",
    "Qwen3TTSModel", "Qwen3TTSConfig", "Qwen3TTSForConditionalGeneration",
    "Qwen3TTSTalkerConfig", "Qwen3TTSSpeakerEncoderConfig", "Qwen3TTSTalkerCodePredictorConfig",
    "Qwen3TTSTokenizerV2Config", "Qwen3TTSTokenizerV2Model", "Qwen3TTSTokenizerV2DecoderConfig",
    "MimiConfig", "mel_spectrogram", "Qwen3TTSTokenizer", "modeling",
)


def log(msg: str) -> None:
    """A progress line of the fixture generators (stdout, flushed so it interleaves with torch's)."""
    print(msg, flush=True)


def import_stack(threads: int = 1, deterministic: bool = True) -> dict:
    """Imports the official stack into this module and returns it as {name: object}; torch runs
    on `threads` intra-op threads, with deterministic algorithms unless a benchmark asks otherwise.

    A missing package is reported with the way to get the environment, not a bare ImportError."""
    global np, torch, F, librosa, sf, safetensors_save, safetensors_load
    global Qwen3TTSModel, Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    global Qwen3TTSTalkerConfig, Qwen3TTSSpeakerEncoderConfig, Qwen3TTSTalkerCodePredictorConfig
    global Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model, Qwen3TTSTokenizerV2DecoderConfig
    global MimiConfig, mel_spectrogram, Qwen3TTSTokenizer, modeling
    try:
        import numpy as np
        import torch
        import torch.nn.functional as F
        import librosa
        import soundfile as sf
        from safetensors.torch import save_file as safetensors_save, load_file as safetensors_load
        from transformers import MimiConfig
        from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer
        from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
        from qwen_tts.core.models.configuration_qwen3_tts import (
            Qwen3TTSSpeakerEncoderConfig,
            Qwen3TTSTalkerCodePredictorConfig,
            Qwen3TTSTalkerConfig,
        )
        from qwen_tts.core.models import modeling_qwen3_tts as modeling
        from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram
        from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
            Qwen3TTSTokenizerV2Config,
            Qwen3TTSTokenizerV2DecoderConfig,
        )
        from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

        import transformers
    except ImportError as e:
        raise SystemExit(
            f"error: {e}. The official package runs in the reference environment: "
            "bash scripts/reference/setup_venv.sh, then run this script with .reference-venv/bin/python"
        ) from None

    assert transformers.__version__ == "4.57.3", f"need transformers==4.57.3, have {transformers.__version__}"
    torch.set_num_threads(threads)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return {name: globals()[name] for name in STACK_NAMES}


TEXT_VOCAB_SIZE = 151936


CODEC_VOCAB_SIZE = 3072


NUM_CODE_GROUPS = 16


CP_VOCAB_SIZE = 2048


CODEC_IDS = dict(
    codec_pad_id=2148,
    codec_bos_id=2149,
    codec_eos_token_id=2150,
    codec_think_id=2154,
    codec_nothink_id=2155,
    codec_think_bos_id=2156,
    codec_think_eos_id=2157,
)


# Base / VoiceDesign: the 10 non-dialect languages (CustomVoice adds sichuan_dialect 2062, beijing_dialect 2074).
CODEC_LANGUAGE_ID = {
    "english": 2050,
    "german": 2053,
    "spanish": 2054,
    "chinese": 2055,
    "japanese": 2058,
    "french": 2061,
    "korean": 2064,
    "russian": 2069,
    "italian": 2070,
    "portuguese": 2071,
}


TOP_LEVEL_IDS = dict(
    im_start_token_id=151644,
    im_end_token_id=151645,
    assistant_token_id=77091,
    tts_pad_token_id=151671,
    tts_bos_token_id=151672,
    tts_eos_token_id=151673,
)


GENERATION_CONFIG = dict(
    do_sample=True,
    temperature=0.9,
    top_k=50,
    top_p=1.0,
    repetition_penalty=1.05,
    subtalker_dosample=True,
    subtalker_temperature=0.9,
    subtalker_top_k=50,
    subtalker_top_p=1.0,
    max_new_tokens=8192,
)


# The added-token block (ids 151643..151675): the Qwen3 block (special flags as in the Qwen3
# tokenizer_config.json) followed by the Qwen3-Omni / Qwen3-TTS audio + TTS tokens.
ADDED_TOKENS = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
    (151669, "<|audio_start|>", True),
    (151670, "<|audio_end|>", True),
    (151671, "<tts_pad>", True),
    (151672, "<tts_text_bos>", True),
    (151673, "<tts_text_eod>", True),
    (151674, "<tts_text_bos_single>", True),
    (151675, "<|audio_pad|>", True),
]


# transformers 4.57.3 `_patch_mistral_regex` replaces the regex for *local-directory* loads with
# `fix_mistral_regex=True` (what `Qwen3TTSModel.from_pretrained` passes) unless config.json's
# `transformers_version` is <= 4.57.2 (or >= 5.0.0).  The fixtures must give the standard Qwen2
# tokenization through the official local load, so config.json says 4.57.2 (see README.md).
CONFIG_TRANSFORMERS_VERSION = "4.57.2"


TINY_SPEAKER = dict(
    mel_dim=128,  # fixed by mel_spectrogram(num_mels=128)
    enc_channels=[16, 16, 16, 16, 48],  # divisible by res2net scale 8
    enc_kernel_sizes=[5, 3, 3, 3, 1],
    enc_dilations=[1, 2, 3, 4, 1],
    enc_attention_channels=8,
    enc_res2net_scale=8,
    enc_se_channels=8,
    sample_rate=24000,
)


# Decoder config fields that are read by the official code but are not __init__ parameters of
# Qwen3TTSTokenizerV2DecoderConfig (they arrive through **kwargs; without head_dim the official code
# silently uses hidden_size // num_attention_heads, without codebook_dim it raises).
CODEC_DECODER_KWARG_FIELDS = ("codebook_dim", "head_dim")


# Predictor lm_head rows are drawn 2x N(0, 1/fan_in) x exp(N(0,1)) like codec_head and then multiplied by
# this power of two (exact in bf16; argmax unchanged): the speak cases make ~2000 sub-code decisions
# per model, and at gain 1 about 0.5 % of them have a top-1/top-2 gap below MARGIN_MIN.
LM_HEAD_GAIN = 4.0


def build_config_dict(spec: dict) -> dict:
    cp = dict(
        model_type="qwen3_tts_talker_code_predictor",
        vocab_size=CP_VOCAB_SIZE,
        hidden_size=spec["cp_hidden"],
        intermediate_size=spec["cp_intermediate"],
        num_hidden_layers=spec["cp_layers"],
        num_attention_heads=spec["cp_heads"],
        num_key_value_heads=spec["cp_kv_heads"],
        head_dim=spec["cp_head_dim"],
        hidden_act="silu",
        max_position_embeddings=65536,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        rope_theta=1000000,
        rope_scaling=None,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        layer_types=["full_attention"] * spec["cp_layers"],
        attention_dropout=0.0,
        num_code_groups=NUM_CODE_GROUPS,
    )
    talker = dict(
        model_type="qwen3_tts_talker",
        vocab_size=CODEC_VOCAB_SIZE,
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        hidden_act="silu",
        max_position_embeddings=32768,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        rope_theta=1000000,
        rope_scaling=dict(interleaved=True, mrope_section=list(spec["mrope_section"]), rope_type="default"),
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        attention_dropout=0.0,
        num_code_groups=NUM_CODE_GROUPS,
        text_hidden_size=spec["text_hidden"],
        text_vocab_size=TEXT_VOCAB_SIZE,
        position_id_per_seconds=13,
        **CODEC_IDS,
        spk_id={},
        spk_is_dialect={},
        codec_language_id=dict(CODEC_LANGUAGE_ID),
        code_predictor_config=cp,
    )
    speaker = dict(spec["speaker"])
    speaker["enc_dim"] = spec["hidden"]  # the x-vector is injected into the codec-embedding stream
    speaker = {k: speaker[k] for k in inspect.signature(Qwen3TTSSpeakerEncoderConfig.__init__).parameters if k != "self"}
    cfg = dict(
        architectures=["Qwen3TTSForConditionalGeneration"],
        model_type="qwen3_tts",
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size=spec["size"],
        tts_model_type="base",
        **TOP_LEVEL_IDS,
        torch_dtype="bfloat16",
        transformers_version=CONFIG_TRANSFORMERS_VERSION,
        speaker_encoder_config=speaker,
        talker_config=talker,
    )
    _check_all_init_params(cfg)
    return cfg


def init_params(cls) -> list[str]:
    return [
        n
        for n, p in inspect.signature(cls.__init__).parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def _check_all_init_params(cfg: dict) -> None:
    """Every __init__ parameter of every config class must be written explicitly."""
    checks = [
        (Qwen3TTSConfig, cfg),
        (Qwen3TTSTalkerConfig, cfg["talker_config"]),
        (Qwen3TTSTalkerCodePredictorConfig, cfg["talker_config"]["code_predictor_config"]),
        (Qwen3TTSSpeakerEncoderConfig, cfg["speaker_encoder_config"]),
    ]
    for cls, d in checks:
        missing = [p for p in init_params(cls) if p not in d]
        assert not missing, f"{cls.__name__}: config.json lacks {missing}"


def verify_config_roundtrip(model_dir: Path, cfg: dict) -> None:
    """Load config.json with the official class and check every field we wrote reads back."""
    loaded = Qwen3TTSConfig.from_pretrained(str(model_dir))

    def cmp(obj, d, path):
        for k, v in d.items():
            if k in ("architectures", "model_type", "transformers_version", "torch_dtype"):
                continue
            got = getattr(obj, k)
            if isinstance(v, dict) and k in ("talker_config", "code_predictor_config", "speaker_encoder_config"):
                cmp(got, v, f"{path}.{k}")
            else:
                assert got == v, f"{path}.{k}: wrote {v!r}, official class reads {got!r}"

    cmp(loaded, cfg, "config")


def tokenizer_config_dict() -> dict:
    return dict(
        add_bos_token=False,
        add_prefix_space=False,
        added_tokens_decoder={
            str(i): dict(content=c, lstrip=False, normalized=False, rstrip=False, single_word=False, special=s)
            for i, c, s in ADDED_TOKENS
        },
        additional_special_tokens=[c for i, c, s in ADDED_TOKENS if s and c != "<|endoftext|>"],
        bos_token=None,
        clean_up_tokenization_spaces=False,
        eos_token="<|im_end|>",
        errors="replace",
        model_max_length=131072,
        pad_token="<|endoftext|>",
        split_special_tokens=False,
        tokenizer_class="Qwen2Tokenizer",
        unk_token=None,
    )


def link_or_copy(src: Path, dst: Path, copy: bool) -> None:
    """Identical files in a second model dir are relative symlinks (keeps the working tree small)."""
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.is_dir():
        shutil.rmtree(dst)
    if copy:
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    else:
        dst.symlink_to(os.path.relpath(src, dst.parent))


def init_weights(model, gen) -> None:
    """Deterministic init with O(1) activations and robust greedy decisions.

    Linear/conv weights ~ N(0, 1/fan_in); embeddings ~ N(0, 1); norm weights 1 + 0.2 N; biases
    0.1 N.  The output heads (talker codec_head, predictor lm_heads) get heavy-tailed rows (row
    scale exp(N) and 2x std) so that top-1/top-2 logit gaps are large; the predictor lm_heads are
    further multiplied by LM_HEAD_GAIN.  The codec_head EOS row is rescaled later from the speak
    cases (`calibrate_eos`).
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if len(shape) == 1:
                if "norm" in name:
                    v = 1.0 + 0.2 * torch.randn(shape, generator=gen)
                else:
                    v = 0.1 * torch.randn(shape, generator=gen)
            elif "embedding" in name:
                v = torch.randn(shape, generator=gen)
            else:
                fan_in = int(np.prod(shape[1:]))
                v = torch.randn(shape, generator=gen) / (fan_in**0.5)
                if "codec_head" in name or "lm_head" in name:
                    row = torch.exp(1.0 * torch.randn((shape[0], 1), generator=gen))
                    v = 2.0 * v * row
                    if "lm_head" in name:
                        v = v * LM_HEAD_GAIN  # a power of two: same bf16 mantissas, same argmax
            p.copy_(v)


def build_tts_model(spec: dict, cfg: dict, seed: int, randomize: bool = True):
    config = Qwen3TTSConfig(**copy.deepcopy({k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}))
    torch.manual_seed(seed)
    model = Qwen3TTSForConditionalGeneration(config).eval()
    if randomize:
        gen = torch.Generator().manual_seed(seed)
        init_weights(model, gen)
    return model


def save_bf16(model, path: Path) -> dict:
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    safetensors_save(sd, str(path), metadata={"format": "pt"})
    return sd


# The shipped speech_tokenizer/config.json values (docs/model.md §2), every field of every config class.
CODEC_FULL = dict(
    encoder=dict(
        sampling_rate=24000,
        frame_rate=12.5,
        audio_channels=1,
        hidden_size=512,
        num_filters=64,
        num_residual_layers=1,
        upsampling_ratios=[8, 6, 5, 4],
        kernel_size=7,
        last_kernel_size=3,
        residual_kernel_size=3,
        dilation_growth_rate=2,
        use_causal_conv=True,
        pad_mode="constant",
        compress=2,
        trim_right_ratio=1.0,
        codebook_size=2048,
        codebook_dim=256,
        num_quantizers=32,
        use_conv_shortcut=False,
        vector_quantization_hidden_dimension=256,
        num_semantic_quantizers=1,
        upsample_groups=512,
        num_hidden_layers=8,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        hidden_act="gelu",
        max_position_embeddings=8000,
        initializer_range=0.02,
        norm_eps=1e-5,
        use_cache=False,
        use_streaming=False,
        rope_theta=10000.0,
        sliding_window=250,
        attention_dropout=0.0,
        layer_scale_initial_scale=0.01,
        attention_bias=False,
    ),
    decoder=dict(
        codebook_size=2048,
        codebook_dim=512,
        hidden_size=512,
        latent_dim=1024,
        max_position_embeddings=8000,
        rope_theta=10000,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        attention_bias=False,
        sliding_window=72,
        intermediate_size=1024,
        hidden_act="silu",
        layer_scale_initial_scale=0.01,
        rms_norm_eps=1e-5,
        num_hidden_layers=8,
        num_quantizers=16,
        num_semantic_quantizers=1,
        semantic_codebook_size=4096,
        vector_quantization_hidden_dimension=512,
        upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2],
        decoder_dim=1536,
        attention_dropout=0.0,
    ),
    encoder_valid_num_quantizers=16,
    input_sample_rate=24000,
    output_sample_rate=24000,
    decode_upsample_rate=1920,
    encode_downsample_rate=1920,
)


def codec_spec(encoder: dict, decoder: dict) -> dict:
    """A speech-tokenizer spec that differs from the shipped one (CODEC_FULL) in the given
    encoder and decoder fields; every other field, and the order of all of them, is the shipped
    config's."""
    spec = copy.deepcopy(CODEC_FULL)
    for part, changes in (("encoder", encoder), ("decoder", decoder)):
        unknown = set(changes) - set(spec[part])
        assert not unknown, f"not fields of the shipped {part} config: {sorted(unknown)}"
        spec[part].update(copy.deepcopy(changes))
    return spec


def codec_config_dict(spec: dict) -> dict:
    """speech_tokenizer/config.json with every field (save_pretrained would only write non-defaults)."""
    cfg = dict(
        architectures=["Qwen3TTSTokenizerV2Model"],
        model_type="qwen3_tts_tokenizer_12hz",
        encoder_config=dict(model_type="mimi", **spec["encoder"]),
        decoder_config=dict(spec["decoder"]),
        encoder_valid_num_quantizers=spec["encoder_valid_num_quantizers"],
        input_sample_rate=spec["input_sample_rate"],
        output_sample_rate=spec["output_sample_rate"],
        decode_upsample_rate=spec["decode_upsample_rate"],
        encode_downsample_rate=spec["encode_downsample_rate"],
        torch_dtype="float32",
        transformers_version="4.57.3",
    )
    checks = (
        (MimiConfig, cfg["encoder_config"]),
        (Qwen3TTSTokenizerV2DecoderConfig, cfg["decoder_config"]),
        (Qwen3TTSTokenizerV2Config, cfg),
    )
    for cls, d in checks:
        missing = [p for p in init_params(cls) if p not in d]
        assert not missing, f"{cls.__name__}: speech_tokenizer/config.json lacks {missing}"
    for k in CODEC_DECODER_KWARG_FIELDS:
        assert k in cfg["decoder_config"], k
    return cfg


CODEC_PREPROCESSOR_CONFIG = dict(
    chunk_length_s=None,
    feature_extractor_type="EncodecFeatureExtractor",
    feature_size=1,
    overlap=None,
    padding_side="right",
    padding_value=0.0,
    return_attention_mask=True,
    sampling_rate=24000,
)


def new_codec_model(cfg: dict, seed: int):
    config = Qwen3TTSTokenizerV2Config(
        **{k: v for k, v in copy.deepcopy(cfg).items() if k not in ("architectures", "model_type")}
    )
    torch.manual_seed(seed)
    return Qwen3TTSTokenizerV2Model(config).eval()


def codec_codebooks(model) -> tuple[list, list]:
    """(encoder codebooks [semantic, acoustic 0..30], decoder codebooks [rvq_first, rvq_rest 0..14]);
    each item is (embed_sum / embedding_sum, cluster_usage)."""
    q = model.encoder.quantizer
    enc = [(l.codebook.embed_sum, l.codebook.cluster_usage) for l in q.semantic_residual_vector_quantizer.layers]
    enc += [(l.codebook.embed_sum, l.codebook.cluster_usage) for l in q.acoustic_residual_vector_quantizer.layers]
    dq = model.decoder.quantizer
    dec = [(l._codebook.embedding_sum, l._codebook.cluster_usage) for l in dq.rvq_first.vq.layers]
    dec += [(l._codebook.embedding_sum, l._codebook.cluster_usage) for l in dq.rvq_rest.vq.layers]
    return enc, dec


def init_codec_weights(model, gen) -> None:
    """Deterministic init with O(1) activations in every block of the codec.

    Conv / linear weights N(0, 1/fan_in) (transposed convs: fan_in = in*k/stride), biases 0.1 N,
    LayerNorm / RMSNorm weights 1 + 0.2 N (LayerNorm bias 0.1 N), layer scales and ConvNeXt gamma
    0.5 + 0.1 N (the official inits 0.01 / 1e-6 would make the transformers and ConvNeXt blocks
    invisible in the references), SnakeBeta log-alpha / log-beta 0.2 N, decoder residual units'
    second conv x0.3 (else the 12 residual units grow the signal ~80x).  Codebooks: entries
    N(0, 1), cluster_usage 0.5 + U(0, 1) (so embed = embed_sum / usage is exercised); the encoder
    codebooks are then re-drawn by `build_tiny_codec`.
    """
    nn = torch.nn
    with torch.no_grad():
        for _, m in model.named_modules():
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
                w = m.weight
                if isinstance(m, nn.ConvTranspose1d):
                    fan_in = w.shape[0] * w.shape[2] / m.stride[0]
                elif isinstance(m, nn.Conv1d):
                    fan_in = w.shape[1] * w.shape[2]
                else:
                    fan_in = w.shape[1]
                w.copy_(torch.randn(tuple(w.shape), generator=gen) / fan_in**0.5)
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(tuple(m.bias.shape), generator=gen))
            elif isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm"):
                m.weight.copy_(1.0 + 0.2 * torch.randn(tuple(m.weight.shape), generator=gen))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.1 * torch.randn(tuple(m.bias.shape), generator=gen))
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("scale", "gamma"):
                p.copy_(0.5 + 0.1 * torch.randn(tuple(p.shape), generator=gen))
            elif leaf in ("alpha", "beta"):
                p.copy_(0.2 * torch.randn(tuple(p.shape), generator=gen))
        for blk in model.decoder.decoder:
            for unit in getattr(blk, "block", [])[2:]:
                unit.conv2.conv.weight.mul_(0.3)  # residual branches: keeps the 12-unit stack O(1)
        enc_cbs, dec_cbs = codec_codebooks(model)
        for emb, usage in enc_cbs + dec_cbs:
            usage.copy_(0.5 + torch.rand(tuple(usage.shape), generator=gen))
            emb.copy_(torch.randn(tuple(emb.shape), generator=gen) * usage[:, None])


def write_codec_dir(dst: Path, cfg: dict, sd: dict) -> None:
    """A codec in the official `speech_tokenizer/` layout (f32 safetensors)."""
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    dst.mkdir(parents=True, exist_ok=True)
    safetensors_save(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    write_json(dst / "config.json", cfg)
    write_json(dst / "preprocessor_config.json", CODEC_PREPROCESSOR_CONFIG)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_official(model_dir: Path, dtype=None, device: str = "cpu"):
    """The official model as a user loads it: `Qwen3TTSModel.from_pretrained` (f32 on the CPU
    unless asked otherwise)."""
    return Qwen3TTSModel.from_pretrained(str(model_dir), dtype=dtype or torch.float32, device_map=device)
