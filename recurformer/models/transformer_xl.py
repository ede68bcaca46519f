"""Transformer-XL (Dai et al. 2019, "Transformer-XL: Attentive Language Models Beyond a
Fixed-Length Context", §3.2 segment-level recurrence, §3.3 relative positional encodings).

The stream is cut into segments of L tokens. Layer n of segment τ attends over its own input for
the last M positions before the segment (the memory, with stop-gradient) followed by the segment:

    h~_τ^{n-1} = StopGrad(h_{τ-1}^{n-1}) ∘ h_τ^{n-1}           (memory: last M inputs of layer n)
    q = W_q h_τ^{n-1},   k = W_{k,E} h~_τ^{n-1},   v = W_v h~_τ^{n-1}
    score[i, j] = (q_i + u)·k_j + (q_i + v)·W_{k,R} R_{i-j}     (terms (a)+(c), (b)+(d); /sqrt(d_head))

Queries come from the segment only; every (valid) memory position is visible and the segment is
causal. R_δ is the sinusoid of the distance δ (base ``rope_theta``), capped at ``clamp_len``;
u, v are learned per layer and head; (b)+(d) use the relative shift (``ops/relative.py``). With
``same_length`` every query sees exactly the last M keys (itself included), as in the original
evaluation. The layer sits in the library's pre-norm RMSNorm + SwiGLU block, so that comparisons
isolate the recurrence and the position scheme (the paper uses post-LayerNorm + ReLU):

    y = x + W_o RelAttn(n(x), n(memory)),   out = y + SwiGLU(n(y)),   n = RMSNorm

The memory holds the normed inputs n(h^{n-1}) of the layer (the stop-gradient covers the norm's
gain too). Positions before the start of a document are masked. The layer state holds the memory
of the current segment and the layer's normed inputs for the segment's tokens read so far, so
whole == chunked == stepwise. Gradients flow inside a segment (also across calls, until the trainer
detaches the state); the memory never carries gradient. A row can be reset only at a segment
boundary (segments are aligned across the batch).

As the memory of layer n holds the layer's own inputs, not its outputs, no segment waits for the
previous one's computation. With autograd a call projects q, k, v and the output once over all
its positions (a position read both in its segment and as memory has one key/value, whose
gradient from the memory reaches W_{k,E} and W_v but not the input: ``memory_rows``) and attends
all its whole segments as one batch of windows [memory; segment]; a segment continued from the
previous call, a partial one at the end and a fresh stream's first segments (whose memory slots
before the document start are neither projected nor attended) are windows of their own. Without
autograd (decoding) the keys/values of the memory and of the segment so far are kept
(``XLRoom``), and the call is attended piece by piece.

``qkv_conv: K`` passes each layer's (normed) input through a short causal convolution before q/k/v
(``nn.ConvConfig``); the memory then holds the convolved inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from ..config import RecurformerError, option
from ..modules import pieces, split_heads
from ..nn import Block, ConvConfig, ConvLayer, StreamingLM
from ..ops.relative import relative_scores, sinusoid_table
from ..registry import register, register_layer
from ..stack import Layer
from ..state import Call, LayerState, reset_rows, writable


@dataclass
class TransformerXLConfig(ConvConfig):
    context_field = "segment_len"
    segment_len: int = option(64, range=">= 1")  # L: tokens per segment
    mem_len: int | None = option(None, range=">= 0")  # M: cached positions per layer (None: M = L; 0: no recurrence)
    clamp_len: int | None = option(None, range=">= 0")  # distances beyond clamp_len use R_clamp_len (None: no cap)
    same_length: bool = False  # every query sees exactly the last M keys

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.same_length and self.memory_len == 0:
            raise RecurformerError("same_length needs mem_len >= 1 (a query would see no key)")

    @property
    def memory_len(self) -> int:
        return self.segment_len if self.mem_len is None else self.mem_len


def identity(t: Tensor) -> tuple:
    """What tells a live tensor from every other one: its memory, layout and type."""
    return t.data_ptr(), t.device, t.dtype, t.shape, t.stride()


class _MemoryRows(torch.autograd.Function):
    """y = x W^T, already computed (``y``, no graph), with the gradient of StopGrad(x) W^T:
    dW = dy^T x, none for x."""

    @staticmethod
    def forward(y: Tensor, x: Tensor, w: Tensor) -> Tensor:
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[1])
        ctx.w_dtype = inputs[2].dtype

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[None, None, Tensor]:
        (x,) = ctx.saved_tensors  # (under autocast, the product in dy's dtype as autograd's own)
        return None, None, (dy.flatten(0, -2).T @ x.flatten(0, -2).to(dy.dtype)).to(ctx.w_dtype)


def memory_rows(y: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """The keys (or values) y = x W^T of positions as read from the memory, StopGrad(x) W^T: the
    gradient reaches W, not x. They share the projection of the inputs x (with autograd, read in
    their own segment), where projecting the detached inputs again would double its cost."""
    return cast(Tensor, _MemoryRows.apply(y.detach(), x.detach(), w))


@dataclass(eq=False)
class XLRoom:
    """While decoding without autograd: the keys/values [B, H, M+L, d] of the memory (positions
    0..M-1) and of the current segment's tokens read so far (from M on), and the position terms
    ``rel`` = W_{k,R} R_δ [H, M+L, d]. A call then projects only its own tokens, O(D^2) per token
    instead of O((M+L) D^2) for the whole memory, segment and distance table again.

    ``held`` identifies the state the room is up to date with, ``weights`` the projections it was
    computed with (data pointer and version counter: an in-place change through ``.data`` escapes
    it, as it escapes autograd)."""

    k: Tensor
    v: Tensor
    rel: Tensor
    weights: tuple
    held: tuple = ()

    def fits(self, state: "XLState") -> bool:
        return self.held == (identity(state.mem), identity(state.seg))

    def write(self, at: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Put the keys/values [B, H, n, d] of n new tokens at position ``at``; the keys/values
        of positions 0..at+n-1."""
        n = k.shape[2]
        self.k[:, :, at : at + n], self.v[:, :, at : at + n] = k, v
        return self.k[:, :, : at + n], self.v[:, :, : at + n]

    def next_segment(self, L: int, M: int) -> None:
        """The segment is complete: the last M of its memory + segment positions become the memory."""
        self.k[:, :, :M], self.v[:, :, :M] = self.k[:, :, L : L + M].clone(), self.v[:, :, L : L + M].clone()


