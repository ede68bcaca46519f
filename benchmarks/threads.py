"""Intra-op threads on a shared CPU: greedy generation (the default run's Memory Attention, random
weights, batch 1) and one training step of it, timed with 1 and with all of the process's CPUs
as torch threads, with OpenMP's default (spinning) wait policy and with OMP_WAIT_POLICY=passive,
each in a fresh process; with ``--hog N``, N busy-looping processes hold CPUs meanwhile (as
another user's job would).

    python benchmarks/threads.py [--hog 1] [--tokens 64] [--repeat 3] [--out out/threads.json]

Prints one row per setting (best of ``--repeat``) and writes JSON; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from recurformer.models import build_model
torch.manual_seed(0)
model = build_model("memory_attention", dict(vocab_size=4096, dim=128, n_layers=4, n_heads=4, chunk_size=32))
tokens = int(sys.argv[2])
prompt = torch.zeros(1, 1, dtype=torch.long)
model.eval()
model.generate(prompt, max_new_tokens=4, temperature=0)  # warm-up
t0 = time.perf_counter()
model.generate(prompt, max_new_tokens=tokens, temperature=0)
gen = tokens / (time.perf_counter() - t0)
model.train()
x = torch.randint(0, 4096, (8, 256))
model(x, targets=x).loss.backward()  # warm-up
t0 = time.perf_counter()
model(x, targets=x).loss.backward()
step = time.perf_counter() - t0
print(f"{gen} {step} {torch.get_num_threads()}")
"""


def hog() -> None:
    while True:
        pass


def run(threads: int, policy: str | None, tokens: int) -> tuple[float, float, int]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", CHILD, root, str(tokens)], env=env, capture_output=True, text=True, check=True
    )
    gen, step, n = out.stdout.split()
    return float(gen), float(step), int(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hog", type=int, default=0, help="busy-looping processes to run meanwhile")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens generated")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs per setting")
    ap.add_argument("--out", default="out/threads.json", help="the JSON written")
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    hogs = [mp.Process(target=hog, daemon=True) for _ in range(args.hog)]
    for h in hogs:
        h.start()
    rows = []
    try:
        time.sleep(0.5)
        for threads in sorted({1, cpus}):
            for policy in (None, "passive"):
                best = [run(threads, policy, args.tokens) for _ in range(args.repeat)]
                rows.append(
                    {
                        "threads": threads,
                        "wait_policy": policy or "default",
                        "hog": args.hog,
                        "generate_tok_per_s": max(b[0] for b in best),
                        "train_step_s": min(b[1] for b in best),
                    }
                )
                r = rows[-1]
                print(
                    f"threads {threads}  OMP_WAIT_POLICY {r['wait_policy']:>8}  hog {args.hog}:  generate {r['generate_tok_per_s']:8.1f} tok/s"
                    f"   training step {r['train_step_s']:6.3f} s",
                    flush=True,
                )
    finally:
        for h in hogs:
            h.terminate()
    meta = {"cpus": cpus, "loadavg_at_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
