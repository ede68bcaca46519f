"""Recurrent Memory Transformer (Bulatov, Kuratov, Burtsev, "Recurrent Memory Transformer",
NeurIPS 2022, §3 "Recurrent Memory Transformer", the decoder-only variant), as the authors' code
(booydar/recurrent-memory-transformer, ``MemoryCell``) runs it.

The stream is cut into segments of S tokens. Segment τ is read as one sequence of 2M + S vectors,
the memory H^mem_τ [M, D] both before the tokens (read slots) and after them (write slots):

    H~^0_τ = [H^mem_τ ; E(x_τ) ; H^mem_τ]                       (paper §3: [H^mem ∘ H ∘ H^mem])
    H~^n_τ = Block_n(H~^{n-1}_τ),  n = 1..N                     (pre-norm blocks, one causal mask)
    H^mem_{τ+1} = Norm(H~^N_τ[M + S :])                         (the write slots' final outputs)
    logits_τ = E^T Norm(H~^N_τ[M : M + S])

with one plain causal mask over the 2M + S positions, as the decoder's own mask in the authors'
code: every token sees every read slot and the tokens before it, the write slots see the read
slots, the whole segment and the write slots before them, the read slots see the read slots
before them. H^mem_1 is a learned parameter (``init_memory``, N(0, init_std) like the embeddings,
as the authors' memory). Positions: RoPE at the position inside the extended segment
(read 0..M-1, tokens M..M+S-1, write M+S..2M+S-1), restarting every segment as the authors'
absolute positions do, so no position exceeds 2M+S-1 at any length and the write slots are told
apart from the read slots by position alone. The new memory is taken after the final RMSNorm, as
both the authors' code (GPT-2's ln_f output) and lucidrains' recurrent-memory-transformer-pytorch
take it. Choices of lucidrains' code not taken (the paper has none of them): separate learned write
tokens with a learned read-slot embedding, bidirectional attention among memory slots, a learned
null key/value per layer, value residuals and hyper-connections; its Memory Replay BackProp is a
memory-saving training schedule, not a model change (here ``train.seq_len`` x ``train.truncation``
tokens backpropagate together, as the authors' k2 segments).

Streaming, exactly: a token depends only on the read memory and the tokens before it in its
segment, so each layer keeps the keys/values of [read slots; tokens so far] of the current segment
(at most M + S - 1 positions: constant memory). A call runs piece by piece (``pieces``): a piece
that starts a segment is preceded by the read slots, one that completes it is followed by the
write slots, and the piece runs through all layers against the caches; a whole segment is
therefore the paper's single pass. One new token costs, per layer, its projections and MLP plus
attention over M + r + 1 keys (r: its offset in the segment), O(D^2 + (M + r) D); the segment's
first token also runs the M read slots (through every layer but the last, where only their keys
and values are read: their outputs there would be read by nothing), its last the M write slots
(attending over 2M + S keys) through every layer. Gradients flow across segments through the
memory until the trainer detaches the state (the TBPTT boundary). A row can be reset (to
``init_memory``) only at a segment boundary.

The memory slots pass through every layer, so every layer of the stack is an 'rmt' layer: a
hybrid stack with 'full' or 'window' layers is refused (such a layer has no way to read the slots).

``qkv_conv: K`` passes each layer's (normed) input over the extended segment through a short
causal convolution before q/k/v (``nn.ConvConfig``). The convolution restarts with every segment,
as the positions do; the state keeps the segment's last K-1 inputs (``conv``).

``memory_update: write_gate`` holds the memory unless the segment opens a gate (``WriteGate``,
closed at initialisation; ``RMT.next_memory``), so the keep path carries no norm gain:

    N_τ = Norm(H~^N_τ[M + S :]),   g = sigmoid(W_g N_τ + b_g),   H^mem_{τ+1} = H^mem_τ + g * (N_τ - H^mem_τ)

``associative: true`` is the Associative Recurrent Memory Transformer (``armt.py``): what crosses
a segment boundary is then each layer's fast-weight matrix instead of the memory slots. The two
differ in that alone, so an RMT holds it as one part (``SegmentMemory``: this file's ``Slots``,
ARMT's ``AssociativeMemory``) that its layers and its segment loop ask, never a branch of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
from torch import Tensor, nn

from .. import tap
from ..config import RecurformerError, option
from ..modules import (
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
class RMTConfig(ConvConfig):
    context_field = "segment_len"
    segment_len: int = option(128, range=">= 1")  # S: tokens per segment
    memory_size: int = option(16, range=">= 1")  # M: memory slots (read and write)
    associative: bool = False  # ARMT: a fast-weight matrix per layer, written by the write slots
    assoc_dim: int = option(32, range=">= 1")  # d_mem: ARMT's key/query width before the DPFP feature map (K = 6 d_mem)
    memory_update: Literal["replace", "write_gate"] = "replace"  # the new memory as written, or held by a gate
    read_slots: bool = True  # M read slots before the tokens (false: write slots only, as ARMT's code)

    @property
    def n_read(self) -> int:
        """R: the read slots before the tokens (M, or 0 with ``read_slots: false``)."""
        return self.memory_size if self.read_slots else 0

    def __post_init__(self) -> None:
        super().__post_init__()
        memory_class(self).check(self)
        other = [k for k in self.layers or [] if k != "rmt"]
        if other:
            raise RecurformerError(
                f"config key 'layers' names '{other[0]}': an RMT runs its memory slots through every layer, so every layer is 'rmt'"
            )


@dataclass
class RMTState(LayerState):
    """``k``/``v`` [B, H, c, d]: keys/values (rotated) of the current segment's read slots and
    tokens read so far, c = R + r after r tokens (R: the read slots, M or 0), c = 0 at a segment boundary (the read slots run
    with the segment's first token); ``memory`` [B, M, D] (layer 0 only, not ``associative``): the
    memory of the current segment, the stack's input at the read and the write slots; ``assoc``
    [B, K, D] and ``assoc_z`` [B, K] (``associative`` only): the layer's fast-weight matrix A and
    normaliser z, as written by the segments before the current one; ``conv`` [B, K-1, D]
    (``ConvLayer``): the layer's last K-1 inputs of the current extended segment (zeros at its
    start)."""

    cache: ClassVar[dict[str, int]] = {"k": 2, "v": 2}
    k: Tensor
    v: Tensor
    memory: Tensor | None = None
    assoc: Tensor | None = None
    assoc_z: Tensor | None = None
    conv: Tensor | None = None


class RMTAttention(ConvLayer):
    """Causal self-attention of new positions over the cached ones: the positions of x [B, n, D]
    are c..c+n-1, c the cache length (their place in the extended segment), and each sees the
    cache and the new positions up to itself."""

    kind, unit = "rmt", "segment"
    state_cls = RMTState
    shift_invariant = True  # positions within a chunk, or relative to a document start

    def __init__(self, cfg: RMTConfig, index: int) -> None:
        super().__init__(cfg)
        self.cfg, self.index = cfg, index
        self.memory = memory_of(cfg)  # what crosses a segment boundary (not a module: no parameters)
        self.wq, self.wk, self.wv, self.wo = qkvo(cfg.dim)

    @property
    def period(self) -> int:
        return self.cfg.segment_len

    def describe(self) -> str:
        return f"rmt(S={self.cfg.segment_len}, M={self.cfg.memory_size})"

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> RMTState:
        c = self.cfg
        z = torch.zeros(batch_size, c.n_heads, 0, c.head_dim, device=device, dtype=dtype)
        return self.memory.layer_state(RMTState(k=z, v=z), self.index, batch_size, device, dtype)

    def reset(self, state: RMTState, fresh: Tensor) -> RMTState:
        """The fresh rows' part of the segment memory back at a document start (the KV cache is
        empty at a segment boundary, and layer 0's memory slots are reset by the model)."""
        return self.memory.reset(state, fresh)

    def check_state(self, state: LayerState, pos: int) -> str | None:
        if (why := super().check_state(state, pos)) is not None:
            return why
        r = pos % self.period
        want = self.cfg.n_read + r if r else 0
        got = state.k.shape[2]  # type: ignore[attr-defined]
        if got != want or state.v.shape[2] != want:  # type: ignore[attr-defined]
            return f"'k' holds {got} positions, expected {want} (the {self.cfg.n_read} read slots and {r} tokens)"
        return None

    def tables(self, c: int, n: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """RoPE cos/sin of positions c..c+n-1 and the boolean mask [n, c+n] (None: plain causal
        from position 0, or one query that sees every key)."""
        cos, sin = rope_cos_sin(
            torch.arange(c, c + n, device=x.device), self.cfg.head_dim, self.cfg.rope_theta, x.dtype
        )
        if c == 0 or n == 1:
            return cos, sin, None
        i, j = torch.arange(n, device=x.device)[:, None], torch.arange(c + n, device=x.device)[None, :]
        return cos, sin, j <= c + i

    def forward(self, x: Tensor, state: RMTState, call: Call) -> tuple[Tensor, RMTState]:
        """The attention output of the rows of x [B, n, D] from ``a`` on: a = M in the last layer
        when the piece starts a segment (its first M rows, the read slots, are read after the last
        layer by nothing, and in it only as keys/values; ``Block`` adds the output to the last
        rows), a = 0 otherwise."""
        R, S, H, c, n = self.cfg.n_read, self.cfg.segment_len, self.cfg.n_heads, state.k.shape[2], x.shape[1]
        a = R if c == 0 and self.index == self.cfg.n_layers - 1 else 0
        cos, sin, mask = call.shared(("rmt", c, n, x.dtype), lambda: self.tables(c, n, x))
        k, v = apply_rope(split_heads(self.wk(x), H), cos, sin), split_heads(self.wv(x), H)
        if c:  # a cache to continue (a piece that starts a segment has none)
            k, v = torch.cat((state.k, k), dim=2), torch.cat((state.v, v), dim=2)
        if a:
            cos, sin, mask = call.shared(("rmt", c + a, n - a, x.dtype), lambda: self.tables(c + a, n - a, x))
        q = apply_rope(split_heads(self.wq(x[:, a:]), H), cos, sin)
        o = attend(q, k, v, mask, causal=c + a == 0)
        if tap.active():  # the read-out: the tokens' attention mass on the M read slots
            p = torch.arange(c + a, c + n, device=x.device)
            tokens = (p >= R) & (p < R + S)
            vis = torch.arange(c + n, device=x.device)[None, :] <= p[:, None]
            tap.record(self, tap.attention_share(q[:, :, tokens], k, vis[tokens], R))
        return self.wo(merge_heads(o)), dataclasses.replace(state, k=k, v=v)


def with_memory(state: LayerState, memory: Tensor) -> RMTState:
    """Layer 0's state with the memory of the current segment replaced."""
    assert isinstance(state, RMTState)
    return dataclasses.replace(state, memory=memory)


class SegmentMemory:
    """What crosses a segment boundary in an RMT, and where the model reads and writes it: the plain
    RMT's memory slots (``Slots``: layer 0's state holds them, the write slots' outputs become the
    next segment's) or ARMT's fast weights (``armt.AssociativeMemory``). ``memory_of`` picks it
    from the config (``SEGMENT_MEMORIES``)."""

    def __init__(self, cfg: RMTConfig) -> None:
        self.cfg = cfg

    @classmethod
    def check(cls, cfg: RMTConfig) -> None:
        """One line if ``cfg`` asks of this memory what it cannot do (``RMTConfig`` asks, as it is built)."""

    def layer_state(self, state: RMTState, index: int, batch_size: int, device: Any, dtype: torch.dtype) -> RMTState:
        """Layer ``index``'s state at a document start, from ``state`` (its empty caches)."""
        raise NotImplementedError

    def reset(self, state: RMTState, fresh: Tensor) -> RMTState:
        """A layer's state with the rows ``fresh`` back at a document start (its own part only)."""
        return state

    def block(self, mixer: RMTAttention) -> Layer:
        """The block around one layer's attention."""
        return Block(self.cfg, mixer)

    def slots(
        self, model: RMT, layers: list[LayerState], fresh: Tensor, dtype: torch.dtype
    ) -> tuple[Tensor, list[LayerState]]:
        """The memory slots [B, M, D] of the current segment and the layers' states that hold them."""
        raise NotImplementedError

    def carried(self, layers: list[LayerState]) -> list[Tensor]:
        """The tensors a whole segment (``RMT.segment``, a compiled region) reads and writes."""
        return []

    def segment_state(self, carried: list[Tensor], index: int) -> dict[str, Tensor]:
        """Layer ``index``'s fields of its state inside ``RMT.segment``, from ``carried``."""
        return {}

    def carry_out(self, state: LayerState) -> list[Tensor]:
        """What layer's state after ``RMT.segment`` hands on (``carried``'s part of it)."""
        return []

    def take(self, layers: list[LayerState], carried: list[Tensor]) -> list[LayerState]:
        """The layers' states with what ``RMT.segment`` handed on."""
        return layers

    def next_segment(
        self, model: RMT, memory: Tensor, slots: Tensor, blank: list[LayerState], layers: list[LayerState]
    ) -> tuple[Tensor, list[LayerState]]:
        """After a segment's write slots [B, M, D] (last-layer outputs): the next segment's memory
        slots and the layers' states (``blank``: empty caches)."""
        raise NotImplementedError

    def numbers(self) -> tuple[int, str]:
        """The numbers a row carries across segments, and in words."""
        raise NotImplementedError


class Slots(SegmentMemory):
    """The RMT's memory slots: layer 0's state holds the memory of the current segment (reset to
    ``init_memory``), and the write slots' final outputs become the next one (``RMT.next_memory``)."""

    @classmethod
    def check(cls, cfg: RMTConfig) -> None:
        if not cfg.read_slots:
            raise RecurformerError(
                "config key 'read_slots' is false, but a plain RMT reads its memory only through its read slots (set associative: true, which reads A from every row)"
            )

    def layer_state(self, state: RMTState, index: int, batch_size: int, device: Any, dtype: torch.dtype) -> RMTState:
        c = self.cfg
        memory = torch.zeros(batch_size, c.memory_size, c.dim, device=device, dtype=dtype) if index == 0 else None
        return dataclasses.replace(state, memory=memory)

    def slots(
        self, model: RMT, layers: list[LayerState], fresh: Tensor, dtype: torch.dtype
    ) -> tuple[Tensor, list[LayerState]]:
        # init_memory enters every call's graph (with no fresh row, with a zero gradient), so
        # that DDP finds every parameter used
        memory = reset_rows(fresh, getattr(layers[0], "memory"), model.init_memory)
        return memory, [with_memory(layers[0], memory), *layers[1:]]

    def next_segment(
        self, model: RMT, memory: Tensor, slots: Tensor, blank: list[LayerState], layers: list[LayerState]
    ) -> tuple[Tensor, list[LayerState]]:
        memory = model.next_memory(memory, slots)
        return memory, [with_memory(blank[0], memory), *blank[1:]]

    def numbers(self) -> tuple[int, str]:
        return self.cfg.memory_size * self.cfg.dim, "memory M × d"


SEGMENT_MEMORIES: dict[str, type[SegmentMemory]] = {"slots": Slots}  # armt.py adds "associative"


def memory_class(cfg: RMTConfig) -> type[SegmentMemory]:
    """The kind of part that ``cfg`` carries across segments."""
    return SEGMENT_MEMORIES["associative" if cfg.associative else "slots"]


def memory_of(cfg: RMTConfig) -> SegmentMemory:
    """The part of an RMT that ``cfg`` carries across segments."""
    return memory_class(cfg)(cfg)


@register_layer("rmt", RMTConfig)
def rmt_layer(cfg: RMTConfig, index: int) -> Layer:
    mixer = RMTAttention(cfg, index)
    return mixer.memory.block(mixer)


class RMT(StreamingLM):
    kind = "rmt"
    config: RMTConfig
    norm: RMSNorm

    def __init__(self, config: RMTConfig) -> None:
        super().__init__(config)
        self.init_memory = nn.Parameter(torch.randn(config.memory_size, config.dim) * config.init_std)
        self.memory = memory_of(config)  # what crosses a segment boundary (``SegmentMemory``)
        self.write_gate = WriteGate(config.dim) if config.memory_update == "write_gate" else None
        if self.write_gate is not None:  # built after the model's init_weights, so initialised here as it would be
            nn.init.normal_(self.write_gate.proj.weight, 0.0, config.init_std)
            self.write_gate.init_extra(config.init_std)

    def layer_pass(
        self, h: Tensor, layers: list[LayerState], fresh: Tensor, call: Call
    ) -> tuple[Tensor, list[LayerState]]:
        """The layers over h [B, T, D], piece by piece: [read slots;] tokens [; write slots]
        through the whole stack, then, at a segment end, the new memory and empty caches (the
        fresh rows' memory is ``init_memory``; ``StreamingLM.body`` has reset their A and z)."""
        S, M, R, pos = self.config.segment_len, self.config.memory_size, self.config.n_read, call.pos
        B, ns = h.shape[0], pieces(pos % S, h.shape[1], S)
        memory, layers = self.memory.slots(self, list(layers), fresh, h.dtype)
        blank = None  # the states of a segment start, built once per call
        outs, a = [], 0
        for hp, n in zip(h.split(ns, dim=1), ns, strict=True):  # split: its gradient is one cat
            r, done = (pos + a) % S, (pos + a) % S + n == S
            x = torch.cat([memory] * (r == 0 and R > 0) + [hp] + [memory] * done, dim=1)
            if r == 0 and done:  # a whole segment: one compiled region
                x, carried = self.segment(x, call.start, self.segment_tables(x, call), self.memory.carried(layers))
                layers = self.memory.take(layers, carried)
            else:
                piece = dataclasses.replace(call, pos=pos + a)
                for i, (layer, s) in enumerate(zip(self.layers, layers)):
                    x, layers[i] = layer(x, s, piece)
            # the last layer answers for the tokens [and the write slots] only
            out, slots = x.split((n, M), dim=1) if done else (x, None)
            outs.append(out)
            if slots is not None:  # the write slots' outputs are the next memory (or in A); the caches start over
                if blank is None:
                    blank = [layer.init_state(B, h.device, self.tok_emb.weight.dtype) for layer in self.layers]
                memory, layers = self.memory.next_segment(self, memory, slots, blank, layers)
            a += n
        return (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]), layers

    def segment_tables(self, x: Tensor, call: Call) -> list[Tensor]:
        """The RoPE tables of a whole segment x [B, R + S + M, D] (made once per call): cos/sin of
        positions 0..R+S+M-1, and, with read slots (R > 0), of R.. with the mask, for the last
        layer's queries."""
        R, L = self.config.n_read, x.shape[1]
        attn = cast(RMTAttention, cast(Block, self.layers[0]).attn)
        cos, sin, _ = call.shared(("rmt", 0, L, x.dtype), lambda: attn.tables(0, L, x))
        if not R:
            return [cos, sin]
        cos_q, sin_q, mask = call.shared(("rmt", R, L - R, x.dtype), lambda: attn.tables(R, L - R, x))
        assert mask is not None
        return [cos, sin, cos_q, sin_q, mask]

    @compiled_region
    def segment(
        self, x: Tensor, start: Tensor, tables: list[Tensor], carried: list[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """A whole segment x = [read slots; S tokens; write slots] [B, R + S + M, D] through the stack
        from empty caches -> the last layer's outputs at the tokens and write slots [B, S + M, D],
        and what the segment memory hands on (``carried``: ARMT's A_0, z_0, A_1, ...; nothing for
        the memory slots, which leave through the write slots' outputs). A compiled region (``modules.compiled_region``): a compiled model
        traces it once and runs the same graph for every segment. The layers read no position from the call
        (an RMT's positions restart every segment), only ``tables`` (``segment_tables``)."""
        c, (B, L, _) = self.config, x.shape
        R, dtype = c.n_read, x.dtype
        memo: dict[tuple, tuple[Tensor, Tensor, Tensor | None]] = {("rmt", 0, L, dtype): (tables[0], tables[1], None)}
        if R:
            memo[("rmt", R, L - R, dtype)] = (tables[2], tables[3], tables[4])
        call = Call(0, start, memo=memo)
        empty = x.new_empty(B, c.n_heads, 0, c.head_dim)
        out = []
        for i, layer in enumerate(self.layers):
            x, s = layer(x, RMTState(k=empty, v=empty, **self.memory.segment_state(carried, i)), call)
            out += self.memory.carry_out(s)
        return x, out

    def next_memory(self, memory: Tensor, out: Tensor) -> Tensor:
        """The memory of the next segment from this one's and the write slots' last-layer outputs
        [B, M, D]: Norm(out) (the paper), or with ``memory_update: write_gate`` that write held
        by ``WriteGate``: memory + g * (Norm(out) - memory), g = sigmoid(W_g Norm(out) + b_g)."""
        new = self.norm(out)
        return new if self.write_gate is None else self.write_gate(memory, new)

    def info_lines(self) -> list[str]:
        c = self.config
        S, M, R, N, D = c.segment_len, c.memory_size, c.n_read, c.n_layers, c.dim
        carried, what = self.memory.numbers()
        conv = c.conv_floats
        most = carried + 2 * (R + S - 1) * D * N + conv
        read = f"{R} read slots; " if R else ""
        return super().info_lines() + [
            f"segment S = {S}, memory M = {M}: each segment is read as [{read}S tokens; M write slots], RoPE positions 0..{R + S + M - 1}",
            f"state per row: {what} = {carried:,} + K/V of [{read}tokens so far] ≤ 2 × ({R} + S - 1) × d × layers"
            f" = {most - carried - conv:,}{f' + convolution inputs {conv:,}' if conv else ''},"
            f" at most {most:,} floats ({4 * most / 2**20:.2f} MiB at fp32), the same at any length",
        ]


register("rmt", RMTConfig, RMT, "Recurrent Memory Transformer: memory slots read and written around every segment")
