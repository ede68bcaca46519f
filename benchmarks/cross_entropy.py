"""The training loss on its own: ``F.cross_entropy`` over float32 logits (what the models ran
before) against ``recurformer.modules.cross_entropy`` (gradient computed in the forward, block by
block of rows), forward and backward of logits [N, V], timed A B A B in one process.

    OMP_NUM_THREADS=1 python benchmarks/cross_entropy.py --threads 1 --out out/cross_entropy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recurformer.flops import machine_meta
from recurformer.modules import cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="N: tokens of a step (default 8 x 256)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, help="torch threads (default: as OMP_NUM_THREADS gives)")
    ap.add_argument("--out", default="out/cross_entropy.json")
    args = ap.parse_args()
    if min(args.rows, args.vocab, args.rounds) < 1:
        ap.error(f"--rows, --vocab and --rounds must be >= 1, got {args.rows}, {args.vocab}, {args.rounds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    targets = torch.randint(0, args.vocab, (args.rows,))

    def torch_loss(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.float(), targets)

    def ours(x: torch.Tensor) -> torch.Tensor:
        return cross_entropy(x, targets)

    rows = []
    for prec, dtype in DTYPES.items():
        logits = torch.randn(args.rows, args.vocab, dtype=dtype)

        def run(loss_fn) -> float:
            x = logits.detach().requires_grad_()
            t0 = time.perf_counter()
            loss_fn(x).backward()
            return time.perf_counter() - t0

        for _ in range(2):
            run(torch_loss), run(ours)
        times: dict[str, list[float]] = {"torch": [], "ours": []}
        for i in range(args.rounds):
            for name in ("torch", "ours") if i % 2 == 0 else ("ours", "torch"):
                times[name].append(run(torch_loss if name == "torch" else ours))
        ratios = [a / b for a, b in zip(times["torch"], times["ours"])]
        rows.append(
            dict(
                precision=prec,
                torch_ms=statistics.median(times["torch"]) * 1e3,
                ours_ms=statistics.median(times["ours"]) * 1e3,
                speedup=statistics.median(ratios),
                speedup_range=[min(ratios), max(ratios)],
            )
        )
    print(
        f"logits [{args.rows}, {args.vocab}], forward + backward, {args.rounds} A B rounds, {torch.get_num_threads()} threads"
    )
    print(f"{'logits':6} {'F.cross_entropy ms':>19} {'ours ms':>8} {'speed-up':>9} {'range':>12}")
    for r in rows:
        lo, hi = r["speedup_range"]
        print(f"{r['precision']:6} {r['torch_ms']:19.1f} {r['ours_ms']:8.1f} {r['speedup']:8.2f}x {lo:5.2f}-{hi:4.2f}")
    meta = dict(
        machine_meta(),
        rows=args.rows,
        vocab=args.vocab,
        rounds=args.rounds,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
