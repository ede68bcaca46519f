"""The gated delta rule token by token: the reference that ``chunk.delta_rule_chunked`` is tested
against ("Gated Delta Networks: Improving Mamba2 with Delta Rule", Yang, Kautz & Hatamizadeh, §3),
and the form that decodes single tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def delta_rule_naive(q: Tensor, k: Tensor, v: Tensor, b: Tensor, g: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token (the reference). q, k [B, H, T, d_k] (normalised),
    v [B, H, T, d_v], write strengths b and log-decays g = log a [B, H, T], initial state S
    [B, H, d_v, d_k] -> outputs o [B, H, T, d_v] and the final state. Per token, with S' = a_t S:

        S_t = S' + b_t (v_t - S' k_t) k_t^T,    o_t = S_t q_t

    which is a_t S (I - b_t k_t k_t^T) + b_t v_t k_t^T."""
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        kt = k[:, :, t]
        u = b[:, :, t, None] * (v[:, :, t] - (S @ kt[..., None])[..., 0])
        S = S + u[..., None] * kt[..., None, :]
        outs.append((S @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, dim=2), S
