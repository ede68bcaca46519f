"""The Python API beside the command line on a shared CPU, in both import orders: the default
run's model (configs/tinystories-cpu.yaml, trained a few steps first) evaluated at lengths 256 and
512 on 4 windows, probed on 20 documents, and trained for ``--steps`` steps, each way in a fresh
process: the API with ``import torch`` before ``import recurformer`` (every notebook), the API
with ``recurformer`` first, and the command line (``recurformer.cli.main``, which imports
recurformer first). ``--hog N`` busy-looping processes hold CPUs meanwhile (another user's jobs);
``--root NAME=DIR`` times another source tree too (e.g. ``before=`` a checkout of an older
commit), the trees interleaved per repeat.

    python benchmarks/import_order.py [--hog 2] [--steps 20] [--repeat 1] [--root before=/tmp/old] \\
        [--out out/import_order.json]

Prints one row per tree and way (seconds for evaluate and probe, checkpoint loading included;
training tokens/s, the run's mean) and writes JSON; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from threads import busy  # noqa: E402  (the same busy processes as the threads benchmark)

CHILD = r"""
import json, sys, tempfile, time
root, way, ckpt, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, root)
if way == "api, torch first":
    import torch
    import recurformer
else:
    import recurformer
    import torch
from recurformer.cli import main

tmp = tempfile.mkdtemp()
times = {}
t0 = time.perf_counter()
if way == "cli":
    main(["eval", "--checkpoint", ckpt, "--lengths", "256,512", "--windows", "4", "--dataset", "tinystories-sample",
          "--json", f"{tmp}/eval.json"])
else:
    model, tok = recurformer.load(ckpt)
    recurformer.evaluate(model, tok, dataset="tinystories-sample", lengths=[256, 512], windows=4)
times["evaluate_s"] = time.perf_counter() - t0
t0 = time.perf_counter()
if way == "cli":
    main(["probe", "--checkpoint", ckpt, "--docs", "20", "--json", f"{tmp}/probe.json"])
else:
    model, tok = recurformer.load(ckpt)
    recurformer.probe(model, tok, docs=20)
times["probe_s"] = time.perf_counter() - t0
sets = {"train.steps": steps, "train.out_dir": f"{tmp}/run", "train.eval_every": 1000, "train.save_every": 1000,
        "train.loggers": []}
if way == "cli":
    main(["train", "--config", "tinystories-cpu", *[f"--set={k}={json.dumps(v)}" for k, v in sets.items()]])
    lines = open(f"{tmp}/run/metrics.jsonl").read().splitlines()
    times["train_tok_per_s"] = [json.loads(x) for x in lines if "mean_tok_per_s" in x][-1]["mean_tok_per_s"]
else:
    run = recurformer.train("tinystories-cpu", progress=False, **sets)
    times["train_tok_per_s"] = run.metrics["mean_tok_per_s"]
print("RESULT " + json.dumps(times))
"""

WAYS = ("api, torch first", "api, recurformer first", "cli")


def child_env() -> dict[str, str]:
    """The environment of a fresh shell: no OpenMP settings of this process."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}


def run(root: str, way: str, ckpt: str, steps: int, timeout: float) -> dict[str, float] | None:
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, root, way, ckpt, str(steps)], env=child_env(), capture_output=True,
            text=True, check=True, timeout=timeout, cwd=tempfile.gettempdir(),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{way} in {root} failed:\n{e.stderr[-3000:]}") from None
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT ") :]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hog", type=int, default=2, help="busy-looping processes to run meanwhile")
    ap.add_argument("--steps", type=int, default=20, help="training steps timed")
    ap.add_argument("--repeat", type=int, default=1, help="best of this many runs per tree and way")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a run is stopped")
    ap.add_argument("--root", action="append", default=[], metavar="NAME=DIR", help="another source tree to time")
    ap.add_argument("--out", default="out/import_order.json", help="the JSON written")
    args = ap.parse_args()
    roots = {"this tree": str(Path(__file__).resolve().parents[1])}
    roots.update(r.split("=", 1) for r in args.root)
    ckpt = tempfile.mkdtemp(prefix="import-order-")
    subprocess.run(
        [sys.executable, "-m", "recurformer", "train", "--config", "tinystories-cpu", "--set", "train.steps=2",
         "--set", f"train.out_dir={ckpt}", "--set", "train.loggers=[]"],
        env={**child_env(), "PYTHONPATH": roots["this tree"]}, check=True, capture_output=True,
    )  # fmt: skip
    cpus, load = len(os.sched_getaffinity(0)), os.getloadavg()
    runs: dict[tuple[str, str], list[dict[str, float] | None]] = {(n, w): [] for n in roots for w in WAYS}
    with busy(args.hog):
        for _ in range(args.repeat):  # A B C A B C: a change in the machine's load hits every setting
            for name, root in roots.items():
                for way in WAYS:
                    got = run(root, way, ckpt, args.steps, args.timeout)
                    runs[name, way].append(got)
                    print(f"  {name}, {way}: {got or 'timed out'}", flush=True)
    rows = []
    print("\n| tree | way | evaluate (s) | probe (s) | training (tok/s) |\n|---|---|---:|---:|---:|")
    for (name, way), got in runs.items():
        done = [g for g in got if g is not None]
        row = {
            "tree": name,
            "way": way,
            "hog": args.hog,
            "evaluate_s": min((g["evaluate_s"] for g in done), default=None),
            "probe_s": min((g["probe_s"] for g in done), default=None),
            "train_tok_per_s": max((g["train_tok_per_s"] for g in done), default=None),
            "timed_out": len(got) - len(done),
        }
        rows.append(row)
        cells = [f"{row[k]:,.1f}" if row[k] is not None else "timed out" for k in ("evaluate_s", "probe_s")]
        tps = f"{row['train_tok_per_s']:,.0f}" if row["train_tok_per_s"] is not None else "timed out"
        print(f"| {name} | {way} | {cells[0]} | {cells[1]} | {tps} |", flush=True)
    meta = {
        "cpus": cpus,
        "hog": args.hog,
        "steps": args.steps,
        "repeat": args.repeat,
        "roots": roots,
        "loadavg_at_start": load,
        "loadavg_at_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
