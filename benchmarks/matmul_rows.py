"""How fast this CPU multiplies by a layer's weight when only a few rows come at a time.

The Recurrent Transformer's layer (block_size 1) runs its output projection, FFN and key/value
projections once per position, on the batch's B rows only (``recurformer/ops/recurrent_attention/``:
finish), where the other models multiply all B x T rows of a call at once. This script times
``F.linear`` of [M, K] by a [N, K] weight for M = 8 (one position of a batch of 8), 64 and 2048
(a whole call) at the paper's shapes (dim 288, FFN 768), fp32 and bf16, and prints each as GFLOP/s
and as a fraction of the best 1024 x 1024 matmul of the dtype measured in the same run.

    OMP_NUM_THREADS=1 python benchmarks/matmul_rows.py --threads 1 --out out/matmul_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recurformer.flops import machine_meta, matmul_peak

SHAPES = [(288, 288), (288, 768), (768, 288)]  # (K, N): W_k / W_v / W_o, W_1 / W_3, W_2
ROWS = [8, 64, 2048]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def seconds(fn, budget: float = 0.3, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of one call, each repeat running ~``budget`` s."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    fn()
    n = max(1, int(budget / max(time.perf_counter() - t0, 1e-7)))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, help="torch threads (default: as OMP_NUM_THREADS gives)")
    ap.add_argument("--out", default="out/matmul_rows.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for prec, dtype in DTYPES.items():
        peak = matmul_peak(dtype)
        for K, N in SHAPES:
            w = torch.randn(N, K, dtype=dtype)
            for M in ROWS:
                x = torch.randn(M, K, dtype=dtype)
                s = seconds(lambda: F.linear(x, w))
                gflops = 2 * M * K * N / s / 1e9
                rows.append(dict(precision=prec, M=M, K=K, N=N, us=s * 1e6, gflops=gflops, of_peak=gflops * 1e9 / peak))
        print(f"{prec} peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'prec':5} {'M':>5} {'K':>4} {'N':>4} {'us':>9} {'GFLOP/s':>8} {'of peak':>8}")
    for r in rows:
        print(
            f"{r['precision']:5} {r['M']:5d} {r['K']:4d} {r['N']:4d} {r['us']:9.1f} {r['gflops']:8.1f} {r['of_peak']:8.1%}"
        )
    meta = dict(
        machine_meta(),
        omp=os.environ.get("OMP_NUM_THREADS"),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
