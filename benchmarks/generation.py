"""Streaming generation: tokens/s and resident memory after 1k, 8k and 64k generated tokens, for
every model in the registry (each in a fresh process, random weights, greedy decoding through
the streaming contract, batch 1). Recurrent models should stay flat in memory and speed; the
Llama baseline's KV cache (and per-token attention cost) grows with the length.

    python benchmarks/generation.py [--tokens 1024,8192,65536] [--out out/generation.json]

With ``--contexts``: decoding speed at a given context instead, the tokens/s of ``--decode``
greedy tokens after reading that many random tokens (in calls of 1024, without autograd), one
process per model and context. ``--against DIR`` runs the same measurement with the recurformer
of another checkout (e.g. ``git worktree add /tmp/base <commit>``), alternating with this one
``--repeat`` times (the best of each is kept, against the noise of a shared machine), and
reports the ratio of the two:

    python benchmarks/generation.py --models llama,transformer_xl --contexts 1024,8192,65536 \
        --decode 64 --against /tmp/base --out out/decode.json

``--batch 1,16`` decodes that many rows at once (tokens/s counts every row's tokens), and
``--kinds`` the ways a token is decoded, alternating with each other in one run: ``eager`` (the
model's call), ``step`` (its call captured, ``capture.DecodeGraphs``: the host samples and reads
every token) and ``blocks`` (the sampling inside the captured step, the host reading the tokens
every ``--block`` of them: ``DecodeGraphs.sampler``), captured with ``--backend`` (cuda on a GPU,
trace on the CPU); ``--against`` takes ``eager`` only (an older checkout has no ``blocks``):

    python benchmarks/generation.py --models rmt --contexts 1024 --batch 1,16 --kinds step,blocks --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recurformer.device import pick_device
from recurformer.models import model_names

SMALL = dict(vocab_size=4096, dim=128, n_layers=4, n_heads=4)
EXTRA = {
    "memory_attention": dict(chunk_size=32),
    "sliding_window": dict(window=256),
    "transformer_xl": dict(segment_len=32),
    "block_recurrent": dict(block_size=32),
    "recurrent_transformer": dict(),
}

# the children import nothing of recurformer beyond the model and generate, so --against runs older checkouts
DEVICE_CODE = """
dev = torch.device(sys.argv[-1])
def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
def mem_mb():  # CUDA: tensors allocated at the peak; CPU: resident set now
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
"""

CHILD = (
    """
import json, sys, time, torch
from recurformer import build_model
from recurformer.generate import new_session, stream
name, marks = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
cfg = json.loads(sys.argv[3])
"""
    + DEVICE_CODE
    + """
torch.manual_seed(0)
model = build_model(name, cfg).eval().to(dev)
s = new_session(model, 1, seed=0)
out, t0, last_t, last_n = [], time.perf_counter(), time.perf_counter(), 0
it = stream(model, [1, 2, 3], max(marks), temperature=0.0, session=s)
for n, _ in enumerate(it, 1):
    if n in marks:
        sync()
        now = time.perf_counter()
        out.append(dict(tokens=n, mem_mb=round(mem_mb(), 1), tok_per_s=round((n - last_n) / (now - last_t), 1)))
        last_t, last_n = now, n
print(json.dumps(out))
"""
)

DECODE_CHILD = (
    """
import json, sys, time, torch
from recurformer import build_model
from recurformer.generate import new_session, read, stream
name, context, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = json.loads(sys.argv[5])
kind, backend, block = sys.argv[6], sys.argv[7], int(sys.argv[8])
"""
    + DEVICE_CODE
    + """
torch.manual_seed(0)
model = build_model(name, cfg).eval().to(dev)
s = new_session(model, batch, seed=0)
tokens = torch.randint(0, cfg["vocab_size"], (batch, context))
for a in range(0, context, 1024):
    read(model, s, tokens[:, a : a + 1024])
how, notes = {}, []
if kind != "eager":  # an older checkout: eager only
    from recurformer.capture import DecodeGraphs
    graphs = DecodeGraphs(model, backend)
    how = dict(step=graphs.or_eager(notes.append)) if kind == "step" else dict(graphs=graphs, block=block, note=notes.append)
# warm-up: a whole number of reset boundaries, so that every graph is recorded and the timed run starts where it did
for _ in stream(model, None, max(2, model.reset_boundary), temperature=0.0, session=s, **how):
    pass
sync()
t0 = time.perf_counter()
for _ in stream(model, None, n, temperature=0.0, session=s, **how):
    pass
