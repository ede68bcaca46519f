"""The hook by which a layer reports how much it reads its memory (for ``recurformer.readout``).

A layer kind with a memory path calls ``record(self, share)`` in its forward, only while a
read-out is recording (``active()``; otherwise the hook costs one test), with ``share`` [B, n]
in [0, 1] for each of the n tokens of the piece it just read: the fraction of the token's read
that came from the memory. Where memory slots and tokens share one softmax (Memory Attention:
the memory as a key/value prefix; RMT: memory tokens in the segment), ``attention_share`` gives
the attention mass on the memory keys, averaged over heads. Layers that read their state
through a separate attention (Block-Recurrent) report the share of the output norm that
comes from it. Nothing here changes what a layer computes."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import Tensor, nn

_recordings: list[dict[nn.Module, list[Tensor]]] = []


def active() -> bool:
    return bool(_recordings)


def record(layer: nn.Module, share: Tensor) -> None:
    """Add [B, n] shares of ``layer`` for its next n tokens to the innermost recording."""
    if _recordings:
        _recordings[-1].setdefault(layer, []).append(share.detach().float())


@contextlib.contextmanager
def recording() -> Iterator[dict[nn.Module, list[Tensor]]]:
    """``with recording() as rec:`` run the model; then ``rec[layer]`` lists its [B, n] shares in
    the order the tokens were read."""
    rec: dict[nn.Module, list[Tensor]] = {}
    _recordings.append(rec)
    try:
        yield rec
    finally:
        _recordings.pop()


def attention_share(q: Tensor, k: Tensor, mask: Tensor | None, slots: int) -> Tensor:
    """Mass of softmax(q k^T / sqrt(d) + mask) on the first ``slots`` keys, averaged over heads:
    q [B, H, n, d], k [B, H, S, d], ``mask`` boolean (True = visible) or additive -> [B, n]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return torch.softmax(scores, dim=-1)[..., :slots].sum(-1).mean(1)


def output_share(memory_part: Tensor, token_part: Tensor) -> Tensor:
    """|m| / (|m| + |x|) per token, for two [B, n, D] contributions to a layer's output."""
    m, x = memory_part.float().norm(dim=-1), token_part.float().norm(dim=-1)
    return m / (m + x).clamp_min(torch.finfo(torch.float32).tiny)
