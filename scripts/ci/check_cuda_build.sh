#!/usr/bin/env bash
# Checks that the GPU build (`--features cuda,nccl`) builds on a machine without a GPU, the way
# users build it (docs/architecture.md §9.2): scripts/release/build_cuda.sh (CUDA 13.0 from PyPI wheels,
# a link-time libcuda stub, CUDA_COMPUTE_CAP=90, its run-time libraries checked), then every
# target compiled with the same kernels (`cargo check --all-targets`; extra arguments go to it).
# A fresh target dir takes ~15 min on 2 cores (most of it candle's CUDA kernels). PROFILE picks
# the profile (default release, as users build it). CI passes PROFILE=dev, the test suite's
# target dir (the dependencies the GPU features leave alone are not checked again) and
# CHECK_ONLY=1: every target compiled with the GPU features, without building and linking the
# binary (scripts/release/build_cuda.sh does that, with its libraries checked, for a release).
#   scripts/ci/check_cuda_build.sh
#   CARGO_TARGET_DIR=/tmp/tc scripts/ci/check_cuda_build.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PROFILE=${PROFILE:-release}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
if [[ -z ${CHECK_ONLY:-} ]]; then
    bash scripts/release/build_cuda.sh
fi
source scripts/release/cuda_env.sh
# The profile of the build above: the kernels are built once per profile.
cargo check --locked --profile "$PROFILE" --workspace --features cuda,nccl --all-targets "$@"
