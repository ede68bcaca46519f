"""Intra-op threads on a shared CPU: greedy generation (the default run's Memory Attention, random
weights, batch 1) and one training step of it, timed with 1 and with all of the process's CPUs
as torch threads, with OpenMP's default wait policy (spin a while, then sleep), with
OMP_WAIT_POLICY=passive (sleep at once) and with OMP_WAIT_POLICY=active (spin), each in a fresh
process, the settings interleaved over the repeats; with ``--hog N``, N busy-looping processes
hold CPUs meanwhile (as another user's job would). A run slower than ``--timeout`` is stopped and
reported as such.

    python benchmarks/threads.py [--hog 1] [--tokens 64] [--repeat 3] [--out out/threads.json]

Prints one row per setting (best of ``--repeat``) and writes JSON; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """``n`` busy-looping processes (another user's jobs) for the block, ended however it ends."""
    hogs = [mp.Process(target=hog, daemon=True) for _ in range(n)]
    for h in hogs:
        h.start()
    try:
        time.sleep(0.5)
        yield
    finally:
        for h in hogs:
            h.terminate()


POLICIES = (None, "passive", "active")


def run(threads: int, policy: str | None, tokens: int, timeout: float) -> tuple[float, float] | None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    root = str(Path(__file__).resolve().parents[1])
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, root, str(tokens)], env=env, capture_output=True, text=True, check=True,
            timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    gen, step, n = out.stdout.split()
    assert int(n) == threads, f"asked for {threads} torch threads, got {n}"
    return float(gen), float(step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hog", type=int, default=0, help="busy-looping processes to run meanwhile")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens generated")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs per setting")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a run is stopped")
    ap.add_argument("--out", default="out/threads.json", help="the JSON written")
    args = ap.parse_args()
    cpus, load = len(os.sched_getaffinity(0)), os.getloadavg()
    settings = [(t, p) for t in sorted({1, cpus}) for p in POLICIES]
    runs: dict[tuple[int, str | None], list[tuple[float, float] | None]] = {k: [] for k in settings}
    with busy(args.hog):
        for _ in range(args.repeat):  # A B C A B C: a change in the machine's load hits every setting
            for threads, policy in settings:
                got = run(threads, policy, args.tokens, args.timeout)
                runs[threads, policy].append(got)
                print(f"  {threads} thread(s), {policy or 'default'}: {got or 'timed out'}", flush=True)
    rows = []
    for (threads, policy), got in runs.items():
        done = [g for g in got if g is not None]
        rows.append(
            {
                "threads": threads,
                "wait_policy": policy or "default",
                "hog": args.hog,
                "generate_tok_per_s": max((g[0] for g in done), default=None),
                "train_step_s": min((g[1] for g in done), default=None),
                "timed_out": len(got) - len(done),
            }
        )
        r = rows[-1]
        gen = f"{r['generate_tok_per_s']:8.1f}" if done else f"{'—':>8}"
        step = f"{r['train_step_s']:6.3f}" if done else f"{'—':>6}"
        print(
            f"threads {threads}  OMP_WAIT_POLICY {r['wait_policy']:>8}  hog {args.hog}:  generate {gen} tok/s"
            f"   training step {step} s"
            + (f"   ({r['timed_out']} of {len(got)} runs over {args.timeout:.0f} s)" if r["timed_out"] else ""),
            flush=True,
        )
    meta = {
        "cpus": cpus,
        "loadavg_at_start": load,
        "loadavg_at_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
