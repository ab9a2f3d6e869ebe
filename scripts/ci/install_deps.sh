#!/usr/bin/env bash
# Installs the Debian packages voiceclone needs to build (whisper.cpp is compiled from source by
# whisper-rs: cmake, a C++ compiler and libclang for bindgen), and the packages named as
# arguments (what a script needs besides). Idempotent; needs root or sudo.
#   bash scripts/ci/install_deps.sh [PACKAGE...]
set -euo pipefail
# curl: a client of `voiceclone serve` in its tests (tests/it/serve.rs).
packages=(cmake clang libclang-dev g++ pkg-config curl "$@")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust from rustup.rs" >&2; exit 1; }
