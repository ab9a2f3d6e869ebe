#!/usr/bin/env bash
# Checks that the GPU build (`--features cuda,nccl`) builds on a machine without a GPU, the way
# users build it (docs/architecture.md §9.2): scripts/release/build_cuda.sh (CUDA 13.0 from PyPI wheels,
# a link-time libcuda stub, CUDA_COMPUTE_CAP=90, its run-time libraries checked), then every
# target compiled with the same kernels (`cargo check --all-targets`; extra arguments go to it).
# A fresh target dir takes ~15 min on 2 cores (most of it candle's CUDA kernels).
#   scripts/ci/check_cuda_build.sh
#   CARGO_TARGET_DIR=/tmp/tc scripts/ci/check_cuda_build.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/release/build_cuda.sh
source scripts/release/cuda_env.sh
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
# The release profile, as the build above: the kernels are built once per profile.
cargo check --locked --release --workspace --features cuda,nccl --all-targets "$@"
