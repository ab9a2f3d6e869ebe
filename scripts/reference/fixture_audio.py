"""The committed reference clips under ``tests/fixtures/audio/`` and how the fixtures read them.

``ref24k.wav`` (the voice-clone reference of every speak case, the log-mel and x-vector references) and
``codec-clip{1,2}.wav`` (the codec references) are made once with espeak-ng and then reused, since
espeak-ng's output differs between versions (``make_fixtures.py --regen-audio`` remakes them).  They are
read back exactly as the official wrappers read a path (``read_wav_24k``).  Used by ``make_fixtures.py``
and the reference modules beside it; the heavy packages are bound by ``bind_stack`` after argument
parsing.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from official import FIXTURES
from official import log as _log

AUDIO_WAV = FIXTURES / "audio" / "ref24k.wav"
# The text espeak-ng speaks for ref24k.wav (the clip keeps the first 2.6 s of it).
ESPEAK_TEXT = "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background."

# The codec reference clips: two espeak-ng clips of different lengths (clip1 is not a whole number of
# 1920-sample frames, clip2 is exactly 40 frames).
CODEC_CLIPS = [
    dict(name="clip1", wav="codec-clip1.wav", seconds=1.7, voice="en-gb+f3", speed=165, peak=0.7,
         text="Four hours of steady work faced us. The wide road shimmered in the hot sun."),
    dict(name="clip2", wav="codec-clip2.wav", seconds=3.2, voice="en-us", speed=140, peak=0.9,
         text="A large size in stockings is hard to sell. The boy was there when the sun rose."),
]


def bind_stack(s: dict) -> None:
    """Binds the official stack's names used below (`s` = `official.import_stack()`, which the scripts
    call after parsing their arguments, so that --help works without the heavy packages)."""
    global np, librosa, sf
    np, librosa, sf = s["np"], s["librosa"], s["sf"]



def _espeak_clip(path: Path, text: str, voice: str, speed: int, seconds: float, peak: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "espeak.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(raw), text], check=True)
        y, sr = librosa.load(str(raw), sr=None, mono=True)
    y = librosa.resample(y, orig_sr=sr, target_sr=24000)  # librosa default (soxr_hq), as the official code
    y, _ = librosa.effects.trim(y, top_db=40)
    n = int(round(seconds * 24000))
    assert len(y) >= n, f"espeak-ng output too short for {seconds} s"
    y = y[:n]
    y = peak * y / np.max(np.abs(y))
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), y, 24000, subtype="PCM_16")
    _log(f"wrote {path} ({len(y) / 24000:.2f} s)")


def make_reference_audio(regen: bool) -> None:
    if AUDIO_WAV.exists() and not regen:
        return
    _espeak_clip(AUDIO_WAV, ESPEAK_TEXT, "en-us", 150, 2.6, 0.6)


def make_codec_audio(regen: bool) -> dict:
    """The codec reference clips (tests/fixtures/audio/codec-clip*.wav), made once with espeak-ng
    and then reused; returns {name: samples as read back from the file}."""
    out = {}
    for c in CODEC_CLIPS:
        path = FIXTURES / "audio" / c["wav"]
        if regen or not path.exists():
            _espeak_clip(path, c["text"], c["voice"], c["speed"], c["seconds"], c["peak"])
        out[c["name"]] = read_wav_24k(path)
        assert len(out[c["name"]]) == int(round(c["seconds"] * 24000))
    return out


def read_wav_24k(path: Path):
    # Exactly how the official wrappers read a path (`_load_audio_to_np`, `Qwen3TTSTokenizer.load_audio`):
    # librosa.load(sr=None) -> int16 / 32768 for a 16-bit WAV.
    audio, sr = librosa.load(str(path), sr=None, mono=True)
    audio = audio.astype(np.float32)
    assert sr == 24000
    pcm, sr2 = sf.read(str(path), dtype="int16")
    assert sr2 == 24000 and np.array_equal(audio, pcm.astype(np.float32) / 32768.0)
    return audio


def read_reference_audio():
    return read_wav_24k(AUDIO_WAV)
