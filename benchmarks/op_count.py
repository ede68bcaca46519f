"""Operators one training step runs, per model and per token: what a GPU pays one kernel launch
for each (at small sizes a step is launch-bound, not FLOP-bound).

One training step (forward, backward, AdamW) of every registered model at the Memory Attention paper's width
(dim 288, 6 layers, 6 heads, vocab 4096; chunk / segment / block 32, Gated DeltaNet's WY chunk
32, sliding window 256), on the
CPU under ``torch.profiler``, with the fused AdamW the trainer uses. Counted: the ATen
operators that would launch a kernel, in forward, backward and the optimizer step: those that
call no other launching operator, without the ones that launch nothing on a GPU (views,
reshapes, allocations, no-op ``to``/``type_as``, CPU scalars; a factory counts
by the fill it runs) and without operators on empty
tensors (no kernel runs). Also timed: CPU tokens/s of the step (median of
``--repeats``). With ``--against DIR`` each model is measured in the recurformer of another
checkout as well (e.g. ``git worktree add /tmp/base main``), alternating A B A B in fresh
processes, and the ratios are printed.

    OMP_NUM_THREADS=1 python benchmarks/op_count.py [--models llama,memory_attention] [--out out/op_count.json]
    OMP_NUM_THREADS=1 python benchmarks/op_count.py --against /tmp/base --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAPER = dict(vocab_size=4096, dim=288, n_layers=6, n_heads=6)
EXTRA = {
    "memory_attention": dict(chunk_size=32, memory_qkv="shared"),
    "sliding_window": dict(window=256),
    "transformer_xl": dict(segment_len=32),
    "block_recurrent": dict(block_size=32),
    "gated_deltanet": dict(chunk_size=32),
}
NO_LAUNCH = {  # metadata-only operators: no kernel on a GPU
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::as_strided",
    "aten::expand",
    "aten::transpose",
    "aten::t",
    "aten::permute",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::select",
    "aten::slice",
    "aten::alias",
    "aten::detach",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::split",
    "aten::split_with_sizes",
    "aten::unbind",
    "aten::chunk",
    "aten::narrow",
    "aten::lift_fresh",
    "aten::result_type",
    "aten::_reshape_alias",
    "aten::view_as",
    "aten::expand_as",
    "aten::unflatten",
    "aten::flatten",
    "aten::contiguous",
    "aten::is_nonzero",
    "aten::_has_compatible_shallow_copy_type",
    "aten::set_",
    "aten::to",
    "aten::type_as",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::resize_",
    "aten::scalar_tensor",
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::new_zeros",
    "aten::zeros",
    "aten::zeros_like",
    "aten::ones",
    "aten::ones_like",
    "aten::full",
    "aten::new_full",
    "aten::conj",
    "aten::_conj",
    "aten::_neg_view",
    "aten::movedim",
    "aten::swapaxes",
    "aten::numpy_T",
    "aten::matrix_H",
}

# runs in a fresh process, with the recurformer of the checkout it is started in
CHILD = r"""
import json, statistics, sys, time, torch
from torch.profiler import ProfilerActivity, profile
from recurformer import build_model
name, cfg, B, T, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
no_launch = set(json.loads(sys.argv[6]))
torch.manual_seed(0)
model = build_model(name, cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, cfg["vocab_size"], (B, T))
state = None
def step():
    global state
    out = model(x, state=state, targets=x)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = out.state.detach() if model.bounded_state else None
step(); step()  # warm-up: the optimizer's state, then a step with a carried state
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    step()
memo = {}
def has_launch(e):  # whether an operator below e launches
    if id(e) not in memo:
        memo[id(e)] = any(launches(c) or has_launch(c) for c in e.cpu_children)
    return memo[id(e)]
def launches(e):
    empty = any(isinstance(s, list) and 0 in s for s in e.input_shapes or [])
    return e.name.startswith("aten::") and e.name not in no_launch and not empty and not has_launch(e)
ops = {}
for e in prof.events():
    if launches(e):
        ops[e.name] = ops.get(e.name, 0) + 1
ts = []
for _ in range(repeats):
    t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
print(json.dumps(dict(ops=sum(ops.values()), top=sorted(ops.items(), key=lambda kv: -kv[1])[:12], tok_per_s=B * T / statistics.median(ts))))
"""


def measure(code: Path, name: str, cfg: dict, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    argv = [name, json.dumps(cfg), str(args.batch), str(args.seq), str(args.repeats), json.dumps(sorted(NO_LAUNCH))]
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=code, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"op_count.py: error: {name} in {code} failed: {(done.stderr.strip().splitlines() or [''])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from recurformer.models import model_names

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(model_names()))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per process (the median is kept)")
    ap.add_argument("--against", help="another checkout to compare with (A B A B, fresh processes)")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds with --against")
    ap.add_argument("--out", default="out/op_count.json")
    args = ap.parse_args()
    if args.against and not (Path(args.against) / "recurformer").is_dir():
        sys.exit(f"op_count.py: error: --against {args.against} is not a recurformer checkout")
    tokens = args.batch * args.seq
    codes = {"this": ROOT} | ({"against": Path(args.against).resolve()} if args.against else {})
    print(
        f"one training step, B x T = {args.batch} x {args.seq}, paper width, CPU, {os.environ.get('OMP_NUM_THREADS', '?')} thread(s)"
    )
    head = f"{'model':<24}{'ops':>7}{'ops/token':>11}{'tok/s':>9}"
    print(
        head
        + (
            f"{'ops before':>12}{'ops/token':>11}{'tok/s':>9}{'ops ratio':>11}{'tok/s ratio':>13}"
            if args.against
            else ""
        )
    )
    rows = []
    for name in args.models.split(","):
        cfg = dict(PAPER, **EXTRA.get(name, {}))
        runs: dict[str, list[dict]] = {k: [] for k in codes}
        for _ in range(args.rounds if args.against else 1):
            for k, code in codes.items():  # interleaved: A B A B
                runs[k].append(measure(code, name, cfg, args))
        row: dict = dict(model=name, config=cfg)
        for k, rs in runs.items():
            row[k] = dict(
                ops=rs[0]["ops"],
                ops_per_token=rs[0]["ops"] / tokens,
                top=rs[0]["top"],
                tok_per_s=[round(r["tok_per_s"], 1) for r in rs],
                tok_per_s_median=statistics.median(r["tok_per_s"] for r in rs),
            )
        line = f"{name:<24}{row['this']['ops']:>7}{row['this']['ops_per_token']:>11.2f}{row['this']['tok_per_s_median']:>9,.0f}"
        if args.against:
            a, b = row["this"], row["against"]
            row["ops_ratio"] = a["ops"] / b["ops"]
            row["tok_per_s_ratio"] = a["tok_per_s_median"] / b["tok_per_s_median"]
            line += f"{b['ops']:>12}{b['ops_per_token']:>11.2f}{b['tok_per_s_median']:>9,.0f}{row['ops_ratio']:>11.2f}{row['tok_per_s_ratio']:>13.2f}"
        rows.append(row)
        print(line, flush=True)
    meta = dict(
        batch=args.batch,
        seq=args.seq,
        repeats=args.repeats,
        rounds=args.rounds if args.against else 1,
        threads=os.environ.get("OMP_NUM_THREADS"),
        against=args.against,
        command=" ".join(sys.argv),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
