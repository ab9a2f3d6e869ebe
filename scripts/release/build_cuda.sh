#!/usr/bin/env bash
# Builds the CUDA binary (`--features cuda,nccl`), dynamically linked as it must be: the driver's
# libcuda is the machine's own (docs/architecture.md §9.2, §9.4). The C++ runtime is linked in;
# what the binary needs at run time is checked to be only the driver, CUDA, NCCL and glibc
# (with libgcc_s, which Rust's standard library unwinds with). The last line printed is the path
# of the binary.
#
#   bash scripts/release/build_cuda.sh                   # CUDA 13.0 from PyPI wheels, release profile
#   CUDA_HOME=/usr/local/cuda-13.0 NCCL_LIB=/usr/lib/x86_64-linux-gnu bash scripts/release/build_cuda.sh
#   PROFILE=dev bash scripts/release/build_cuda.sh       # another cargo profile
#
# Environment: CUDA_HOME/NCCL_LIB or CUDA_PREFIX (scripts/release/cuda_env.sh), CUDA_COMPUTE_CAP (90),
# CARGO_TARGET_DIR (default target/cuda), PROFILE (release).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/release/cuda_env.sh
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
PROFILE=${PROFILE:-release}

nvcc --version | tail -n 1 >&2
cargo build --locked --features cuda,nccl --profile "$PROFILE" --bin voiceclone >&2
dir=$PROFILE
[[ $PROFILE == dev ]] && dir=debug
bin=$CARGO_TARGET_DIR/$dir/voiceclone

# What the binary asks the dynamic loader for, and that it is nothing else.
allowed='^(libcuda\.so\.1|libcublas\.so\.13|libcublasLt\.so\.13|libcurand\.so\.10|libnvrtc\.so\.13|libcudart\.so\.13|libnccl\.so\.2|libc\.so\.6|libm\.so\.6|libgcc_s\.so\.1|ld-linux-x86-64\.so\.2|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1)$'
needed=$(readelf -d "$bin" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p')
unexpected=$(grep -vE "$allowed" <<<"$needed" || true)
if [[ -n $unexpected ]]; then
    echo "error: $bin needs libraries outside the driver, CUDA, NCCL and glibc: $unexpected" >&2
    exit 1
fi
{
    echo "needed: $(tr '\n' ' ' <<<"$needed")"
    echo "ldd with LD_LIBRARY_PATH=$CUDA_LIB_DIRS (libcuda.so.1 comes from the driver):"
    LD_LIBRARY_PATH=$CUDA_LIB_DIRS ldd "$bin" | sed 's/ (0x[0-9a-f]*)//'
} >&2
echo "$PWD/$bin"
