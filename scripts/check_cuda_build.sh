#!/usr/bin/env bash
# Checks that the GPU build (`--features cuda,nccl`) compiles on a machine without a GPU, following
# docs/architecture.md §9.2: CUDA 13.0 from PyPI wheels (in $CUDA_PREFIX, default /tmp/cuda13, created
# on first use, ~1.4 GB), a link-time-only libcuda stub, CUDA_COMPUTE_CAP=90 (H100/H200).
# Extra arguments go to cargo check. A fresh target dir takes ~10-20 min on 2 cores (kernel build).
#   scripts/check_cuda_build.sh            # cargo check --features cuda,nccl --all-targets
#   CARGO_TARGET_DIR=/tmp/tc scripts/check_cuda_build.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The libcuda stub is generated from cudarc's driver bindings, so its source must be unpacked.
cargo fetch --locked

P=${CUDA_PREFIX:-/tmp/cuda13}
if [ ! -x "$P/venv/bin/python" ]; then
  python3 -m venv "$P/venv"
  # nvcc must be 13.0 exactly: newer nvcc writes PTX a CUDA 13.0 driver rejects.
  "$P/venv/bin/pip" install -q \
    "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-nvrtc==13.0.*" \
    "nvidia-cublas==13.0.*" "nvidia-curand==10.4.*" "nvidia-nccl-cu13==2.30.*"
fi
NV=$("$P/venv/bin/python" -c 'import os,nvidia;print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")')
CU=$NV/cu13 # the cu13 wheels unpack into nvidia/cu13/{bin,include,lib,nvvm}; nccl into nvidia/nccl/lib
L=$P/linkdir
if [ ! -e "$L/libcuda.so" ]; then
  mkdir -p "$L"
  # Link-time-only libcuda stub: every cu* function cudarc declares. Never put it on LD_LIBRARY_PATH.
  CUDARC_SYS=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs | head -1)
  grep -ohE "fn cu[A-Za-z0-9_]+\(" "$CUDARC_SYS" | sed 's/fn //; s/(//' | sort -u |
    awk '{print "void "$1"(void){}"}' >"$L/stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$L/libcuda.so" "$L/stub.c"
  for s in cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13 cudart.so.13; do
    ln -sf "$CU/lib/lib$s" "$L/lib${s%%.so*}.so"
  done
  ln -sf "$NV/nccl/lib/libnccl.so.2" "$L/libnccl.so"
fi
export PATH=$CU/bin:$PATH CUDA_HOME=$CU CUDA_ROOT=$CU CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} \
  CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2} LIBRARY_PATH=$L
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}

nvcc --version | tail -1
cargo check --locked --features cuda,nccl --all-targets "$@"
