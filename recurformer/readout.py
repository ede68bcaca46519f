"""Read-outs of the memory path of any model: does it read its memory, and does a loss reach it?

Two numbers tell apart the two ways a recurrent memory can fail to carry a fact: a model that
never *reads* its memory (the tokens put no attention on it), and one that never learns to
*write* it (no gradient from a later loss reaches the state that should hold the fact).

- ``memory_share``: for every layer with a memory path (those that implement the ``tap`` hook:
  Memory Attention, Block-Recurrent, ...), the mean share of each token's read that comes from
  the memory, per segment of the input. For Memory Attention this is the softmax mass the
  segment's tokens put on the C memory slots; for the Block-Recurrent Transformer, whose tokens
  read the state through a separate attention, the share of the output norm that comes from it.
- ``state_gradient``: ||d L_k / d S_0||, the norm of the gradient of the loss of segment k
  (k = 1..K) with respect to every floating-point tensor of the state S_0 after segment 0, as in
  the analysis of gradient flow through recurrent memories (Bulatov et al., "Recurrent Memory
  Transformer", NeurIPS 2022, §4). Zero means that segment's loss cannot teach the model to
  write anything into S_0: the state does not reach it (beyond a window) or is ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import tap
from .config import Checked, RecurformerError, make_options, opt, option
from .device import cpu_threads
from .nn import IGNORE_INDEX, StreamingLM


@dataclass
class Readout:
    segment: int  # tokens per segment
    share: dict[int, list[float]]  # layer index -> mean memory share of the tokens of each segment
    grad_norm: list[float]  # k = 1..K: ||d L_k / d S_0|| (nan where segment k scores nothing)

    def to_json(self) -> dict[str, Any]:
        return {
            "segment": self.segment,
            "share": {str(k): v for k, v in self.share.items()},
            "grad_norm": self.grad_norm,
        }


def default_segment(model: StreamingLM) -> int:
    """The model's chunk / segment / block length (its context field, or the reset boundary)."""
    field = model.config.context_field
    value = getattr(model.config, field) if field else None
    return int(value) if value else model.reset_boundary


@torch.no_grad()
def memory_share(model: StreamingLM, tokens: Tensor, segment: int) -> dict[int, list[float]]:
    """Layer index -> the mean memory share of the tokens of each ``segment``-token piece of
    ``tokens`` [B, T], read one segment per call with the state carried. Layers without a
    memory path are left out."""
    model.eval()
    with tap.recording() as rec:
        for _ in model.read(tokens, segment):
            pass
    out: dict[int, list[float]] = {}
    for i, layer in enumerate(model.layers):
        shares = [torch.cat(rec[m], dim=1) for m in layer.modules() if m in rec]
        if shares:
            s = shares[0]  # [B, T]
            out[i] = [float(s[:, a : a + segment].mean()) for a in range(0, s.shape[1], segment)]
    return out


def state_gradient(model: StreamingLM, inputs: Tensor, targets: Tensor, segment: int, k: int) -> list[float]:
    """[||d L_j / d S_0|| for j = 1..k]: S_0 the state after the first ``segment`` tokens of
    ``inputs`` [B, T >= (k + 1) * segment], L_j the mean cross-entropy on ``targets`` (the same
    shape; IGNORE_INDEX where not scored) of segment j; nan for a segment that scores nothing."""
    if inputs.shape[1] < (k + 1) * segment:
        raise RecurformerError(
            f"the gradient read-out needs {(k + 1) * segment} tokens per row ({k + 1} segments of {segment}), got {inputs.shape[1]}"
        )
    model.eval()
    with torch.no_grad():
        s0 = model(inputs[:, :segment]).state
    leaves: list[Tensor] = []

    def leaf(t: Tensor) -> Tensor:
        if t.is_floating_point() and t.numel():
            t = t.detach().clone().requires_grad_()
            leaves.append(t)
        return t

    state = replace(s0, layers=[s.map(leaf) for s in s0.layers])
    losses: list[Tensor | None] = []
    for j, out in enumerate(model.read(inputs[:, segment : (k + 1) * segment], segment, state), start=1):
        y = targets[:, j * segment : (j + 1) * segment]
        scored = bool((y != IGNORE_INDEX).any())
        losses.append(
            F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX) if scored else None
        )
    norms = []
    for loss in losses:
        if loss is None:
            norms.append(math.nan)
            continue
        grads = torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True) if leaves else []
        norms.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None)))
    return norms


