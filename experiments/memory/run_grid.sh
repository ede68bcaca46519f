#!/usr/bin/env bash
# The synthetic memory grid: passkey and MQAR x every registered model x every recipe of
# experiments/memory/configs/ x seeds, each cell one `recurformer synth` run (1 thread), JOBS cells side by
# side. A cell whose JSON exists is skipped, so a stopped grid continues where it was. Then the
# MQAR pictures (accuracy vs distance, accuracy vs state size) and the tables.
#
#   experiments/memory/run_grid.sh controls           # first: llama (full attention) and sliding_window, fixed, twostage and recall-first, seed 0
#   experiments/memory/run_grid.sh grid               # every task x model x recipe x seed
#   experiments/memory/run_grid.sh plots              # the pictures and tables from what has finished
#
# Environment: OUT (runs/memory), SEEDS ("0 1 2"), JOBS (2), MODELS (every registered model),
# RECIPES (fixed twostage recall-first curriculum mixed noise passing tbptt; twostage and recall-first are MQAR's only),
# TASKS (mqar passkey), PYTHON (python),
# EXTRA (more arguments for every cell, e.g. EXTRA="--steps 2 --set synth.eval_lengths=[128]" for a smoke run).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OUT=${OUT:-runs/memory}
SEEDS=${SEEDS:-0 1 2}
JOBS=${JOBS:-2}
TASKS=${TASKS:-mqar passkey}
RECIPES=${RECIPES:-fixed twostage recall-first curriculum mixed noise passing tbptt}
MODELS=${MODELS:-$($PY -c 'from recurformer.models import model_names; print(" ".join(model_names()))')}
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD

cells() {  # task model recipe seed, one cell per line
  for seed in $1; do for task in $TASKS; do for recipe in $3; do for model in $2; do
    echo "$task $model $recipe $seed"
  done; done; done; done
}

run_cell() {  # task model recipe seed
  local dir="$OUT/$1" name="$2.$3.seed$4"
  [ -f "$dir/$name.json" ] && return 0
  [ -f "experiments/memory/configs/$1-$3.yaml" ] || return 0  # a recipe of one task only (twostage, recall-first: MQAR)
  mkdir -p "$dir"
  $PY -m recurformer synth --task "$1" --model "$2" --config "experiments/memory/configs/$1-$3.yaml" --set "synth.seed=$4" \
    --json "$dir/$name.json" --save "$dir/$name.model" $EXTRA > "$dir/$name.log" 2>&1 || echo "failed: $1 $2 $3 seed $4 (see $dir/$name.log)"
}
export -f run_cell
EXTRA=${EXTRA:-}
export OUT PY EXTRA

case "${1:-}" in
  controls) cells 0 "llama sliding_window" "fixed twostage recall-first" ;;
  grid) cells "$SEEDS" "$MODELS" "$RECIPES" ;;
  plots) ;;
  *) echo "usage: $0 controls|grid|plots"; exit 2 ;;
esac | xargs -P "$JOBS" -L 1 bash -c 'run_cell "$@"' _

for task in $TASKS; do
  ls "$OUT/$task"/*.seed*.json > /dev/null 2>&1 || continue
  $PY benchmarks/memory_plots.py "$OUT/$task"/*.seed*.json --distance 128 --out "$OUT/$task/summary"
done
