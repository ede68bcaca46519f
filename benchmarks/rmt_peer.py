"""Training throughput of recurformer's RMT beside lucidrains' recurrent-memory-transformer-pytorch,
side by side in one process: the same dim, depth, heads, segment length and memory size, fp32,
training steps (forward + backward + AdamW) interleaved A B A B, reported as median tokens/s and
the ratio ours / theirs (of the medians, the median of the per-pair ratios, and best of each). The peer package is imported from ``--peer PATH`` (a
directory holding ``recurrent_memory_transformer_pytorch`` and its dependencies, e.g. the
site-packages of a scratch venv with ``pip install recurrent-memory-transformer-pytorch``), run as
it is, nothing copied.

Both unroll every segment of a B x T batch from the initial memory and backpropagate through all
of them (the peer: ``RecurrentMemoryTransformerWrapper(...)(x, return_loss=True)``, no memory
replay, no XL memories; ours: ``model(x, targets=y)`` with a fresh state). The peer is configured
to be as close to ours as it allows: rotary positions instead of absolute ones, hyper-connections
off (one residual stream); its null key/value, value residuals, GEGLU, untied head and separate
write tokens stay (the layouts are compared in docs/results/rmt.md).

    python benchmarks/rmt_peer.py --peer /path/to/site-packages [--threads 1] [--out out/rmt_peer.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recurformer import build_model


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--peer", required=True, metavar="PATH", help="directory holding recurrent_memory_transformer_pytorch"
    )
    ap.add_argument("--dim", type=int, default=288)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--segment", type=int, default=128)
    ap.add_argument("--memory", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512, help="tokens per row and step (seq / segment segments)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="out/rmt_peer.json")
    args = ap.parse_args()
    if not (Path(args.peer) / "recurrent_memory_transformer_pytorch").is_dir():
        sys.exit(f"rmt_peer.py: error: --peer {args.peer} holds no recurrent_memory_transformer_pytorch package")
    sys.path.append(str(Path(args.peer).resolve()))  # after ours: torch resolves from this environment
    from recurrent_memory_transformer_pytorch import RecurrentMemoryTransformer, RecurrentMemoryTransformerWrapper

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = build_model(
        "rmt",
        dict(
            vocab_size=args.vocab,
            dim=args.dim,
            n_layers=args.depth,
            n_heads=args.heads,
            segment_len=args.segment,
            memory_size=args.memory,
        ),
    )
    peer_model = RecurrentMemoryTransformer(
        args.dim, num_tokens=args.vocab, depth=args.depth, heads=args.heads, dim_head=args.dim // args.heads, seq_len=args.segment,
        num_memory_tokens=args.memory, use_flash_attn=True, abs_pos_emb=False, rotary_pos_emb=True, use_xl_memories=False,
        num_residual_streams=1,
    )  # fmt: skip
    theirs = RecurrentMemoryTransformerWrapper(peer_model)
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-4)

    def step_ours() -> None:
        out = ours(x[:, :-1], targets=x[:, 1:])
        assert out.loss is not None
        out.loss.backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)

    def step_theirs() -> None:
        loss, _ = theirs(x, return_loss=True)  # the wrapper shifts x into inputs and labels itself
        loss.backward()
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)

    rows: dict[str, tuple[Callable[[], None], int]] = {
        "recurformer rmt": (step_ours, sum(p.numel() for p in ours.parameters())),
        "lucidrains RMT": (step_theirs, sum(p.numel() for p in theirs.parameters())),
    }
    for fn, _ in rows.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.repeats):  # A B A B: machine noise hits both alike
        for k, (fn, _) in rows.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(
        f"fp32, {args.threads} thread(s), batch {args.batch} x {args.seq} tokens, segments of {args.segment}, memory {args.memory}"
    )
    print(f"{'model':<18}{'params':>12}{'train tok/s':>13}{'median s/step':>15}")
    for k, (_, n) in rows.items():
        print(f"{k:<18}{n:>12,}{tps[k]:>13,.0f}{statistics.median(times[k]):>15.3f}")
    # the machine may be shared: each A B pair ran back to back, so the median of the per-pair
    # ratios is steadier than the ratio of medians; the best-of ratio is printed beside them
    ratio = tps["recurformer rmt"] / tps["lucidrains RMT"]
    paired = statistics.median(b / a for a, b in zip(times["recurformer rmt"], times["lucidrains RMT"]))
    best = min(times["lucidrains RMT"]) / min(times["recurformer rmt"])
    print(
        f"tokens/s ratio ours / theirs: {ratio:.2f} (of medians), {paired:.2f} (median of A B pairs), {best:.2f} (best of each)"
    )
    meta = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), cpu=cpu_name(), threads=args.threads, torch=torch.__version__,
        peer_version=metadata.version("recurrent-memory-transformer-pytorch") if _has_dist() else None,
        config={k: getattr(args, k) for k in ("dim", "depth", "heads", "segment", "memory", "vocab", "batch", "seq", "repeats")},
        command="python " + " ".join("PEER" if a == args.peer else a for a in sys.argv),  # no local path in the record
    )  # fmt: skip
    results = [
        dict(model=k, params=n, train_tokens_per_s=round(tps[k]), seconds=[round(t, 4) for t in times[k]])
        for k, (_, n) in rows.items()
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            dict(
                meta=meta,
                results=results,
                ratio_of_medians=round(ratio, 3),
                ratio_paired_median=round(paired, 3),
                ratio_best=round(best, 3),
            ),
            indent=2,
        )
    )
    print(f"wrote {args.out}")


def _has_dist() -> bool:
    try:
        metadata.version("recurrent-memory-transformer-pytorch")
        return True
    except metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
