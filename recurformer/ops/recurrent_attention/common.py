"""What the tiled and the naive recurrent attention share: the callable types, the block edges
and the tiled schedule on block indices, the visibility mask, the scores, the inputs both take
(``RecurrentInputs``, with the defaults of the earlier calls' state), and the count of K/V reads of each schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# finish(a [B, H, n, d] (accumulator dtype), s, e) -> (z [B, n, D], k [B, H, n, d], v [B, H, n, d])
# for the call's positions s..e-1
Finish = Callable[[Tensor, int, int], tuple[Tensor, Tensor, Tensor]]
# bias(dist) -> additive logit bias [H or 1, *dist.shape] for integer distances dist = i - j >= 0
BiasFn = Callable[[Tensor], Tensor]
Stats = tuple[Tensor, Tensor, Tensor]  # m [B, H, n], l [B, H, n], o [B, H, n, d]
# tile_update(q, k, v, bias, m, l, o): see ``tile_update``
TileUpdate = Callable[[Tensor, Tensor, Tensor, "Tensor | None", Tensor, Tensor, Tensor], None]


def alibi_bias(slopes: Tensor) -> BiasFn:
    """ALiBi: bias_h(i, j) = -m_h (i - j)."""

    def fn(dist: Tensor) -> Tensor:
        return -slopes.view(-1, *([1] * dist.dim())) * dist.to(slopes.dtype)

    return fn


def block_edges(pos0: int, T: int, block: int) -> list[int]:
    """Boundaries (call-relative) of the blocks met by positions pos0..pos0+T-1; the first block
    may be the remainder of a block begun in an earlier call, the last may be unfinished."""
    edges = [0]
    e = min(T, block - pos0 % block)
    while True:
        edges.append(e)
        if e >= T:
            return edges
        e = min(T, e + block)


def tile_schedule(n_blocks: int) -> list[tuple[int, int, int]]:
    """The tiled schedule on block indices 0..n_blocks-1: after block ``t`` (0-based) is
    finished, the key tile of blocks ``t-P+1..t`` updates query blocks ``t+1..hi`` (inclusive),
    with P the largest power of two dividing t+1. Returns (t, P, hi) for the non-empty tiles."""
    out = []
    for t in range(n_blocks):
        P = (t + 1) & -(t + 1)
        hi = min(t + P, n_blocks - 1)
        if t + 1 <= hi:
            out.append((t, P, hi))
    return out


def visible(qpos: Tensor, kpos: Tensor, block: int, start: Tensor, temporary: bool) -> Tensor:
    """[B, nq, nk] bool: persistent key j is visible at i iff block(j) < block(i) and j >= start
    of the row's document; temporary key j iff block(j) == block(i) and j <= i."""
    qb, kb = (qpos // block)[:, None], (kpos // block)[None, :]
    vis = (qb == kb) & (kpos[None, :] <= qpos[:, None]) if temporary else kb < qb
    return vis[None] & (kpos[None, None, :] >= start[:, None, None])


def scores(q: Tensor, k: Tensor, scale: float, acc: torch.dtype) -> Tensor:
    return torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale


@dataclass
class RecurrentInputs:
    """What both recurrent attentions take (``recurrent_attention_tiled``, ``recurrent_attention_naive``):
    q, tk, tv [B, H, T, d], the queries and temporary pairs of positions pos0..pos0+T-1; ``finish``;
    the ``block`` length b; the persistent pairs ``past_k``/``past_v`` [B, H, S, d] of earlier calls
    and the temporaries ``past_tk``/``past_tv`` [B, H, r0, d] of their unfinished block (None:
    none); each row's document ``start`` [B] (None: 0); the score ``scale`` (None: d^-1/2); and
    ``bias_fn`` (None: no bias)."""

    q: Tensor
    tk: Tensor
    tv: Tensor
    finish: Finish
    block: int = 1
    pos0: int = 0
    past_k: Tensor | None = None
    past_v: Tensor | None = None
    past_tk: Tensor | None = None
    past_tv: Tensor | None = None
    start: Tensor | None = None
    scale: float | None = None
    bias_fn: BiasFn | None = None

    def filled(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, float]:
        """past_k, past_v, past_tk, past_tv, start and scale, each None given its default."""
        B, H, _, d = self.q.shape
        empty = self.q.new_zeros(B, H, 0, d)
        return (
            empty if self.past_k is None else self.past_k,
            empty if self.past_v is None else self.past_v,
            empty if self.past_tk is None else self.past_tk,
            empty if self.past_tv is None else self.past_tv,
            torch.zeros(B, dtype=torch.long, device=self.q.device) if self.start is None else self.start,
            d**-0.5 if self.scale is None else self.scale,
        )


def kv_reads(n: int, block: int = 1, schedule: str = "tiled") -> int:
    """Number of persistent K/V positions read (per batch row and head) by one layer over n
    positions: the naive schedule re-reads the whole prefix for every block (Θ(N^2)); the tiled
    one reads each key tile once per tile update (Θ(N log N)). Temporary pairs (read once each)
    are left out of both."""
    nb = -(-n // block)
    if schedule == "naive":
        return sum(min(t * block, n) for t in range(nb))
    edges = block_edges(0, n, block)
    return sum(edges[t + 1] - edges[t - P + 1] for t, P, _ in tile_schedule(nb))
