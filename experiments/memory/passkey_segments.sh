#!/usr/bin/env bash
# A curriculum over segment counts for the passkey (Bulatov et al., "Scaling Transformer to 1M
# tokens and beyond with RMT", 2023, §3): stages of 1, 2, 4, 8, 16 segments of 32 tokens, each a
# `recurformer synth` run of experiments/memory/configs/passkey-gated-deltanet-segments.yaml started from the
# last stage's saved model (synth.init_from), then the last model tested at long lengths with
# `synth --evaluate` (OUT/eval.stage<n>.{json,log}). Every stage leaves OUT/stage<n>.{json,log,model};
# a stage (or test) whose JSON exists is skipped, so a stopped chain continues where it was.
#
#   experiments/memory/passkey_segments.sh SEED OUT [EXTRA...]    # EXTRA: more --set for every stage
#
# Environment: STAGES ("1 2 4 8 16"), LENGTHS (the test lengths, "504,2048,8192,32768,131072"),
# CONFIG (memory/passkey-gated-deltanet-segments), PYTHON (python).
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 SEED OUT [EXTRA...]" >&2; exit 2; }
seed=$1 out=$2
shift 2
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
CONFIG=${CONFIG:-memory/passkey-gated-deltanet-segments}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH=$PWD
mkdir -p "$out"
prev=""
for n in ${STAGES:-1 2 4 8 16}; do
  L=$((32 * n - 8))
  if [ ! -f "$out/stage$n.json" ]; then
    if [ -e "$out/stage$n.model" ]; then
      echo "$out/stage$n.model exists without $out/stage$n.json (a stage stopped after saving): move it away to rerun" >&2
      exit 1
    fi
    $PY -m recurformer synth --config "$CONFIG" --set "synth.seed=$seed" --set "task.length=$L" \
      --set "synth.train_lengths=[8,$L]" ${prev:+--set "synth.init_from=$prev"} "$@" \
      --save "$out/stage$n.model" --json "$out/stage$n.json" > "$out/stage$n.log" 2>&1
  fi
  prev=$out/stage$n.model
done
if [ ! -f "$out/eval.stage$n.json" ]; then
  $PY -m recurformer synth --evaluate "$prev" --lengths "${LENGTHS:-504,2048,8192,32768,131072}" --n-test 64 \
    --set "synth.seed=$seed" --json "$out/eval.stage$n.json" > "$out/eval.stage$n.log" 2>&1
fi
cat "$out/eval.stage$n.log"
