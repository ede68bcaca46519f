"""Transformer-XL relative attention scores (Dai et al. 2019, §3.3; Brenndoerfer, "Recurrent Memory:
Extending Transformer Context with Segment-Level State Caching"):

    score[i, j] = (a) q_i·k_j + (b) q_i·r_{i-j} + (c) u·k_j + (d) v·r_{i-j}
                = (q_i + u)·k_j + (q_i + v)·r_{i-j}

with q_i = W_q x_i, k_j = W_{k,E} x_j, r_δ = W_{k,R} R_δ (R: sinusoid of the distance δ) and the
global biases u, v. The Tq queries are the last Tq of the Tk keys' positions, so query i sits at
key position Tk - Tq + i and its distance to key j is δ = Tk - Tq + i - j (negative = future).

``relative_scores`` computes (b)+(d) for all distances at once as a [Tq, Tk] product against the
distance-ordered table and realigns it with the "relative shift" (pad one zero column, reinterpret
the buffer with rows of Tq, drop the first row): O(Tq·Tk·d) with no gather and no loop over (i, j).
``relative_scores_reference`` is the explicit double loop over (i, j), term by term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import RecurformerError


def sinusoid_table(distances: Tensor, dim: int, base: float, dtype: torch.dtype) -> Tensor:
    """R_δ = [sin(δ ω_k), cos(δ ω_k)]_k with ω_k = base^(-2k/dim): [n, dim] for ``distances`` [n].
    Angles in float64, so large distances are as exact as small ones."""
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=distances.device) / dim)
    ang = distances.to(torch.float64)[:, None] * inv_freq
    return torch.cat((ang.sin(), ang.cos()), dim=-1).to(dtype)


def rel_shift(x: Tensor) -> Tensor:
    """x [..., Tq, Tk] with column t holding distance Tk-1-t (descending) -> y [..., Tq, Tk] with
    y[..., i, j] = x[..., i, j + Tq - 1 - i], i.e. distance Tk - Tq + i - j, for every j <= i + Tk - Tq.
    Entries of future keys (j > i + Tk - Tq) are left unspecified: callers mask them."""
    *lead, Tq, Tk = x.shape
    x = F.pad(x, (1, 0))  # [..., Tq, Tk+1]: a zero column on the left
    x = x.reshape(*lead, Tk + 1, Tq)[..., 1:, :]  # same buffer seen with rows of Tq; drop the first
    return x.reshape(*lead, Tq, Tk)


def _check(q: Tensor, k: Tensor, r: Tensor, u: Tensor, v: Tensor) -> None:
    Tq, Tk = q.shape[-2], k.shape[-2]
    if Tk < Tq:
        raise RecurformerError(f"relative attention needs at least as many keys as queries, got {Tk} < {Tq}")
    if r.shape[-2] != Tk or u.shape != v.shape or u.shape != (q.shape[-3], q.shape[-1]):
        raise RecurformerError(
            f"relative attention shapes do not fit: r {tuple(r.shape)}, u {tuple(u.shape)}, q {tuple(q.shape)}"
        )


def relative_scores(q: Tensor, k: Tensor, r: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """Unscaled Transformer-XL scores (a)+(b)+(c)+(d) via the relative shift.

    q [..., H, Tq, d], k [..., H, Tk, d] (any leading dimensions, e.g. batch and window),
    r [H, Tk, d] with r[:, δ] = W_{k,R} R_δ for δ = 0..Tk-1, u, v [H, d]  ->  [..., H, Tq, Tk];
    entries of future keys are unspecified."""
    _check(q, k, r, u, v)
    ac = (q + u[:, None]) @ k.transpose(-1, -2)  # (a) + (c): [..., H, Tq, Tk]
    bd = (q + v[:, None]) @ r.flip(-2).transpose(-1, -2)  # (b) + (d), column t = distance Tk-1-t
    return ac + rel_shift(bd)


def relative_scores_reference(q: Tensor, k: Tensor, r: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """The same scores by an explicit loop over (i, j), each term separately; future keys: NaN."""
    _check(q, k, r, u, v)
    B, H, Tq, _ = q.shape
    Tk = k.shape[-2]
    out = torch.full((B, H, Tq, Tk), float("nan"), dtype=q.dtype, device=q.device)
    for i in range(Tq):
        for j in range(Tk):
            dist = Tk - Tq + i - j
            if dist < 0:
                continue
            a = (q[:, :, i] * k[:, :, j]).sum(-1)  # content - content
            b = (q[:, :, i] * r[:, dist]).sum(-1)  # content - distance
            c = (u * k[:, :, j]).sum(-1)  # global content bias
            d = (v * r[:, dist]).sum(-1)  # global distance bias
            out[:, :, i, j] = a + b + c + d
    return out
