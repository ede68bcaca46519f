"""Each model's fraction of this machine's matmul peak, and where its training step's time goes.

For every model and precision (fp32, or bf16 under CPU autocast) one training step (forward +
backward + AdamW on ``--batch`` x ``--seq`` tokens, the paper config of ``throughput.py``) is
timed (the median of ``--steps`` after two warm-up steps) and then profiled once with
``torch.profiler``, each row in a fresh process:

    fraction of peak = tokens/s x counted FLOP/token / (n x n matmul FLOP/s of the dtype)

FLOP/token is counted on the model (``recurformer.flops``: every matmul, attention by the pairs
its mask shows, training = 3 forwards). The peak (the best 1024 x 1024 matmul, as
``recurformer.flops.matmul_peak``) is measured in this run before the first row and again after
every row, fp32 and bf16, so its drift under other load shows; each row is divided by the better
of the peaks measured just before and just after it. ``--clock cpu`` times steps and peaks alike
in the process's CPU seconds instead of wall seconds (1 thread): on a machine other jobs share,
the time the process waits for a core then counts in neither.

The profiled step's self time is split into four buckets (``bucket``):

- *optimizer*: every op inside ``opt.step()`` and ``opt.zero_grad()`` (a ``record_function``
  range around them);
- *matmul*: aten::mm / addmm / bmm / baddbmm anywhere else;
- *attention*: every other op inside a ``scaled_dot_product_attention`` call or its fused
  backward. Attention written with explicit matmuls (Transformer-XL's relative attention,
  ``modules.biased_attend``) shows as matmul and elementwise instead, and so does the backward of SDPA's math path (taken when the
  mask needs a gradient: autograd differentiates it op by op);
- *elementwise*: the rest (norms, activations, RoPE, dtype casts, the loss, autograd's own
  bookkeeping), with the costliest of these ops by name.

Beside them, the matmuls' own rate (FLOPs from their recorded shapes over their share of the timed
step) in the step and for the same shapes timed alone, as fractions of the peak: a model whose matmuls alone reach
80% of peak cannot train at 85% of it, however small the rest.

    OMP_NUM_THREADS=2 python benchmarks/step_profile.py --models all --precisions fp32,bf16 --out out/step_profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import CONFIGS, EXTRA  # the same models and sizes as the throughput table

from recurformer import build_model
from recurformer.flops import machine_name, train_flops_per_token
from recurformer.models import model_names
from recurformer.nn import StreamingLM

OPTIMIZER = "optimizer"  # the record_function range around opt.step() and opt.zero_grad()
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
BUCKETS = ("matmul", "attention", "elementwise", "optimizer")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Clock = Callable[[], float]
CLOCKS: dict[str, Clock] = {"wall": time.perf_counter, "cpu": time.process_time}


def is_attention(name: str) -> bool:
    """An SDPA call: the forward op (fused kernel or math path) or a fused kernel's backward node."""
    return name.startswith(("aten::scaled_dot_product_attention", "aten::_scaled_dot_product")) or (
        "ScaledDotProduct" in name and "Backward" in name
    )


def bucket(chain: Sequence[str]) -> str:
    """The bucket of a profiled op from its name and its ancestors' names, innermost first."""
    if OPTIMIZER in chain:
        return "optimizer"
    if chain[0] in MATMULS:
        return "matmul"
    if any(is_attention(n) for n in chain):
        return "attention"
    return "elementwise"


def chain(event: Any) -> list[str]:
    """Names of a profiler event and its ancestors, innermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def matmul_dims(name: str, shapes: list[list[int]]) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of one recorded matmul call from its input shapes."""
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    return (a[0] if len(a) == 3 else 1), a[-2], a[-1], b[-1]


def split(events: Iterable[Any]) -> tuple[dict[str, float], dict[str, float], dict[tuple[int, ...], list[float]]]:
    """Self seconds per bucket, per elementwise op name, and [calls, seconds] per matmul shape."""
    buckets = dict.fromkeys(BUCKETS, 0.0)
    elementwise: dict[str, float] = defaultdict(float)
    matmuls: dict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in events:
        sec = ev.self_cpu_time_total / 1e6
        b = bucket(chain(ev))
        buckets[b] += sec
        if b == "elementwise":
            elementwise[ev.name] += sec
        elif b == "matmul":
            dims = matmul_dims(ev.name, ev.input_shapes)
            matmuls[dims][0] += 1
            matmuls[dims][1] += sec
    return buckets, dict(elementwise), dict(matmuls)


