#!/usr/bin/env bash
# Regenerates tests/fixtures/audio/tone-*: 0.5 s of a 997 Hz sine at -6 dBFS in each compressed
# format the decoder supports, at different sample rates (Debian's ffmpeg). The decoder tests
# check frequency and level after decoding. WAV variants are written by the tests themselves.
set -euo pipefail
out="$(cd "$(dirname "$0")/../.." && pwd)/tests/fixtures/audio"
mkdir -p "$out"
ff() { ffmpeg -hide_banner -loglevel error -y -bitexact "$@"; }
# ffmpeg's sine source is at 1/8 full scale; volume 4 makes it -6 dBFS (amplitude 0.5). Lossy
# formats use high bit rates so the encoder itself keeps the level within a few tenths of a dB.
ff -f lavfi -i "sine=frequency=997:sample_rate=44100:duration=0.5,volume=4" -c:a flac "$out/tone-44100.flac"
ff -f lavfi -i "sine=frequency=997:sample_rate=44100:duration=0.5,volume=4" -c:a libmp3lame -b:a 320k "$out/tone-44100.mp3"
ff -f lavfi -i "sine=frequency=997:sample_rate=48000:duration=0.5,volume=4" -c:a libvorbis -q:a 5 "$out/tone-48000.ogg"
ff -f lavfi -i "sine=frequency=997:sample_rate=32000:duration=0.5,volume=4" -c:a aac -b:a 96k "$out/tone-32000-aac.m4a"
ff -f lavfi -i "sine=frequency=997:sample_rate=22050:duration=0.5,volume=4" -c:a alac "$out/tone-22050-alac.m4a"
# The parity reference clip (ref24k.wav, written by scripts/reference/make_fixtures.py) in other formats, for
# tests/it/embed_cli.rs: lossless FLAC (decodes to the same samples) and a lossy 44.1 kHz stereo MP3
# (exercises decoding, down-mixing and resampling back to 24 kHz).
if [ -f "$out/ref24k.wav" ]; then
  ff -i "$out/ref24k.wav" -c:a flac "$out/ref24k.flac"
  ff -i "$out/ref24k.wav" -ac 2 -ar 44100 -c:a libmp3lame -b:a 320k "$out/ref24k-44k-stereo.mp3"
fi
ls -l "$out"
