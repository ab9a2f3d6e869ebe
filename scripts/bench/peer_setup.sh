#!/usr/bin/env bash
# Builds the C++ peer qwentts.cpp (ggml-based Qwen3-TTS) from a checkout of its source and converts
# the random 0.6B checkpoint to its GGUFs at Q8_0 and Q4_K_M, for scripts/bench/peer.sh
# (docs/performance.md §2). Nothing of the peer enters this repository: its source, build, venv
# and GGUFs stay where the arguments say.
#
#   scripts/bench/peer_setup.sh SRC OUT [GGML_SRC]
#
# SRC: a checkout of https://github.com/ServeurpersoCom/qwentts.cpp (the maintained upstream that
# the Hugging Face GGUFs Serveurperso/Qwen3-TTS-GGUF come from); a git clone records its commit,
# which peer.sh prints. GGML_SRC: a ggml source tree for SRC/ggml when the `ggml` submodule is not
# checked out (SRC/ggml/CMakeLists.txt missing): it is linked in. The submodule is the author's
# ggml fork; its CPU path is stock ggml ops (the fork adds GPU fusions), so upstream ggml builds the
# same CPU program. OUT: a folder of ours for the converter's venv and the GGUFs.
#
# Steps, each skipped when its output exists:
# 1. Threads: the peer has no thread option, it runs hardware_concurrency() / 2 CPU threads (one
#    per core on an SMT machine; 1 on a 2-core VM without SMT). A one-function patch of
#    SRC/src/backend.h makes QWENTTS_N_THREADS override that count (unset: the peer's own rule),
#    so that both sides run the same number of threads. peer.sh checks the count the peer prints.
# 2. Build: the README's CPU build (buildcpu.sh, the Dockerfile's CPU stage): CMake Release,
#    -DGGML_BLAS=ON (OpenBLAS: apt libopenblas-dev), ggml's default GGML_NATIVE=ON (-march=native),
#    `-j JOBS` (2); only the targets used: qwen-tts and quantize.
# 3. The converter's venv OUT/venv: gguf, safetensors and numpy from PyPI (numpy and safetensors
#    at the reference environment's versions); torch, which its safetensors reads need for bf16,
#    comes from the reference environment (.reference-venv, a .pth file: nothing is installed
#    there).
# 4. The model: MODEL (default .big-fixtures/qwen3-tts-0.6b-random) is made when absent, as
#    speak.sh does, into MODEL.tmp-peer.PID and moved into place only if MODEL still does not exist.
# 5. Conversion with the peer's own tools, in OUT: OUT/checkpoints links MODEL as
#    Qwen3-TTS-12Hz-0.6B-Base and the codec as Qwen3-TTS-Tokenizer-12Hz; SRC/convert.py
#    writes OUT/models/qwen-{talker-0.6b-base,tokenizer-12hz}-F32.gguf; SRC/build/quantize makes
#    the Q8_0 and Q4_K_M talkers and the Q8_0 tokenizer (the README pairs every talker with it).
#
# OUT holds the conversion of one MODEL and CODEC (recorded in OUT/source.txt; another pair needs
# another OUT).
#
# Environment: MODEL, CODEC (the speech tokenizer that peer.sh puts on MODEL: default
# .big-fixtures/codec-full, the full-size random one of `scripts/reference/bench_codec.py
# --make-full-size`, which this script makes when absent the way it makes MODEL; `own` takes
# MODEL/speech_tokenizer), PYTHON (the reference environment's python, default
# .reference-venv/bin/python), JOBS (2).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    usage
    exit 0
