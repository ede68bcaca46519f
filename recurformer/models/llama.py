"""Llama baseline (Touvron et al. 2023): pre-norm RMSNorm blocks, SwiGLU FFN, RoPE, tied
embeddings, causal attention through PyTorch SDPA. The streaming state is the KV cache; positions
continue across calls. With ``window`` set, a query at position p sees keys in (p - window, p] and
the cache keeps only the last ``window - 1`` keys (bounded memory at any length).

    h = x + Wo · Attn(RoPE(Wq n(x)), RoPE(Wk n(x)), Wv n(x)),   n = RMSNorm
    y = h + W2 (silu(W1 n(h)) * W3 n(h))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import RecurformerError
from ..nn import ModelConfig, RMSNorm, State, StreamingLM, SwiGLU, apply_rope, attend, merge_heads, rope_cos_sin, split_heads


@dataclass
class LlamaConfig(ModelConfig):
    context_field = "window"
    window: int | None = None  # attention window (None: full causal attention)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is not None and self.window < 1:
            raise RecurformerError(f"config key 'window' must be >= 1, got {self.window}")


@dataclass
class KVState(State):
    """KV cache. ``k``/``v``: per layer [B, H, S, head_dim], keys already rotated at their
    absolute positions ``pos - S .. pos - 1``. ``start[b]``: position where row b's current
    document begins (earlier keys are masked out)."""

    k: list[Tensor]
    v: list[Tensor]
    start: Tensor  # [B] int64
    pos: int


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x: [B, T, D] -> (out [B, T, D], keys [B, H, S+T, d], values [B, H, S+T, d])"""
        q = apply_rope(split_heads(self.wq(x), self.n_heads), cos, sin)
        k = apply_rope(split_heads(self.wk(x), self.n_heads), cos, sin)
        v = split_heads(self.wv(x), self.n_heads)
        k = torch.cat((k_cache, k), dim=2)
        v = torch.cat((v_cache, v), dim=2)
        o = attend(q, k, v, mask, causal=mask is None)
        return self.wo(merge_heads(o)), k, v


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.dim, cfg.hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor, mask: Tensor | None):
        a, k, v = self.attn(self.attn_norm(x), cos, sin, kc, vc, mask)
        h = x + a
        return h + self.ffn(self.ffn_norm(h)), k, v


class Llama(StreamingLM):
    state_cls = KVState

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.window = config.window
        self.init_weights()

    @property
    def bounded_state(self) -> bool:
        return self.window is not None

    def set_window(self, window: int | None) -> None:
        """Evaluate with a sliding-window mask (the seed's "Slide Window" baseline is a normally
        trained Llama evaluated with a 256-token window)."""
        if window is not None and window < 1:
            raise RecurformerError(f"window must be >= 1, got {window}")
        self.window = window

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> KVState:  # type: ignore[override]
        c = self.config
        dtype = self.tok_emb.weight.dtype
        empty = [torch.zeros(batch_size, c.n_heads, 0, c.head_dim, device=device, dtype=dtype) for _ in range(c.n_layers)]
        return self.state_cls(
            fresh=torch.ones(batch_size, dtype=torch.bool, device=device),
            k=empty,
            v=list(empty),
            start=torch.zeros(batch_size, dtype=torch.long, device=device),
            pos=0,
        )

    def body(self, h: Tensor, state: KVState) -> tuple[Tensor, KVState]:  # type: ignore[override]
        B, T, _ = h.shape
        S = state.k[0].shape[2]
        pos0 = state.pos
        start = torch.where(state.fresh, torch.full_like(state.start, pos0), state.start)
        q_pos = torch.arange(pos0, pos0 + T, device=h.device)
        k_pos = torch.arange(pos0 - S, pos0 + T, device=h.device)
        cos, sin = rope_cos_sin(q_pos, self.config.head_dim, self.config.rope_theta, h.dtype)

        W = self.window
        hides_cache = S > 0 and bool((start > pos0 - S).any())
        if S == 0 and not hides_cache and (W is None or W >= T):
            mask = None  # plain causal: SDPA's fast path
        else:
            vis = k_pos[None, :] <= q_pos[:, None]  # [T, S+T]
            if W is not None:
                vis = vis & (k_pos[None, :] > q_pos[:, None] - W)
            mask = (vis[None] & (k_pos[None, None, :] >= start[:, None, None])).unsqueeze(1)  # [B, 1, T, S+T]

        keep = None if W is None else W - 1
        ks, vs = [], []
        for layer, kc, vc in zip(self.layers, state.k, state.v):
            h, k, v = layer(h, cos, sin, kc, vc, mask)
            if keep is not None:
                k, v = k[:, :, k.shape[2] - min(keep, k.shape[2]) :], v[:, :, v.shape[2] - min(keep, v.shape[2]) :]
            ks.append(k)
            vs.append(v)
        new = self.state_cls(fresh=torch.zeros_like(state.fresh), k=ks, v=vs, start=start, pos=pos0 + T)
        return h, new
