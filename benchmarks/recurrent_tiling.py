"""One-layer forward latency of the Recurrent Transformer vs sequence length N: naive schedule
(one position at a time over the growing prefix), exact tiled schedule, the block variant
(tiled, b > 1) and a standard Transformer (Llama) layer; plus the K/V bytes each schedule reads
(Θ(N^2) vs Θ(N log N)) and the autograd memory of the tiled path. Prints a table and writes
docs/recurrent_tiling.json and .png (like the seed's latency figure).

    OMP_NUM_THREADS=1 python benchmarks/recurrent_tiling.py [--dim 256 --batch 8 --max-n 4096]
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
from recurformer.models.llama import Block
from recurformer.ops.recurrent_attention import kv_reads


def timeit(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def layer_fn(model, x, impl):
    layer = model.layers[0]
    B, T, D = x.shape
    empty = x.new_zeros(B, layer.n_heads, 0, D // layer.n_heads)
    past = {k: empty for k in ("k", "v", "tk", "tv")}
    start = torch.zeros(B, dtype=torch.long)
    rope, bias = layer.position_signal(0, T, x.device, x.dtype)
    return lambda: layer.run(x, past, pos0=0, start=start, rope=rope, bias_fn=bias, impl=impl)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward (unique storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


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
    ap.add_argument("--out", default="docs/recurrent_tiling")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, dim=args.dim, n_layers=1, n_heads=args.heads)
    models = {"recurrent": build_model("recurrent_transformer", cfg).eval()}
    for b in args.blocks:
        models[f"block{b}"] = build_model("recurrent_transformer", dict(cfg, block_size=b)).eval()
        models[f"block{b}"].load_state_dict(models["recurrent"].state_dict())
    tcfg = build_model("llama", cfg).config
    block = Block(tcfg).eval()
    from recurformer.layers import rope_cos_sin

    rows = []
    N = args.min_n
    print(f"one layer, dim {args.dim}, {args.heads} heads, batch {args.batch}, fp32, torch threads {torch.get_num_threads()}")
    hdr = f"{'N':>6} {'naive ms':>10} {'tiled ms':>10} " + " ".join(f"{'b=' + str(b) + ' ms':>10}" for b in args.blocks)
    print(hdr + f" {'transf ms':>10} {'naive/tiled':>11} {'KV MB naive':>12} {'KV MB tiled':>12}")
    while N <= args.max_n:
        x = torch.randn(args.batch, N, args.dim)
        r = {"N": N}
        with torch.no_grad():
            if N <= args.naive_max_n:
                r["naive_ms"] = timeit(layer_fn(models["recurrent"], x, "naive"), args.reps if N < 2048 else 1)
            r["tiled_ms"] = timeit(layer_fn(models["recurrent"], x, "tiled"), args.reps)
            for b in args.blocks:
                r[f"block{b}_ms"] = timeit(layer_fn(models[f"block{b}"], x, "tiled"), args.reps)
            cos, sin = rope_cos_sin(torch.arange(N), tcfg.head_dim, tcfg.rope_theta, x.dtype)
            e = x.new_zeros(args.batch, args.heads, 0, args.dim // args.heads)
            r["transformer_ms"] = timeit(lambda: block(x, cos, sin, e, e, None), args.reps)
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

    # autograd memory of the tiled path (saved tensors), small N
    mem = []
    for n in (128, 256, 512, 1024):
        x = torch.randn(1, n, args.dim, requires_grad=True)
        m = models["recurrent"]
        mem.append({"N": n, "tiled_saved_MB": saved_bytes(layer_fn(m, x, "tiled")) / 1e6, "naive_saved_MB": saved_bytes(layer_fn(m, x, "naive")) / 1e6})
        print(f"autograd saved tensors, batch 1, N={n}: tiled {mem[-1]['tiled_saved_MB']:.1f} MB, naive {mem[-1]['naive_saved_MB']:.1f} MB", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows, "autograd_memory": mem}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ns = [r["N"] for r in rows]
    for key, label in [("naive_ms", "recurrent, naive"), ("tiled_ms", "recurrent, tiled")] + [
        (f"block{b}_ms", f"recurrent, tiled, block b={b}") for b in args.blocks
    ] + [("transformer_ms", "Transformer layer")]:
        pts = [(r["N"], r[key]) for r in rows if key in r]
        ax[0].plot(*zip(*pts), marker="o", label=label)
    ax[0].set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="forward latency (ms)",
              title=f"one layer, D={args.dim}, batch {args.batch}, CPU")  # fmt: skip
    ax[0].legend()
    ax[1].plot(ns, [r["kv_bytes_naive"] / 1e6 for r in rows], marker="o", label="naive  Θ(N²)")
    ax[1].plot(ns, [r["kv_bytes_tiled"] / 1e6 for r in rows], marker="o", label="tiled  Θ(N log N)")
    ax[1].set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="persistent K/V read (MB)", title="K/V traffic")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
