#!/usr/bin/env bash
# Creates the reference environment: a Python venv in the checkout, at .reference-venv/
# (git-ignored), with the official qwen-tts==0.1.1 package and the pinned stack of
# scripts/reference/requirements.txt. Every script that runs the official code finds it there:
# the Python scripts under scripts/reference/ are run with .reference-venv/bin/python, and the
# benchmarks under scripts/bench/ that compare with the official package default to it.
#
#   bash scripts/reference/setup_venv.sh            # ~7 GB download the first time (torch's
#                                                   # CUDA wheels from PyPI; fine for CPU runs)
#   REFERENCE_VENV=DIR bash scripts/reference/setup_venv.sh    # somewhere else
#
# Re-running it is cheap: a finished environment is stamped and left alone; an interrupted
# install (no stamp) is made again from scratch. CI never needs it: the committed fixtures and
# references are what the tests read.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${REFERENCE_VENV:-$PWD/.reference-venv}
requirements=scripts/reference/requirements.txt
stamp=$venv/.voiceclone-reference

if [[ -f $stamp ]] && cmp -s "$stamp" "$requirements"; then
    echo "reference environment present: $venv" >&2
    echo "$venv/bin/python"
    exit 0
fi
python3 -c 'import venv, ensurepip' 2>/dev/null ||
    { echo "error: python3 cannot make a venv (Debian: apt-get install python3-venv)" >&2; exit 1; }
echo "creating the reference environment in $venv" >&2
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet -r "$requirements"
"$venv/bin/pip" install --quiet --no-deps qwen-tts==0.1.1
"$venv/bin/python" -c 'import qwen_tts, peft, gguf' ||
    { echo "error: the official package does not import in $venv" >&2; exit 1; }
# The stamp is the requirements it was made from: a changed pin makes the environment again.
cp "$requirements" "$stamp"
echo "reference environment ready: $venv" >&2
echo "$venv/bin/python"
