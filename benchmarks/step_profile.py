"""Where one CPU training step's time goes, and what that allows for the fraction of peak.

``throughput.py`` reports a training step as a fraction of this machine's n x n matmul peak. This
script splits that fraction into its two factors with ``torch.profiler`` (one step after five,
the median of the last three timed, fp32 or under bf16 autocast, the paper config and batch as in
``throughput.py``):

    fraction of peak  ~  (share of the step spent in matmuls) x (the matmuls' own FLOP/s / peak)
                         + the attention's part

"of peak" is the step's counted FLOPs (``recurformer.flops``, as ``throughput.py``) over its
unprofiled time and the peak.

- *matmul share*: self time of aten::mm / addmm / bmm / baddbmm over the step's self time;
  attention (SDPA) and everything else (norms, activations, RoPE, softmax, loss, optimizer) are
  reported beside it, with the costliest of the rest by name.
- *matmul efficiency*: the FLOPs of those calls (2·m·k·n from their recorded shapes) over their
  time, in the step and again for the same shapes timed alone (best of several runs, in the
  precision's dtype: under CPU autocast the matmuls run in bf16 and attention in fp32), each as a
  fraction of the 1024 x 1024 peak of that dtype measured in the same run.

So a model whose matmuls alone reach 80% of peak cannot train at 85% of it, however small the rest.

    OMP_NUM_THREADS=2 python benchmarks/step_profile.py --models memory_attention,llama [--precision bf16] --out out/step_profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recurformer import build_model
from recurformer.flops import matmul_peak, train_flops_per_token
from recurformer.models import model_names

CONFIG = dict(vocab_size=4096, dim=288, n_layers=6, n_heads=6)  # throughput.py's "paper" config
EXTRA = {"memory_attention": dict(chunk_size=32, memory_qkv="shared"), "sliding_window": dict(window=256)}
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION = "aten::_scaled_dot_product"


def matmul_dims(name: str, shapes: list[list[int]]) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of one recorded matmul call from its input shapes."""
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    return (a[0] if len(a) == 3 else 1), a[-2], a[-1], b[-1]


def alone_flops_per_s(
    dims: tuple[int, int, int, int], dtype: torch.dtype = torch.float32, seconds: float = 0.3
) -> float:
    """Best FLOP/s of one matmul of these dims in ``dtype`` timed by itself."""
    bsz, m, k, n = dims
    a, b = torch.randn(bsz, m, k, dtype=dtype), torch.randn(bsz, k, n, dtype=dtype)
    mm = torch.bmm if bsz > 1 else lambda x, y: x[0] @ y[0]
    mm(a, b)
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end or best == float("inf"):
        t0 = time.perf_counter()
        mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * bsz * m * k * n / best


def profile_model(name: str, batch: int, seq: int, precision: str = "fp32") -> dict:
    torch.manual_seed(0)
    model = build_model(name, dict(CONFIG, **EXTRA.get(name, {})))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    flops = train_flops_per_token(model, seq) * batch * seq  # counted, as throughput.py
    x = torch.randint(0, CONFIG["vocab_size"], (batch, seq))
    state = None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def step() -> None:
        nonlocal state
        with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
            out = model(x, state=state, targets=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = out.state.detach() if model.bounded_state else None

    for _ in range(2):
        step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    total = mm_time = attn_time = 0.0
    other: dict[str, float] = defaultdict(float)
    by_dims: dict[tuple[int, int, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])  # dims -> [calls, seconds]
    for ev in prof.key_averages(group_by_input_shape=True):
        sec = ev.self_cpu_time_total / 1e6
        total += sec
        if ev.key in MATMULS:
            mm_time += sec
            by_dims[matmul_dims(ev.key, ev.input_shapes)][0] += ev.count
            by_dims[matmul_dims(ev.key, ev.input_shapes)][1] += sec
        elif ev.key.startswith(ATTENTION):
            attn_time += sec
        else:
            other[ev.key] += sec
    mm_flops = sum(2 * d[0] * d[1] * d[2] * d[3] * calls for d, (calls, _) in by_dims.items())
    alone_s = sum(
        2 * d[0] * d[1] * d[2] * d[3] * calls / alone_flops_per_s(d, dtype) for d, (calls, _) in by_dims.items()
    )
    top = sorted(other.items(), key=lambda kv: -kv[1])[:4]
    return dict(
        model=name,
        step_s=round(step_s, 3),
        profiled_step_s=round(total, 3),
        step_gflop_per_s=round(flops / step_s / 1e9, 2),
        matmul_share=round(mm_time / total, 4),
        attention_share=round(attn_time / total, 4),
        other_share=round(1 - (mm_time + attn_time) / total, 4),
        matmul_gflop=round(mm_flops / 1e9, 2),
        matmul_calls=int(sum(c for c, _ in by_dims.values())),
        matmul_gflop_per_s_in_step=round(mm_flops / mm_time / 1e9, 2),
        matmul_gflop_per_s_alone=round(mm_flops / alone_s / 1e9, 2),
        top_other={k: round(v / total, 4) for k, v in top},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="memory_attention,llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: the step under CPU autocast, fractions of the bf16 peak",
    )
    ap.add_argument("--out", default="out/step_profile.json", help="write the rows as JSON here")
    args = ap.parse_args()
    names = args.models.split(",")
    if unknown := [n for n in names if n not in model_names()]:
        sys.exit(f"step_profile.py: error: unknown model {unknown[0]}; choose from {', '.join(model_names())}")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak = matmul_peak.__wrapped__(dtype, "cpu")
    rows = [profile_model(n, args.batch, args.seq, args.precision) for n in names]
    peak = max(peak, matmul_peak.__wrapped__(dtype, "cpu"))  # best of start and end, as throughput.py
    for r in rows:
        r["step_of_peak"] = round(r["step_gflop_per_s"] * 1e9 / peak, 4)
        r["matmul_of_peak_in_step"] = round(r["matmul_gflop_per_s_in_step"] * 1e9 / peak, 4)
        r["matmul_of_peak_alone"] = round(r["matmul_gflop_per_s_alone"] * 1e9 / peak, 4)
    print(
        f"{args.precision} 1024x1024 matmul peak: {peak / 1e9:.1f} GFLOP/s on {torch.get_num_threads()} threads; one step of {args.batch} x {args.seq} tokens"
    )
    print(
        f"{'model':<24}{'step s':>8}{'of peak':>9}{'matmul':>8}{'SDPA':>7}{'other':>7}{'mm/peak in step':>17}{'mm/peak alone':>15}  costliest other ops"
    )
    for r in rows:
        tops = ", ".join(f"{k.removeprefix('aten::')} {v:.1%}" for k, v in r["top_other"].items())
        print(
            f"{r['model']:<24}{r['step_s']:>8.2f}{r['step_of_peak']:>9.1%}{r['matmul_share']:>8.1%}{r['attention_share']:>7.1%}{r['other_share']:>7.1%}"
            f"{r['matmul_of_peak_in_step']:>17.1%}{r['matmul_of_peak_alone']:>15.1%}  {tops}"
        )
    if args.out:
        meta = dict(
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            precision=args.precision,
            peak_flops=peak,
            config=CONFIG,
            batch=args.batch,
            seq=args.seq,
            command=" ".join(sys.argv),
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
