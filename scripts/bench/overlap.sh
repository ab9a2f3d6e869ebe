#!/usr/bin/env bash
# Overlapped communication and hybrid sharding on an emulated network
# (docs/distributed.md §8.3, docs/performance.md §9.1): 4 CPU ranks on 2 emulated nodes of 2, the 61 M "medium"
# model, step time of one shard group of 4 ("flat") and of 2 groups of 2 ("hybrid", the groups
# being the nodes), each with `--prefetch 0` and `--prefetch 1`, against the ideal
# max(compute, communication).
#
#   scripts/bench/overlap.sh [ROUNDS]      # default 3 rounds
#
# BIN: the voiceclone binary (default: a release build); MODEL_DIR: the medium model (default
# .big-fixtures/medium-synthetic, written by scripts/bench/synthetic.py model-medium, which
# needs numpy); STEPS: steps per run (default 5; the step time is the median of steps 2..).
#
# 1. Compute: every layout without emulation and with --prefetch 0, on the same ranks and
#    cores (their loopback traffic included): the step time with no inter-node link to wait for.
# 2. The link: the bytes a rank sends across nodes per step in the flat layout
#    (metrics.jsonl) divided by its compute time, so that without overlap the flat step spends
#    about as long communicating as computing (BANDWIDTH overrides it, e.g. 1gbit; LATENCY is
#    200us by default).
# 3. ROUNDS rounds over the four settings in turn, on the emulated network; the best step
#    time of each. Communication of a layout = its bytes across nodes per step / bandwidth
#    + its inter-node messages × latency; ideal = max(compute, communication).
# The ranks share the machine's cores: check that it is otherwise idle (the load average is
# printed first).
#
# SMOKE=1 (scripts/bench/smoke.sh): the tiny fixture model (MODEL_DIR's default), one round of
# 2 steps of 8-frame utterances, BIN the test build, nothing built or written outside a
# temporary folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/model.sh
if is_smoke; then
  ROUNDS=${1:-1} STEPS=${STEPS:-2} FRAMES=8 MODEL=${MODEL_DIR:-$SMOKE_MODEL}
else
  ROUNDS=${1:-3} STEPS=${STEPS:-5} FRAMES=60 MODEL=${MODEL_DIR:-.big-fixtures/medium-synthetic}
fi
LATENCY=${LATENCY:-200us}
if [[ ! -f $MODEL/model.safetensors ]]; then
  echo "== writing the medium model to $MODEL (once)" >&2
  mkdir -p "$(dirname "$MODEL")"
  python3 scripts/bench/synthetic.py model-medium tests/fixtures/tiny-0b6 "$MODEL"
fi
MODEL=$(cd "$MODEL" && pwd)
ensure_bin
BIN=$(realpath "$BIN")
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
"$BIN" --version | sed -n '1,3p'
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 scripts/bench/synthetic.py workspace "$WORK/template" "$MODEL" "$FRAMES"
# No held-out set and no samples: the steps alone are timed.
printf '[train]\nval_fraction = 0.0\nsamples = false\n' >>"$WORK/template/voiceclone.toml"

declare -A GROUP=([flat]=0 [hybrid]=node)
# run NAME LAYOUT PREFETCH [EMULATION]: trains and prints "median-step-seconds across-bytes
# within-bytes" (the bytes of step 2, the most any rank sent).
run() {
  local ws="$WORK/$1" emu=${4:-ranks-per-node=2,bandwidth=1000gbyte,latency=0us}
  rm -rf "$ws"
  cp -r "$WORK/template" "$ws"
  VOICECLONE_EMULATE_NETWORK=$emu "$BIN" --workdir "$ws" train --cpu-ranks 4 \
    --shard-group "${GROUP[$2]}" --prefetch "$3" --batch-size 2 --grad-accum 4 \
    --max-steps "$STEPS" --save-every 0 --no-shuffle --no-export >"$ws.out" 2>&1 || {
    cat "$ws.out" >&2
    exit 1
  }
  python3 - "$ws/checkpoints/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "frames" in r]
s = statistics.median(r["seconds"] for r in rows[1:])
print(f"{s:.3f} {rows[1]['sent_across_nodes']} {rows[1]['sent_within_node']}")
EOF
  rm -rf "$ws"
}

