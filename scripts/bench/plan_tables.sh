#!/usr/bin/env bash
# The memory tables of docs/usage.md §5 and docs/training.md §11: `voiceclone train --plan --json` for
# the released models' shapes (configs/models/) on N = 1, 2, 4, 8 GPUs at the default batch and
# without a manifest (every utterance as long as prep.max_seconds allows), one markdown table
# per model: predicted GB per GPU for each memory mode (and the host's share per rank with the
# optimizer offloaded). Reads config.json only; no GPU needed.
#
#   scripts/bench/plan_tables.sh            (BIN: the voiceclone binary; default: cargo build)
#
# SMOKE=1 (scripts/bench/smoke.sh): the same tables (they take seconds), BIN the test build,
# nothing built.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/bench/smoke.sh
if is_smoke; then
  smoke_bin
elif [ -z "${BIN:-}" ]; then
  cargo build --quiet
  BIN=$PWD/target/debug/voiceclone
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
for size in 0.6b 1.7b; do
  for n in 1 2 4 8; do
    "$BIN" --workdir "$WORK" train --plan --json --model "configs/models/qwen3-tts-12hz-$size-base" \
      --gpus "$n" --gpu-memory 24 >"$WORK/$size-$n.json"
  done
done
python3 - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
for size in ["0.6b", "1.7b"]:
    plans = {n: json.load(open(f"{work}/{size}-{n}.json")) for n in [1, 2, 4, 8]}
    p1 = plans[1]
    print(f"\n{size.upper()} (batch {p1['batch_size']} × {p1['grad_accum']}, longest utterance "
          f"{p1['longest']['frames']} frames): GB per GPU (host GB per rank)\n")
    print("| optimizer_state | offload | recompute | N = 1 | N = 2 | N = 4 | N = 8 |")
    print("|---|---|---|---|---|---|---|")
    for i, m in enumerate(p1["modes"]):
        cells = []
        for n in [1, 2, 4, 8]:
            e = plans[n]["modes"][i]
            cell = f"{e['gpu_bytes'] / 1e9:.1f}"
            if m["offload"] == "optimizer":
                cell += f" ({e['host_bytes'] / n / 1e9:.1f})"
            cells.append(cell)
        print(f"| `{m['optimizer_state']}` | `{m['offload']}` | `{m['recompute']}` | " + " | ".join(cells) + " |")
PY