fi
if (($# < 2)); then
    usage >&2
    exit 2
fi
# The arguments are paths from where it is called; the rest from the repository root.
SRC=$(realpath "$1")
mkdir -p "$2"
OUT=$(realpath "$2")
GGML_SRC=${3:+$(realpath "$3")}
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-.big-fixtures/qwen3-tts-0.6b-random}
CODEC=${CODEC:-.big-fixtures/codec-full}
CODEC_ARG=$CODEC # as given, for the command printed at the end
PYTHON=${PYTHON:-.reference-venv/bin/python}
JOBS=${JOBS:-2}

for f in CMakeLists.txt src/backend.h convert.py tools/qwen-tts.cpp tools/quantize.cpp; do
    if [[ ! -f $SRC/$f ]]; then
        echo "error: $SRC/$f is missing: SRC must be a checkout of qwentts.cpp" >&2
        exit 1
    fi
done
if [[ ! -f $SRC/ggml/CMakeLists.txt ]]; then
    if [[ -z $GGML_SRC || ! -f $GGML_SRC/CMakeLists.txt ]]; then
        echo "error: $SRC/ggml is not checked out (git submodule update --init), or give a ggml" \
            "source tree as GGML_SRC" >&2
        exit 1
    fi
    rmdir "$SRC/ggml" 2>/dev/null || true
    ln -sfn "$GGML_SRC" "$SRC/ggml"
fi

echo "== 1. thread count override (QWENTTS_N_THREADS) in $SRC/src/backend.h" >&2
if ! grep -q QWENTTS_N_THREADS "$SRC/src/backend.h"; then
    python3 - "$SRC/src/backend.h" <<'EOF'
import sys
path = sys.argv[1]
src = open(path).read()
old = "    int n = (int) std::thread::hardware_concurrency() / 2;\n"
new = ("    const char * forced = std::getenv(\"QWENTTS_N_THREADS\");  // voiceclone's peer.sh\n"
       "    int n = forced ? std::atoi(forced) : (int) std::thread::hardware_concurrency() / 2;\n")
if src.count(old) != 1:
    sys.exit(f"error: {path}: the thread rule changed, the patch no longer applies")
if "#include <cstdlib>" not in src:
    src = src.replace("#include <thread>\n", "#include <cstdlib>\n#include <thread>\n", 1)
open(path, "w").write(src.replace(old, new))
EOF
fi

echo "== 2. build (Release, GGML_BLAS=ON, native CPU, -j $JOBS)" >&2
if [[ ! -x $SRC/build/qwen-tts || ! -x $SRC/build/quantize || $SRC/src/backend.h -nt $SRC/build/qwen-tts ]]; then
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_BLAS=ON >"$OUT/cmake.log" 2>&1 || {
        cat "$OUT/cmake.log" >&2
        exit 1
    }
    cmake --build "$SRC/build" --config Release -j "$JOBS" --target qwen-tts quantize >>"$OUT/cmake.log" 2>&1 || {
        tail -40 "$OUT/cmake.log" >&2
        exit 1
    }
fi
grep -E 'GGML_NATIVE|GGML_BLAS|CMAKE_BUILD_TYPE' "$SRC/build/CMakeCache.txt" | grep -v '^//' >&2 || true

echo "== 3. converter venv $OUT/venv" >&2
VENV_PY=$OUT/venv/bin/python
if ! "$VENV_PY" -c "import gguf, safetensors, numpy, torch" >/dev/null 2>&1; then
    read -r numpy_v st_v site <<<"$("$PYTHON" -c 'import numpy, safetensors, sysconfig
print(numpy.__version__, safetensors.__version__, sysconfig.get_paths()["purelib"])')"
    "$PYTHON" -m venv "$OUT/venv"
    "$VENV_PY" -m pip install --quiet "numpy==$numpy_v" "safetensors==$st_v" gguf
    echo "$site" >"$("$VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/reference-torch.pth"
    "$VENV_PY" -c "import gguf, safetensors, numpy, torch"
fi

echo "== 4. the model $MODEL and the codec $CODEC" >&2
make_once() { # DIR COMMAND...: COMMAND DIR.tmp-peer.PID, moved to DIR unless another run made it
    local dir=$1 tmp=$1.tmp-peer.$$
    shift
    "$@" "$tmp"
    if [[ ! -e $dir ]]; then mv -T "$tmp" "$dir"; else rm -rf "$tmp"; fi
}
if [[ ! -f $MODEL/model.safetensors ]]; then
    make_once "$MODEL" "$PYTHON" scripts/reference/make_fixtures.py --full-size
fi
if [[ $CODEC == own ]]; then
    CODEC=$MODEL/speech_tokenizer
elif [[ ! -f $CODEC/model.safetensors ]]; then
    make_once "$CODEC" "$PYTHON" scripts/reference/bench_codec.py --make-full-size
fi

echo "== 5. conversion into $OUT/models" >&2
source="model $(realpath "$MODEL"), codec $(realpath "$CODEC")"
if [[ -f $OUT/source.txt && $(cat "$OUT/source.txt") != "$source" ]]; then
    echo "error: $OUT holds the GGUFs of $(cat "$OUT/source.txt"), not of $source: take another OUT" >&2
    exit 1
fi
echo "$source" >"$OUT/source.txt"
mkdir -p "$OUT/checkpoints" "$OUT/models"
ln -sfn "$(realpath "$MODEL")" "$OUT/checkpoints/Qwen3-TTS-12Hz-0.6B-Base"
ln -sfn "$(realpath "$CODEC")" "$OUT/checkpoints/Qwen3-TTS-Tokenizer-12Hz"
(cd "$OUT" && "$VENV_PY" "$SRC/convert.py") >"$OUT/convert.log" 2>&1 || {
    cat "$OUT/convert.log" >&2
    exit 1
}
quantize() { # name type
    local dst=$OUT/models/qwen-$1-$2.gguf
    if [[ ! -f $dst ]]; then
        "$SRC/build/quantize" "$OUT/models/qwen-$1-F32.gguf" "$dst.tmp" "$2" >>"$OUT/quantize.log" 2>&1 || {
            tail -20 "$OUT/quantize.log" >&2
            exit 1
        }
        mv "$dst.tmp" "$dst"
    fi
}
quantize talker-0.6b-base Q8_0
quantize talker-0.6b-base Q4_K_M
quantize tokenizer-12hz Q8_0
ls -l "$OUT/models" >&2
cat <<EOF
PEER_DIR=$SRC/build \\
PEER_Q8_0=$OUT/models/qwen-talker-0.6b-base-Q8_0.gguf \\
PEER_Q4_K_M=$OUT/models/qwen-talker-0.6b-base-Q4_K_M.gguf \\
PEER_CODEC=$OUT/models/qwen-tokenizer-12hz-Q8_0.gguf \\
MODEL=$MODEL CODEC=$CODEC_ARG scripts/bench/peer.sh
EOF