echo "== compute (no emulated link, --prefetch 0)"
declare -A COMPUTE ACROSS
for layout in flat hybrid; do
  read -r s across within < <(run "c-$layout" "$layout" 0)
  COMPUTE[$layout]=$s
  ACROSS[$layout]=$across
  echo "$layout: step ${s} s, per step a rank sends at most $across bytes across nodes, $within within"
done
if [[ -z ${BANDWIDTH:-} ]]; then
  BANDWIDTH=$(python3 -c "print(f'{${ACROSS[flat]} / ${COMPUTE[flat]} / 1e6:.1f}mbyte')")
fi
EMU="ranks-per-node=2,bandwidth=$BANDWIDTH,latency=$LATENCY"
echo "== emulated link: $EMU"

declare -A BEST
for round in $(seq "$ROUNDS"); do
  for layout in flat hybrid; do
    for prefetch in 0 1; do
      read -r s _ _ < <(run "r-$layout-$prefetch" "$layout" "$prefetch" "$EMU")
      key="$layout-$prefetch"
      echo "round $round: $layout, prefetch $prefetch: $s s"
      BEST[$key]=$(python3 -c "print(min(float('$s'), float('${BEST[$key]:-inf}')))")
    done
  done
done

UNITS=$(python3 -c "import json; print(json.load(open('$MODEL/config.json'))['talker_config']['num_hidden_layers'] + 3)")
python3 - "$EMU" "$UNITS" "${COMPUTE[flat]}" "${COMPUTE[hybrid]}" "${ACROSS[flat]}" "${ACROSS[hybrid]}" \
  "${BEST[flat-0]}" "${BEST[flat-1]}" "${BEST[hybrid-0]}" "${BEST[hybrid-1]}" <<'EOF'
import sys
emu = dict(kv.split("=") for kv in sys.argv[1].split(","))
def parse(v, units):
    for u, f in units:
        if v.lower().endswith(u):
            return float(v[: -len(u)]) * f
    raise SystemExit(f"cannot read {v}")
bw = parse(emu["bandwidth"], [("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("gbyte", 1e9), ("mbyte", 1e6)])
lat = parse(emu["latency"], [("us", 1e-6), ("ms", 1e-3), ("s", 1.0)])
units = int(sys.argv[2])
compute = {"flat": float(sys.argv[3]), "hybrid": float(sys.argv[4])}
across = {"flat": float(sys.argv[5]), "hybrid": float(sys.argv[6])}
best = {("flat", 0): float(sys.argv[7]), ("flat", 1): float(sys.argv[8]),
        ("hybrid", 0): float(sys.argv[9]), ("hybrid", 1): float(sys.argv[10])}
# Messages across nodes per step, one per ring step: flat, 3 ring steps for each of 2 gathers and
# a reduce-scatter of every unit and for the text rows' gather and reduction; hybrid, 2 for
# each unit's all-reduce and the text rows'.
messages = {"flat": units * 3 * 3 + 3 * 2, "hybrid": units * 2 + 2}
base = best[("flat", 0)]
print(f"\n{'layout':<8} {'prefetch':>8} {'step (s)':>9} {'compute':>8} {'comm':>7} {'ideal':>7} "
      f"{'/ideal':>7} {'speed-up':>9}")
for (layout, p), s in best.items():
    comm = across[layout] / bw + messages[layout] * lat
    ideal = max(compute[layout], comm)
    print(f"{layout:<8} {p:>8} {s:>9.3f} {compute[layout]:>8.3f} {comm:>7.3f} {ideal:>7.3f} "
          f"{s / ideal:>7.2f} {base / s:>8.2f}x")
h = best[("hybrid", 1)]
hideal = max(compute["hybrid"], across["hybrid"] / bw + messages["hybrid"] * lat)
print(f"\ngoal: hybrid + prefetch within 1.3x of its ideal: {h / hideal:.2f}x; "
      f"at least 1.6x faster than flat without overlap: {base / h:.2f}x")
EOF