@dataclass
class XLState(LayerState):
    """``mem`` [B, M, D]: the layer's normed inputs at the M positions before the current segment
    (detached; zeros before the document start, where they are masked); ``seg`` [B, r, D]: its
    normed inputs for the r tokens of the current segment read so far; ``room``: their projections
    while decoding (``XLRoom``)."""

    partial: ClassVar[dict[str, int]] = {"seg": 1}
    runtime: ClassVar[tuple[str, ...]] = ("room",)
    mem: Tensor
    seg: Tensor
    room: XLRoom | None = field(default=None, repr=False, compare=False)
    conv: Tensor | None = None  # [B, K-1, D]: the convolution's last K-1 inputs (``ConvLayer``)


class RelAttention(ConvLayer):
    kind, unit = "xl", "segment"
    state_cls = XLState
    shift_invariant = True  # positions within a chunk, or relative to a document start

    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__(cfg)
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.scale = cfg.head_dim**-0.5
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)  # W_{k,E}
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wr = nn.Linear(cfg.dim, cfg.dim, bias=False)  # W_{k,R}
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.u = nn.Parameter(torch.zeros(cfg.n_heads, cfg.head_dim))  # global content bias
        self.v = nn.Parameter(torch.zeros(cfg.n_heads, cfg.head_dim))  # global position bias

    @property
    def period(self) -> int:
        return self.cfg.segment_len

    def describe(self) -> str:
        return f"xl(L={self.cfg.segment_len}, M={self.cfg.memory_len})"

    def reach(self, q: int) -> int | None:
        """Each layer reaches back to the memory of the query's segment, S(q) - M (with
        same_length: q - (M-1))."""
        c = self.cfg
        return q - (c.memory_len - 1) if c.same_length else (q // c.segment_len) * c.segment_len - c.memory_len

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> XLState:
        z = lambda n: torch.zeros(batch_size, n, self.cfg.dim, device=device, dtype=dtype)  # noqa: E731
        return XLState(mem=z(self.cfg.memory_len), seg=z(0))

    def reset(self, state: XLState, fresh: Tensor) -> XLState:
        return XLState(mem=reset_rows(fresh, state.mem, torch.zeros_like(state.mem[0])), seg=state.seg)

    def mask(self, call: Call, start: int, N: int, r: int, n: int) -> Tensor:
        """[B, N, 1, n, M+r+n] bool for N windows of segments from position ``start`` on, L apart:
        query i (segment offset r+i) sees key j (segment offset j-M) iff the distance
        δ = M + r + i - j is >= 0, the key is in the row's document (j >= M - valid, valid: the
        memory slots from the row's document start on), and, with same_length, δ < M."""
        L, M, dev = self.cfg.segment_len, self.cfg.memory_len, call.start.device
        valid = (start + L * torch.arange(N, device=dev) - call.start[:, None]).clamp(0, M)  # [B, N]
        i = torch.arange(n, device=dev)[:, None]
        j = torch.arange(M + r + n, device=dev)[None, :]
        d = M + r + i - j
        vis = d >= 0
        if self.cfg.same_length:
            vis = vis & (d < M)
        return (vis & (j >= (M - valid)[..., None, None])).unsqueeze(2)

    def positions(self, x: Tensor) -> Tensor:
        """The sinusoid R_δ [M+L, D] for every distance a piece can see, capped at clamp_len."""
        c = self.cfg
        dist = torch.arange(c.memory_len + c.segment_len, device=x.device)
        if c.clamp_len is not None:
            dist = dist.clamp(max=c.clamp_len)
        return sinusoid_table(dist, c.dim, c.rope_theta, x.dtype)

    def rel(self, x: Tensor, call: Call) -> Tensor:
        """W_{k,R} R_δ [H, M+L, d] for δ = 0..M+L-1."""
        c = self.cfg
        pos_emb = call.shared(("xl-R", c.segment_len, c.memory_len, x.dtype), lambda: self.positions(x))
        return self.wr(pos_emb).view(c.memory_len + c.segment_len, self.n_heads, c.head_dim).transpose(0, 1)

    def room(self, st: XLState, x: Tensor, call: Call) -> XLRoom:
        """``st``'s room if it is up to date with ``st`` and the weights, else a new one: the
        memory and the segment so far projected once."""
        weights = tuple((w.data_ptr(), w._version) for w in (self.wk.weight, self.wv.weight, self.wr.weight))
        room = st.room
        if (
            room is not None
            and room.fits(st)
            and room.weights == weights
            and room.k.dtype == x.dtype
            and writable(room.k)
        ):
            return room
        c, H = self.cfg, self.n_heads
        ctx = torch.cat((st.mem, st.seg), dim=1)
        empty = lambda: x.new_empty(x.shape[0], H, c.memory_len + c.segment_len, c.head_dim)  # noqa: E731
        room = XLRoom(k=empty(), v=empty(), rel=self.rel(x, call), weights=weights)
        room.write(0, split_heads(self.wk(ctx), H), split_heads(self.wv(ctx), H))
        return room

    def runs(self, call: Call, T: int, batch: bool) -> list[tuple[int, int, int, int, int]]:
        """The call's pieces (``pieces``) as runs (a, N, r, n, drop): N pieces of n tokens from
        token a on, the first of them continuing a segment of which r tokens were read, each
        window without its first ``drop`` memory slots (before every row's document start: a
        fresh stream's first segments, neither projected nor attended). With ``batch``,
        consecutive whole segments that drop nothing form one run, attended in one batched op."""
        L, M = self.cfg.segment_len, self.cfg.memory_len
        out: list[tuple[int, int, int, int, int]] = []
        a = 0
        for n in pieces(call.pos % L, T, L):
            r = (call.pos + a) % L
            drop = 0 if call.start_floor is None else min(M, max(M - (call.pos + a - r - call.start_floor), 0))
            if batch and (r, n, drop) == (0, L, 0) and out and out[-1][2:] == (0, L, 0):
                out[-1] = (out[-1][0], out[-1][1] + 1, 0, L, 0)
            else:
                out.append((a, 1, r, n, drop))
            a += n
        return out

    def windows(self, mem: Tensor, live: Tensor, N: int) -> Tensor:
        """Keys (or values) of N windows [B, N, H, m + l, d] from mem [B, (N-1)L + m, D] and live
        [B, N·l, D]: window i holds the m memory slots ``mem[:, iL : iL + m]`` followed by the
        l segment tokens ``live[:, il : (i+1)l]``."""
        L, H, d = self.cfg.segment_len, self.n_heads, self.cfg.head_dim
        slots = mem.unfold(1, mem.shape[1] - (N - 1) * L, L).unflatten(2, (H, d)).transpose(-1, -2)  # [B, N, H, m, d]
        return torch.cat((slots, live.unflatten(1, (N, -1)).unflatten(-1, (H, d)).transpose(2, 3)), dim=3)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, rel: Tensor, mask: Tensor) -> Tensor:
        """q [B, N, H, n, d] (the queries of N windows), k, v [B, N, H, K, d] (each window's
        [memory; segment so far; queries' tokens]), rel [H, K, d] (W_{k,R} R_δ, δ = 0..K-1),
        mask [B, N, 1, n, K] bool -> [B, N·n, D] (before W_o)."""
        s = relative_scores(q, k, rel, self.u, self.v) * self.scale  # [B, N, H, n, K]
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return (p @ v).transpose(2, 3).flatten(1, 2).flatten(2)

    def forward(self, x: Tensor, st: XLState, call: Call) -> tuple[Tensor, XLState]:
        """x [B, T, D] (normed) -> attention output [B, T, D]. The projections run once over the
        call: with autograd, the keys/values of every position the call reads (those read as
        memory with the gradient of the detached inputs: ``memory_rows``), and the whole
        segments of the call are attended as one batch of windows. Without autograd the
        keys/values of earlier positions come from the room and the call is attended piece by
        piece."""
        c = self.cfg
        L, M, T, H = c.segment_len, c.memory_len, x.shape[1], self.n_heads
        room = None if torch.is_grad_enabled() else self.room(st, x, call)
        rel = self.rel(x, call) if room is None else room.rel
        mem, seg, r0 = st.mem, st.seg, st.seg.shape[1]
        live = torch.cat((seg, x), dim=1) if r0 else x  # the inputs from the current segment's start on
        runs = self.runs(call, T, batch=room is None)
        d0, last = runs[0][4], (r0 + T - 1) // L * L  # memory slots no window reads; the last segment's start in live
        if room is None:  # keys/values of the memory slots read and of the live inputs; those of slots
            # and inputs that windows read as memory pass their gradient to W only (StopGrad)
            ctx, m = torch.cat((mem[:, d0:], live), dim=1), M - d0 + last
            k, v = self.wk(ctx), self.wv(ctx)
            km, vm = (memory_rows(y[:, :m], ctx[:, :m], w.weight) for y, w in ((k, self.wk), (v, self.wv)))
            kl, vl = k[:, M - d0 :], v[:, M - d0 :]
        else:  # the keys/values of the memory and of the segment so far are in the room
            kl, vl = self.wk(x), self.wv(x)
        q, outs = self.wq(x).unflatten(-1, (H, c.head_dim)), []
        for a, N, r, n, drop in runs:
            s = a + r0 - r  # the run's first segment starts at live[:, s], at km[:, s + M - d0]
            if room is None:
                mrows, lrows = slice(s + drop - d0, s + M - d0 + (N - 1) * L), slice(s, s + N * (r + n))
                k, v = self.windows(km[:, mrows], kl[:, lrows], N), self.windows(vm[:, mrows], vl[:, lrows], N)
            else:
                k, v = room.write(M + r, split_heads(kl[:, a : a + n], H), split_heads(vl[:, a : a + n], H))
                k, v = k[:, None, :, drop:], v[:, None, :, drop:]
            mask = call.shared(("xl-mask", L, M, a, N), lambda: self.mask(call, call.pos + s - r0, N, r, n))
            qa = q[:, a : a + N * n].unflatten(1, (N, n)).transpose(2, 3)
            outs.append(self.attention(qa, k, v, rel[:, : M - drop + r + n], mask[..., drop:]))
            if room is not None and r + n == L:  # segment complete: its keys/values become the memory's
                room.next_segment(L, M)
        done = (r0 + T) // L * L  # the live inputs in complete segments
        if done:  # the last M of them become the memory (stop-gradient)
            mem = torch.cat((mem[:, min(done, M) :], live[:, max(done - M, 0) : done]), dim=1).detach()
        seg = live[:, done:].clone() if done else live
        new = XLState(mem=mem, seg=seg, room=room)
        if room is not None:
            room.held = (identity(mem), identity(seg))
        return self.wo(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]), new


