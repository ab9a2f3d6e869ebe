#!/usr/bin/env python3
"""Read a directory of TensorBoard event files with TensorBoard's own reader and print it as JSON.

Usage: scripts/ci/tensorboard_events.py DIR

The test of voiceclone's event files (tests/it/train_tensorboard.rs, docs/training.md §9.1)
runs this with the test assets' Python (`tensorboard` installed by
scripts/assets/fetch_test_assets.sh) and compares what TensorBoard reads with metrics.jsonl.
Every event is kept (size guidance 0) and nothing is purged, so a step written twice shows
twice. Prints one JSON object:

  {"scalars": {TAG: [[STEP, VALUE], ...]},
   "audio": {TAG: [{"step", "sample_rate", "length_frames", "content_type", "wav_base64"}, ...]}}

with a value that is not finite as the string "nan", "inf" or "-inf" (JSON has no such number).
"""

import base64
import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator as ea


def number(v):
    return v if math.isfinite(v) else str(v)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    keep_all = {kind: 0 for kind in (ea.SCALARS, ea.AUDIO, ea.IMAGES, ea.HISTOGRAMS, ea.TENSORS)}
    acc = ea.EventAccumulator(sys.argv[1], size_guidance=keep_all, purge_orphaned_data=False)
    acc.Reload()
    tags = acc.Tags()
    out = {
        "scalars": {
            tag: [[e.step, number(e.value)] for e in acc.Scalars(tag)] for tag in tags[ea.SCALARS]
        },
        "audio": {
            tag: [
                {
                    "step": e.step,
                    "sample_rate": e.sample_rate,
                    "length_frames": e.length_frames,
                    "content_type": e.content_type,
                    "wav_base64": base64.b64encode(e.encoded_audio_string).decode("ascii"),
                }
                for e in acc.Audio(tag)
            ]
            for tag in tags[ea.AUDIO]
        },
    }
    json.dump(out, sys.stdout)


main()
