#!/usr/bin/env bash
# The copy-probe experiment (docs/results/probe.md): six arms on tinystories-repeat (configs/*.yaml here),
# trained two at a time with one thread each, then probed (copy_gain and swap_Δ by distance) and
# evaluated by length (the Table-1 view, cold and warm).
#
#   bash experiments/copy-probe/run.sh train   # ~45 min per arm at ~4-5k tokens/s; resumes unfinished runs
#   bash experiments/copy-probe/run.sh probe   # out/copy-probe/repeat.json/.png, l-ctrl at 2.5M/5M/10M, swap
#   bash experiments/copy-probe/run.sh eval    # out/copy-probe/table1-cold.json, table1-warm.json
#
# ARMS="l-ctrl ma-1024" limits the arms; RUNS (default runs/probe) is where the runs live.
set -euo pipefail
cd "$(dirname "$0")/../.."
ARMS=${ARMS:-"l-ctrl ma-1024 ma-128 sw-32 xl-16 brt-16"}
RUNS=${RUNS:-runs/probe}
OUT=${OUT:-out/copy-probe}
export OMP_NUM_THREADS=1
mkdir -p "$OUT"

train_arm() {  # a finished or started run is resumed, never overwritten
    local arm=$1
    if [ -d "$RUNS/$arm" ] && ls -d "$RUNS/$arm"/step_* >/dev/null 2>&1; then
        recurformer train --resume "$RUNS/$arm"
    else
        recurformer train --config "experiments/copy-probe/configs/$arm.yaml" --set "train.out_dir=$RUNS/$arm"
    fi > "$RUNS/$arm.log" 2>&1
}
export -f train_arm
export RUNS

case "${1:-}" in
train)
    mkdir -p "$RUNS"
    printf '%s\n' $ARMS | xargs -P 2 -I{} bash -c 'train_arm {}'
    ;;
probe)
    runs=(); for arm in $ARMS; do runs+=("$RUNS/$arm"); done
    recurformer probe --checkpoint "${runs[@]}" --json "$OUT/repeat.json"
    recurformer probe --checkpoint "$RUNS"/l-ctrl/step_000612 "$RUNS"/l-ctrl/step_001224 "$RUNS"/l-ctrl/step_002448 \
        --json "$OUT/repeat-l-ctrl-by-tokens.json"
    recurformer probe --task swap --dataset tinystories-repeat --docs 200 --distances 1,4,16,64,256,1024 \
        --checkpoint "${runs[@]}" --json "$OUT/swap.json"
    ;;
eval)
    runs=(); for arm in $ARMS; do runs+=("$RUNS/$arm"); done
    common=(--lengths 256,512,1024,2048,4096 --last 256 --windows 128 --context 5120)
    recurformer eval --checkpoint "${runs[@]}" "${common[@]}" --json "$OUT/table1-cold.json"
    recurformer eval --checkpoint "${runs[@]}" "${common[@]}" --warm-state 1024 --json "$OUT/table1-warm.json"
    ;;
*)
    sed -n '2,10p' "$0"; exit 2
    ;;
esac
