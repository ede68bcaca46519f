"""Throughput of two source trees side by side (e.g. a branch against the commit it started from):
every measurement runs in a fresh process with ``PYTHONPATH`` pointing at tree A or tree B, the
two alternate within each repeat (A, B, B, A, ...), so background load hits both alike. Reports
the median of each and the ratio B/A per model and measurement.

Times are the worker's CPU time (``time.process_time``, one thread), which a loaded machine
disturbs far less than wall-clock time. Measurements (fp32, or ``--precision bf16`` under CPU
autocast; the ``paper`` configuration of ``throughput.py``, keys changed by ``--set``): ``train`` = forward + backward
+ AdamW step on B x T tokens with the state carried (tokens/s); ``eval`` = one no-grad forward
over T_eval tokens (tokens/s); ``decode`` = token-by-token calls with the state (tokens/s).

    python benchmarks/throughput_ab.py --a /tmp/old --b . [--models llama,memory_attention] [--repeats 3]
        [--set block_size=64 --set num_states=64] [--precision bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import contextlib, json, sys, time, torch
from recurformer import build_model
name, B, T, T_eval, n_dec, steps = sys.argv[1], *map(int, sys.argv[2:7])
precision, overrides = sys.argv[7], json.loads(sys.argv[8])
cfg = dict(vocab_size=4096, dim=288, n_layers=6, n_heads=6)
cfg.update({"memory_attention": dict(chunk_size=32), "sliding_window": dict(window=256)}.get(name, {}))
cfg.update(overrides)
amp = lambda: torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
torch.manual_seed(0)
model = build_model(name, cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the trainer
x = torch.randint(0, 4096, (B, T))
state, times = None, []
for i in range(steps + 1):
    t0 = time.process_time()
    with amp():
        out = model(x, state=state, targets=x)
    out.loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    state = out.state.detach() if model.bounded_state else None
    times.append(time.process_time() - t0)
res = {"train": B * T / min(times[1:])}
model.eval()
with torch.no_grad(), amp():
    xe = torch.randint(0, 4096, (1, T_eval))
    model(xe[:, :64])
    t0 = time.process_time(); model(xe); res["eval"] = T_eval / (time.process_time() - t0)
    st = model(xe[:, :64]).state
    t0 = time.process_time()
    for t in range(n_dec):
        st = model(xe[:, t : t + 1], state=st).state
    res["decode"] = n_dec / (time.process_time() - t0)
print(json.dumps(res))
"""


def measure(tree: str, name: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS=str(args.threads))
    argv = [
        sys.executable,
        "-c",
        WORKER,
        name,
        str(args.batch),
        str(args.seq),
        str(args.eval_len),
        str(args.decode),
        str(args.steps),
        args.precision,
        json.dumps(dict(parse_set(kv) for kv in args.set)),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd="/")
    if done.returncode != 0:
        sys.exit(f"throughput_ab.py: {tree} {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_set(kv: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as JSON (numbers, lists) or else kept as a string."""
    key, eq, value = kv.partition("=")
    if not eq or not key:
        sys.exit(f"throughput_ab.py: --set wants KEY=VALUE, got {kv!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="the reference tree (e.g. an exported old commit)")
    p.add_argument("--b", required=True, help="the tree to compare")
    p.add_argument(
        "--models", default="llama,sliding_window,memory_attention,transformer_xl,block_recurrent,recurrent_transformer"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--eval-len", type=int, default=2048)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: CPU autocast")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for every model")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rep in range(args.repeats):
        for name in args.models.split(","):
            order = ("a", "b") if rep % 2 == 0 else ("b", "a")
            for which in order:
                runs.setdefault((name, which), []).append(measure(getattr(args, which), name, args))
                print(f"rep {rep} {name} {which}: {runs[(name, which)][-1]}", file=sys.stderr, flush=True)
    print("| model | measure | A tokens/s | B tokens/s | B/A |\n|---|---|---|---|---|")
    table = []
    for name in args.models.split(","):
        for m in ("train", "eval", "decode"):
            a = statistics.median(r[m] for r in runs[(name, "a")])
            b = statistics.median(r[m] for r in runs[(name, "b")])
            table.append({"model": name, "measure": m, "a": a, "b": b, "ratio": b / a})
            print(f"| {name} | {m} | {a:,.0f} | {b:,.0f} | {b / a:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
