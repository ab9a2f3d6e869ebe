# Sourced by the benchmarks: a measurement needs a quiet machine (docs/performance.md §1).
#
# `require_quiet WHEN` reads the 1-minute load average and stops the script when it is 0.5 or
# more, unless FORCE=1; it sets LOAD_NOTE to "load average X WHEN" (marked NOT QUIET under
# FORCE=1, with a warning on stderr) for the benchmark's report. Under SMOKE=1 it reads the load
# the same way but never stops: a smoke run measures nothing (scripts/bench/smoke.sh).
# shellcheck source=scripts/bench/smoke.sh
source "$(dirname "${BASH_SOURCE[0]}")/smoke.sh"
require_quiet() {
    local when=$1 load
    load=$(cut -d' ' -f1 /proc/loadavg)
    if python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 0.5 else 1)" "$load" || is_smoke; then
        LOAD_NOTE="load average $load $when"
        if is_smoke; then LOAD_NOTE+=" (SMOKE=1: not a measurement)"; fi
    elif [[ ${FORCE:-0} == 1 ]]; then
        LOAD_NOTE="load average $load $when: NOT QUIET (FORCE=1), figures are disturbed"
        echo "warning: $LOAD_NOTE" >&2
    else
        echo "error: the 1-minute load average is $load (>= 0.5): other jobs share the CPU and the" \
            "figures would be wrong (docs/performance.md §1). Wait, or FORCE=1 to run anyway." >&2
        exit 1
    fi
}

# `wait_quiet SECONDS` waits up to SECONDS for the 1-minute load average to fall below 0.5 (after
# a build or a fixture write of the benchmark itself); `require_quiet` then decides. Under
# SMOKE=1 it does not wait.
wait_quiet() {
    local deadline=$((SECONDS + $1))
    if is_smoke; then deadline=$SECONDS; fi
    while ((SECONDS < deadline)) &&
        ! python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 0.5 else 1)" "$(cut -d' ' -f1 /proc/loadavg)"; do
        sleep 5
    done
}
