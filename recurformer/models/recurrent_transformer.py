"""Recurrent Transformer ("The Recurrent Transformer: Greater Effective Depth and Efficient
Decoding", §"The Recurrent Transformer layer"; the tiled algorithm in its appendix): layerwise
recurrence. Each layer's persistent key/value pair
at position i is computed from that layer's *output* z_i, so later positions read already
processed representations of earlier ones (§"The Recurrent Transformer layer"):

    q_i = qkN(Q N(x_i)),   k~_i = qkN(K N(x_i)),   v~_i = V N(x_i)        (temporary pair)
    a_i = Attn((k_1, v_1), ..., (k_{i-1}, v_{i-1}), (k~_i, v~_i); q_i)  + ALiBi or RoPE
    z_i = x_i + α (Wo a_i + MLP(N(x_i + α Wo a_i)))                       (α = 1/sqrt(L) or 1)
    k_i = qkN(K N(z_i)),    v_i = V N(z_i)                                (persistent pair)

N = RMSNorm (shared by x and z, as in the paper and the authors' code), qkN = RMSNorm over the
full D-dim q or k (all heads together, as the code), MLP = SwiGLU (library convention; the
authors' code uses GELU). Scores are scaled by 1/sqrt(head_dim). ALiBi slopes 2^(-8h/H)
(max bias 8) by default. The FFN sits inside the recurrence (z feeds the persistent pair), so
this is a whole layer, not a mixer in the shared pre-norm block.

Block variant (the paper's "future work"): with ``block_size`` b > 1, positions are grouped in
blocks of b; a query sees the persistent pairs of earlier blocks and the temporary pairs of its
own block up to itself, so persistent pairs are revealed b at a time (b = 1: the exact layer).
The recurrent depth over N positions is N/b.

``impl`` picks the evaluation: "tiled" (exact tiled forward, default) or "naive" (one block at a
time over the growing prefix); see ``recurformer/ops/recurrent_attention/``. Gradients: "tiled"
has a custom backward (FlashAttention-style: O(N d) saved tensors per layer, tile scores and
finish's vector-Jacobian products recomputed, blocks in reverse; the parameters' gradients
through one batched finish under autograd; it traces as one graph); "naive" runs plain autograd (O(N^2 d) saved: every
step keeps its concatenated prefix of persistent pairs and its attention probabilities).
``compile`` (the trainer's ``train.compile``) compiles the tiled op's tile update alone, with
``dynamic=False``, as the paper's authors do; the per-block finish stays eager.

Streaming: the state holds per layer the persistent pairs of every past position of the current
document (the KV cache; decoding costs one extra K/V projection per token and layer vs a
Transformer step) and the temporary pairs of an unfinished block. A row can be reset only at a
block boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
from torch import Tensor, nn

from ..config import option
from ..modules import MLP, RMSNorm, acc_dtype, alibi_slopes, apply_rope, merge_heads, qkvo, rope_cos_sin, split_heads
from ..nn import ModelConfig, StreamingLM
from ..ops.recurrent_attention import (
    BiasFn,
    RecurrentInputs,
    TileUpdate,
    alibi_bias,
    compiled_tile_update,
    recurrent_attention_naive,
    recurrent_attention_tiled,
    tile_update,
)
from ..registry import register, register_layer
from ..stack import Layer
from ..state import Call, LayerState


@dataclass
class RecurrentTransformerConfig(ModelConfig):
    position: Literal["alibi", "rope"] = "alibi"
    alibi_max_bias: float = option(8.0, range="> 0")
    # b: persistent pairs revealed b positions at a time (1 = the paper's layer)
    block_size: int = option(1, range=">= 1")
    impl: Literal["tiled", "naive"] = "tiled"
    residual_scale: bool = False  # multiply the attention and MLP branches by 1/sqrt(n_layers)
    qk_norm: bool = True


@dataclass
class RecurrentState(LayerState):
    """``k``/``v`` [B, H, S, d]: persistent pairs of positions pos-S..pos-1 (keys rotated at their
    positions when RoPE is on); ``tk``/``tv`` [B, H, r, d]: temporary pairs of the r = pos mod b
    positions of the unfinished block (pairs before a row's document start are masked out)."""

    cache: ClassVar[dict[str, int]] = {"k": 2, "v": 2}
    partial: ClassVar[dict[str, int]] = {"tk": 2, "tv": 2}
    k: Tensor
    v: Tensor
    tk: Tensor
    tv: Tensor


class RecurrentLayer(Layer):
    kind, unit, bounded = "recurrent", "block", False
    state_cls = RecurrentState

    def __init__(self, cfg: RecurrentTransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.alpha = 1 / math.sqrt(cfg.n_layers) if cfg.residual_scale else 1.0
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq, self.wk, self.wv, self.wo = qkvo(cfg.dim)
        self.q_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MLP(cfg.dim, cfg.hidden)
        self.max_bias = cfg.alibi_max_bias
        self.register_buffer("slopes", torch.empty(cfg.n_heads, dtype=torch.float64), persistent=False)
        self.init_buffers()
        self.tile_update: TileUpdate = tile_update  # compiled by ``compile``

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Regional compilation, as the paper's authors compile their layer: the tiled op's tile
        update under ``torch.compile(dynamic=False)`` (``compiled_tile_update``; ``backend`` as
        ``torch.compile``'s), the rest eager. What ``StreamingLM.compile_layers`` (the trainer's
        ``train.compile``) calls; compiling the whole layer would unroll the loop over its blocks
        into one graph per call length, and the per-block finish would recompile at every block
        offset. The same numbers as eager."""
        self.tile_update = compiled_tile_update(kwargs.get("backend", "inductor"))

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent ALiBi slopes where the buffer lives: a model built on the
        meta device and then loaded (as ``transformers`` does) gets its slopes back this way."""
        old = self.get_buffer("slopes")
        self.register_buffer("slopes", alibi_slopes(self.n_heads, self.max_bias).to(old), persistent=False)

    @property
    def period(self) -> int:
        return self.cfg.block_size

    def kv(self, u: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """Key and value [B, H, n, d] of u [B, n, D] (x: temporary pair, z: persistent pair)."""
        n = self.attn_norm(u)
        k = split_heads(self.k_norm(self.wk(n)), self.n_heads)
        if rope is not None:
            k = apply_rope(k, *rope)
        return k, split_heads(self.wv(n), self.n_heads)

    def describe(self) -> str:
        return f"recurrent(b={self.period}, {self.cfg.position})"

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> RecurrentState:
        z = torch.zeros(batch_size, self.n_heads, 0, self.cfg.head_dim, device=device, dtype=dtype)
        return RecurrentState(k=z, v=z, tk=z, tv=z)

    def position_signal(
        self, pos0: int, T: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[tuple[Tensor, Tensor] | None, BiasFn | None]:
        """(rope cos/sin for positions pos0..pos0+T-1 or None, bias function or None)."""
        c = self.cfg
        if c.position == "rope":
            return rope_cos_sin(torch.arange(pos0, pos0 + T, device=device), c.head_dim, c.rope_theta, dtype), None
        return None, alibi_bias(cast(Tensor, self.slopes).to(dtype))

    def forward(self, x: Tensor, st: RecurrentState, call: Call) -> tuple[Tensor, RecurrentState]:
        acc = acc_dtype(x.dtype)
        rope, bias_fn = call.shared(
            ("rt-pos", self.cfg.position, acc), lambda: self.position_signal(call.pos, x.shape[1], x.device, acc)
        )
        if rope is not None:
            rope = (rope[0].to(x.dtype), rope[1].to(x.dtype))
        z, new = self.run(x, st.tensors(), pos0=call.pos, start=call.start, rope=rope, bias_fn=bias_fn)
        return z, RecurrentState(**new)

    def run(
        self,
        x: Tensor,
        past: dict[str, Tensor],
        *,
        pos0: int,
        start: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        bias_fn: BiasFn | None,
        impl: str | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """x: [B, T, D] -> z [B, T, D] and this layer's new state slice."""
        b = self.cfg.block_size
        q = split_heads(self.q_norm(self.wq(self.attn_norm(x))), self.n_heads)  # [B, H, T, d]
        if rope is not None:
            q = apply_rope(q, *rope)
        tk, tv = self.kv(x, rope)
        alpha = self.alpha
        branch = (lambda t: t) if alpha == 1.0 else (lambda t: alpha * t)  # no multiply by 1 per block

        def finish(a: Tensor, s: int, e: int) -> tuple[Tensor, Tensor, Tensor]:
            h = x[:, s:e] + branch(self.wo(merge_heads(a.to(x.dtype))))
            z = h + branch(self.ffn(self.ffn_norm(h)))
            k, v = self.kv(z, None if rope is None else (rope[0][s:e], rope[1][s:e]))
            return z, k, v

        inputs = RecurrentInputs(
            q, tk, tv, finish, block=b, pos0=pos0, past_k=past["k"], past_v=past["v"], past_tk=past["tk"],
            past_tv=past["tv"], start=start, bias_fn=bias_fn,
        )  # fmt: skip
        if (impl or self.cfg.impl) == "tiled":  # finish reads x and the parameters: the custom backward
            z, k, v = recurrent_attention_tiled(inputs, finish_inputs=(x, *self.parameters()), update=self.tile_update)
        else:
            z, k, v = recurrent_attention_naive(inputs)
        r = (pos0 + x.shape[1]) % b  # positions of the unfinished block after this call
        tk_all, tv_all = torch.cat((past["tk"], tk), 2), torch.cat((past["tv"], tv), 2)
        R = tk_all.shape[2]
        new = {
            "k": torch.cat((past["k"], k), 2),
            "v": torch.cat((past["v"], v), 2),
            "tk": tk_all[:, :, R - r :],
            "tv": tv_all[:, :, R - r :],
        }
        return z, new


@register_layer("recurrent", RecurrentTransformerConfig)
def recurrent_layer(cfg: RecurrentTransformerConfig, index: int) -> Layer:
    return RecurrentLayer(cfg)


class RecurrentTransformer(StreamingLM):
    kind = "recurrent"
    config: RecurrentTransformerConfig

    def info_lines(self) -> list[str]:
        c = self.config
        return super().info_lines() + [
            f"state: persistent K/V cache 2 * n_layers * dim = {2 * c.n_layers * c.dim} numbers per position (grows with the document)",
            f"block_size b = {c.block_size}: recurrent depth N/b per layer; impl = {c.impl}; position = {c.position}",
        ]


register(
    "recurrent_transformer",
    RecurrentTransformerConfig,
    RecurrentTransformer,
    "Recurrent Transformer: each layer attends to the previous layer's persistent keys/values",
)
