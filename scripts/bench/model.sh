# Sourced by the benchmarks that run `voiceclone` on a random checkpoint of the real shapes
# (docs/performance.md §1): the checks and set-up they share.
#
# `require_model DIR` stops the script when DIR holds no model (and says which script writes
# the 0.6B-shaped one). `ensure_bin` builds target/release/voiceclone into BIN unless BIN is set;
# under SMOKE=1 it builds nothing and takes the test build (`smoke_bin`, scripts/bench/smoke.sh).
# `model_with_codec MODEL CODEC DEST` makes DEST the model MODEL with the speech tokenizer in
# CODEC (links to both; the codec of the real size is what limits streaming on a CPU, and the
# random checkpoints carry a small one), stopping when CODEC holds no tokenizer.
# `train_steps WS MODEL DATA XVECTOR BATCH STEPS [WRAPPER...]` makes WS a workspace of the rows
# DATA (every row trains: no held-out set, so no evaluation between steps) with the x-vector file
# XVECTOR on MODEL, and runs STEPS full optimizer steps of `$BIN train` there — consecutive rows,
# micro-batches of BATCH, no accumulation, no warm-up, lr 2e-5, weight decay 0.01, clip 1.0, a
# checkpoint only at the end, no export — under WRAPPER (e.g. `env RAYON_NUM_THREADS=2`). Each
# step's line is in WS/checkpoints/metrics.jsonl; its stderr in WS/stderr, shown when it fails.
# shellcheck source=scripts/bench/smoke.sh
source "$(dirname "${BASH_SOURCE[0]}")/smoke.sh"
require_model() {
    if [[ ! -f $1/model.safetensors ]]; then
        echo "error: no model at $1 (scripts/reference/make_fixtures.py --full-size $1 writes the" \
            "0.6B-shaped random one, see scripts/bench/speak.sh)" >&2
        exit 1
    fi
}

ensure_bin() {
    if is_smoke; then
        smoke_bin
    elif [[ -z ${BIN:-} ]]; then
        echo "== building voiceclone (release)" >&2
        cargo build --release --quiet --bin voiceclone
        BIN=target/release/voiceclone
    fi
}

train_steps() {
    local ws=$1 model=$2 data=$3 xvector=$4 batch=$5 steps=$6
    shift 6
    mkdir -p "$ws/data"
    cp "$data" "$ws/data/train.jsonl"
    cp "$xvector" "$ws/data/speaker.safetensors"
    printf '[model]\nbase = "%s"\n[train]\nval_fraction = 0.0\n' "$(cd "$model" && pwd)" \
        >"$ws/voiceclone.toml"
    "$@" "$BIN" --workdir "$ws" train --no-shuffle --batch-size "$batch" --grad-accum 1 \
        --warmup-steps 0 --lr 2e-5 --weight-decay 0.01 --clip-norm 1.0 --max-steps "$steps" \
        --epochs 1000000 --save-every 0 --keep 1 --no-export >/dev/null 2>"$ws/stderr" || {
        cat "$ws/stderr" >&2
        exit 1
    }
}

model_with_codec() {
    local model=$1 codec=$2 dest=$3 f
    if [[ ! -f $codec/model.safetensors || ! -f $codec/config.json ]]; then
        echo "error: no speech tokenizer at $codec (model.safetensors and config.json;" \
            "scripts/reference/bench_codec.py --make-full-size $codec writes the full-size one," \
            "CODEC=own keeps the model's own)" >&2
        exit 1
    fi
    mkdir -p "$dest"
    for f in "$model"/*; do
        [[ $(basename "$f") == speech_tokenizer ]] || ln -s "$(realpath "$f")" "$dest/"
    done
    ln -s "$(realpath "$codec")" "$dest/speech_tokenizer"
}
