"""The gated delta rule in chunks: the chunkwise WY/UT form of "Gated Delta Networks: Improving
Mamba2 with Delta Rule" (Yang, Kautz & Hatamizadeh, §3), for training; equal to ``naive`` to
rounding in outputs, final state and every gradient (tests/ops/test_delta_rule.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ...modules import compiled_region


def delta_rule_chunked(
    q: Tensor, k: Tensor, v: Tensor, b: Tensor, g: Tensor, S: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """``delta_rule_naive`` in chunks of ``chunk`` tokens (the paper's §3 chunkwise WY/UT form with gates).

    Within a chunk of n tokens, with G_i = g_1 + ... + g_i (the log of the decay since the chunk
    began) and S_0 the state before it, write u_t = b_t (v_t - a_t S_{t-1} k_t), so that
    S_t = a_t S_{t-1} + u_t k_t^T and S_t = e^{G_t} S_0 + sum_{j<=t} e^{G_t - G_j} u_j k_j^T. Then

        (I + L) U = diag(b) V - diag(b e^G) K S_0^T,    L_tj = b_t e^{G_t - G_j} k_t.k_j  (j < t)

    one unit lower-triangular system for the n rows of U (the UT transform: U = U_0 - W S_0^T),
    solved by substitution (a power series for (I + L)^{-1}, cheaper on the CPU, loses float32 to
    cancellation where a trained layer writes nearly parallel keys hard), and

        O   = diag(e^G) Q S_0^T + ((Q K^T) * M) U,    M_tj = e^{G_t - G_j}  (j <= t, else 0)
        S_n = e^{G_n} S_0 + U^T diag(e^{G_n - G}) K

    Everything but the states is computed for all chunks at once: only the recurrence of S_0 and
    U runs chunk after chunk (``chunk_step``, one compiled region), the outputs of all chunks
    after it in one batch. The last chunk is padded with tokens of b = 0, a = 1 and
    k = q = v = 0, which leave the state exactly as it is (their outputs are dropped). Every
    exponent is <= 0 (decays only), so nothing overflows."""
    T, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    C = min(chunk, T)
    N = -(-T // C)
    if N * C > T:
        q, k, v = (F.pad(t, (0, 0, 0, N * C - T)) for t in (q, k, v))
        b, g = (F.pad(t, (0, N * C - T)) for t in (b, g))
    q, k, v, b, g = (t.unflatten(2, (N, C)) for t in (q, k, v, b, g))  # [B, H, N, C, ...]
    G = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    M = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, -math.inf).exp()  # [B, H, N, C, C]
    L = (b[..., None] * (k @ k.transpose(-1, -2)) * M).tril(-1)
    eG = G.exp()
    rhs = torch.cat(((b * eG)[..., None] * k, b[..., None] * v), dim=-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    W, U0 = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True).split((dk, dv), dim=-1)
    Kg = (G[..., -1:] - G).exp()[..., None] * k
    aC = G[..., -1, None, None].exp()  # [B, H, N, 1, 1]
    Bsz, H = q.shape[:2]
    states, us, S = [], [], S.flatten(0, 1)  # [B H, d_v, d_k]: heads as the batch of bmm
    # unbind, not an index per chunk: its gradient is one stack, where each index's is a zero-filled copy
    for u0, w, kg, ac in zip(*(t.flatten(0, 1).unbind(1) for t in (U0, -W, Kg, aC)), strict=True):
        states.append(S)
        U, S = chunk_step(S, u0, w, kg, ac)
        us.append(U)
    S0t = torch.stack(states, dim=1).unflatten(0, (Bsz, H)).transpose(-1, -2)  # [B, H, N, d_k, d_v]: every S_0^T
    U = torch.stack(us, dim=1).unflatten(0, (Bsz, H))
    o = (eG[..., None] * q) @ S0t + ((q @ k.transpose(-1, -2)) * M) @ U
    return o.flatten(2, 3)[:, :, :T], S.unflatten(0, (Bsz, H))


@compiled_region
def chunk_step(S: Tensor, U0: Tensor, Wn: Tensor, Kg: Tensor, aC: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of ``delta_rule_chunked``'s recurrence, heads as the batch: S_0 [BH, d_v, d_k]
    -> (U [BH, C, d_v], S_n):

        U = U_0 - W S_0^T,    S_n = e^{G_n} S_0 + U^T diag(e^{G_n - G}) K

    with ``Wn`` = -W, ``Kg`` = diag(e^{G_n - G}) K and ``aC`` = e^{G_n} [BH, 1, 1]: two
    ``baddbmm`` (whose gradient reaches the added term with no operator). A compiled region
    (``modules.compiled_region``): a compiled layer traces it once and runs the same graph for
    every chunk."""
    U = torch.baddbmm(U0, Wn, S.transpose(-1, -2))
    return U, torch.baddbmm(aC * S, U.transpose(-1, -2), Kg)
