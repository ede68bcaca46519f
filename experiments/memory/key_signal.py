"""How much of the passkey a saved model's state still holds, segment after segment.

Two batches of passkey rows share their filler and differ only in the key. After each segment of
``--segment`` tokens (default: the model's chunk / segment length) the script reads both states and
prints the key signal: ||S(key A) - S(key B)|| / ||S(key A)|| over the state's floating-point
tensors, the mean over rows. A state that carries the key keeps it above zero at every segment; a
key that fades shows as a signal that falls towards 0, and the length at which the model's exact
match collapses can be read against it.

    python experiments/memory/key_signal.py runs/memory/passkey/rmt.mixed.seed0.model --segments 24
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from recurformer.data.synthetic import passkey  # noqa: E402
from recurformer.hub import load  # noqa: E402
from recurformer.nn import State, StreamingLM  # noqa: E402


def state_vector(state: State) -> torch.Tensor:
    """[B, N]: every floating-point tensor of the state with a batch dimension, flattened per row."""
    B = state.fresh.shape[0]
    parts = [
        t.reshape(B, -1) for t in state.to_flat().values() if t.is_floating_point() and t.dim() and t.shape[0] == B
    ]
    return torch.cat(parts, dim=1)


def key_signal(
    model: StreamingLM, segments: int, segment: int, rows: int, seed: int, vocab: int, key_len: int, key_vocab: int
) -> list[float]:
    rng = np.random.default_rng(seed)
    x, _ = passkey(rng, rows, vocab, segments * segment, key_len, key_vocab)
    a = torch.as_tensor(x[:, : key_len + segments * segment])  # key, then filler: no query
    b = a.clone()
    b[:, :key_len] = (b[:, :key_len] + 1 + torch.as_tensor(rng.integers(0, key_vocab - 1, (rows, key_len)))) % key_vocab
    out, sa, sb = [], None, None
    with torch.no_grad():
        for k in range(segments):
            lo, hi = k * segment, (k + 1) * segment
            sa, sb = model(a[:, lo:hi], state=sa).state, model(b[:, lo:hi], state=sb).state
            va, vb = state_vector(sa), state_vector(sb)
            out.append(float(((va - vb).norm(dim=1) / va.norm(dim=1).clamp(min=1e-12)).mean()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="+", help="models saved by `recurformer synth --task passkey --save`")
    ap.add_argument("--segments", type=int, default=24)
    ap.add_argument("--segment", type=int, help="tokens per segment (default: the model's chunk / segment length)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write {checkpoint: [signal per segment]} here")
    ap.add_argument("--plot", help="draw the key signal against the tokens read (log scale) into this PNG")
    args = ap.parse_args()
    result, segments = {}, {}
    for path in args.checkpoint:
        loaded = load(path)
        model, name, cfg = loaded.model, loaded.name, loaded.config
        task = cfg.get("task") or {}
        if task.get("name") != "passkey":
            print(f"error: {path} was not trained on passkey (task {task.get('name')})", file=sys.stderr)
            return 2
        segment = args.segment or model.reset_boundary
        sig = key_signal(
            model, args.segments, segment, args.rows, args.seed, task["vocab_size"], task["key_len"], task["key_vocab"]
        )
        result[path], segments[path] = sig, segment
        print(f"{path} ({name}, segments of {segment}): key signal after segment 1..{args.segments}")
        print("  " + " ".join(f"{s:.3f}" for s in sig))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, segments, args.plot)
    return 0


def plot(result: dict[str, list[float]], segments: dict[str, int], out: str) -> None:
    """One line per checkpoint: the key signal after each segment against the tokens read so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for path, sig in result.items():
        tokens = [(k + 1) * segments[path] for k in range(len(sig))]
        ax.plot(tokens, sig, label=Path(path).name)
    ax.set_xscale("log")
    ax.set_xlabel("tokens read (the key first, then filler)")
    ax.set_ylabel("key signal ||S(A) - S(B)|| / ||S(A)||")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
