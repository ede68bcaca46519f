"""Training and evaluation throughput of every model in the seeds' configuration
(dim 288, 6 layers, 6 heads, vocab 4096; Memory Attention chunk 32 with shared memory Q/K/V).

Training: forward + backward + AdamW step on B x T tokens (default 8 x 256), tokens/s.
Evaluation: one no-grad forward at T=4096 (batch 1), seconds (not for "+compile" rows).
Each row in fp32 and under bf16 autocast (when the CPU supports it); a "+compile" suffix compiles
the model's layers (``StreamingLM.compile_layers``, the trainer's ``--compile``; compile time
excluded by the warm-up). Rows are measured side by side in one run, interleaved over repeats, and
the median is reported.

``--processes 1,2`` instead compares data parallelism on this machine: the trainer (``recurformer
train``, Memory Attention in the seeds' configuration, the bundled TinyStories sample) at one global
batch, run as N processes (``torchrun``, DDP) x cores/N threads each; tokens/s from the run's
metrics after the first logging interval (warm-up).

    python benchmarks/throughput.py [--models memory_attention,llama] [--precisions fp32,bf16,fp32+compile]
    python benchmarks/throughput.py --processes 1,2 --steps 25 --out docs/ddp_throughput.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from recurformer import build_model
from recurformer.models import model_names

ROOT = Path(__file__).resolve().parent.parent
SEED_CONFIG = dict(vocab_size=4096, dim=288, n_layers=6, n_heads=6)
EXTRA = {"memory_attention": dict(chunk_size=32, memory_qkv="shared"), "sliding_window": dict(window=256)}


def autocast(precision: str):
    if precision.startswith("bf16"):
        return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step_fn(name: str, precision: str, B: int, T: int, device: str):
    torch.manual_seed(0)
    model = build_model(name, dict(SEED_CONFIG, **EXTRA.get(name, {}))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if precision.endswith("+compile"):
        model.compile_layers()
    x = torch.randint(0, 4096, (B, T), device=device)
    state = None

    def step() -> None:
        nonlocal state
        with autocast(precision):
            out = model(x, state=state, targets=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = out.state.detach() if model.bounded_state else None  # a full KV cache would grow

    return step


def eval_fn(name: str, precision: str, T: int, device: str):
    """None for compiled rows: a compiled layer unrolls its chunk loop (T/C steps), and a graph of
    128 chunks takes far longer to compile than the measurement is worth."""
    if precision.endswith("+compile"):
        return None
    torch.manual_seed(0)
    model = build_model(name, dict(SEED_CONFIG, **EXTRA.get(name, {}))).to(device).eval()
    x = torch.randint(0, 4096, (1, T), device=device)

    def run() -> None:
        with torch.no_grad(), autocast(precision):
            model(x)

    return run


def timed(fn) -> float:
    if fn is None:
        return float("nan")
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def trainer_tokens_per_s(nproc: int, threads: int, batch: int, seq: int, steps: int, precision: str, out: Path) -> float:
    """Median tokens/s of ``recurformer train`` on ``nproc`` processes (torchrun when > 1)."""
    sets = [
        "model.name=memory_attention", "model.dim=288", "model.n_layers=6", "model.n_heads=6", "model.chunk_size=32",
        f"train.out_dir={out}", f"train.batch_size={batch}", f"train.seq_len={seq}", f"train.steps={steps}",
        f"train.precision={precision}", "train.log_every=5", f"train.eval_every={steps}", "train.eval_batches=1",
        f"train.save_every={steps}", "data.dataset=tinystories-sample",
    ]
    launcher = [sys.executable, "-m", "recurformer.cli"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "--master_addr=127.0.0.1", "--master_port=29517", "-m", "recurformer.cli"]
    cmd = launcher + ["train", "--config", str(ROOT / "configs" / "repro" / "base.yaml")] + [a for x in sets for a in ("--set", x)]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"throughput.py: error: the {nproc}-process training run failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["tok_per_s"] for r in rows if "tok_per_s" in r][1:])


def compare_processes(args: argparse.Namespace) -> None:
    cores, precision = os.cpu_count() or 1, args.precisions.split(",")[0]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.processes.split(",")):
            if args.batch % n or cores % n:
                sys.exit(f"throughput.py: error: {n} processes must divide the batch ({args.batch}) and the cores ({cores})")
            label = f"{n} process{'es' if n > 1 else ''} x {cores // n} thread{'s' if cores // n > 1 else ''}"
            tps = trainer_tokens_per_s(n, cores // n, args.batch // n, args.seq, args.steps, precision, Path(tmp) / str(n))
            results.append(dict(processes=n, threads_per_process=cores // n, train_tokens_per_s=round(tps)))
            print(f"{label:<32}{tps:>10,.0f} tok/s", flush=True)
    meta = dict(torch=torch.__version__, precision=precision, global_batch=args.batch, seq=args.seq, steps=args.steps)
    Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(model_names()))
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--eval-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--processes", help="compare the trainer on these process counts (e.g. 1,2), in the first of --precisions")
    ap.add_argument("--steps", type=int, default=30, help="training steps per run of --processes")
    ap.add_argument("--out", default="docs/throughput.json")
    args = ap.parse_args()
    if args.processes:
        return compare_processes(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [(m, p) for m in args.models.split(",") for p in args.precisions.split(",")]
    train = {r: train_step_fn(*r, args.batch, args.seq, device) for r in rows}
    evals = {r: eval_fn(*r, args.eval_len, device) for r in rows}
    for r in rows:  # warm-up (compiles the "+compile" rows)
        timed(train[r])
        timed(evals[r])
    times: dict = {r: {"train": [], "eval": []} for r in rows}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every row alike
        for r in rows:
            times[r]["train"].append(timed(train[r]))
            times[r]["eval"].append(timed(evals[r]))
    results = []
    print(f"{'model':<18}{'prec':<14}{'train tok/s':>13}{'eval T=' + str(args.eval_len) + ' (s)':>18}")
    for (m, p), t in times.items():
        tps = args.batch * args.seq / statistics.median(t["train"])
        ev = statistics.median(t["eval"])
        results.append(dict(model=m, precision=p, train_tokens_per_s=round(tps), eval_seconds=None if ev != ev else round(ev, 3)))
        print(f"{m:<18}{p:<14}{tps:>13,.0f}{ev:>18.3f}")
    meta = dict(
        torch=torch.__version__, device=device, threads=torch.get_num_threads(), machine=platform.machine(),
        batch=args.batch, seq=args.seq, eval_len=args.eval_len, repeats=args.repeats,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
