"""Llama baseline (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models",
§2.2): pre-norm RMSNorm blocks, SwiGLU FFN, RoPE, tied embeddings, causal attention through
PyTorch SDPA. The layer state is the KV cache; positions continue across calls. A 'window' layer
(``window`` = W) lets a query at position p see keys in (p - W, p] and keeps only the last W - 1
keys (bounded memory at any length: the sliding-window baseline).

    h = x + Wo · Attn(RoPE(Wq n(x)), RoPE(Wk n(x)), Wv n(x)),   n = RMSNorm
    y = h + W2 (silu(W1 n(h)) * W3 n(h))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from ..config import RecurformerError
from ..layers import Block, apply_rope, attend, merge_heads, rope_cos_sin, split_heads
from ..nn import Call, Layer, LayerState, ModelConfig, StreamingLM


@dataclass
class LlamaConfig(ModelConfig):
    context_field = "window"


@dataclass
class KVState(LayerState):
    """KV cache ``k``/``v`` [B, H, S, head_dim], keys already rotated at their absolute positions
    ``pos - S .. pos - 1`` (keys before a row's document start are masked out)."""

    cache: ClassVar[dict[str, int]] = {"k": 2, "v": 2}
    k: Tensor
    v: Tensor


class Attention(Layer):
    """Causal self-attention with RoPE over the KV cache; ``window`` W limits it to the last W
    positions (None: full attention)."""

    state_cls = KVState

    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.theta = cfg.n_heads, cfg.head_dim, cfg.rope_theta
        self.window = window
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "full" if self.window is None else "window"

    @property
    def bounded(self) -> bool:  # type: ignore[override]
        return self.window is not None

    def describe(self) -> str:
        return self.kind if self.window is None else f"window(W={self.window})"

    def reach(self, q: int) -> int | None:
        return None if self.window is None else q - (self.window - 1)

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> KVState:
        z = torch.zeros(batch_size, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVState(k=z, v=z)

    def tables(self, call: Call, T: int, S: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """RoPE cos/sin of the queries and the boolean mask [B, 1, T, S+T] (None: plain causal)."""
        pos0, W, start = call.pos, self.window, call.start
        q_pos = torch.arange(pos0, pos0 + T, device=x.device)
        k_pos = torch.arange(pos0 - S, pos0 + T, device=x.device)
        cos, sin = rope_cos_sin(q_pos, self.head_dim, self.theta, x.dtype)
        hides_cache = S > 0 and bool((start > pos0 - S).any())
        if S == 0 and not hides_cache and (W is None or W >= T):
            return cos, sin, None  # plain causal: SDPA's fast path
        vis = k_pos[None, :] <= q_pos[:, None]  # [T, S+T]
        if W is not None:
            vis = vis & (k_pos[None, :] > q_pos[:, None] - W)
        return cos, sin, (vis[None] & (k_pos[None, None, :] >= start[:, None, None])).unsqueeze(1)

    def forward(self, x: Tensor, state: KVState, call: Call) -> tuple[Tensor, KVState]:
        """x: [B, T, D] (normed) -> (out [B, T, D], cache with the new keys/values)."""
        T, S = x.shape[1], state.k.shape[2]
        cos, sin, mask = call.shared(("rope+mask", S, self.window, x.dtype), lambda: self.tables(call, T, S, x))
        q = apply_rope(split_heads(self.wq(x), self.n_heads), cos, sin)
        k = torch.cat((state.k, apply_rope(split_heads(self.wk(x), self.n_heads), cos, sin)), dim=2)
        v = torch.cat((state.v, split_heads(self.wv(x), self.n_heads)), dim=2)
        o = attend(q, k, v, mask, causal=mask is None)
        if self.window is not None:
            keep = min(self.window - 1, k.shape[2])
            k, v = k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :]
        return self.wo(merge_heads(o)), KVState(k=k, v=v)


class Llama(StreamingLM):
    kind = "full"

    def default_kind(self) -> str:
        return "full" if self.config.window is None else "window"

    @staticmethod
    def make_layer(cfg: ModelConfig, index: int) -> Layer:
        return Block(cfg, Attention(cfg, None))

    def set_window(self, window: int | None) -> None:
        """Evaluate with a sliding-window mask (the seed's "Slide Window" baseline is a normally
        trained Llama evaluated with a 256-token window)."""
        if window is not None and window < 1:
            raise RecurformerError(f"window must be >= 1, got {window}")
        for m in self.modules():
            if isinstance(m, Attention):
                m.window = window
