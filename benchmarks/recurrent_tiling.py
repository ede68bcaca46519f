"""One layer of the Recurrent Transformer vs sequence length N, two tables:

* forward (no grad) latency: naive schedule (one position at a time over the growing prefix),
  exact tiled schedule, the block variant (tiled, b > 1) and a standard Transformer (Llama) layer;
  plus the K/V bytes each schedule reads (Θ(N^2) vs Θ(N log N));
* training (``--train-ns``): bytes autograd saves for backward (saved_tensors_hooks, unique
  storages) and forward+backward latency of the naive path (plain autograd: O(N^2 d) saved, it
  keeps each step's concatenated prefix), the tiled path (its custom backward: O(N d) saved) and
  the Transformer layer (SDPA).

Prints the tables and writes out/recurrent_tiling.json and .png (like the latency figure of *The
Recurrent Transformer: Greater Effective Depth and Efficient Decoding*, "Exact tiling schedule").

    OMP_NUM_THREADS=1 python benchmarks/recurrent_tiling.py [--dim 256 --batch 8 --max-n 4096]
        [--train-ns 1024 4096 8192 --train-batch 1 --naive-train-max-n 1024] [--parts forward train]
        [--clock cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recurformer import build_model
from recurformer.device import pick_device, synchronize
from recurformer.nn import Call
from recurformer.ops.recurrent_attention import kv_reads

DEVICE = torch.device("cpu")  # --device
CLOCK = time.perf_counter  # --clock: wall time, or this process's CPU time (on a CPU shared with other jobs)


def timeit(fn, reps: int, warmup: bool = True) -> float:
    """Median time (ms, ``CLOCK``) of ``reps`` calls, after one warm-up call unless told otherwise;
    queued CUDA work is waited for before each clock read."""
    if warmup:
        fn()
    ts = []
    for _ in range(reps):
        synchronize(DEVICE)
        t0 = CLOCK()
        fn()
        synchronize(DEVICE)
        ts.append(CLOCK() - t0)
    return statistics.median(ts) * 1e3


def layer_fn(model, x, impl):
    """The recurrent layer on x from position 0: () -> (z, state)."""
    layer = model.layers[0]
    B, T, D = x.shape
    empty = x.new_zeros(B, layer.n_heads, 0, D // layer.n_heads)
    past = {k: empty for k in ("k", "v", "tk", "tv")}
    start = torch.zeros(B, dtype=torch.long, device=x.device)
    rope, bias = layer.position_signal(0, T, x.device, x.dtype)
    return lambda: layer.run(x, past, pos0=0, start=start, rope=rope, bias_fn=bias, impl=impl)


def dense_fn(model, x):
    """The Transformer (Llama) layer on x from position 0: () -> (y, state)."""
    layer = model.layers[0]
    state = layer.init_state(x.shape[0], x.device, x.dtype)
    return lambda: layer(x, state, Call(0, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)))


def train_fn(fwd):
    """One forward + backward of sum(output)."""
    return lambda: fwd()[0].sum().backward()


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while fn runs (unique storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def forward_table(args, models, dense) -> list[dict]:
    rows = []
    N = args.min_n
    print(
        f"forward: one layer, dim {args.dim}, {args.heads} heads, batch {args.batch}, fp32, {DEVICE}, torch threads {torch.get_num_threads()}"
    )
    hdr = f"{'N':>6} {'naive ms':>10} {'tiled ms':>10} " + " ".join(f"{'b=' + str(b) + ' ms':>10}" for b in args.blocks)
    print(hdr + f" {'transf ms':>10} {'naive/tiled':>11} {'KV MB naive':>12} {'KV MB tiled':>12}")
    while N <= args.max_n:
        x = torch.randn(args.batch, N, args.dim, device=DEVICE)
        r = {"N": N}
        with torch.no_grad():
            if N <= args.naive_max_n:
                r["naive_ms"] = timeit(layer_fn(models["recurrent"], x, "naive"), args.reps if N < 2048 else 1)
            r["tiled_ms"] = timeit(layer_fn(models["recurrent"], x, "tiled"), args.reps)
            for b in args.blocks:
                r[f"block{b}_ms"] = timeit(layer_fn(models[f"block{b}"], x, "tiled"), args.reps)
            r["transformer_ms"] = timeit(dense_fn(dense, x), args.reps)
        per_pos = 2 * args.dim * 4 * args.batch  # K and V, fp32, all heads and rows
        r["kv_bytes_naive"] = kv_reads(N, schedule="naive") * per_pos
        r["kv_bytes_tiled"] = kv_reads(N) * per_pos
        rows.append(r)
        ratio = r["naive_ms"] / r["tiled_ms"] if "naive_ms" in r else float("nan")
        print(
            f"{N:>6} {r.get('naive_ms', float('nan')):>10.1f} {r['tiled_ms']:>10.1f} "
            + " ".join(f"{r[f'block{b}_ms']:>10.1f}" for b in args.blocks)
            + f" {r['transformer_ms']:>10.1f} {ratio:>11.2f} {r['kv_bytes_naive'] / 1e6:>12.1f} {r['kv_bytes_tiled'] / 1e6:>12.1f}",
            flush=True,
        )
        N *= 2
    return rows


def train_table(args, models, dense) -> list[dict]:
    """Saved bytes and forward+backward latency (x requires grad, as inside a stack)."""
    rows = []
    print(
        f"training: one layer, dim {args.dim}, {args.heads} heads, batch {args.train_batch}, fp32, forward + backward of sum(z)"
    )
    print(
        f"{'N':>6} "
        + " ".join(
            f"{name + ' ' + unit:>16}" for name in ("naive", "tiled", "transf") for unit in ("saved MB", "fwd+bwd ms")
        )
    )
    for N in args.train_ns:
        x = torch.randn(args.train_batch, N, args.dim, device=DEVICE, requires_grad=True)
        fwds = {"tiled": layer_fn(models["recurrent"], x, "tiled"), "transformer": dense_fn(dense, x)}
        if N <= args.naive_train_max_n:
            fwds["naive"] = layer_fn(models["recurrent"], x, "naive")
        r = {"N": N}
        for name, fwd in fwds.items():
            out: list[torch.Tensor] = []
            r[f"{name}_saved_bytes"] = saved_bytes(lambda: out.append(fwd()[0]))
            out.pop().sum().backward()  # with the forward above: the warm-up
            r[f"{name}_fwd_bwd_ms"] = timeit(train_fn(fwd), args.train_reps, warmup=False)
        rows.append(r)
        cells = [
            (r.get(f"{n}_saved_bytes", float("nan")) / 1e6, r.get(f"{n}_fwd_bwd_ms", float("nan")))
            for n in ("naive", "tiled", "transformer")
        ]
        print(f"{N:>6} " + " ".join(f"{mb:>16.1f} {ms:>16.0f}" for mb, ms in cells), flush=True)
    return rows


def plot(args, rows: list[dict], train: list[dict], path: Path) -> None:
    """Forward latency and K/V traffic (forward table), saved bytes and fwd+bwd latency (training)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if rows else 0) + (2 if train else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    ax = list(axes[0])
    if rows:
        fwd, kv = ax.pop(0), ax.pop(0)
        for key, label in (
            [("naive_ms", "recurrent, naive"), ("tiled_ms", "recurrent, tiled")]
            + [(f"block{b}_ms", f"recurrent, tiled, block b={b}") for b in args.blocks]
            + [("transformer_ms", "Transformer layer")]
        ):
            pts = [(r["N"], r[key]) for r in rows if key in r]
            fwd.plot(*zip(*pts), marker="o", label=label)
        fwd.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="forward latency (ms)",
                title=f"one layer, D={args.dim}, batch {args.batch}, {DEVICE.type.upper()}")  # fmt: skip
        fwd.legend()
        ns = [r["N"] for r in rows]
        kv.plot(ns, [r["kv_bytes_naive"] / 1e6 for r in rows], marker="o", label="naive  Θ(N²)")
        kv.plot(ns, [r["kv_bytes_tiled"] / 1e6 for r in rows], marker="o", label="tiled  Θ(N log N)")
        kv.set(
            xscale="log",
            yscale="log",
            xlabel="sequence length N",
            ylabel="persistent K/V read (MB)",
            title="K/V traffic",
        )
        kv.legend()
    if train:
        mem, lat = ax
        for name, label in (
            ("naive", "recurrent, naive (autograd)"),
            ("tiled", "recurrent, tiled (custom backward)"),
            ("transformer", "Transformer layer"),
        ):
            pts = [
                (r["N"], r[f"{name}_saved_bytes"] / 1e6, r[f"{name}_fwd_bwd_ms"])
                for r in train
                if f"{name}_saved_bytes" in r
            ]
            if pts:
                ns, mb, ms = zip(*pts)
                mem.plot(ns, mb, marker="o", label=label)
                lat.plot(ns, ms, marker="o", label=label)
        mem.set(
            xscale="log",
            yscale="log",
            xlabel="sequence length N",
            ylabel="saved for backward (MB)",
            title=f"training, batch {args.train_batch}",
        )
        lat.set(
            xscale="log",
            yscale="log",
            xlabel="sequence length N",
            ylabel="forward + backward (ms)",
            title=f"training, D={args.dim}, {DEVICE.type.upper()}",
        )
        mem.legend()
        lat.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--min-n", type=int, default=64)
    ap.add_argument("--max-n", type=int, default=4096)
    ap.add_argument("--naive-max-n", type=int, default=4096)
    ap.add_argument("--blocks", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-ns", type=int, nargs="*", default=[1024, 4096, 8192])
    ap.add_argument("--train-batch", type=int, default=1)
    ap.add_argument("--train-reps", type=int, default=1)
    ap.add_argument(
        "--naive-train-max-n", type=int, default=1024, help="naive saves O(N^2 d): ~1.1 GB at N=1024, dim 256"
    )
    ap.add_argument("--parts", nargs="+", choices=["forward", "train"], default=["forward", "train"])
    ap.add_argument("--out", default="out/recurrent_tiling")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (auto: CUDA when present)")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (a CPU shared with other jobs)",
    )
    args = ap.parse_args()
    global DEVICE, CLOCK
    DEVICE = pick_device(args.device)
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, dim=args.dim, n_layers=1, n_heads=args.heads)
    models = {"recurrent": build_model("recurrent_transformer", cfg)}
    for b in args.blocks:
        models[f"block{b}"] = build_model("recurrent_transformer", dict(cfg, block_size=b))
        models[f"block{b}"].load_state_dict(models["recurrent"].state_dict())
    dense = build_model("llama", cfg).to(DEVICE)
    for m in models.values():
        m.to(DEVICE)
    rows = forward_table(args, models, dense) if "forward" in args.parts else []
    train = train_table(args, models, dense) if "train" in args.parts else []

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(DEVICE),
        "device_name": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    out.with_suffix(".json").write_text(
        json.dumps({"args": vars(args), "meta": meta, "rows": rows, "training": train}, indent=1)
    )
    plot(args, rows, train, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