def readout(model: StreamingLM, inputs: Tensor, targets: Tensor, segment: int | None = None, k: int = 4) -> Readout:
    """Both read-outs over ``inputs`` [B, T] (``targets``: the next tokens, IGNORE_INDEX where not scored)."""
    segment = segment or default_segment(model)
    if segment < 1 or segment % model.reset_boundary:
        raise RecurformerError(
            f"--segment must be a positive multiple of the model's chunk/segment/block length ({model.reset_boundary}), got {segment}"
        )
    return Readout(segment, memory_share(model, inputs, segment), state_gradient(model, inputs, targets, segment, k))


def table(r: Readout, kinds: list[str]) -> str:
    """Markdown: the memory share per layer (first segments and the mean of the rest), then the gradient norms."""
    lines = [
        f"memory share of the tokens' read, per segment of {r.segment} tokens",
        "",
        "| layer | kind | seg 0 | seg 1 | seg 2 | later (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for i, s in r.share.items():
        cells = [f"{v:.4f}" for v in s[:3]] + ["-"] * max(0, 3 - len(s))
        later = f"{sum(s[3:]) / len(s[3:]):.4f}" if len(s) > 3 else "-"
        lines.append(f"| {i} | {kinds[i]} | " + " | ".join(cells) + f" | {later} |")
    if not r.share:
        lines.append("| - | no layer with a memory path | | | | |")
    lines += [
        "",
        "gradient norm reaching the state after segment 0 from the loss of segment k",
        "",
        "| k | norm |",
        "|---|---|",
    ]
    lines += [
        f"| {j} | - (no token scored in segment {j}) |" if math.isnan(g) else f"| {j} | {g:.3e} |"
        for j, g in enumerate(r.grad_norm, start=1)
    ]
    return "\n".join(lines)


__all__ = ["Readout", "default_segment", "memory_share", "readout", "state_gradient", "table"]


@dataclass
class ReadoutOptions(Checked):
    """``recurformer readout`` (``readout_checkpoint``): which model, which rows, how many segments."""

    checkpoint: str = option(
        None, "a run, checkpoint or pretrained directory (e.g. from synth --save), or a Hub repo id", required=True
    )
    task: str | None = option(None, "read synthetic task rows (see synth) instead of the checkpoint's validation text")
    segment: int | None = option(
        None, "tokens per segment (default: the model's chunk / segment / block length)", range=">= 1"
    )
    segments: int = option(4, "K: gradient norms from the losses of segments 1..K", range=">= 1")
    rows: int = option(16, "rows to read", range=">= 1")
    seed: int = option(0, "which rows are read")
    out: str | None = option(None, "write the read-out as JSON here", flag="--json")


@cpu_threads()
def readout_checkpoint(
    checkpoint: str | Path,
    *,
    task_values: dict[str, Any] | None = None,
    log: Callable[[str], object] = print,
    **options: Any,
) -> Readout:
    """``recurformer readout``: does a model read its memory, and does a later loss reach it
    (``readout``) on ``rows`` rows of a synthetic ``task`` (with ``task_values``) or of the
    checkpoint's validation text (``options``: the fields of ``ReadoutOptions``); logs the table,
    writes ``out`` (JSON) when given."""
    from .data import eval_windows
    from .data.synthetic import get_task, make_split
    from .evaluate.lengths import eval_tokens
    from .files import atomic_write, check_writable
    from .hub import load

    o = make_options(ReadoutOptions, {"checkpoint": str(checkpoint), **options})
    task, segment, segments, rows, seed, out = o.task, o.segment, o.segments, o.rows, o.seed, o.out
    if out:
        check_writable(Path(out), f"{opt('out')} file")
    loaded = load(checkpoint)
    model, tok, config = loaded.model, loaded.tokenizer, loaded.config
    segment = segment or default_segment(model)
    need = (segments + 1) * segment
    if task:
        params = get_task(task).params(task_values or {})
        if int(params["vocab_size"]) != model.config.vocab_size:
            raise RecurformerError(
                f"task {task} has vocab_size {params['vocab_size']}, the model {model.config.vocab_size}; set task.vocab_size"
            )
        data = make_split(task, rows, seed, params)
        x, y = data.inputs, data.targets
        if x.shape[1] < need:
            raise RecurformerError(
                f"task rows have {x.shape[1]} tokens, the read-out needs {need} ({segments + 1} segments of {segment}); lengthen the task"
            )
    else:
        w = eval_windows(eval_tokens(tok, config), need, rows, seed=seed)
        x, y = w[:, :-1], w[:, 1:]
    r = readout(model, x, y, segment, segments)
    log(f"{checkpoint}: {type(model).__name__}, {x.shape[0]} rows of {x.shape[1]} tokens")
    log(table(r, [layer.kind for layer in model.layers]))
    if out:
        atomic_write(Path(out), lambda p: p.write_text(json.dumps(r.to_json(), indent=2) + "\n"))
        log(f"wrote {out}")
    return r
