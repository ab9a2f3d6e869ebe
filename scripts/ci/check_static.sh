#!/usr/bin/env bash
# Proof that the release binary runs anywhere (docs/architecture.md §9.4), run by CI:
#
#   1. `readelf` and `file` show a static executable: no program interpreter, no dynamic section.
#   2. In an empty root — a directory holding only the binary, a fixture model, a recording, the
#      test Whisper model and /tmp, entered with chroot (no /etc, /proc, /dev, /usr, no libc) —
#      `--help`, `prep` of a real recording, `speak` (its WAV equal byte for byte to the dynamic
#      build's), `serve` answering /health, and a hub download over TLS: against a local HTTPS
#      server whose certificate is signed by a CA of our own, the binary completes the handshake
#      and refuses the certificate as of an unknown issuer (its roots are built in; there is no
#      certificate store in the root to read), while the server sees the client's alert.
#   3. The README's quick start: scripts/release/install.sh into a prefix, then `voiceclone prep` from
#      the PATH; and the install script refuses to replace another program of that name.
#   4. Under `qemu-x86_64 -cpu Haswell` (an x86-64-v3 CPU without AVX-512): `--version` reports
#      the AVX2 kernels and whisper.cpp's portable backend, and `speak` gives the dynamic
#      build's bytes under the same emulated CPU.
#      Skipped with a message where qemu-user is not installed.
#
#   scripts/ci/check_static.sh [STATIC_BIN [DYNAMIC_BIN]]
#
# STATIC_BIN defaults to what scripts/release/release.sh builds (it is run); DYNAMIC_BIN to
# target/debug/voiceclone (built when missing). Needs root (chroot), the test assets
# (scripts/assets/fetch_test_assets.sh); it installs file, openssl, curl and qemu-user where missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD

fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "ok: $*"; }

[[ $EUID -eq 0 ]] || fail "chroot needs root (run as root or under sudo)"
# The tools this check uses: `file`, an HTTPS server and client, and Debian's user-mode qemu
# (where it cannot be installed, part 4 is skipped with a message).
bash scripts/ci/install_deps.sh file openssl curl qemu-user ||
    echo "warning: could not install every package this check uses"

static=${1:-}
if [[ -z $static ]]; then
    static=$(bash scripts/release/release.sh | tail -n 1)
fi
dynamic=${2:-target/debug/voiceclone}
if [[ ! -x $dynamic ]]; then
    cargo build --locked >&2
fi
assets=${VOICECLONE_TEST_ASSETS:-$repo/.test-assets}
whisper=$assets/whisper/ggml-tiny.en.bin
recording=$assets/speech/prep2/01_mix_wav16k.wav
[[ -f $whisper && -f $recording ]] || fail "test assets missing in $assets: run scripts/assets/fetch_test_assets.sh"

