"""Training throughput on one machine: 1 process x 2 threads vs 2 processes (torchrun, DDP,
gloo) x 1 thread, at the same global batch, Memory Attention in the seeds' configuration
(dim 288, 6 layers, chunk 32) on the bundled TinyStories sample. Tokens/s are read from the
runs' metrics.jsonl after the first logging interval (warm-up).

    python benchmarks/ddp_throughput.py [--steps 30] [--precision fp32] [--out docs/ddp_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.name=memory_attention", "model.dim=288", "model.n_layers=6", "model.n_heads=6", "model.chunk_size=32"]


def run(nproc: int, threads: int, batch: int, steps: int, precision: str, out: Path) -> float:
    sets = MODEL + [
        f"train.out_dir={out}", f"train.batch_size={batch}", "train.seq_len=256", f"train.steps={steps}",
        f"train.precision={precision}", "train.log_every=5", f"train.eval_every={steps}", "train.eval_batches=1",
        f"train.save_every={steps}", "data.dataset=tinystories-sample",
    ]
    args = [a for s in sets for a in ("--set", s)]
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                "--master_port=29517", "-m", "recurformer.cli"] if nproc > 1 else [sys.executable, "-m", "recurformer.cli"]
    cfg = ROOT / "configs" / "repro" / "base.yaml"
    subprocess.run(launcher + ["train", "--config", str(cfg), *args], check=True, cwd=ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS=str(threads)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tok_per_s"] for r in rows if "tok_per_s" in r][1:]  # drop the first interval (warm-up)
    return statistics.median(tps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--out", default="docs/ddp_throughput.json")
    args = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, nproc, threads in (("1 process x 2 threads", 1, 2), ("2 processes x 1 thread (DDP)", 2, 1)):
            res[label] = run(nproc, threads, args.global_batch // nproc, args.steps, args.precision, Path(tmp) / label.split()[0])
            print(f"{label:<32}{res[label]:>10,.0f} tok/s", flush=True)
    Path(args.out).write_text(json.dumps({"precision": args.precision, "global_batch": args.global_batch, "tokens_per_s": res}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
