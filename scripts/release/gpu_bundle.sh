#!/usr/bin/env bash
# Prepares what a GPU machine needs to run scripts/gpu-check.sh in one call
# (docs/distributed.md §10): the CUDA release build (xz-compressed) and the Python wheels the FSDP2 anchor needs that
# such a machine lacks, in a git-ignored folder, with run.sh, the one command to run there.
#
#   bash scripts/release/gpu_bundle.sh [DIR]      # default .gpu-bundle (under 40 MB)
#
# The GPU machines lent to this project (no network there) carry Python 3.12 with PyTorch,
# numpy, torchaudio, onnxruntime, safetensors and the NVIDIA runtime wheels (CUDA 13, cuBLAS,
# cuRAND, NCCL), but transformers 5 and tokenizers 0.23, which the official qwen-tts 0.1.1 does
# not run with; the wheels here are the official package and what it imports beyond that,
# at the versions of scripts/reference/requirements.txt (PYTHON_VERSION overrides 3.12).
# Everything else gpu-check reads is in the checkout, which travels with the call.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.gpu-bundle}
PYVER=${PYTHON_VERSION:-3.12}
mkdir -p "$DIR/wheels"

echo "== the CUDA release build" >&2
bin=$(bash scripts/release/build_cuda.sh | tail -n 1)
[[ -x $bin ]] || { echo "error: scripts/release/build_cuda.sh gave no binary ($bin)" >&2; exit 1; }
strip -o "$DIR/voiceclone" "$bin"
xz -9 -T0 -f "$DIR/voiceclone"

echo "== wheels for Python $PYVER (manylinux x86-64)" >&2
rm -f "$DIR"/wheels/*.whl
# What `scripts/reference/official.py`'s import_stack loads that the machine lacks (read off an
# import of it: the packages loaded, against the machine's package list in the device notes).
pins=(qwen-tts==0.1.1 transformers==4.57.3 tokenizers==0.22.2 "huggingface-hub>=0.34,<1.0"
  librosa==0.11.0 soundfile==0.14.0 soxr pooch platformdirs decorator cffi pycparser audioread)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR/wheels" "${pins[@]}"
# sox is published as source only: its pure-Python wheel is built here.
python3 -m pip wheel --quiet --no-deps sox==1.5.0 -w "$DIR/wheels"

cat >"$DIR/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs scripts/gpu-check.sh on a GPU machine from this bundle (scripts/release/gpu_bundle.sh made
# it). Call from the repository root: OUT=DIR bash .gpu-bundle/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
  "$here/voiceclone.xz" /tmp/voiceclone
chmod +x /tmp/voiceclone
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/vc-site "$here"/wheels/*.whl
export PYTHONPATH=/tmp/vc-site${PYTHONPATH:+:$PYTHONPATH}
# The CUDA 13 and NCCL libraries of the machine's Python (the NVIDIA wheels PyTorch runs on).
nv=$(python3 -c 'import os, nvidia; print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")')
libs=$(find "$nv" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BIN=/tmp/voiceclone bash scripts/gpu-check.sh
EOF
chmod +x "$DIR/run.sh"
size=$(du -sb "$DIR" | cut -f1)
echo "bundle: $DIR, $((size / 1000000)) MB" >&2
ls -la "$DIR" "$DIR/wheels" >&2
if ((size > 40 * 1000 * 1000)); then
  echo "error: the bundle is over 40 MB" >&2
  exit 1
fi