def alone_flops_per_s(
    dims: tuple[int, ...], dtype: torch.dtype, clock: Clock = time.perf_counter, seconds: float = 0.2
) -> float:
    """Best FLOP/s of one matmul of these dims in ``dtype`` timed by itself on ``clock`` over
    ~``seconds``; of (1, 1024, 1024, 1024) it is the peak (as ``recurformer.flops.matmul_peak``).
    Each sample times as many calls as take ~1 ms, so a matmul of a few microseconds is not below
    the clock's resolution (the CPU clock's can be coarse enough to read 0 for one call)."""
    bsz, m, k, n = dims
    a, b = torch.randn(bsz, m, k, dtype=dtype), torch.randn(bsz, k, n, dtype=dtype)
    mm = torch.bmm if bsz > 1 else lambda x, y: x[0] @ y[0]
    mm(a, b)
    t0 = time.perf_counter()
    mm(a, b)
    reps = max(1, int(1e-3 / max(time.perf_counter() - t0, 1e-7)))
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end or best == float("inf"):
        t0 = clock()
        for _ in range(reps):
            mm(a, b)
        if (elapsed := clock() - t0) > 0:
            best = min(best, elapsed / reps)
    return 2 * bsz * m * k * n / best


def train_step(model: StreamingLM, x: torch.Tensor, precision: str) -> Callable[[], None]:
    """One training step on ``x`` as throughput.py takes it (the state carried when bounded), the
    optimizer inside the ``OPTIMIZER`` range."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the trainer (optim.make_optimizer)
    state = None

    def step() -> None:
        nonlocal state
        with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
            out = model(x, state=state, targets=x)
        out.loss.backward()
        with record_function(OPTIMIZER):
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = out.state.detach() if model.bounded_state else None  # a full KV cache would grow

    return step


def profile_model(name: str, precision: str, batch: int, seq: int, steps: int, clock: Clock) -> dict:
    torch.manual_seed(0)
    model = build_model(name, dict(CONFIGS["paper"], **EXTRA.get(name, {})))
    flops_per_token = train_flops_per_token(model, seq)  # counted, as throughput.py
    step = train_step(model, torch.randint(0, model.config.vocab_size, (batch, seq)), precision)
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        times.append(clock() - t0)
    step_s = statistics.median(times)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    seconds, elementwise, matmuls = split(prof.events())
    total = sum(seconds.values())
    mm_flops = sum(2 * b * m * k * n * calls for (b, m, k, n), (calls, _) in matmuls.items())
    alone_s = sum(
        2 * b * m * k * n * calls / alone_flops_per_s((b, m, k, n), DTYPES[precision], clock)
        for (b, m, k, n), (calls, _) in matmuls.items()
    )
    top = sorted(elementwise.items(), key=lambda kv: -kv[1])[:4]
    return dict(
        model=name,
        precision=precision,
        step_s=round(step_s, 4),
        step_s_all=[round(t, 4) for t in times],
        tokens_per_s=round(batch * seq / step_s, 1),
        mflop_per_token=round(flops_per_token / 1e6, 3),
        gflop_per_s=round(flops_per_token * batch * seq / step_s / 1e9, 2),
        profiled_step_s=round(total, 4),
        **{f"{b}_share": round(s / total, 4) for b, s in seconds.items()},
        top_elementwise={k: round(v / total, 4) for k, v in top},
        matmul_calls=int(sum(c for c, _ in matmuls.values())),
        # the matmuls' time: their share of the profiled step x the timed step (on the chosen clock)
        matmul_gflop_per_s_in_step=round(mm_flops / max(seconds["matmul"] / total * step_s, 1e-9) / 1e9, 2),
        matmul_gflop_per_s_alone=round(mm_flops / max(alone_s, 1e-9) / 1e9, 2),
    )


def measure_peaks(precisions: list[str], clock: Clock) -> dict:
    """The 1024 x 1024 matmul peak of each precision now, and the machine's 1-minute load average."""
    peaks: dict[str, Any] = {p: alone_flops_per_s((1, 1024, 1024, 1024), DTYPES[p], clock, 0.5) for p in precisions}
    return dict(peaks, load_1min=os.getloadavg()[0], time=datetime.now(timezone.utc).strftime("%H:%M:%S"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']} {r['precision']}" for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    left = [0.0] * len(rows)
    for b, color in zip(BUCKETS, ("tab:blue", "tab:orange", "tab:gray", "tab:green")):
        width = [r[f"{b}_share"] for r in rows][::-1]
        ax.barh(labels, width, left=left, color=color, label=b)
        left = [a + w for a, w in zip(left, width)]
    for i, r in enumerate(rows[::-1]):
        ax.text(1.01, i, f"{r['of_peak']:.0%} of peak", va="center", fontsize=8)
    ax.set_xlim(0, 1.2)
    ax.set_xlabel("share of the profiled training step's self time")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)


def run_row(name: str, precision: str, args: argparse.Namespace) -> dict | None:
    """One row in a fresh process of this script: the profile of a long step (the Recurrent
    Transformer's) holds ~15 GB of events, which a process does not give back."""
    cmd = [sys.executable, __file__, "--row", f"{name}:{precision}", "--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--steps", str(args.steps), "--threads", str(torch.get_num_threads()), "--clock", args.clock]
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode or not r.stdout.strip():
        last = ([ln for ln in r.stderr.splitlines() if ln.strip()] or ["no output"])[-1]
        print(f"{name} {precision}: failed (exit {r.returncode}): {last[:200]}", flush=True)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all", help="comma-separated model names, or all")
    ap.add_argument("--precisions", "--precision", default="fp32,bf16", help="fp32, bf16 (CPU autocast) or both")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (the median is reported)")
    ap.add_argument("--threads", type=int, help="torch threads (default: as OMP_NUM_THREADS gives)")
    ap.add_argument("--out", default="out/step_profile.json", help="write the rows as JSON here (and a PNG beside)")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: the process's CPU seconds for steps and peaks alike (1 thread, on a machine other jobs share)",
    )
    ap.add_argument("--row", metavar="MODEL:PRECISION", help=argparse.SUPPRESS)  # a worker: one row as JSON
    args = ap.parse_args()
    if args.row:
        torch.set_num_threads(args.threads)
        name, precision = args.row.split(":")
        print(json.dumps(profile_model(name, precision, args.batch, args.seq, args.steps, CLOCKS[args.clock])))
        return
    names = model_names() if args.models == "all" else args.models.split(",")
    if unknown := [n for n in names if n not in model_names()]:
        ap.error(f"--models: unknown model {unknown[0]!r}; choose from all, {', '.join(model_names())}")
    precisions = args.precisions.split(",")
    if bad := [p for p in precisions if p not in DTYPES]:
        ap.error(f"--precisions: unknown precision {bad[0]!r}; choose from fp32, bf16")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        ap.error(
            f"--clock cpu needs 1 thread (CPU seconds of several threads count their waiting), got {torch.get_num_threads()}"
        )
    clock = CLOCKS[args.clock]

    checkpoints, rows, failed = [measure_peaks(precisions, clock)], [], []
    for name in names:
        for precision in precisions:
            row = run_row(name, precision, args)
            checkpoints.append(measure_peaks(precisions, clock))
            if row is None:
                failed.append(f"{name} {precision}")
                continue
            # the better of the peaks measured just before and just after the row
            peak = max(checkpoints[-2][precision], checkpoints[-1][precision])
            row["peak_gflop_per_s"] = round(peak / 1e9, 1)
            row["of_peak"] = round(row["gflop_per_s"] * 1e9 / peak, 4)
            row["matmul_of_peak_in_step"] = round(row["matmul_gflop_per_s_in_step"] * 1e9 / peak, 4)
            row["matmul_of_peak_alone"] = round(row["matmul_gflop_per_s_alone"] * 1e9 / peak, 4)
            rows.append(row)
            print(f"{name} {precision}: {row['tokens_per_s']:,.0f} tok/s, {row['of_peak']:.1%} of peak", flush=True)

    print(
        f"{torch.get_num_threads()} thread(s), {args.clock} clock; one training step of {args.batch} x {args.seq} tokens"
    )
    for p in precisions:
        series = [c[p] / 1e9 for c in checkpoints]
        print(f"{p} matmul peak {min(series):.1f}-{max(series):.1f} GFLOP/s over {len(series)} measurements")
    loads = [c["load_1min"] for c in checkpoints]
    print(f"load average (1 min) {min(loads):.2f}-{max(loads):.2f}")
    print(
        f"{'model':<22}{'prec':<5}{'tok/s':>7}{'MFLOP/tok':>10}{'GFLOP/s':>8}{'of peak':>8}{'matmul':>7}{'attn':>6}"
        f"{'elemw':>6}{'optim':>6}{'mm rate/peak':>13}  largest elementwise op"
    )
    for r in rows:
        op, share = next(iter(r["top_elementwise"].items()), ("-", 0.0))
        print(
            f"{r['model']:<22}{r['precision']:<5}{r['tokens_per_s']:>7,.0f}{r['mflop_per_token']:>10.1f}"
            f"{r['gflop_per_s']:>8.1f}{r['of_peak']:>8.1%}{r['matmul_share']:>7.1%}{r['attention_share']:>6.1%}"
            f"{r['elementwise_share']:>6.1%}{r['optimizer_share']:>6.1%}{r['matmul_of_peak_in_step']:>13.1%}"
            f"  {op.removeprefix('aten::')} {share:.1%}"
        )
    if args.out:
        meta = dict(
            date=datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            cpu=machine_name(),
            cores=os.cpu_count(),
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            config=CONFIGS["paper"],
            extra=EXTRA,
            batch=args.batch,
            seq=args.seq,
            steps=args.steps,
            clock=args.clock,
            peaks=checkpoints,
            failed=failed,
            command="python " + " ".join(sys.argv),
        )
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
        tmp.replace(out)
        if rows:
            plot(rows, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
