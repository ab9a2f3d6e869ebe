#!/usr/bin/env bash
# Builds the CPU release binary: one static, stripped x86-64 Linux executable that runs on any
# x86-64-v3 CPU without a Rust toolchain or any shared library (docs/architecture.md §9.4).
# The last line printed is the path of the binary.
#
#   scripts/release/release.sh
#
# How: the `x86_64-unknown-linux-musl` target (musl libc is linked statically by design; glibc
# cannot resolve names or users statically without loading its NSS modules at run time), with
# zig as the C/C++ compiler and linker through cargo-zigbuild, both pinned from PyPI: zig brings
# musl's headers and libc++ for that target, which whisper.cpp's C++ needs and Debian does not
# package. whisper-rs-sys asks to link `stdc++`; zig links its static libc++ for that name.
# ggml's code generation is the portable baseline of `.cargo/config.toml`, with a second copy of
# its CPU backend for AVX-512 machines. The tools are
# installed under target/release-tools (ignored by git); the Debian build dependencies by
# scripts/ci/install_deps.sh.
#
# Environment: RELEASE_TOOLS (default target/release-tools), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."

TARGET=x86_64-unknown-linux-musl
PROFILE=dist
ZIG_PKG="ziglang==0.17.1"
ZIGBUILD_PKG="cargo-zigbuild==0.24.1"
TOOLS=$(realpath -m "${RELEASE_TOOLS:-target/release-tools}")
PYTHON=${PYTHON:-python3}

log() { printf '==> %s\n' "$*" >&2; }

bash scripts/ci/install_deps.sh >&2
# Debian's python3 has no venv without python3-venv.
if ! "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
    bash scripts/ci/install_deps.sh python3 python3-venv >&2
fi

if ! rustup target list --installed | grep -qx "$TARGET"; then
    log "adding the Rust target $TARGET"
    rustup target add "$TARGET" >&2
fi

# The stamp names the pinned versions: a venv without it (an interrupted install, other pins) is
# made again.
stamp="$TOOLS/venv/.installed"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$ZIG_PKG $ZIGBUILD_PKG" ]]; then
    log "installing $ZIG_PKG and $ZIGBUILD_PKG into $TOOLS/venv"
    rm -rf "$TOOLS/venv"
    "$PYTHON" -m venv "$TOOLS/venv"
    "$TOOLS/venv/bin/pip" install -q --disable-pip-version-check "$ZIG_PKG" "$ZIGBUILD_PKG" >&2
    echo "$ZIG_PKG $ZIGBUILD_PKG" >"$stamp"
fi
export PATH="$TOOLS/venv/bin:$PATH"

log "building voiceclone for $TARGET (profile $PROFILE)"
# A second copy of ggml's CPU backend, for AVX-512, chosen at run time where the CPU has it
# (build.rs, docs/architecture.md §9.4).
VOICECLONE_GGML_AVX512=ON cargo zigbuild --locked --profile "$PROFILE" --target "$TARGET" >&2

bin="target/$TARGET/$PROFILE/voiceclone"
# Static means no program interpreter and no dynamic section at all.
if readelf -l "$bin" | grep -q INTERP; then
    echo "error: $bin has a program interpreter: it is not static" >&2
    exit 1
fi
if ! readelf -d "$bin" 2>&1 | grep -q "no dynamic section"; then
    echo "error: $bin has a dynamic section:" >&2
    readelf -d "$bin" >&2
    exit 1
fi
log "size: $(stat -c %s "$bin") bytes"
echo "$PWD/$bin"
