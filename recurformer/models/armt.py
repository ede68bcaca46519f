"""The Associative Recurrent Memory Transformer (Rodkin, Kuratov, Bulatov, Burtsev, "Associative
Recurrent Memory Transformer", 2024, §3), composed onto the RMT (``rmt.py``): the RMT's segments,
attention and caches as they are, with what crosses a segment boundary replaced
(``AssociativeMemory``, the RMT's ``SegmentMemory`` part for ``associative: true``).

With ``associative: true`` every layer l holds a fast-weight
matrix A [K, D] and a normaliser z [K] (K = 2 nu d_mem features, nu = 3, d_mem = ``assoc_dim``),
zero at a document start, read by every row of the layer's input and written once per segment
from the layer's outputs at the write slots (``Associative``). As the authors' code runs it, the
memory slots are then the same learned vectors (``init_memory``) at every segment: the recurrent
state is (A, z) of every layer alone, and the write slots' outputs leave the segment only through
the writes (no RMSNorm gain is reapplied to a carried memory each segment). The read slots stay,
as a learned prefix that reads A like every row; ``read_slots: false`` drops them, as the authors'
code has write slots only: a segment is then [E(x_τ); H^mem] at RoPE positions 0..S+M-1 (R = 0
read slots where the text says M of them before the tokens). The
read costs every row O(D d_mem + K D) per layer, the write O(M (D d_mem + K D)) per layer and segment.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import RecurformerError
from ..nn import Block
from ..stack import Layer
from ..state import Call, LayerState, reset_rows
from .rmt import RMT, SEGMENT_MEMORIES, RMTAttention, RMTConfig, RMTState, SegmentMemory


def dpfp(x: Tensor, nu: int = 3) -> Tensor:
    """The DPFP feature map (Schlag, Irie, Schmidhuber, "Linear Transformers Are Secretly Fast
    Weight Programmers", ICML 2021, §5.4), x [..., d] -> [..., 2 nu d]: with r = [relu(x), relu(-x)],
    phi(x) = [r * roll(r, 1), ..., r * roll(r, nu)] (non-negative, so z . phi stays >= 0)."""
    r = torch.cat((F.relu(x), F.relu(-x)), dim=-1)
    return torch.cat([r * r.roll(j, dims=-1) for j in range(1, nu + 1)], dim=-1)


class Associative(nn.Module):
    """ARMT's associative block of one layer (Rodkin et al., "Associative Recurrent Memory
    Transformer", 2024, §3), phi = ``dpfp`` with nu = 3 then L2-normalised (``feature``),
    A [K, D] (row f: what feature f recalls):

        read, every row x_j of the layer's input:   x_j <- x_j + phi(q_j) A / (z . phi(q_j) + eps),  q_j = W_q x_j
        write, once per segment, from the layer's outputs m_i at the M write slots:
            k_i = phi(W_k m_i),  v_i = W_v m_i,  beta_i = sigmoid(W_b m_i)
            vbar_i = k_i A / (z . k_i + eps)                         (what A recalls at k_i)
            gamma_i = clip(1 - z . k_i, 0, 1)                        (detached; §3's 1 - z.k/||k||^2, ||k|| = 1)
            A <- A + sum_i beta_i k_i^T (v_i - vbar_i)               (delta rule)
            z <- z + sum_i gamma_i k_i

    Every slot reads the A and z of before the segment (the sum over i). From the authors' code
    (``AssociativeLayerWrapper``): phi's output is L2-normalised for queries and keys alike, so the
    read weight z . phi(q) / (z . phi(q) + eps) is ~1 from the first write on at any scale of the
    hidden states (unnormalised, a product of two projections of a small residual stream, it sits
    orders of magnitude below eps at initialisation and the read is ~0); W_v starts at zero, so a
    fresh model's A stays zero (vbar = 0) until W_v learns, while z grows; gamma is detached;
    eps = 1e-5. Where the code differs: it skips the read on a document's first segment (A = 0
    reads exactly 0 there, so nothing is skipped here). W_b's bias starts at 0 (beta = 1/2)."""

    eps = 1e-5
    nu = 3

    def __init__(self, cfg: RMTConfig) -> None:
        super().__init__()
        self.wq = nn.Linear(cfg.dim, cfg.assoc_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.assoc_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wb = nn.Linear(cfg.dim, 1)

    @classmethod
    def features(cls, assoc_dim: int) -> int:
        """K: the width of phi's output."""
        return 2 * cls.nu * assoc_dim

    def init_extra(self, std: float) -> None:
        nn.init.zeros_(self.wv.weight)
        nn.init.zeros_(self.wb.bias)

    def feature(self, x: Tensor) -> Tensor:
        """phi(x) = dpfp(x) / ||dpfp(x)|| (zero where dpfp(x) is zero)."""
        return F.normalize(dpfp(x, self.nu), dim=-1)

    def read(self, x: Tensor, A: Tensor, z: Tensor) -> Tensor:
        """phi(W_q x) A / (z . phi(W_q x) + eps) for x [B, n, D], A [B, K, D], z [B, K]."""
        q = self.feature(self.wq(x))
        return (q @ A) / (q @ z[:, :, None] + self.eps)

    def write(self, m: Tensor, A: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
        """(A, z) after the write of the slots' outputs m [B, M, D]."""
        k = self.feature(self.wk(m))  # [B, M, K]
        seen = k @ z[:, :, None]  # [B, M, 1]
        vbar = (k @ A) / (seen + self.eps)
        beta = torch.sigmoid(self.wb(m))
        gamma = (1 - seen).clamp(0, 1).detach()
        return A + (beta * k).transpose(1, 2) @ (self.wv(m) - vbar), z + (gamma * k).sum(1)


class AssociativeBlock(Block):
    """The RMT block with ARMT's associative block before it (``Associative``): the read is added
    to every input row, and the piece that ends a segment (its last M rows, the write slots, at
    positions 2M + S - M.. of the extended segment) writes the block's outputs there into A, z."""

    def __init__(self, cfg: RMTConfig, mixer: RMTAttention) -> None:
        super().__init__(cfg, mixer)
        self.assoc = Associative(cfg)
        self.cfg = cfg

    def forward(self, x: Tensor, state: LayerState, call: Call) -> tuple[Tensor, LayerState]:
        assert isinstance(state, RMTState) and state.assoc is not None and state.assoc_z is not None
        M, S, c = self.cfg.memory_size, self.cfg.segment_len, state.k.shape[2]
        x = x + self.assoc.read(x, state.assoc, state.assoc_z)
        y, new = super().forward(x, state, call)
        if c + x.shape[1] == self.cfg.n_read + S + M:
            assert isinstance(new, RMTState)
            A, z = self.assoc.write(y[:, -M:], state.assoc, state.assoc_z)
            new = dataclasses.replace(new, assoc=A, assoc_z=z)
        return y, new


def with_assoc(state: LayerState, old: LayerState) -> RMTState:
    """``state`` (a fresh one: empty caches) with the A and z of ``old``."""
    assert isinstance(state, RMTState) and isinstance(old, RMTState)
    return dataclasses.replace(state, assoc=old.assoc, assoc_z=old.assoc_z)


class AssociativeMemory(SegmentMemory):
    """ARMT's part of an RMT: every layer's state carries A and z (zero at a document start), the
    memory slots are ``init_memory`` at every segment, each layer's block reads A and writes it
    (``AssociativeBlock``), and a whole segment hands every layer's A, z on."""

    @classmethod
    def check(cls, cfg: RMTConfig) -> None:
        if cfg.memory_update != "replace":
            raise RecurformerError(
                f"config key 'memory_update' is '{cfg.memory_update}', but an associative RMT carries no memory slots to gate (its slots are the same every segment)"
            )

    def layer_state(self, state: RMTState, index: int, batch_size: int, device: Any, dtype: torch.dtype) -> RMTState:
        K, D = Associative.features(self.cfg.assoc_dim), self.cfg.dim
        A = torch.zeros(batch_size, K, D, device=device, dtype=dtype)
        return dataclasses.replace(state, assoc=A, assoc_z=torch.zeros(batch_size, K, device=device, dtype=dtype))

    def reset(self, state: RMTState, fresh: Tensor) -> RMTState:
        assert state.assoc is not None and state.assoc_z is not None
        zero = state.assoc.new_zeros(())
        return dataclasses.replace(
            state, assoc=reset_rows(fresh, state.assoc, zero), assoc_z=reset_rows(fresh, state.assoc_z, zero)
        )

    def block(self, mixer: RMTAttention) -> Layer:
        return AssociativeBlock(self.cfg, mixer)

    def slots(
        self, model: RMT, layers: list[LayerState], fresh: Tensor, dtype: torch.dtype
    ) -> tuple[Tensor, list[LayerState]]:
        B = layers[0].k.shape[0]  # type: ignore[attr-defined]
        return model.init_memory.to(dtype).expand(B, self.cfg.memory_size, -1), layers  # the same slots every segment

    def carried(self, layers: list[LayerState]) -> list[Tensor]:
        return [t for s in layers for t in (s.assoc, s.assoc_z)]  # type: ignore[attr-defined]

    def segment_state(self, carried: list[Tensor], index: int) -> dict[str, Tensor]:
        return {"assoc": carried[2 * index], "assoc_z": carried[2 * index + 1]}

    def carry_out(self, state: LayerState) -> list[Tensor]:
        return [state.assoc, state.assoc_z]  # type: ignore[attr-defined]

    def take(self, layers: list[LayerState], carried: list[Tensor]) -> list[LayerState]:
        return [
            dataclasses.replace(cast(RMTState, s), assoc=A, assoc_z=z)
            for s, A, z in zip(layers, carried[::2], carried[1::2])
        ]

    def next_segment(
        self, model: RMT, memory: Tensor, slots: Tensor, blank: list[LayerState], layers: list[LayerState]
    ) -> tuple[Tensor, list[LayerState]]:
        return memory, [with_assoc(f, s) for f, s in zip(blank, layers)]

    def numbers(self) -> tuple[int, str]:
        K, D, N = Associative.features(self.cfg.assoc_dim), self.cfg.dim, self.cfg.n_layers
        return (K * D + K) * N, f"A, z: (K × d + K) × layers, K = {K}"


SEGMENT_MEMORIES["associative"] = AssociativeMemory
