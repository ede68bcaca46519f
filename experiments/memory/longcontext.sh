#!/usr/bin/env bash
# Every memory on one long-context task (s_niah_1, s_niah_2, s_niah_3, mk_niah, qa1, qa2, qa3, mqar_zoology), each cell one
# `recurformer synth` run of the task's model-neutral recipe (configs/TASK-fixed.yaml), 1 thread, JOBS
# cells side by side. The controls come first: full attention (llama: must hold where it fits) and the
# sliding window (an exact zero beyond its reach). A cell whose JSON exists is skipped; a cell stopped
# after a save (every synth.save_every steps) is continued with `synth --resume`, so a stop loses nothing.
#
#   experiments/memory/longcontext.sh s_niah_2            # every memory, seed 0
#   SEEDS="0 1 2" MODELS="gdn-closed armt" experiments/memory/longcontext.sh mk_niah
#   WIDTHS="64 128 256" experiments/memory/longcontext.sh mqar_zoology   # Zoology's MQAR frontier
#
# Cells (MODELS narrows them): llama, sliding_window, gdn (Gated DeltaNet, defaults), gdn-closed (its writes
# closed at initialisation, both floors on: the passkey's recipe), armt (rmt with associative: true), rmt,
# memory_attention, block_recurrent, transformer_xl. Writes OUT/TASK/MODEL.RECIPE.seedS.{json,log} and
# .model/ (RECIPE: fixed, closed for gdn-closed, associative for armt), then the table and pictures of
# benchmarks/memory_plots.py (OUT/TASK/summary*; the state-size picture at the longest tested length, or at
# the last of the recipe's synth.eval_settings, e.g. mqar_zoology's seq_len=1024,num_pairs=256).
# Environment: OUT (runs/longcontext), SEEDS (0), JOBS (1), MODELS, PYTHON (python), EXTRA (more arguments
# for every fresh cell, e.g. EXTRA="--steps 2 --set synth.n_test=4" for a smoke run), WIDTHS (the recipe's
# own width: every cell at each width W, --set model.dim=W, written MODEL.RECIPE-wW.seedS.*).
set -euo pipefail
cd "$(dirname "$0")/../.."
TASK=${1:?usage: $0 TASK (s_niah_1 s_niah_2 s_niah_3 mk_niah qa1 qa2 qa3 mqar_zoology)}
[ -f "experiments/memory/configs/$TASK-fixed.yaml" ] || { echo "$0: no recipe experiments/memory/configs/$TASK-fixed.yaml"; exit 2; }
PY=${PYTHON:-python}
OUT=${OUT:-runs/longcontext}/$TASK
SEEDS=${SEEDS:-0}
JOBS=${JOBS:-1}
MODELS=${MODELS:-llama sliding_window gdn gdn-closed armt rmt memory_attention block_recurrent transformer_xl}
EXTRA=${EXTRA:-}
read -ra WLIST <<< "${WIDTHS:-}"
[ ${#WLIST[@]} -gt 0 ] || WLIST=("")  # no WIDTHS: the recipe's own width, files without -wW
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD PY OUT TASK EXTRA
mkdir -p "$OUT"

run_cell() {  # cell seed [width]
  local model=$1 recipe=fixed sets=() width=${3:-}
  case $1 in
    gdn) model=gated_deltanet ;;
    gdn-closed) model=gated_deltanet recipe=closed sets=(--set model.write_init=0.05 --set model.write_floor=0.02 --set model.decay_floor=0.0005) ;;
    armt) model=rmt recipe=associative sets=(--set model.associative=true) ;;
  esac
  [ -n "$width" ] && recipe=$recipe-w$width sets+=(--set "model.dim=$width")
  local name="$OUT/$model.$recipe.seed$2"
  [ -f "$name.json" ] && return 0
  if ls -d "$name.model"/progress/step_* > /dev/null 2>&1; then
    $PY -m recurformer synth --resume "$name.model" --json "$name.json" >> "$name.log" 2>&1
  else
    $PY -m recurformer synth --task "$TASK" --model "$model" --config "experiments/memory/configs/$TASK-fixed.yaml" \
      "${sets[@]}" --set "synth.seed=$2" --json "$name.json" --save "$name.model" $EXTRA > "$name.log" 2>&1
  fi || echo "failed: $TASK $1 seed $2${width:+ width $width} (see $name.log)"
}
export -f run_cell

# no trailing blank on a line: xargs -L would join it with the next (one cell's arguments would run as one)
for seed in $SEEDS; do for cell in $MODELS; do for w in "${WLIST[@]}"; do echo "$cell $seed${w:+ $w}"; done; done; done |
  xargs -P "$JOBS" -L 1 bash -c 'run_cell "$@"' _
# the picture at the longest eval length, or at the last eval setting (the recipe's hardest)
AT=$($PY -c "
import yaml
from recurformer.synth.config import setting_name
s = yaml.safe_load(open('experiments/memory/configs/$TASK-fixed.yaml'))['synth']
print(f'--setting={setting_name(s[\"eval_settings\"][-1])}' if s.get('eval_settings') else f'--distance={max(s[\"eval_lengths\"])}')")
$PY benchmarks/memory_plots.py "$OUT"/*.seed*.json "$AT" --out "$OUT/summary"
