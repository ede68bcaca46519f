"""Training tokens/s of an experiment's arms side by side: each arm is a training config (model,
batch, segment length, truncation, gradient accumulation, precision), built into the library's
own ``Trainer`` on its own data, and timed one optimizer step (``train_step``) at a time in
interleaved rounds (A B C ... then B C ... A, so no arm always runs first), after warm-up steps
that are not timed. Reports each arm's median tokens/s over the rounds, its fraction of the
machine's matmul peak in the arm's precision (tokens/s x the trainer's counted FLOP per token / the
peak the trainer measures, as its ``mfu``), and its ratio to the first arm (the median of the
per-round ratios, and their spread), so the arms of one table are compared in the same minutes on
the same machine.

    python benchmarks/arms.py experiments/copy-probe/configs/copy-l-ctrl.yaml experiments/copy-probe/configs/copy-ma-1024.yaml \\
        [--rounds 5] [--steps 2] [--set train.precision=fp32] [--out out/arms.json]

``--set KEY=VALUE`` overrides every arm's config (as ``recurformer train --set``). Runs write
nothing but the JSON: each trainer's run folder is a temporary directory. The data each config
names must be there (or is prepared on first use, as ``recurformer train`` would).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recurformer.config import RecurformerError  # noqa: E402
from recurformer.device import resolve_precision  # noqa: E402
from recurformer.flops import machine_name  # noqa: E402
from recurformer.training.config import load_run_config
from recurformer.training.trainer import Trainer  # noqa: E402


def tokens_per_step(tr: Trainer) -> int:
    t = tr.cfg.train
    return t.grad_accum * t.batch_size * tr.streams.seq_len


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "configs", nargs="+", help="training configs, one per arm; the first is the reference of the ratios"
    )
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each arm once per round)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per arm and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per arm before the rounds")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="JSON file for the table and every round's times")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--rounds and --steps must be >= 1, --warmup >= 0")
    names = [Path(c).stem for c in args.configs]
    if len(set(names)) != len(names):
        ap.error(f"two arms share a name: {names}")
    with tempfile.TemporaryDirectory(prefix="arms-") as tmp:
        try:
            cfgs = [
                load_run_config(c, [*args.overrides, f"train.out_dir={Path(tmp) / n}", "train.loggers=[]"])
                for c, n in zip(args.configs, names, strict=True)
            ]
            trainers = [Trainer(cfg, show_progress=False) for cfg in cfgs]
        except RecurformerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for tr in trainers:
            for _ in range(args.warmup):
                tr.train_step()
        seconds: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = list(range(len(trainers)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    trainers[i].train_step()  # reads the loss: the step's work is done when it returns
                seconds[names[i]].append(time.perf_counter() - t0)
                print(f"round {r + 1}/{args.rounds} {names[i]}: {seconds[names[i]][-1]:.2f} s", file=sys.stderr)
        rows = []
        for n, tr in zip(names, trainers, strict=True):
            tok = tokens_per_step(tr) * args.steps
            ratios = [s0 / s for s0, s in zip(seconds[names[0]], seconds[n], strict=True)]  # tok/s ratio
            tok_s = statistics.median(tok / s for s in seconds[n])
            t = tr.cfg.train
            rows.append(
                {
                    "arm": n,
                    "model": tr.cfg.model["name"],
                    "precision": resolve_precision(t.precision, tr.device),
                    "batch": f"{t.grad_accum} x {t.batch_size} x {tr.streams.seq_len}",
                    "truncation": t.truncation,
                    "tokens_per_s": round(tok_s),
                    "flops_per_token": tr.flops_per_token,
                    "of_peak": round(tok_s * tr.flops_per_token / tr.peak_flops, 4),
                    "ratio_to_first": round(statistics.median(ratios), 3),
                    "ratio_min": round(min(ratios), 3),
                    "ratio_max": round(max(ratios), 3),
                    "seconds": seconds[n],
                }
            )
    print(f"{'arm':24} {'model':22} {'precision':9} {'tok/s':>7} {'of peak':>8} {'÷ ' + names[0]:>14} {'spread':>12}")
    for row in rows:
        spread = f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}"
        print(
            f"{row['arm']:24} {row['model']:22} {row['precision']:9} {row['tokens_per_s']:>7,} {row['of_peak']:>8.1%} "
            f"{row['ratio_to_first']:>14.2f} {spread:>12}"
        )
    if args.out:
        meta = {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "machine": machine_name(),
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "warmup": args.warmup,
            "overrides": args.overrides,
            "command": "python benchmarks/arms.py " + " ".join(sys.argv[1:] if argv is None else argv),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "arms": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
