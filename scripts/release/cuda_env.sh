# Sourced by scripts/release/build_cuda.sh and scripts/ci/check_cuda_build.sh: the environment that builds
# `--features cuda,nccl` (docs/architecture.md §9.2). After `source scripts/release/cuda_env.sh`:
# nvcc 13.0 on PATH, CUDA_HOME, CUDA_COMPUTE_CAP (default 90: H100/H200), LIBRARY_PATH for
# linking, and CUDA_LIB_DIRS: the directories holding the CUDA and NCCL libraries, which are
# what LD_LIBRARY_PATH needs at run time.
#
# Two sources of CUDA:
#   CUDA_HOME=/usr/local/cuda-13.0 with NCCL_LIB=DIR   a system CUDA 13.0 (NCCL_LIB: where
#                                                     libnccl.so.2 is, if not in CUDA_HOME/lib64)
#   unset (default)                                   PyPI wheels in $CUDA_PREFIX (default
#                                                     /tmp/cuda13, ~1.4 GB, made on first use)
# Where no driver is installed (a build machine without a GPU), linking uses a stub libcuda
# generated from cudarc's bindings: it is on LIBRARY_PATH only, never on LD_LIBRARY_PATH.

# The libcuda stub is generated from cudarc's driver bindings, so its source must be unpacked.
cargo fetch --locked

if [[ -n ${CUDA_HOME:-} ]]; then
  CU=$CUDA_HOME
  CU_LIB=$CU/lib64
  [[ -d $CU_LIB ]] || CU_LIB=$CU/lib
  NCCL_DIR=${NCCL_LIB:-$CU_LIB}
else
  P=${CUDA_PREFIX:-/tmp/cuda13}
  # The stamp is written after the last wheel installed: without it (an interrupted install)
  # the venv is made again.
  if [ ! -e "$P/venv/.installed" ]; then
    python3 -c 'import venv, ensurepip' 2>/dev/null ||
      { echo "error: python3 cannot make a venv: apt-get install python3-venv" >&2; exit 1; }
    rm -rf "$P/venv"
    python3 -m venv "$P/venv"
    # nvcc must be 13.0 exactly: newer nvcc writes PTX a CUDA 13.0 driver rejects.
    "$P/venv/bin/pip" install -q \
      "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
      "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-nvrtc==13.0.*" \
      "nvidia-cublas==13.0.*" "nvidia-curand==10.4.*" "nvidia-nccl-cu13==2.30.*"
    touch "$P/venv/.installed"
  fi
  NV=$("$P/venv/bin/python" -c 'import os,nvidia;print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")')
  CU=$NV/cu13 # the cu13 wheels unpack into nvidia/cu13/{bin,include,lib,nvvm}; nccl into nvidia/nccl/lib
  CU_LIB=$CU/lib
  NCCL_DIR=$NV/nccl/lib
fi
[[ -x $CU/bin/nvcc ]] || { echo "error: no nvcc in $CU/bin" >&2; exit 1; }
[[ -e $NCCL_DIR/libnccl.so.2 ]] || { echo "error: no libnccl.so.2 in $NCCL_DIR (set NCCL_LIB)" >&2; exit 1; }

L=${CUDA_LINK_DIR:-${CUDA_PREFIX:-/tmp/cuda13}/linkdir}
mkdir -p "$L"
# Unversioned names for the linker (wheels ship only the versioned files).
for s in cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13 cudart.so.13; do
  ln -sf "$CU_LIB/lib$s" "$L/lib${s%%.so*}.so"
done
ln -sf "$NCCL_DIR/libnccl.so.2" "$L/libnccl.so"
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
  if [ ! -e "$L/libcuda.so" ]; then
    # Link-time-only libcuda stub: every cu* function cudarc declares.
    CUDARC_SYS=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs | head -1)
    grep -ohE "fn cu[A-Za-z0-9_]+\(" "$CUDARC_SYS" | sed 's/fn //; s/(//' | sort -u |
      awk '{print "void "$1"(void){}"}' >"$L/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$L/libcuda.so" "$L/stub.c"
  fi
else
  rm -f "$L/libcuda.so" # the driver's own is found by the linker
fi
export PATH=$CU/bin:$PATH CUDA_HOME=$CU CUDA_ROOT=$CU CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} \
  CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2} LIBRARY_PATH=$L${LIBRARY_PATH:+:$LIBRARY_PATH}
export CUDA_LIB_DIRS=$CU_LIB:$NCCL_DIR
