"""Which loses a Gated DeltaNet's passkey at long lengths: the decay or the filler's writes?

A saved passkey model (``recurformer synth --task passkey --save``) reads passkey rows of
``--length`` filler tokens, 256 tokens per call with the state carried, once as trained and once
per condition with one gate of the delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks",
§3: S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T) forced on the filler tokens only:

    no_decay    a_t = 1 on filler (g_t = log a_t = 0): nothing of the state decays there
    no_write    b_t = 0 on filler: the filler writes nothing and erases nothing
    frozen      both: the state is what it was before the filler, so the exact match cannot
                depend on how much filler there is (the instrument's control: it must read the
                same at every length)

in every layer, or in layer N only (suffix ``_lN``). The key, the query marker and the answer keep
their trained gates. Three more conditions change the model, on every token:

    floor       b_t through the write floor ``--write-floor`` eps (the model option ``write_floor``:
                max(0, b_t - eps) / (1 - eps)), so writes below eps become exactly 0
    decay_floor log a_t through the decay floor ``--decay-floor`` delta (the model option
                ``decay_floor``: min(0, log a_t + delta)), so decays weaker than delta per token
                become exactly none
    floors      both floors

A condition that restores the exact match names what lost the key; one that leaves it unchanged
did not. Printed: each condition's exact match (every key token right) and,
as trained, each head's mean b_t and g_t on the filler.

    python experiments/memory/gate_ablation.py OUT/stage16.model --length 32768 --rows 32 \
        --conditions trained,no_write_l0,no_decay_l0 --json ablation.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from recurformer.config import RecurformerError  # noqa: E402
from recurformer.data.synthetic import passkey  # noqa: E402
from recurformer.hub import load  # noqa: E402
from recurformer.models.gated_deltanet import GatedDeltaNetLayer  # noqa: E402

CONDITIONS = ("trained", "no_decay", "no_write", "frozen", "floor", "decay_floor", "floors")


def patch(mixer: GatedDeltaNetLayer, index: int, ctx: dict[str, Any]) -> None:
    """Wrap ``mixer.gates``: under ``ctx['cond']`` force g = 0 or b = 0 where ``ctx['filler']``
    [B, T] marks the call's filler tokens; as trained, add each head's b and g summed over filler
    to ``ctx['sums'][index]``."""
    trained = mixer.gates

    def gates(x: Tensor) -> tuple[Tensor, Tensor]:
        cond, _, layer = ctx["cond"].partition("_l")
        here = not layer or int(layer) == index
        saved = mixer.cfg.write_floor, mixer.cfg.decay_floor
        if here and cond in ("floor", "floors"):
            mixer.cfg.write_floor = ctx["floor"]
        if here and cond in ("decay_floor", "floors"):
            mixer.cfg.decay_floor = ctx["decay_floor"]
        try:
            b, g = trained(x)  # [B, H, T] each
        finally:
            mixer.cfg.write_floor, mixer.cfg.decay_floor = saved
        filler = ctx["filler"][:, None, :]
        if cond == "trained":
            s = ctx["sums"].setdefault(index, torch.zeros(3, b.shape[1], dtype=torch.float64))
            s += torch.stack(
                ((b * filler).sum((0, 2)), (g * filler).sum((0, 2)), filler.sum((0, 2)).expand(b.shape[1]))
            )
        elif not layer or int(layer) == index:
            b = b.masked_fill(filler, 0.0) if cond in ("no_write", "frozen") else b
            g = g.masked_fill(filler, 0.0) if cond in ("no_decay", "frozen") else g
        return b, g

    mixer.gates = gates  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a Gated DeltaNet saved by `recurformer synth --task passkey --save`")
    ap.add_argument("--length", type=int, required=True, help="filler tokens per row")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--conditions", default="trained,no_write_l0,no_decay_l0")
    ap.add_argument("--seed", type=int, default=1234, help="of the test rows")
    ap.add_argument("--write-floor", type=float, default=0.02, help="eps of the conditions 'floor' and 'floors'")
    ap.add_argument(
        "--decay-floor", type=float, default=5e-4, help="delta of the conditions 'decay_floor' and 'floors'"
    )
    ap.add_argument("--json", help="write {condition: exact match} and the gate means here")
    args = ap.parse_args()
    conds = args.conditions.split(",")
    for c in conds:
        base, _, layer = c.partition("_l")
        if base not in CONDITIONS or (layer and not layer.isdigit()):
            print(f"error: unknown condition '{c}' (one of {', '.join(CONDITIONS)}, optionally _lN)", file=sys.stderr)
            return 2
    if not 0.0 < args.write_floor < 1.0:
        print(f"error: --write-floor must lie strictly between 0 and 1, got {args.write_floor}", file=sys.stderr)
        return 2
    if not args.decay_floor > 0.0:
        print(f"error: --decay-floor must be > 0, got {args.decay_floor}", file=sys.stderr)
        return 2
    try:
        loaded = load(args.checkpoint)
    except RecurformerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, task = loaded.model.eval(), loaded.config.get("task") or {}
    mixers = [layer.attn for layer in model.layers]
    if task.get("name") != "passkey" or not all(isinstance(m, GatedDeltaNetLayer) for m in mixers):
        print(f"error: {args.checkpoint} is not a Gated DeltaNet trained on passkey", file=sys.stderr)
        return 2
    KV, V = task["key_vocab"], task["vocab_size"]
    x, y = passkey(
        np.random.default_rng(args.seed), args.rows, V, args.length, task["key_len"], KV, task.get("key_span", 0.0)
    )
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    ctx: dict[str, Any] = {"sums": {}, "floor": args.write_floor, "decay_floor": args.decay_floor}
    for i, m in enumerate(mixers):
        patch(m, i, ctx)
    result: dict[str, Any] = {
        "checkpoint": args.checkpoint,
        "length": args.length,
        "rows": args.rows,
        "write_floor": args.write_floor,
        "decay_floor": args.decay_floor,
        "exact": {},
    }
    for c in conds:
        ctx["cond"], right = c, torch.ones(args.rows, dtype=torch.bool)
        with torch.no_grad():
            state = None
            for a in range(0, x.shape[1], 256):
                tokens, targets = x[:, a : a + 256], y[:, a : a + 256]
                ctx["filler"] = (tokens >= KV) & (tokens < V - 1)
                out = model(tokens, state=state)
                state = out.state
                right &= ((out.logits.argmax(-1) == targets) | (targets < 0)).all(1)
        result["exact"][c] = float(right.float().mean())
        print(f"{c}: exact match {result['exact'][c]:.3f} ({args.rows} rows, L = {args.length})", flush=True)
    for i, s in sorted(ctx["sums"].items()):
        b, g = (s[0] / s[2]).tolist(), (s[1] / s[2]).tolist()
        result[f"layer{i}"] = {"b_filler": b, "g_filler": g}
        print(
            f"layer {i} on filler, per head: mean b "
            + " ".join(f"{v:.4f}" for v in b)
            + "; mean g "
            + " ".join(f"{v:.2e}" for v in g)
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
