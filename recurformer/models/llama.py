"""Llama baseline (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models",
§2.2): pre-norm RMSNorm blocks, SwiGLU FFN, RoPE, tied embeddings, causal attention through
PyTorch SDPA. The layer state is the KV cache; positions continue across calls. A 'window' layer
(``window`` = W) lets a query at position p see keys in (p - W, p] and keeps only the last W - 1
keys (bounded memory at any length: the sliding-window baseline).

    h = x + Wo · Attn(RoPE(Wq n(x)), RoPE(Wk n(x)), Wv n(x)),   n = RMSNorm
    y = h + W2 (silu(W1 n(h)) * W3 n(h))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ..config import check_range
from ..modules import apply_rope, attend, float32_under_cpu_autocast, merge_heads, qkvo, rope_cos_sin, split_heads
from ..nn import Block, ModelConfig, StreamingLM
from ..registry import register, register_layer
from ..stack import Layer
from ..state import Call, LayerState, writable


@dataclass
class LlamaConfig(ModelConfig):
    context_field = "window"


@dataclass(eq=False)
class KVRoom:
    """Preallocated keys/values [B, H, capacity, head_dim] behind a full-attention KV cache while
    decoding: a call writes its keys/values after the ``used`` positions in place and attends over
    the filled prefix, so a decoded token reads the cache but does not copy it (``torch.cat`` would
    copy all S positions per token, O(S^2) per sequence). When full, the capacity doubles
    (amortised O(1) copying per token)."""

    k: Tensor
    v: Tensor
    used: int

    @classmethod
    def around(cls, state: "KVState", capacity: int, dtype: torch.dtype) -> "KVRoom":
        """A new room holding ``state``'s cache, with space for ``capacity`` positions."""
        B, H, S, d = state.k.shape
        room = cls(
            k=state.k.new_empty(B, H, capacity, d, dtype=dtype),
            v=state.v.new_empty(B, H, capacity, d, dtype=dtype),
            used=S,
        )
        room.k[:, :, :S], room.v[:, :, :S] = state.k, state.v
        return room

    def fits(self, state: "KVState") -> bool:
        """Whether ``state``'s cache is the filled prefix of this room (then positions from
        ``used`` on belong to no state and may be written)."""
        return all(
            t.data_ptr() == buf.data_ptr()
            and t.device == buf.device
            and t.shape == buf[:, :, : self.used].shape
            and t.stride() == buf.stride()
            for t, buf in ((state.k, self.k), (state.v, self.v))
        )

    def takes(self, state: "KVState", k: Tensor) -> bool:
        """Whether keys ``k`` [B, H, T, head_dim] (and their values) can be written in place
        after ``state``'s cache: it is the filled prefix, T positions are free, the dtype is the
        same and the buffers are writable here."""
        return (
            self.fits(state)
            and self.used + k.shape[2] <= self.k.shape[2]
            and self.k.dtype == k.dtype
            and writable(self.k)
        )

    def append(self, k: Tensor, v: Tensor) -> "KVState":
        """The cache extended by ``k``/``v`` [B, H, T, head_dim], written in place (the caller
        made sure that the room ``takes`` them)."""
        S, T = self.used, k.shape[2]
        self.k[:, :, S : S + T], self.v[:, :, S : S + T] = k, v
        self.used = S + T
        return KVState(k=self.k[:, :, : S + T], v=self.v[:, :, : S + T], room=self)


