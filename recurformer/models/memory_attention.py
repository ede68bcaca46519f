"""Memory Attention: "Block-wise Recurrent Transformer" (Liang; also titled "Truncated Recurrent
Transformer"), §3.1-3.2, as the authors' code (llama2Rnn) runs it.

The input is cut into chunks of C tokens. A memory layer keeps a memory M of C vectors: the
layer's attention output for the previous chunk (heads concatenated, before Wo by default, eq. 5).
Before use it is evolved by a per-layer projection FFN and norm (eq. 2, with the inner pre-norm
the code has):

    M' = RMSNorm_out(M + SwiGLU(RMSNorm_in(M)))

and injected as a key/value prefix (eq. 3-4): chunk token j attends causally over
[W_km M'; W_k X_t] with values [W_vm M'; W_v X_t]. Memory-row queries are never computed: their
outputs are discarded (eq. 5). RoPE positions restart every chunk (memory 0..C-1, chunk C..2C-1),
so no position exceeds 2C-1 at any length. Gradients flow through every chunk of one call; the
trainer decides where to detach. A trailing partial chunk is kept in the state, so splitting a
sequence across calls changes nothing. The memory layer sits in the library's pre-norm block.

``memory_update="gated"`` (not in the paper or the code; added after the copy probe
found the paper's memory does not hold a sentence across chunks) keeps part of the evolved memory
instead of replacing it: when chunk t completes,

    g = sigmoid(W_g [M'_t; O_t] + b_g),    M_{t+1} = g * M'_t + (1 - g) * O_t

per slot and channel, with O_t the chunk's output that the default ("replace") takes as M_{t+1}.
b_g starts at 1 (a fresh gate keeps ~73% of the memory, as forget-gate biases favour
remembering). The default leaves the paper's model exactly as it was.

``memory_update="write_gate"`` holds the memory unless the chunk opens a gate (``WriteGate``,
closed at initialisation; the keep path is the raw memory M_t, not the evolved M'_t):

    g = sigmoid(W_g O_t + b_g),    M_{t+1} = M_t + g * (O_t - M_t),    b_g = -5 at initialisation

``qkv_conv: K`` passes each memory layer's (normed) input through a short causal convolution
before q/k/v (``nn.ConvConfig``).

``memory_layers`` puts memory attention in the chosen layers only and full attention (or, with
``window``, sliding-window attention) in the others, as the code's ``memlayerN`` option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import tap
from ..config import RecurformerError, option
from ..modules import (
    MLP,
    RMSNorm,
    WriteGate,
    apply_rope,
    attend,
    compiled_region,
    merge_heads,
    pieces,
    qkvo,
    rope_cos_sin,
    split_heads,
)
from ..nn import Block, ConvConfig, ConvLayer, StreamingLM
from ..registry import register, register_layer
from ..stack import Layer
from ..state import Call, LayerState, reset_rows


@dataclass
class MemoryAttentionConfig(ConvConfig):
    context_field = "chunk_size"
    chunk_size: int = option(32, range=">= 1")  # C: tokens per chunk = memory slots per layer
    memory_qkv: Literal["shared", "separate"] = "shared"  # memory K/V from W_k,W_v (code) or W_km,W_vm (paper)
    memory_source: Literal["pre_wo", "post_wo"] = "pre_wo"  # memory = attention output before/after Wo
    memory_ffn: bool = True  # the projection FFN (eq. 2)
    memory_norm: bool = True  # the output RMSNorm of eq. 2
    init_memory: Literal["zeros", "learned"] = "zeros"
    memory_update: Literal["replace", "gated", "write_gate"] = "replace"  # M_{t+1} = O_t (the paper) or a gate above
    memory_layers: list[int] | None = None  # memory attention only in these layers (None: all)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_layers is not None:
            if self.layers is not None:
                raise RecurformerError("give either 'layers' or 'memory_layers', not both")
            bad = [i for i in self.memory_layers if not 0 <= i < self.n_layers]
            if bad:
                raise RecurformerError(
                    f"config key 'memory_layers' names layer {bad[0]}, outside 0..{self.n_layers - 1}"
                )

    def layer_kinds(self, default: str) -> list[str]:
        if self.memory_layers is None:
            return super().layer_kinds(default)
        other = "full" if self.window is None else "window"
        return ["memory" if i in self.memory_layers else other for i in range(self.n_layers)]


@dataclass
class MemoryState(LayerState):
    """``memory`` [B, C, D], the raw memory (attention output of the last complete chunk) not yet
    evolved; for the chunk in progress (r tokens so far): ``mem_k``/``mem_v`` [B, H, C, d], keys and
    values of the evolved memory, and ``part_k``/``part_v`` [B, H, r, d] and ``part_o`` [B, r, D] of
    its first r tokens. When r = 0, mem_k/mem_v are not read (they are recomputed from ``memory``)."""

    partial: ClassVar[dict[str, int]] = {"part_k": 2, "part_v": 2, "part_o": 1}
    memory: Tensor
    mem_k: Tensor
    mem_v: Tensor
    part_k: Tensor
    part_v: Tensor
    part_o: Tensor
    conv: Tensor | None = None  # [B, K-1, D]: the convolution's last K-1 inputs (``ConvLayer``)


class MemoryAttentionLayer(ConvLayer):
    kind, unit = "memory", "chunk"
    state_cls = MemoryState
    shift_invariant = True  # positions within a chunk, or relative to a document start

    def __init__(self, cfg: MemoryAttentionConfig) -> None:
        super().__init__(cfg)
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.wq, self.wk, self.wv, self.wo = qkvo(cfg.dim)
        if cfg.memory_qkv == "separate":
            self.wkm = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wvm = nn.Linear(cfg.dim, cfg.dim, bias=False)
        if cfg.memory_ffn:
            self.mem_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.mem_ffn = MLP(cfg.dim, cfg.hidden)
        if cfg.memory_norm:
            self.mem_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.memory_update == "gated":
            self.mem_gate = nn.Linear(2 * cfg.dim, cfg.dim)
        if cfg.memory_update == "write_gate":
            self.write_gate = WriteGate(cfg.dim)
        if cfg.init_memory == "learned":  # zero-initialised and trainable, as `train_orimem` in the code
            self.init_memory = nn.Parameter(torch.zeros(cfg.chunk_size, cfg.dim))

    @property
    def period(self) -> int:
        return self.cfg.chunk_size

    def init_extra(self, std: float) -> None:
        if self.cfg.memory_update == "gated":
            nn.init.constant_(self.mem_gate.bias, 1.0)

    def describe(self) -> str:
        update = self.cfg.memory_update
        return f"memory(C={self.period}{'' if update == 'replace' else ', ' + update})"

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> MemoryState:
        B, C, D, H, d = batch_size, self.cfg.chunk_size, self.cfg.dim, self.n_heads, self.cfg.head_dim
        z = lambda *s: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        return MemoryState(
            memory=z(B, C, D),
            mem_k=z(B, H, C, d),
            mem_v=z(B, H, C, d),
            part_k=z(B, H, 0, d),
            part_v=z(B, H, 0, d),
            part_o=z(B, 0, D),
        )

    def reset(self, state: MemoryState, fresh: Tensor) -> MemoryState:
        init = self.init_memory if self.cfg.init_memory == "learned" else torch.zeros_like(state.memory[0])
        return MemoryState(**{**state.tensors(), "memory": reset_rows(fresh, state.memory, init)})

    def evolve(self, m: Tensor) -> Tensor:
        """Eq. 2: M' = Norm(M + FFN(Norm(M))). Zero memory stays exactly zero."""
        if self.cfg.memory_ffn:
            m = m + self.mem_ffn(self.mem_ffn_norm(m))
        if self.cfg.memory_norm:
            m = self.mem_norm(m)
        return m

    def qkv_weights(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """[Wq; Wk; Wv] [3D, D] for the chunk's tokens (queries, keys and values in one matmul) and
        [Wk; Wv] [2D, D] for the memory (its rows D.. with shared memory Q/K/V). Built once per
        call, in the autocast dtype when autocast is on, so its cast is not repeated per chunk."""
        w = torch.cat((self.wq.weight, self.wk.weight, self.wv.weight))
        w_m = torch.cat((self.wkm.weight, self.wvm.weight)) if self.cfg.memory_qkv == "separate" else w[self.cfg.dim :]
        dev = x.device.type
        if torch.is_autocast_enabled(dev) and w.dtype != (low := torch.get_autocast_dtype(dev)):
            return w.to(low), w_m.to(low)
        return w, w_m

    def memory_kv(self, m: Tensor, cos: Tensor, sin: Tensor, w_kv: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys/values of the evolved memory M' = ``evolve(m)`` at RoPE positions 0..C-1: [B, H, C, d] each
        (``w_kv``: ``qkv_weights()[1]``, when the caller holds it)."""
        k, v = F.linear(m, self.qkv_weights(m)[1] if w_kv is None else w_kv).chunk(2, dim=-1)
        return apply_rope(split_heads(k, self.n_heads), cos, sin), split_heads(v, self.n_heads)

    def next_memory(self, memory: Tensor, evolved: Tensor | None, out: Tensor) -> Tensor:
        """M_{t+1} once chunk t is complete, from its raw memory M_t, its evolved memory M'_t (None:
        computed here when needed, as when an earlier call began the chunk) and its output O_t
        [B, C, D]: O_t (the paper), g * M'_t + (1 - g) * O_t (``gated``) or the write gate's."""
        if self.cfg.memory_update == "gated":
            evolved = self.evolve(memory) if evolved is None else evolved
            g = torch.sigmoid(self.mem_gate(torch.cat((evolved, out), dim=-1)))
            return g * evolved + (1 - g) * out
        if self.cfg.memory_update == "write_gate":
            return self.write_gate(memory, out)
        return out

    def tables(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """RoPE cos/sin [2C, d/2] (rows 0..C-1 memory, C..2C-1 chunk positions) and the boolean
        [C, 2C] mask over [memory; chunk] for queries at chunk offsets 0..C-1: every memory slot
        visible, chunk keys causal (offsets r..r+n-1 use ``mask[r : r + n, : C + r + n]``)."""
        C, dev = self.cfg.chunk_size, x.device
        cos, sin = rope_cos_sin(torch.arange(2 * C, device=dev), self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        j = torch.arange(C, device=dev)
        return cos, sin, torch.cat((torch.ones(C, C, dtype=torch.bool, device=dev), j[None, :] <= j[:, None]), dim=1)

    def read(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, r: int) -> Tensor:
        """The output [B, n, D] (``pre_wo``: before Wo) of the queries q [B, H, n, d] at chunk
        offsets r..r+n-1 over the keys/values k, v [B, H, C + r + n, d] of [memory; chunk]. The
        mask is the boolean table's slice on every device: PyTorch's lower-right causal bias (no
        mask tensor) failed on an H200 with torch 2.11, under the FLOP counter (a dispatch mode) and
        under bf16 autocast (it checks dtypes before autocast casts them; RoPE leaves q, k in fp32)."""
        C, n = self.cfg.chunk_size, q.shape[2]
        visible = mask[r : r + n, : C + r + n]  # all C memory slots, the chunk's keys up to each query's own
        o = merge_heads(attend(q, k, v, visible))
        if tap.active():  # the read-out: attention mass on the C memory slots
            tap.record(self, tap.attention_share(q, k, visible, C))
        return o if self.cfg.memory_source == "pre_wo" else self.wo(o)

    @compiled_region
    def whole_chunk(
        self, q: Tensor, k: Tensor, v: Tensor, memory: Tensor, cos: Tensor, sin: Tensor, w_kv: Tensor, mask: Tensor
    ) -> tuple[Tensor, ...]:
        """One whole chunk read in one call (the loop body of an aligned call): the memory M_t
        evolved (eq. 2), its keys/values (eq. 3-4), the chunk's output O_t and the next memory
        -> (O_t, keys and values of M'_t, M_{t+1}), the last left out where M_{t+1} is O_t (the
        paper's update: a region's outputs may not alias each other, nor may its inputs). A compiled region
        (``modules.compiled_region``): a compiled layer traces it once and runs the same graph for
        every chunk."""
        evolved = self.evolve(memory)
        mem_k, mem_v = self.memory_kv(evolved, cos, sin, w_kv)
        out = self.read(q, torch.cat((mem_k, k), 2), torch.cat((mem_v, v), 2), mask, 0)
        new = self.next_memory(memory, evolved, out)
        return (out, mem_k, mem_v) if new is out else (out, mem_k, mem_v, new)

    def forward(self, x: Tensor, st: MemoryState, call: Call) -> tuple[Tensor, MemoryState]:
        """x: [B, T, D] (normed) -> attention output after Wo [B, T, D] and the new state.

        Only the attention and the memory evolution run chunk by chunk (``whole_chunk`` for a
        chunk read whole; a chunk split across calls keeps its first tokens' keys, values and
        outputs in the state); the projections, RoPE (chunk positions C..2C-1, whatever chunk a
        token is in) and, for ``pre_wo`` memory, Wo run once over all T tokens."""
        C, T, H, D = self.cfg.chunk_size, x.shape[1], self.n_heads, self.cfg.dim
        cos, sin, mask = call.shared(("memory", C, x.dtype), lambda: self.tables(x))
        r0 = call.pos % C  # tokens of the current chunk read by earlier calls
        pos = C + (r0 + torch.arange(T, device=x.device)) % C
        w_qkv, w_kv_memory = self.qkv_weights(x)
        qk_x, v_x = F.linear(x, w_qkv).split((2 * D, D), dim=-1)
        q_all, k_all = apply_rope(split_heads(qk_x, 2 * H), cos[pos], sin[pos]).split(H, dim=1)  # RoPE of q, k at once
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():  # a traced region's inputs may not alias
            k_all = k_all.clone()
        v_all = split_heads(v_x, H)
        sizes = pieces(r0, T, C)
        pre_wo = self.cfg.memory_source == "pre_wo"
        memory, mem_k, mem_v, part_k, part_v, part_o = st.memory, st.mem_k, st.mem_v, st.part_k, st.part_v, st.part_o
        evolved: Tensor | None = None  # M'_t of the chunk in progress, once computed in this call
        outs: list[Tensor] = []
        for q, k_new, v_new in zip(q_all.split(sizes, 2), k_all.split(sizes, 2), v_all.split(sizes, 2)):
            r, n = part_k.shape[2], q.shape[2]
            if r == 0 and n == C:
                out, mem_k, mem_v, *new = self.whole_chunk(q, k_new, v_new, memory, cos[:C], sin[:C], w_kv_memory, mask)
                memory = new[0] if new else out
                outs.append(out)
                continue
            if r == 0:
                evolved = self.evolve(memory)
                mem_k, mem_v = self.memory_kv(evolved, cos[:C], sin[:C], w_kv_memory)
            k = torch.cat((part_k, k_new), dim=2) if r else k_new
            v = torch.cat((part_v, v_new), dim=2) if r else v_new
            out = self.read(q, torch.cat((mem_k, k), 2), torch.cat((mem_v, v), 2), mask, r)
            src = torch.cat((part_o, out), dim=1) if r else out  # the memory: o (pre_wo) or Wo o
            if r + n == C:  # chunk complete: its output becomes (or, gated, enters) the next memory
                memory, evolved = self.next_memory(memory, evolved, src), None
                B, _, _, d = k.shape  # fresh empty tensors, not views (torch.compile mishandles aliased empty outputs)
                part_k, part_v, part_o = (
                    k.new_zeros(B, H, 0, d),
                    v.new_zeros(B, H, 0, d),
                    src.new_zeros(B, 0, src.shape[2]),
                )
            else:
                part_k, part_v, part_o = k, v, src
            outs.append(out)
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return self.wo(y) if pre_wo else y, MemoryState(memory, mem_k, mem_v, part_k, part_v, part_o)


@register_layer("memory", MemoryAttentionConfig)
def memory_layer(cfg: MemoryAttentionConfig, index: int) -> Layer:
    return Block(cfg, MemoryAttentionLayer(cfg))


class MemoryAttention(StreamingLM):
    kind = "memory"


register(
    "memory_attention",
    MemoryAttentionConfig,
    MemoryAttention,
    "Memory Attention: block-wise recurrent transformer carrying a per-layer memory across chunks",
)
