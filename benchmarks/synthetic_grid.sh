#!/usr/bin/env bash
# The synthetic-diagnostics grid of docs/results/synthetic.md: every task x every registered model at a
# CPU budget, in two single-threaded processes side by side (parts in out/synthetic_runs/), then
# merged into out/synthetic.*. Budget per cell: 400 AdamW steps x batch 32 (one pass over MAD's
# 12,800 training rows; MAD trains 200 epochs), 600 for copy; lr 1e-3. About 1 h on 2 cores.
# LRS="3e-4,1e-3,3e-3" sweeps every cell (about 3 h); docs/results/synthetic.md ran the extra lrs of the
# MAD tasks as separate runs and joined them with --merge (best on validation).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-out/synthetic}
PARTS=${PARTS:-out/synthetic_runs/grid}
mkdir -p "$(dirname "$PARTS")"
common=(--lrs "${LRS:-1e-3}" --steps 400
  --set synth.n_length_test=128
  --task-set copy:synth.steps=600 --task-set copy:synth.eval_lengths=10,20,30,40,60
  --task-set delayed_copy:synth.eval_lengths=50,100,200,400
  --task-set passkey:length=128 --task-set passkey:model.n_layers=2 --task-set passkey:synth.eval_lengths=128,512,2048,8192)
export OMP_NUM_THREADS=1
# Models whose state grows with the length (full KV cache, persistent pairs) get a shorter passkey sweep.
$PY benchmarks/synthetic.py --models recurrent_transformer,llama "${common[@]}" \
  --task-set passkey:synth.eval_lengths=128,512,2048 --out "$PARTS.a" > "$PARTS.a.log" 2>&1 &
$PY benchmarks/synthetic.py --models memory_attention,sliding_window,transformer_xl,block_recurrent "${common[@]}" \
  --out "$PARTS.b" > "$PARTS.b.log" 2>&1 &
wait
$PY benchmarks/synthetic.py --merge "$PARTS.a.json" "$PARTS.b.json" --out "$OUT"