@dataclass
class KVState(LayerState):
    """KV cache ``k``/``v`` [B, H, S, head_dim], keys already rotated at their absolute positions
    ``pos - S .. pos - 1`` (keys before a row's document start are masked out). While decoding,
    ``k``/``v`` are the filled prefix of a ``KVRoom``."""

    cache: ClassVar[dict[str, int]] = {"k": 2, "v": 2}
    runtime: ClassVar[tuple[str, ...]] = ("room",)
    k: Tensor
    v: Tensor
    room: KVRoom | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Band:
    """Queries ``q0``..``q1``-1 of a call attend to keys ``k0``..``k1``-1 under ``mask``
    [B, 1, q1 - q0, k1 - k0] (boolean, True = visible; None: plain causal or no mask)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Tensor | None


@float32_under_cpu_autocast
def banded_attend(q: Tensor, k: Tensor, v: Tensor, bands: list[Band], causal: bool) -> Tensor:
    """``attend`` of queries q [B, H, T, d] over keys/values [B, H, S+T, d] band by band (one
    SDPA per band, the keys a view), the outputs concatenated along the queries; ``causal``
    applies to a band without a mask. In float32 under CPU autocast, cast once rather than per band."""
    if len(bands) == 1:
        b = bands[0]
        return attend(q, k[:, :, b.k0 : b.k1], v[:, :, b.k0 : b.k1], b.mask, causal=causal)
    outs = [attend(q[:, :, b.q0 : b.q1], k[:, :, b.k0 : b.k1], v[:, :, b.k0 : b.k1], b.mask) for b in bands]
    return torch.cat(outs, dim=2)


class Attention(Layer):
    """Causal self-attention with RoPE over the KV cache; ``window`` W limits it to the last W
    positions (None: full attention). A window layer whose call holds more keys than a tile of
    queries can see attends tile by tile over bands of W + m - 1 keys (``bands``)."""

    state_cls = KVState

    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.theta = cfg.n_heads, cfg.head_dim, cfg.rope_theta
        self.window = window
        self.query_tile: int | None = 64  # queries per band of a window layer (speed only; None: one band)
        self.wq, self.wk, self.wv, self.wo = qkvo(cfg.dim)

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "window"

    @property
    def bounded(self) -> bool:
        return self.window is not None

    def describe(self) -> str:
        return self.kind if self.window is None else f"window(W={self.window})"

    def reach(self, q: int) -> int | None:
        return None if self.window is None else q - (self.window - 1)

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> KVState:
        z = torch.zeros(batch_size, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVState(k=z, v=z)

    def tables(self, call: Call, T: int, S: int, x: Tensor) -> tuple[Tensor, Tensor, list[Band]]:
        """RoPE cos/sin of the queries and the bands the queries attend in (``bands``)."""
        pos0, W, start = call.pos, self.window, call.start
        q_pos = torch.arange(pos0, pos0 + T, device=x.device)
        k_pos = torch.arange(pos0 - S, pos0 + T, device=x.device)
        cos, sin = rope_cos_sin(q_pos, self.head_dim, self.theta, x.dtype)
        # whether a row's document starts inside the cache, from the host's bound (unknown: the mask)
        hides_cache = S > 0 and (call.start_ceiling is None or call.start_ceiling > pos0 - S)
        if not hides_cache and (W is None or W >= S + T) and (S == 0 or T == 1):
            return cos, sin, [Band(0, T, 0, S + T, None)]  # plain causal (S = 0), or one query that sees every key
        vis = k_pos[None, :] <= q_pos[:, None]  # [T, S+T]
        if W is not None:
            vis = vis & (k_pos[None, :] > q_pos[:, None] - W)
        mask = (vis[None] & (k_pos[None, None, :] >= start[:, None, None])).unsqueeze(1)
        return cos, sin, self.bands(mask, T, S)

    def bands(self, mask: Tensor, T: int, S: int) -> list[Band]:
        """The call's queries in tiles of m = ``query_tile`` (a window layer whose S + T keys
        exceed the W + m - 1 that a tile can see, else one tile): queries a..b-1 (positions
        pos + a ..) see only keys S + a - W + 1 .. S + b - 1 of the S + T, so each tile attends
        over that band (a view) with its slice of the boolean ``mask`` [B, 1, T, S+T]. The keys
        left out are hidden from every query of the tile (weight exp(-inf) = 0), so the result
        is the single masked attention's, with at most T (W + m - 1) pairs scored instead of
        T (S + T)."""
        W, m = self.window, self.query_tile
        if W is None or m is None or S + T <= W + m - 1:
            return [Band(0, T, 0, S + T, mask)]
        out = []
        for a in range(0, T, m):
            b, k0 = min(a + m, T), max(0, S + a - W + 1)
            out.append(Band(a, b, k0, S + b, mask[:, :, a:b, k0 : S + b].contiguous()))
        return out

    def forward(self, x: Tensor, state: KVState, call: Call) -> tuple[Tensor, KVState]:
        """x: [B, T, D] (normed) -> (out [B, T, D], cache with the new keys/values)."""
        T, S = x.shape[1], state.k.shape[2]
        key = ("rope+mask", S, self.window, self.query_tile, x.dtype)
        cos, sin, bands = call.shared(key, lambda: self.tables(call, T, S, x))
        q = apply_rope(split_heads(self.wq(x), self.n_heads), cos, sin)
        k_new = apply_rope(split_heads(self.wk(x), self.n_heads), cos, sin)
        v_new = split_heads(self.wv(x), self.n_heads)
        if self.window is None and S > 0 and not torch.is_grad_enabled():
            new = self.extend(state, k_new, v_new)
        else:  # with autograd an in-place write could change a tensor that backward still needs
            new = KVState(k=torch.cat((state.k, k_new), dim=2), v=torch.cat((state.v, v_new), dim=2))
        o = banded_attend(q, new.k, new.v, bands, causal=S == 0)
        if self.window is not None:
            keep = min(self.window - 1, new.k.shape[2])
            new = KVState(k=new.k[:, :, new.k.shape[2] - keep :], v=new.v[:, :, new.v.shape[2] - keep :])
        return self.wo(merge_heads(o)), new

    @staticmethod
    def extend(state: KVState, k: Tensor, v: Tensor) -> KVState:
        """The full cache extended by ``k``/``v`` in its room (without autograd): in place while
        the room fits the state and has space, else in a new room of twice the needed size."""
        room = state.room
        if room is None or not room.takes(state, k):
            room = KVRoom.around(state, 2 * (state.k.shape[2] + k.shape[2]), k.dtype)
        return room.append(k, v)


@register_layer("full", ModelConfig)
def full_layer(cfg: ModelConfig, index: int) -> Layer:
    return Block(cfg, Attention(cfg, None))


class Llama(StreamingLM):
    kind = "full"

    def default_kind(self) -> str:
        return "full" if self.config.window is None else "window"

    def set_window(self, window: int | None) -> None:
        """Evaluate with a sliding-window mask (the "Slide Window" baseline of Liang, "Block-wise Recurrent
        Transformer", is a normally trained Llama evaluated with a 256-token window)."""
        check_range("window", window, (1, True, None, False), "window")
        for m in self.modules():
            if isinstance(m, Attention):
                m.window = window


register("llama", LlamaConfig, Llama, "Llama-style dense decoder (full causal attention, KV cache state)")