@register_layer("xl", TransformerXLConfig)
def xl_layer(cfg: TransformerXLConfig, index: int) -> Layer:
    return Block(cfg, RelAttention(cfg))


class TransformerXL(StreamingLM):
    kind = "xl"
    config: TransformerXLConfig

    def info_lines(self) -> list[str]:
        c = self.config
        L, M, N, D = c.segment_len, c.memory_len, c.n_layers, c.dim
        per_row = M * D * N
        rule = "N·(M-1) + 1 with same_length" if c.same_length else "N·L + L when M = L; N·M + L when L divides M"
        return (
            super().info_lines()
            + [
                f"segment L = {L}, memory M = {M}, clamp_len = {c.clamp_len}, same_length = {c.same_length}",
                f"XL memory = M × d × layers × batch = {M} × {D} × {N} × B = {per_row:,} floats per batch row"
                f" = {4 * per_row:,} bytes ({4 * per_row / 2**20:.2f} MiB) per row at fp32",
                f"+ partial segment in the state: up to (L-1) × d × layers = {(L - 1) * D * N:,} floats per row",
                f"receptive field rule: {rule}",
            ]
            + ([f"+ the convolution's last K-1 inputs: {c.conv_floats:,} floats per row"] if c.conv_floats else [])
        )


register(
    "transformer_xl",
    TransformerXLConfig,
    TransformerXL,
    "Transformer-XL: segment recurrence with a cached memory of hidden states",
)