work=$(mktemp -d)
server_pids=()
cleanup() {
    for p in "${server_pids[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

# --- 1. static --------------------------------------------------------------------------------
readelf -l "$static" | grep -q INTERP && fail "$static has a program interpreter"
readelf -d "$static" 2>&1 | grep -q "no dynamic section" || fail "$static has a dynamic section"
desc=$(file -b "$static")
[[ $desc == *"statically linked"* ]] || fail "file says: $desc"
pass "static: $desc; $(stat -c %s "$static") bytes"

# --- 2. the empty root ------------------------------------------------------------------------
root=$work/root
mkdir -p "$root/tmp" "$root/rec" "$root/ws"
cp "$static" "$root/voiceclone"
cp -r tests/fixtures/tiny-0b6 "$root/model"
cp tests/fixtures/audio/ref24k.wav "$root/ref.wav"
cp "$whisper" "$root/whisper.bin"
cp "$recording" "$root/rec/"
# Nothing of this machine's environment goes in: no HOME, no PATH, no certificate variables.
in_root() { env -i /usr/sbin/chroot "$root" /voiceclone "$@"; }

in_root --help | grep -q "Usage: voiceclone" || fail "--help in the empty root"
pass "--help in the empty root"

in_root --workdir /ws prep /rec --whisper-model /whisper.bin >"$work/prep.log" 2>&1 ||
    { cat "$work/prep.log" >&2; fail "prep in the empty root"; }
utterances=$(grep -c '"text"' "$root/ws/data/train.jsonl" || true)
((utterances > 0)) || fail "prep wrote no utterance"
grep -q '"text": *"[^"]*[A-Za-z]' "$root/ws/data/train.jsonl" || fail "prep's transcripts are empty"
pass "prep in the empty root: $utterances utterance(s) of real speech transcribed; $(in_root --version | grep '^whisper.cpp runs')"

speak_args=("Static binaries run anywhere." --ref-audio /ref.wav --model /model --seed 3 --max-frames 16)
in_root speak "${speak_args[@]}" -o /tmp/static.wav >"$work/speak.log" 2>&1 ||
    { cat "$work/speak.log" >&2; fail "speak in the empty root"; }
# The dynamic build reads the same files at the same paths, through the same root.
mkdir -p "$work/dyn"
cp "$dynamic" "$root/voiceclone-dynamic"
(cd "$root" && "$root/voiceclone-dynamic" speak "${speak_args[@]/#\//$root/}" -o "$work/dyn/dynamic.wav") \
    >"$work/speak-dyn.log" 2>&1 || { cat "$work/speak-dyn.log" >&2; fail "speak with $dynamic"; }
cmp "$root/tmp/static.wav" "$work/dyn/dynamic.wav" || fail "speak: the static build's WAV differs from the dynamic build's"
pass "speak in the empty root: $(stat -c %s "$root/tmp/static.wav") bytes, equal to the dynamic build's"

env -i /usr/sbin/chroot "$root" /voiceclone serve --model /model --port 0 >"$work/serve.out" 2>"$work/serve.err" &
server_pids+=($!)
addr=""
for _ in $(seq 100); do
    addr=$(sed -n 's#.*listening on http://\([^ ]*\).*#\1#p' "$work/serve.out" | head -n 1)
    [[ -n $addr ]] && break
    sleep 0.2
done
[[ -n $addr ]] || { cat "$work/serve.err" >&2; fail "serve in the empty root did not start"; }
health=$(curl -sf "http://$addr/health") || fail "GET /health"
[[ $health == *'"status":"ok"'* || $health == *'"status": "ok"'* ]] || fail "/health said: $health"
pass "serve in the empty root: /health $health"
kill "${server_pids[-1]}" 2>/dev/null || true

# TLS: a CA of our own signs the server's certificate for 127.0.0.1.
tls=$work/tls
mkdir -p "$tls"
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$tls/ca.key" -out "$tls/ca.pem" -days 2 \
    -subj "/CN=voiceclone test CA" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout "$tls/server.key" -out "$tls/server.csr" \
    -subj "/CN=127.0.0.1" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\n' >"$tls/ext"
openssl x509 -req -in "$tls/server.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" -CAcreateserial \
    -out "$tls/server.pem" -days 2 -extfile "$tls/ext" 2>/dev/null
port=$((20000 + RANDOM % 20000))
openssl s_server -accept "127.0.0.1:$port" -cert "$tls/server.pem" -key "$tls/server.key" -www \
    >"$work/tls.log" 2>&1 &
server_pids+=($!)
for _ in $(seq 100); do grep -q "^ACCEPT" "$work/tls.log" && break; sleep 0.1; done
grep -q "^ACCEPT" "$work/tls.log" || { cat "$work/tls.log" >&2; fail "the local TLS server did not start"; }
set +e
env -i HF_ENDPOINT="https://127.0.0.1:$port" HF_HOME=/tmp/hf /usr/sbin/chroot "$root" /voiceclone \
    speak "x" --model Qwen/Qwen3-TTS-12Hz-0.6B-Base -o /tmp/hub.wav >"$work/hub.log" 2>&1
status=$?
set -e
# The server reports the failed handshake when it has read the client's alert.
for _ in $(seq 50); do grep -q "alert" "$work/tls.log" && break; sleep 0.1; done
kill "${server_pids[-1]}" 2>/dev/null || true
((status != 0)) || fail "a hub download from an untrusted server succeeded"
grep -q "UnknownIssuer" "$work/hub.log" || { cat "$work/hub.log" >&2; fail "the hub client did not refuse the certificate as of an unknown issuer"; }
grep -q "alert" "$work/tls.log" || { cat "$work/tls.log" >&2; fail "the TLS server saw no alert from the client"; }
pass "TLS in the empty root: handshake completed, certificate refused (UnknownIssuer), server saw: $(grep -o 'alert [a-z ]*' "$work/tls.log" | head -n 1)"

# --- 3. the README's quick start: install, then prep, from the PATH ----------------------------
# Without --binary the install script builds with scripts/release/release.sh, as a user's first run does
# (here the build is already done, so it only checks it is current).
prefix=$work/prefix
bash scripts/release/install.sh --prefix "$prefix" >"$work/install.log" 2>&1 ||
    { cat "$work/install.log" >&2; fail "scripts/release/install.sh"; }
[[ -z ${1:-} ]] && { cmp "$prefix/bin/voiceclone" "$static" || fail "the installed binary is not the release build"; }
mkdir -p "$work/quick/recordings"
cp "$recording" "$work/quick/recordings/"
(cd "$work/quick" && env -i HOME="$work/quick" PATH="$prefix/bin:/usr/bin:/bin" \
    voiceclone prep ./recordings --whisper-model "$whisper") >"$work/quick.log" 2>&1 ||
    { cat "$work/quick.log" >&2; fail "voiceclone prep from the PATH"; }
[[ -s $work/quick/data/train.jsonl ]] || fail "the quick start's prep wrote no manifest"
# Another program of that name is never replaced.
other=$work/other/bin/voiceclone
mkdir -p "${other%/*}"
printf '#!/bin/sh\necho not ours\n' >"$other"
chmod +x "$other"
cp "$other" "$work/other.orig"
if bash scripts/release/install.sh --binary "$static" --prefix "$work/other" >"$work/other.log" 2>&1; then
    fail "install.sh replaced a program that is not voiceclone"
fi
grep -q "is not voiceclone" "$work/other.log" || { cat "$work/other.log" >&2; fail "install.sh's refusal"; }
cmp "$other" "$work/other.orig" || fail "install.sh changed a program that is not voiceclone"
pass "quick start: install.sh put $(head -n 1 <("$prefix/bin/voiceclone" --version)) in $prefix/bin, prep from the PATH wrote data/train.jsonl; another program named voiceclone is left alone"

# --- 4. a CPU without AVX-512 -----------------------------------------------------------------
if ! command -v qemu-x86_64 >/dev/null; then
    echo "skipped: qemu-x86_64 is not installed (Debian's qemu-user): the run on an emulated CPU without AVX-512"
    exit 0
fi
qemu=(qemu-x86_64 -cpu Haswell)
version=$("${qemu[@]}" "$static" --version 2>/dev/null)
grep -q "avx-512 no" <<<"$version" || fail "under qemu -cpu Haswell --version says: $version"
grep -q "int8 matmul avx2, int4 matmul avx2, bf16 matmul avx2" <<<"$version" || fail "the kernels did not fall back to AVX2: $version"
grep -q "whisper.cpp runs: the portable build" <<<"$version" || fail "whisper.cpp did not fall back to its portable backend: $version"
# prep itself is not run here: whisper.cpp under qemu's emulation of AVX2 took over ten minutes.
(cd "$root" && "${qemu[@]}" "$root/voiceclone" speak "${speak_args[@]/#\//$root/}" -o "$work/haswell-static.wav") \
    >"$work/qemu.log" 2>&1 || { cat "$work/qemu.log" >&2; fail "speak under qemu -cpu Haswell"; }
(cd "$root" && "${qemu[@]}" "$root/voiceclone-dynamic" speak "${speak_args[@]/#\//$root/}" -o "$work/haswell-dynamic.wav") \
    >"$work/qemu-dyn.log" 2>&1 || { cat "$work/qemu-dyn.log" >&2; fail "the dynamic build's speak under qemu -cpu Haswell"; }
cmp "$work/haswell-static.wav" "$work/haswell-dynamic.wav" || fail "under qemu -cpu Haswell the static WAV differs from the dynamic one"
pass "qemu -cpu Haswell: kernels on AVX2 ($(grep '^cpu:' <<<"$version")), whisper.cpp on its portable backend; speak equal to the dynamic build's"
