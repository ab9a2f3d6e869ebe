# Sourced by every benchmark: the smoke mode, SMOKE=1 (scripts/README.md, "Smoke mode"). It runs
# the script's whole path in seconds — the binary located, its model or fixture made, each
# measured command once at a tiny size, the reference side once where the reference environment
# is installed, the outputs parsed and the table printed — so that a change that breaks a
# benchmark fails CI (scripts/ci/bench_smoke.sh) instead of the next measurement. Its figures
# mean nothing: nothing is built, the load is not enforced, every size is a toy.
#
# `is_smoke`: true under SMOKE=1.
# `smoke_bin`: under SMOKE=1 sets BIN, default target/debug/voiceclone (the test suite's build;
#   a smoke run builds nothing), and stops when it is missing.
# `smoke_examples`: the examples built beside BIN (target/debug/examples for the test build).
# `SMOKE_MODEL`: the model of every smoke run, for the random checkpoints of the measurements:
#   the committed tiny fixture (hidden size 8, a training step in milliseconds). synthetic.py's
#   model shapes are made in CI by the GPU check's dry run (scripts/ci/gpu_check_dry_run.sh).
# `reference_side PYTHON MODULES [HOW]`: whether the reference side runs. Outside the smoke mode
#   a PYTHON that cannot import MODULES stops the script, saying HOW to install them (default:
#   the reference environment of scripts/reference/setup_venv.sh); under SMOKE=1 the side is
#   left out and says so (CI installs neither the reference environment nor prep's baseline).
# `parsed WHAT VALUE`: stops the script when VALUE, read from a command's output, is empty: the
#   output changed and the table would show a blank.
case ${SMOKE:=0} in
0 | 1) ;;
*)
    echo "error: SMOKE=$SMOKE: set SMOKE=1 for the smoke mode or leave it unset" >&2
    exit 2
    ;;
esac

is_smoke() { [[ $SMOKE == 1 ]]; }
# shellcheck disable=SC2034 # read by the scripts that source this file
SMOKE_MODEL=$PWD/tests/fixtures/tiny-0b6

smoke_bin() {
    is_smoke || return 0
    BIN=${BIN:-$PWD/target/debug/voiceclone}
    if [[ ! -x $BIN ]]; then
        echo "error: SMOKE=1 builds nothing and $BIN is missing: build it (cargo build --features" \
            "test-hooks) or set BIN" >&2
        exit 1
    fi
    BIN=$(realpath "$BIN")
    echo "== SMOKE=1 (scripts/bench/smoke.sh): $BIN, nothing built; the figures are no measurement" >&2
}

smoke_examples() {
    local dir
    dir=$(dirname "$BIN")/examples
    if [[ ! -d $dir ]]; then
        echo "error: no examples beside $BIN (in $dir): cargo test builds them, or cargo build --examples" >&2
        exit 1
    fi
    echo "$dir"
}

reference_side() {
    local python=$1 modules=$2
    local how=${3:-bash scripts/reference/setup_venv.sh makes the reference environment}
    if "$python" -c "import $modules" >/dev/null 2>&1; then
        return 0
    fi
    if is_smoke; then
        echo "== SMOKE=1: no reference side: $python cannot import $modules ($how)" >&2
        return 1
    fi
    echo "error: $python lacks $modules ($how)" >&2
    exit 1
}

parsed() {
    if [[ -z $2 ]]; then
        echo "error: could not read $1 from the output (its format changed?)" >&2
        exit 1
    fi
}
