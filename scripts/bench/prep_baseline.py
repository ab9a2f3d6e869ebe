#!/usr/bin/env python3
"""Python baseline for the `voiceclone prep` benchmark.

Does the same job as `voiceclone prep` the way it is usually done in Python:
decode any format with librosa, resample with soxr (HQ), transcribe with
faster-whisper (the same Whisper weights, in CTranslate2 form), cut Whisper's
segments into 1-15 s utterances, and write 24 kHz 16-bit WAV files plus a
JSONL manifest.

Usage:
    scripts/bench/prep_baseline.py INPUT_DIR OUT_DIR --model CT2_MODEL_DIR [--threads N]

Needs `scripts/assets/fetch_test_assets.sh --bench` (faster-whisper, librosa, soxr,
soundfile in .test-assets/venv); the model is .test-assets/whisper/ct2-tiny.en.
The last stdout line is JSON: {"audio_seconds", "wall_seconds", "utterances"},
where wall_seconds covers the whole job, imports and model load included.
"""

import time

START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".aif", ".aiff"}
WHISPER_RATE = 16000
OUTPUT_RATE = 24000

# The same rules as voiceclone's [prep] defaults (configs/default.toml).
MIN_SECONDS = 1.0
MAX_SECONDS = 15.0
MAX_MERGE_GAP = 1.5
MAX_NO_SPEECH_PROB = 0.6
PAD_SECONDS = 0.15


def spans_from_segments(segments):
    """Whisper segments -> [start, end, text] spans, long ones split at word boundaries."""
    spans = []
    for seg in segments:
        text = seg.text.strip()
        if seg.no_speech_prob > MAX_NO_SPEECH_PROB or not text or text.startswith("["):
            continue
        if seg.end - seg.start <= MAX_SECONDS:
            spans.append([seg.start, seg.end, text])
            continue
        # Greedy split: start a new piece when the next word would overflow.
        piece = []
        for word in seg.words or []:
            if piece and word.end - piece[0].start > MAX_SECONDS:
                spans.append([piece[0].start, piece[-1].end, "".join(w.word for w in piece).strip()])
                piece = []
            piece.append(word)
        if piece:
            spans.append([piece[0].start, piece[-1].end, "".join(w.word for w in piece).strip()])
    return spans


def merge_short(spans):
    """Merge neighbours while either is under MIN_SECONDS and the result fits."""
    merged = []
    for start, end, text in spans:
        if merged:
            prev = merged[-1]
            short = prev[1] - prev[0] < MIN_SECONDS or end - start < MIN_SECONDS
            if short and start - prev[1] <= MAX_MERGE_GAP and end - prev[0] <= MAX_SECONDS:
                prev[1], prev[2] = end, f"{prev[2]} {text}"
                continue
        merged.append([start, end, text])
    return [s for s in merged if s[1] - s[0] >= MIN_SECONDS]


def padded(spans, total):
    """Pad each utterance, never past the middle of the gap to a neighbour."""
    out = []
    for i, (start, end, text) in enumerate(spans):
        lower = (spans[i - 1][1] + start) / 2 if i > 0 else 0.0
        upper = (end + spans[i + 1][0]) / 2 if i + 1 < len(spans) else total
        out.append((max(start - PAD_SECONDS, lower), min(end + PAD_SECONDS, upper), text))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", required=True, type=Path, help="CTranslate2 Whisper model directory")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    parser.add_argument(
        "--compute-type",
        default="float32",
        help="CTranslate2 compute type; float32 (default) is the closest CPU match to "
        "whisper.cpp's f16-weight matmuls, int8 trades accuracy for speed",
    )
    args = parser.parse_args()

    # librosa falls back to audioread (ffmpeg) for formats libsndfile cannot read
    # (m4a) and warns about that deprecated path on every such file.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import librosa
    import soundfile
    import soxr
    from faster_whisper import WhisperModel

    model = WhisperModel(
        str(args.model), device="cpu", compute_type=args.compute_type, cpu_threads=args.threads
    )

    sources = sorted(p for p in args.input_dir.iterdir() if p.suffix.lower() in AUDIO_SUFFIXES)
    if not sources:
        sys.exit(f"no audio files in {args.input_dir}")
    seg_dir = args.out_dir / "segments"
    seg_dir.mkdir(parents=True, exist_ok=True)

    rows, audio_seconds = [], 0.0
    for source in sources:
        audio, rate = librosa.load(source, sr=None, mono=True)
        total = len(audio) / rate
        audio_seconds += total
        audio_16k = soxr.resample(audio, rate, WHISPER_RATE, quality="HQ")
        # Greedy decoding (beam_size=1) with word timings, as voiceclone's whisper-rs setup.
        segments, _ = model.transcribe(
            audio_16k, language="en", beam_size=1, best_of=1, word_timestamps=True
        )
        spans = padded(merge_short(spans_from_segments(list(segments))), total)

        audio_24k = soxr.resample(audio, rate, OUTPUT_RATE, quality="HQ")
        for n, (start, end, text) in enumerate(spans, 1):
            clip = audio_24k[round(start * OUTPUT_RATE) : round(end * OUTPUT_RATE)]
            name = f"{source.stem}_{n:04d}.wav"
            soundfile.write(seg_dir / name, clip, OUTPUT_RATE, subtype="PCM_16")
            rows.append(
                {
                    "audio": f"segments/{name}",
                    "text": text,
                    "duration": round(len(clip) / OUTPUT_RATE, 3),
                    "source": source.name,
                    "start": round(start, 3),
                    "end": round(end, 3),
                }
            )
        print(f"{source.name}: {total:.1f} s -> {len(spans)} utterances", file=sys.stderr)

    manifest = args.out_dir / "train.jsonl"
    tmp = manifest.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(manifest)

    wall = time.perf_counter() - START
    print(
        json.dumps(
            {"audio_seconds": round(audio_seconds, 3), "wall_seconds": round(wall, 3), "utterances": len(rows)}
        )
    )


if __name__ == "__main__":
    main()