sync()
print(json.dumps(dict(tok_per_s=round(batch * n / (time.perf_counter() - t0), 1), notes=notes)))
"""
)


def child(script: str, args: list[str], code: str | None = None) -> dict | list:
    """Run ``script`` in a fresh process, in and with the recurformer of checkout ``code``
    (default: this one; ``python -c`` imports from its working directory first)."""
    code = code or str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join([code] + env.get("PYTHONPATH", "").split(os.pathsep)).rstrip(os.pathsep)
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=code)
    if res.returncode != 0:
        raise RuntimeError(f"exit {res.returncode}: {(res.stderr.strip().splitlines() or [''])[-1]}")
    return json.loads(res.stdout)


def decode_speed(args: argparse.Namespace) -> None:
    """The ``--contexts`` table: tokens/s per model, context, batch and kind (and against another
    checkout), the kinds and checkouts alternating ``--repeat`` times (the best of each kept)."""
    results: dict = {}
    kinds = args.kinds.split(",")
    if args.against and kinds != ["eager"]:
        raise SystemExit(
            "generation.py: error: --against measures --kinds eager only (an older checkout has no blocks)"
        )
    head = f"{'model':<16}{'context':>9}{'batch':>6}" + "".join(f"{k + ' tok/s':>14}" for k in kinds)
    print(head + (f"{'against':>10}{'ratio':>8}" if args.against else ""))
    for name in args.models.split(","):
        cfg = {**SMALL, **EXTRA.get(name, {}), **args.config}
        rows = []
        for context, batch in ((int(c), int(b)) for c in args.contexts.split(",") for b in args.batch.split(",")):
            codes = [None, args.against] if args.against else [None]
            best = {(kind, code): 0.0 for kind in kinds for code in codes}
            notes: set[str] = set()
            try:
                for _ in range(args.repeat):
                    for kind in kinds:
                        argv = [name, str(context), str(args.decode), str(batch), json.dumps(cfg), kind]
                        argv += [args.backend, str(args.block), args.device]
                        for code in codes:
                            got = child(DECODE_CHILD, argv, code)
                            best[kind, code] = max(best[kind, code], got["tok_per_s"])  # type: ignore[index]
                            notes.update(got.get("notes", []))  # type: ignore[union-attr]
            except RuntimeError as e:
                print(f"{name:<16}{context:>9}{batch:>6} failed ({e})")
                continue
            row = dict(context=context, batch=batch, tok_per_s={k: best[k, None] for k in kinds}, notes=sorted(notes))
            line = f"{name:<16}{context:>9,}{batch:>6}" + "".join(f"{best[k, None]:>14,.1f}" for k in kinds)
            if args.against:
                theirs = best["eager", args.against]
                row.update(against=theirs, ratio=round(best["eager", None] / theirs, 2))
                line += f"{theirs:>10,.1f}{row['ratio']:>7.2f}x"
            rows.append(row)
            print(line + "".join(f"\n  {n}" for n in sorted(notes)), flush=True)
        results[name] = {
            "config": cfg,
            "decode_tokens": args.decode,
            "backend": args.backend,
            "block": args.block,
            "against": args.against,
            "contexts": rows,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(model_names()))
    ap.add_argument("--tokens", default="1024,8192,65536")
    ap.add_argument("--contexts", default=None, help="decoding speed at these contexts, e.g. 1024,8192,65536")
    ap.add_argument("--decode", type=int, default=64, help="tokens timed at each context")
    ap.add_argument("--against", default=None, help="another checkout's directory, to compare with")
    ap.add_argument("--repeat", type=int, default=1, help="alternating runs per context (the best is kept)")
    ap.add_argument("--batch", default="1", help="with --contexts: rows decoded at once, e.g. 1,16")
    ap.add_argument("--kinds", default="eager", help="with --contexts: eager, step and/or blocks (see above)")
    ap.add_argument("--backend", choices=["cuda", "trace", "eager"], help="capture backend (default: cuda on CUDA)")
    ap.add_argument("--block", type=int, default=16, help="tokens per host read of the blocks kind")
    ap.add_argument(
        "--config", type=json.loads, default={}, help="config values for every model, e.g. '{\"dim\": 512}'"
    )
    ap.add_argument("--out", default=None, help="default: out/generation.json (out/decode.json with --contexts)")
    ap.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N; memory is the RSS on the CPU, allocated tensors on CUDA"
    )
    args = ap.parse_args()
    args.device = str(pick_device(args.device))
    args.backend = args.backend or ("cuda" if args.device.startswith("cuda") else "trace")
    if args.contexts:
        args.out = args.out or "out/decode.json"
        return decode_speed(args)
    args.out = args.out or "out/generation.json"
    results = {}
    print(f"{'model':<22}" + "".join(f"{'@' + t:>22}" for t in args.tokens.split(",")) + f"{'mem ratio':>11}")
    for name in args.models.split(","):
        cfg = {**SMALL, **EXTRA.get(name, {}), **args.config}
        try:
            rows = child(CHILD, [name, args.tokens, json.dumps(cfg), args.device])
        except RuntimeError as e:
            print(f"{name:<22} failed ({e})")
            continue
        results[name] = {"config": cfg, "marks": rows}
        cells = "".join(f"{r['tok_per_s']:>9,.0f} tok/s {r['mem_mb']:>5,.0f}MB" for r in rows)
        print(f"{name:<22}{cells}{rows[-1]['mem_mb'] / rows[0]['mem_mb']:>10.2f}x", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=dict(device=args.device), results=results), indent=2))
    plot(results, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


def figure(results: dict):  # type: ignore[no-untyped-def]
    """Resident memory and tokens/s against tokens generated, one line per model; both y axes
    start at 0, so a flat line reads as flat and a growing one as growing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.2))
    for name, r in results.items():
        xs = [m["tokens"] for m in r["marks"]]
        a.plot(xs, [m["mem_mb"] for m in r["marks"]], marker="o", label=name)
        b.plot(xs, [m["tok_per_s"] for m in r["marks"]], marker="o", label=name)
    for ax, y, key in (
        (a, "memory (MB): RSS on CPU, allocated on CUDA", "mem_mb"),
        (b, "tokens/s (since the previous mark)", "tok_per_s"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens generated")
        ax.set_ylabel(y)
        ax.set_ylim(0, 1.15 * max(m[key] for r in results.values() for m in r["marks"]))
        ax.grid(alpha=0.3)
    a.set_title("memory", fontsize=9)
    b.set_title("speed", fontsize=9)
    a.legend(fontsize=7)
    fig.suptitle("Streaming generation, batch 1, greedy, random weights (one process per model)")
    fig.tight_layout()
    return fig


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
