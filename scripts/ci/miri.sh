#!/usr/bin/env bash
# Runs the unit tests of the vc-kernels crate under Miri (undefined behaviour, out-of-bounds and
# uninitialised reads, data races), twice: the baseline build (scalar paths; the `gemm`
# crate's scalar kernels) and an AVX2 + FMA build (`-C target-feature`: Miri cannot run
# `cpuid`, so the run-time checks see only the features enabled at compile time; there the
# AVX2 paths of the kernels and the gemm crate's FMA kernels run). Known: in the AVX2 build the 8
# tests that reach a GEMM stop inside the gemm crate's own dispatch (`Option::unwrap` on `None`
# at gemm-f32's `gemm_def!`, with or without its x86-v4 feature); the scalar build runs all.
#
#   scripts/ci/miri.sh              # both builds
#   scripts/ci/miri.sh scalar       # one of them (scalar | avx2)
#   scripts/ci/miri.sh avx2 gemm::  # a test filter
#
# The `vc-kernels` crate depends on nothing Miri cannot build (gemm, rayon, half, anyhow, libc;
# no candle, no whisper.cpp), so Miri runs its own tests, with the workspace's Cargo.lock.
# Needs a nightly toolchain with the miri and rust-src components
# (`rustup +nightly component add miri rust-src`). Tests shrink their sizes under `cfg(miri)`.
# Aliasing is checked with Tree Borrows: rayon's crossbeam-epoch is known not to satisfy
# Stacked Borrows (crossbeam-rs/crossbeam#996 runs its own Miri tests with Tree Borrows).
# Not part of .ci/run (minutes on 2 cores; the first run also builds Miri's sysroot).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
WHICH=${1:-all}
FILTER=${2:-}
# Miri runs threads; fewer keep it fast (the thread-count tests build their own pools).
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
# rayon's global pool keeps its threads until the process exits, which Miri reports as threads
# left running when main returns: -Zmiri-ignore-leaks accepts that (it also turns off the report
# of memory still allocated at exit, which those threads' state would trip anyway).
export MIRIFLAGS=${MIRIFLAGS:--Zmiri-tree-borrows -Zmiri-ignore-leaks}
cargo +nightly miri setup -q

run() {
    local name=$1 flags=$2
    echo "== miri: $name build${flags:+ ($flags)}" >&2
    local start=$SECONDS
    RUSTFLAGS="$flags" cargo +nightly miri test -p vc-kernels \
        --target-dir "$ROOT/target/miri-$name" --lib -- -Zunstable-options --report-time \
        ${FILTER:+"$FILTER"}
    echo "== miri: $name build passed in $((SECONDS - start)) s" >&2
}

case $WHICH in
    all | scalar) run scalar "" ;;&
    all | avx2) run avx2 "-C target-feature=+avx2,+fma" ;;
    scalar) ;;
    *) echo "usage: $0 [all|scalar|avx2] [test filter]" >&2; exit 2 ;;
esac
