"""Memory Attention, the block-wise recurrent transformer of seed 000 (Liang), as the authors'
code runs it (shared/notes/llama2rnn.md).

The input is cut into chunks of C tokens. Every layer l keeps a memory M_l of C vectors: the
layer's attention output for the previous chunk (heads concatenated, before Wo by default, §3.2
eq. 5). Before use it is evolved by a per-layer projection FFN and norm (eq. 2, with the inner
pre-norm the code has):

    M' = RMSNorm_out(M + SwiGLU(RMSNorm_in(M)))

and injected as a key/value prefix (eq. 3-4): chunk token j attends causally over
[W_km M'; W_k X_t] with values [W_vm M'; W_v X_t]. Memory-row queries are never computed: their
outputs are discarded (eq. 5). RoPE positions restart every chunk (memory 0..C-1, chunk C..2C-1),
so no position exceeds 2C-1 at any length. Gradients flow through every chunk of one call; the
trainer decides where to detach. A trailing partial chunk is kept in the state, so splitting a
sequence across calls changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ..config import RecurformerError
from ..nn import ModelConfig, RMSNorm, State, StreamingLM, SwiGLU, apply_rope, attend, merge_heads, rope_cos_sin, split_heads


@dataclass
class MemoryAttentionConfig(ModelConfig):
    context_field = "chunk_size"
    chunk_size: int = 32  # C: tokens per chunk = memory slots per layer
    memory_qkv: Literal["shared", "separate"] = "shared"  # memory K/V from W_k,W_v (code) or W_km,W_vm (paper)
    memory_source: Literal["pre_wo", "post_wo"] = "pre_wo"  # memory = attention output before/after Wo
    memory_ffn: bool = True  # the projection FFN (eq. 2)
    memory_norm: bool = True  # the output RMSNorm of eq. 2
    init_memory: Literal["zeros", "learned"] = "zeros"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1:
            raise RecurformerError(f"config key 'chunk_size' must be >= 1, got {self.chunk_size}")


@dataclass
class MemoryState(State):
    """Per layer: ``memory`` [B, C, D], the raw memory (attention output of the last complete
    chunk) not yet evolved; for the chunk in progress (r tokens so far, same r for all rows):
    ``mem_k``/``mem_v`` [B, H, C, d], keys/values of the evolved memory, and ``part_k``/``part_v``
    [B, H, r, d] and ``part_o`` [B, r, D] of its first r tokens. When r = 0, mem_k/mem_v are
    not read (they are recomputed from ``memory`` at the next chunk start)."""

    memory: list[Tensor]
    mem_k: list[Tensor]
    mem_v: list[Tensor]
    part_k: list[Tensor]
    part_v: list[Tensor]
    part_o: list[Tensor]

    @property
    def offset(self) -> int:
        """r: tokens of the current chunk already read."""
        return self.part_k[0].shape[2]


class MemoryAttentionLayer(nn.Module):
    def __init__(self, cfg: MemoryAttentionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        if cfg.memory_qkv == "separate":
            self.wkm = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wvm = nn.Linear(cfg.dim, cfg.dim, bias=False)
        if cfg.memory_ffn:
            self.mem_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.mem_ffn = SwiGLU(cfg.dim, cfg.hidden)
        if cfg.memory_norm:
            self.mem_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def evolve(self, m: Tensor) -> Tensor:
        """Eq. 2: M' = Norm(M + FFN(Norm(M))). Zero memory stays exactly zero."""
        if self.cfg.memory_ffn:
            m = m + self.mem_ffn(self.mem_ffn_norm(m))
        if self.cfg.memory_norm:
            m = self.mem_norm(m)
        return m

    def memory_kv(self, m: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys/values of the evolved memory at RoPE positions 0..C-1: [B, H, C, d] each."""
        m = self.evolve(m)
        wk, wv = (self.wkm, self.wvm) if self.cfg.memory_qkv == "separate" else (self.wk, self.wv)
        return apply_rope(split_heads(wk(m), self.n_heads), cos, sin), split_heads(wv(m), self.n_heads)

    def forward(self, x: Tensor, st: dict[str, Tensor], rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """x: [B, T, D] (normed) -> attention output after Wo [B, T, D]; updates ``st`` (this
        layer's slice of the state) in place.

        Only the attention and the memory evolution run chunk by chunk; the projections, RoPE
        (chunk positions C..2C-1, whatever chunk a token is in) and, for ``pre_wo`` memory, Wo
        run once over all T tokens."""
        C, T, H = self.cfg.chunk_size, x.shape[1], self.n_heads
        cos, sin = rope  # [2C, d/2]: rows 0..C-1 memory, C..2C-1 chunk positions
        r0 = st["part_k"].shape[2]  # tokens of the current chunk read by earlier calls
        pos = C + (r0 + torch.arange(T, device=x.device)) % C
        q_all = apply_rope(split_heads(self.wq(x), H), cos[pos], sin[pos])  # [B, H, T, d]
        k_all = apply_rope(split_heads(self.wk(x), H), cos[pos], sin[pos])
        v_all = split_heads(self.wv(x), H)
        first = min(C - r0, T)
        sizes = [first] + [C] * ((T - first) // C) + ([(T - first) % C] if (T - first) % C else [])
        pre_wo = self.cfg.memory_source == "pre_wo"
        outs: list[Tensor] = []
        for q, k_new, v_new in zip(q_all.split(sizes, 2), k_all.split(sizes, 2), v_all.split(sizes, 2)):
            r, n = st["part_k"].shape[2], q.shape[2]
            if r == 0:
                st["mem_k"], st["mem_v"] = self.memory_kv(st["memory"], cos[:C], sin[:C])
            k = torch.cat((st["part_k"], k_new), dim=2) if r else k_new
            v = torch.cat((st["part_v"], v_new), dim=2) if r else v_new
            o = merge_heads(attend(q, torch.cat((st["mem_k"], k), 2), torch.cat((st["mem_v"], v), 2), mask[r : r + n, : C + r + n]))
            out = o if pre_wo else self.wo(o)
            src = torch.cat((st["part_o"], out), dim=1) if r else out  # the memory: o (pre_wo) or Wo o
            if r + n == C:  # chunk complete: its output becomes the next memory
                st["memory"] = src
                B, _, _, d = k.shape  # fresh empty tensors, not views (torch.compile mishandles aliased empty outputs)
                st["part_k"], st["part_v"], st["part_o"] = k.new_zeros(B, H, 0, d), v.new_zeros(B, H, 0, d), src.new_zeros(B, 0, src.shape[2])
            else:
                st["part_k"], st["part_v"], st["part_o"] = k, v, src
            outs.append(out)
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return self.wo(y) if pre_wo else y


class Block(nn.Module):
    def __init__(self, cfg: MemoryAttentionConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MemoryAttentionLayer(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.dim, cfg.hidden)

    def forward(self, x: Tensor, st: dict[str, Tensor], rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        h = x + self.attn(self.attn_norm(x), st, rope, mask)
        return h + self.ffn(self.ffn_norm(h))


class MemoryAttention(StreamingLM):
    state_cls = MemoryState

    def __init__(self, config: MemoryAttentionConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        if config.init_memory == "learned":  # zero-initialised and trainable, as `train_orimem` in the code
            self.init_memory = nn.Parameter(torch.zeros(config.n_layers, config.chunk_size, config.dim))
        self.init_weights()

    @property
    def reset_boundary(self) -> int:
        return self.config.chunk_size  # type: ignore[attr-defined]

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> MemoryState:  # type: ignore[override]
        c: MemoryAttentionConfig = self.config  # type: ignore[assignment]
        dt = self.tok_emb.weight.dtype
        L, B, C, H, d = c.n_layers, batch_size, c.chunk_size, c.n_heads, c.head_dim
        z = lambda *s: torch.zeros(*s, device=device, dtype=dt)  # noqa: E731
        return MemoryState(
            fresh=torch.ones(B, dtype=torch.bool, device=device),
            memory=[z(B, C, c.dim) for _ in range(L)],
            mem_k=[z(B, H, C, d) for _ in range(L)],
            mem_v=[z(B, H, C, d) for _ in range(L)],
            part_k=[z(B, H, 0, d) for _ in range(L)],
            part_v=[z(B, H, 0, d) for _ in range(L)],
            part_o=[z(B, 0, c.dim) for _ in range(L)],
        )

    def body(self, h: Tensor, state: MemoryState) -> tuple[Tensor, MemoryState]:  # type: ignore[override]
        c: MemoryAttentionConfig = self.config  # type: ignore[assignment]
        C = c.chunk_size
        memory = list(state.memory)
        if bool(state.fresh.any()):
            if state.offset:
                raise RecurformerError(
                    f"memory_attention can reset a row only at a chunk boundary (current chunk has {state.offset} of {C} tokens)"
                )
            f = state.fresh[:, None, None]
            for i in range(c.n_layers):
                init = self.init_memory[i].to(h.dtype) if c.init_memory == "learned" else torch.zeros_like(memory[i][:1])
                memory[i] = torch.where(f, init.expand_as(memory[i]), memory[i])
        positions = torch.arange(2 * C, device=h.device)
        rope = rope_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype)
        mask = self._mask(C, h.device)
        new: dict[str, list[Tensor]] = {k: [] for k in ("memory", "mem_k", "mem_v", "part_k", "part_v", "part_o")}
        for i, layer in enumerate(self.layers):
            st = {
                "memory": memory[i],
                "mem_k": state.mem_k[i],
                "mem_v": state.mem_v[i],
                "part_k": state.part_k[i],
                "part_v": state.part_v[i],
                "part_o": state.part_o[i],
            }
            h = layer(h, st, rope, mask)
            for k in new:
                new[k].append(st[k])
        return h, MemoryState(fresh=torch.zeros_like(state.fresh), **new)

    @staticmethod
    def _mask(C: int, device: torch.device) -> Tensor:
        """Boolean [C, 2C] mask over [memory; chunk] for queries at chunk offsets 0..C-1: every
        memory slot visible, chunk keys causal. Queries at offsets r..r+n-1 use
        ``mask[r : r + n, : C + r + n]``."""
        j = torch.arange(C, device=device)
        return torch.cat((torch.ones(C, C, dtype=torch.bool, device=device), j[None, :] <= j[:, None]), dim=1)
