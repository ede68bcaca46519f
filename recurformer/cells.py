"""The recurrent cell of the Block-Recurrent Transformer (Hutchins, Schlag, Wu, Dyer and
Neyshabur, "Block-Recurrent Transformers", 2022, §3 "Method"), in plain PyTorch: the gates
(fixed and LSTM-style), the query/key normalisation, T5 relative-position buckets, and the state
cell (state IDs, the state's projections and the gated update). ``models/block_recurrent.py``
builds its layers from these."""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from .modules import MLP, RMSNorm, grouped_attend, merge_heads, project_heads


class CellConfig(Protocol):
    """The config fields a cell reads (``BlockRecurrentConfig`` has them)."""

    @property
    def dim(self) -> int: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def norm_eps(self) -> float: ...

    @property
    def cell(self) -> str: ...

    @property
    def gate(self) -> str: ...

    @property
    def mlp(self) -> Literal["swiglu", "relu"]: ...

    @property
    def qk_norm(self) -> bool: ...

    @property
    def key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def hidden(self) -> int: ...

    @property
    def states(self) -> int: ...


class Gate(nn.Module):
    """c' = c ⊙ keep + z ⊙ write. fixed: keep = σ(b), write = 1 - keep; lstm: keep = f =
    σ(W_f h + b_f + 1), write = i = σ(W_i h + b_i - 1)."""

    def __init__(self, kind: str, d_hidden: int, dim: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "fixed":
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.wi = nn.Linear(d_hidden, dim)
            self.wf = nn.Linear(d_hidden, dim)

    def init_extra(self, std: float) -> None:
        """meliad: gate biases N(0, 0.1), gate kernels at 0.1 x the normal scale."""
        with torch.no_grad():
            if self.kind == "fixed":
                self.bias.normal_(0.0, 0.1)
            else:
                for lin in (self.wi, self.wf):
                    lin.weight.normal_(0.0, 0.1 * std)
                    lin.bias.normal_(0.0, 0.1)

    def values(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """(keep, write), broadcastable to [B, S, D]."""
        if self.kind == "fixed":
            g = torch.sigmoid(self.bias.to(h.dtype))
            return g, 1 - g
        return torch.sigmoid(self.wf(h) + 1), torch.sigmoid(self.wi(h) - 1)

    def forward(self, c: Tensor, z: Tensor, h: Tensor) -> Tensor:
        keep, write = self.values(h)
        return c * keep + z * write


def qk_normalize(x: Tensor) -> Tensor:
    """x / sqrt(|x|^2 + 1e-6) over the head dim (meliad's key/query normalisation; zero stays zero)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class QK(nn.Module):
    """Query/key treatment of one attention: with ``qk_norm``, logits = s_h (q̂·k̂ + bias) with a
    learned per-head scale s_h (init 1) instead of q·k / sqrt(d) + bias."""

    def __init__(self, cfg: CellConfig) -> None:
        super().__init__()
        self.on = cfg.qk_norm
        self.sqrt_d = math.sqrt(cfg.head_dim)
        if self.on:
            self.scale = nn.Parameter(torch.ones(cfg.n_heads))

    def key(self, k: Tensor) -> Tensor:
        return qk_normalize(k) if self.on else k

    def query(self, q: Tensor, sdpa: bool = True) -> Tensor:
        """[B, H, T, d] -> queries for ``attend`` (which divides by sqrt(d)), or with ``sdpa=False``
        for ``biased_attend`` (which does not): s_h q̂, or q / sqrt(d)."""
        if not self.on:
            return q if sdpa else q / self.sqrt_d
        return qk_normalize(q) * (self.scale.to(q.dtype) * (self.sqrt_d if sdpa else 1.0))[:, None, None]

    def bias(self, b: Tensor) -> Tensor:
        """[H, Tq, Tk] additive bias -> as ``attend`` must add it. Only the finite part is scaled:
        scaling the -inf of a mask would give the scale a NaN gradient (inf * 0)."""
        if not self.on:
            return b
        finite = torch.isfinite(b)
        return torch.where(finite, b.masked_fill(~finite, 0.0) * self.scale.to(b.dtype)[:, None, None], b)


def t5_buckets(distance: Tensor, num_buckets: int, max_distance: int) -> Tensor:
    """Unidirectional T5 buckets for distances q - k >= 0: exact below num_buckets/2, then
    logarithmic up to max_distance, clipped to the last bucket."""
    exact = num_buckets // 2
    n = distance.clamp(min=0)
    log_part = (
        exact
        + (torch.log(n.double().clamp(min=1) / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    )
    return torch.where(n < exact, n, log_part.clamp(max=num_buckets - 1))


class StateCell(nn.Module):
    """The horizontal direction of a recurrent layer: state IDs, the state's Q/K/V/Q2 projections
    and the gated update."""

    def __init__(self, cfg: CellConfig) -> None:
        super().__init__()
        D, S, Dkv = cfg.dim, cfg.states, cfg.key_value_heads * cfg.head_dim
        self.n_heads, self.kv_heads, self.kind = cfg.n_heads, cfg.key_value_heads, cfg.cell
        self.norm = RMSNorm(D, cfg.norm_eps)
        self.ids = nn.Parameter(torch.zeros(S, D))  # learned state IDs, N(0, 1) (meliad)
        self.wq = nn.Linear(D, D, bias=False)
        self.wq2 = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, Dkv, bias=False)
        self.wv = nn.Linear(D, Dkv, bias=False)
        self.qk_self, self.qk_cross = QK(cfg), QK(cfg)  # state -> state, state -> tokens
        if cfg.cell in ("skip", "dual"):
            self.proj = nn.Linear(2 * D, D, bias=False)
            self.gate = Gate(cfg.gate, 2 * D, D)
        if cfg.cell == "dual":
            self.ffn_norm = RMSNorm(D, cfg.norm_eps)
            self.ffn = MLP(D, cfg.hidden, D, cfg.mlp)
            self.ffn_gate = Gate(cfg.gate, cfg.hidden, D)
        if cfg.cell == "single":
            self.ffn = MLP(2 * D, cfg.hidden, D, cfg.mlp)
            self.ffn_gate = Gate(cfg.gate, cfg.hidden, D)

    def init_extra(self, std: float) -> None:
        with torch.no_grad():
            self.ids.normal_(0.0, 1.0)  # meliad's state IDs

    def project(self, c: Tensor, queries: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """c [B, S, D] -> (K_c, V_c [B, Hkv, S, d], Q_c, Q2_c [B, H, S, d]) from u = Norm(c) + ids, in one matmul
        (the weights of W_k, W_v and, if ``queries``, W_q, W_q2 side by side); keys normalised by
        the user, queries (only needed for an update) treated by ``qk_self`` / ``qk_cross``."""
        u = self.norm(c) + self.ids.to(c.dtype)
        ws = (self.wk.weight, self.wv.weight) + ((self.wq.weight, self.wq2.weight) if queries else ())
        parts = project_heads(u, ws, (self.kv_heads, self.kv_heads, self.n_heads, self.n_heads)[: len(ws)])
        if not queries:
            return parts[0], parts[1], None, None
        return parts[0], parts[1], self.qk_self.query(parts[2]), self.qk_cross.query(parts[3])

    def update(self, c: Tensor, qs: Tensor, qs2: Tensor, kc: Tensor, vc: Tensor, kx: Tensor, vx: Tensor) -> Tensor:
        """One block step. qs/qs2/kc/vc: the state's queries, keys (normalised if qk_norm) and
        values (``project``); kx/vx [B, Hkv, 2W, d]: token keys/values of the previous and current
        block (keys as the token queries see them). Returns c' [B, S, D]."""
        o = torch.cat((grouped_attend(qs, kc, vc), grouped_attend(qs2, kx, vx)), dim=1)  # [B, 2H, S, d]: [self ; cross]
        y = merge_heads(o)  # [B, S, 2D]
        if self.kind == "single":
            hid = self.ffn.hidden(y)
            return self.ffn_gate(c, torch.tanh(self.ffn.w2(hid)), hid)
        c = self.gate(c, self.proj(y), y)
        if self.kind == "dual":
            hid = self.ffn.hidden(self.ffn_norm(c))
            c = self.ffn_gate(c, self.ffn.w2(hid), hid)
        return c
