"""Memory of lm-eval's rolling log-likelihood through the ``recurformer`` lm-eval model: a document
read once through the state, ``--chunk`` tokens per call. One fresh process per row (so peak RSS
is that row's); a bounded-state model (Memory Attention) stays flat with the document's length,
a full KV cache (Llama) grows with it. Random weights: memory does not depend on them.

    python benchmarks/rolling_memory.py --lengths 4096,65536 --json out/rolling_memory.json

Needs ``recurformer[eval]``."""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {"memory_attention": {"chunk_size": 64}, "llama": {}}


def row(name: str, n: int, chunk: int, directory: str) -> dict:
    """Run in a child process: score one random document of ``n`` byte tokens."""
    import torch
    from lm_eval.api.instance import Instance

    from recurformer import build_model
    from recurformer.data import Tokenizer
    from recurformer.lm_eval import RecurformerLM

    torch.manual_seed(0)
    path = Path(directory) / name
    build_model(name, dict(vocab_size=258, dim=128, n_layers=4, n_heads=4, **MODELS[name])).eval().save_pretrained(
        path, tokenizer=Tokenizer.byte()
    )
    lm = RecurformerLM(pretrained=str(path), chunk=chunk, device="cpu")
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh ") for _ in range(n))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ll = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "model": name,
        "tokens": n,
        "chunk": chunk,
        "peak_rss_mib": after / 1024,
        "growth_mib": (after - before) / 1024,
        "loglikelihood_per_token": ll / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,65536")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--json", default="out/rolling_memory.json")
    ap.add_argument("--row", nargs=3, metavar=("MODEL", "TOKENS", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:
        print(json.dumps(row(args.row[0], int(args.row[1]), args.chunk, args.row[2])))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            for n in (int(v) for v in args.lengths.split(",")):
                out = subprocess.run(
                    [sys.executable, __file__, "--chunk", str(args.chunk), "--row", name, str(n), tmp],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| model | tokens | peak RSS (MiB) | growth while scoring (MiB) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']:,} | {r['peak_rss_mib']:.1f} | {r['growth_mib']:.1f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
