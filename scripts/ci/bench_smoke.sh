#!/usr/bin/env bash
# Every benchmark of scripts/bench/ in its smoke mode (SMOKE=1, scripts/README.md "Smoke mode"):
# each script's whole path once at a toy size with the test suite's build, so that a change that
# breaks a benchmark (a renamed flag, an output line it parses, a helper it calls) fails CI, not
# the next measurement. Nothing is built and no figure is kept. Needs what scripts/ci/test.sh
# leaves: BIN with the examples beside it (`cargo test` builds them) and the test assets. About a
# minute on 2 cores; each script's time is printed, its output only when it fails.
#
#   scripts/ci/bench_smoke.sh              # BIN=path/to/voiceclone (default: the test build)
#   scripts/ci/bench_smoke.sh serve.sh     # only the named ones
set -euo pipefail
cd "$(dirname "$0")/../.."
export SMOKE=1
export BIN=${BIN:-$PWD/target/debug/voiceclone}
if [[ ! -x $BIN || ! -d $(dirname "$BIN")/examples ]]; then
    echo "error: $BIN or the examples beside it are missing: run scripts/ci/test.sh first" \
        "(cargo test --features test-hooks builds both)" >&2
    exit 1
fi

# GNU time: the peak memory that memory.sh, speak.sh and train.sh report.
bash scripts/ci/install_deps.sh time

# The load check alone: outside the smoke mode, with FORCE=1 so that a busy CI machine passes.
quiet_check() {
    (
        SMOKE=0 FORCE=1
        source scripts/bench/quiet.sh
        wait_quiet 0
        require_quiet "in the smoke stage"
        echo "$LOAD_NOTE"
    )
}

# NAME and its command; every file of scripts/bench/ must be run here or named in USED below.
RUNS=(
    "codec.sh|bash scripts/bench/codec.sh"
    "fsdp.sh|bash scripts/bench/fsdp.sh"
    "lora.sh|bash scripts/bench/lora.sh"
    "memory.sh|bash scripts/bench/memory.sh"
    "overlap.sh|bash scripts/bench/overlap.sh"
    "peer.sh|bash scripts/bench/peer.sh"
    "plan_tables.sh|bash scripts/bench/plan_tables.sh"
    "portable.sh|bash scripts/bench/portable.sh"
    "prep.sh|bash scripts/bench/prep.sh"
    "quiet.sh|quiet_check"
    "regression.sh|bash scripts/bench/regression.sh"
    "samples.sh|bash scripts/bench/samples.sh"
    "serve.sh|bash scripts/bench/serve.sh"
    "serve.sh load|bash scripts/bench/serve.sh load"
    "serve_adapters.sh|bash scripts/bench/serve_adapters.sh"
    "speak.sh|bash scripts/bench/speak.sh"
    "speak_stream.sh|bash scripts/bench/speak_stream.sh"
    "train.sh|bash scripts/bench/train.sh"
    "scaling_model.py|python3 scripts/bench/scaling_model.py"
    # Its imports come after the arguments are read: without prep.sh's baseline packages (CI has
    # none, scripts/README.md) only its command line is checked.
    "prep_baseline.py --help|python3 scripts/bench/prep_baseline.py --help"
    # It needs the peer's source (CI has none, scripts/README.md): only its usage is checked.
    "peer_setup.sh --help|bash scripts/bench/peer_setup.sh --help"
)
# Files that the runs above source or call (scripts/README.md says which).
USED="model.sh smoke.sh synthetic.py prep_wer.py serve_client.py"

names=" "
for run in "${RUNS[@]}"; do names+="${run%%|*} "; done
for f in scripts/bench/*; do
    [[ -f $f ]] || continue # __pycache__
    f=${f##*/}
    if [[ $names != *" $f "* && $names != *" $f --help "* && " $USED " != *" $f "* ]]; then
        echo "error: scripts/bench/$f has no smoke run in $0 (add one, scripts/README.md \"Smoke mode\")" >&2
        exit 1
    fi
done

log=$(mktemp)
trap 'rm -f "$log"' EXIT
failed=()
start=$SECONDS
for run in "${RUNS[@]}"; do
    name=${run%%|*}
    if (($#)) && [[ " $* " != *" ${name%% *} "* ]]; then
        continue
    fi
    t=$SECONDS
    # A hung server or client must not hold CI: no smoke run takes a minute.
    if timeout 300 bash -c "$(declare -f quiet_check); ${run#*|}" >"$log" 2>&1; then
        printf 'ok    %-24s %3d s\n' "$name" $((SECONDS - t))
    else
        status=$?
        printf 'FAIL  %-24s %3d s (exit %d), its output:\n' "$name" $((SECONDS - t)) "$status"
        sed 's/^/    /' "$log"
        failed+=("$name")
    fi
done
echo "smoke runs: $((SECONDS - start)) s"
if ((${#failed[@]})); then
    echo "error: the smoke mode of ${failed[*]} failed (output above)" >&2
    exit 1
fi
