"""Block-Recurrent Transformer (Hutchins et al. 2022, "Block-Recurrent Transformers", §3 "Method":
the recurrent cell, gates and configurations), as the authors' meliad code runs it.

The sequence is cut into blocks of W tokens. Every layer attends over a sliding window: a token
sees exactly the W previous tokens, not itself (meliad's mask, -W <= k - q < 0); the keys of the
previous block are cached, and at a document start they are zeros, an unmasked "attend to
nothing" sink as in meliad. Token self-attention gets a T5 relative bias (32 buckets, max
distance 128, per layer), or RoPE as an option.

Recurrent layers (default: the third-from-last) also keep S state vectors c [S, D]. With
u = Norm(c) + ids (learned state IDs, added only to the projection input):

    vertical (tokens x):   o = Wo [Attn(Q_x; K_x, V_x) ; Attn(Q2_x; K_c, V_c)],  x' = x + o, then FFN
    horizontal (state c):  y = [Attn(Q_c; K_c, V_c) ; Attn(Q2_c; K_x, V_x over prev + current block)]

four query sets (Q_x, Q2_x from x; Q_c, Q2_c from u) and two key/value sets (K_x, V_x shared by
token self-attention and state->token attention; K_c, V_c by state self-attention and
token->state attention); no position bias between state and tokens. ``kv_heads`` < n_heads gives
the key/value sets fewer heads than the queries, each shared by n_heads / kv_heads query heads
(grouped-query attention; 1: one key/value head, as lucidrains' block-recurrent-transformer-pytorch).
The state update, once per completed block, replaces the residual by a gate (the paper's equations):

    fixed:  g = σ(b_g),                                   c' = c ⊙ g + z ⊙ (1 - g)
    lstm:   i = σ(W_i h + b_i - 1), f = σ(W_f h + b_f + 1), c' = c ⊙ f + z ⊙ i

where h is the hidden activation feeding the output layer of the gated module (meliad's MLP._gate).
Configurations: skip  c' = gate(c, Wp y)                                    (h = y)
                dual  c1 = gate(c, Wp y);  c' = gate2(c1, FFN(Norm(c1)))    (h = FFN hidden)
                single c' = gate(c, tanh(FFN(y)))                            (h = FFN hidden)

The tokens of a block cross-attend to the state left by the previous block; the state is
updated only when a block completes, so a trailing partial block is kept in the state (its keys
and values) and whole == chunked == stepwise. Layers run one after another over the whole call
(meliad's default, no feedback). Gradients flow through every block of one call; the trainer
decides where to detach. A per-row reset (``fresh``) restores the learned initial state and a zero
key/value cache, lazily at the next call, and only at a block boundary. Every layer sits in the
library's pre-norm block (with meliad's 2-matrix ReLU MLP as an option).

``qkv_conv: K`` passes each layer's (normed) input through a short causal convolution before its
queries, keys and values, the tokens' queries into the state included (``nn.ConvConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import tap
from ..cells import QK, StateCell, t5_buckets
from ..config import RecurformerError, option
from ..modules import (
    apply_rope,
    biased_attend,
    compiled_region,
    float32_under_cpu_autocast,
    group_bias,
    group_heads,
    grouped_attend,
    merge_heads,
    pieces,
    project_heads,
    rope_cos_sin,
    ungroup_heads,
)
from ..nn import Block, ConvConfig, ConvLayer, StreamingLM
from ..registry import register, register_layer
from ..stack import Layer
from ..state import Call, LayerState, reset_rows


@dataclass
class BlockRecurrentConfig(ConvConfig):
    context_field = "block_size"
    block_size: int = option(512, range=">= 1")  # W: tokens per block = attention window
    num_states: int | None = option(None, range=">= 1")  # S: state vectors per recurrent layer (None: S = W)
    kv_heads: int | None = None  # key/value heads of every attention (None: n_heads; 1: multi-query)
    recurrent_layers: tuple[int, ...] = (-3,)  # layer indices, negative from the end (-3: layer 10 of 12)
    gate: Literal["fixed", "lstm"] = "fixed"
    cell: Literal["skip", "single", "dual"] = "skip"
    position: Literal["t5", "rope"] = "t5"  # token self-attention positions
    t5_buckets: int = 32
    t5_max_distance: int = 128
    mlp: Literal["swiglu", "relu"] = "swiglu"  # relu: meliad's 2-matrix MLP (used for the paper's param count)
    qk_norm: bool = True  # meliad's normalize_keys: L2-normalised q, k times a learned per-head scale
    # queries per attention tile, at most W (speed only: exact at any value)
    query_tile: int = option(128, range=">= 1")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_heads is not None and (self.kv_heads < 1 or self.n_heads % self.kv_heads):
            raise RecurformerError(f"config key 'kv_heads' must divide n_heads ({self.n_heads}), got {self.kv_heads}")
        if self.t5_buckets < 2 or self.t5_max_distance < self.t5_buckets // 2 + 1:
            raise RecurformerError("config keys 't5_buckets' >= 2 and 't5_max_distance' > t5_buckets/2 required")
        idx = self.recurrent_layer_ids
        if len(set(idx)) != len(idx):
            raise RecurformerError(f"config key 'recurrent_layers' names a layer twice: {list(self.recurrent_layers)}")

    @property
    def states(self) -> int:
        return self.block_size if self.num_states is None else self.num_states

    @property
    def key_value_heads(self) -> int:
        return self.n_heads if self.kv_heads is None else self.kv_heads

    @property
    def recurrent_layer_ids(self) -> list[int]:
        out = []
        for i in self.recurrent_layers:
            if not -self.n_layers <= i < self.n_layers:
                raise RecurformerError(f"recurrent layer index {i} is out of range for {self.n_layers} layers")
            out.append(i % self.n_layers)
        return out


@dataclass
class BlockRecurrentState(LayerState):
    """``k``/``v`` [B, Hkv, W + r, d]: un-rotated keys/values of the previous block (zeros at a
    document start) followed by the r tokens of the current block read so far. ``cell`` [B, S, D]
    (recurrent layers only): the recurrent state left by the last complete block."""

    partial: ClassVar[dict[str, int]] = {"k": 2, "v": 2}
    k: Tensor
    v: Tensor
    cell: Tensor | None = None
    conv: Tensor | None = None  # [B, K-1, D]: the convolution's last K-1 inputs (``ConvLayer``)


class BlockAttention(ConvLayer):
    """Sliding-window attention over blocks (the mixer of every layer); ``cell`` makes it
    recurrent. The output is Wo [self-attention ; token->state cross-attention]."""

    kind, unit = "block_recurrent", "block"
    state_cls = BlockRecurrentState
    shift_invariant = True  # positions within a chunk, or relative to a document start

    def __init__(self, cfg: BlockRecurrentConfig, recurrent: bool) -> None:
        super().__init__(cfg)
        D, Dkv = cfg.dim, cfg.key_value_heads * cfg.head_dim
        self.cfg = cfg
        self.n_heads, self.kv_heads = cfg.n_heads, cfg.key_value_heads
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, Dkv, bias=False)
        self.wv = nn.Linear(D, Dkv, bias=False)
        if cfg.position == "t5":
            self.rel_bias = nn.Embedding(cfg.t5_buckets, cfg.n_heads)
        self.qk = QK(cfg)
        self.cell = StateCell(cfg) if recurrent else None
        if recurrent:
            self.wq2 = nn.Linear(D, D, bias=False)  # token -> state queries
            self.qk2 = QK(cfg)
            self.initial_state = nn.Parameter(torch.zeros(cfg.states, D))
        self.wo = nn.Linear(2 * D if recurrent else D, D, bias=False)

    @property
    def period(self) -> int:
        return self.cfg.block_size

    def init_extra(self, std: float) -> None:
        if self.cell is not None:
            with torch.no_grad():
                self.initial_state.normal_(0.0, 0.1)  # meliad's initial state

    def describe(self) -> str:
        W = self.cfg.block_size
        return f"block(W={W})" if self.cell is None else f"block_recurrent(W={W}, S={self.cfg.states})"

    def reach(self, q: int) -> int | None:
        return q - self.cfg.block_size if self.cell is None else None

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> BlockRecurrentState:
        c, B = self.cfg, batch_size
        z = lambda *s: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        cell = z(B, c.states, c.dim) if self.cell is not None else None  # replaced by initial_state (fresh)
        kv = (B, c.key_value_heads, c.block_size, c.head_dim)
        return BlockRecurrentState(k=z(*kv), v=z(*kv), cell=cell)

    def reset(self, st: BlockRecurrentState, fresh: Tensor) -> BlockRecurrentState:
        zero = torch.zeros_like(st.k[0])
        cell = None if st.cell is None else reset_rows(fresh, st.cell, self.initial_state)
        return BlockRecurrentState(k=reset_rows(fresh, st.k, zero), v=reset_rows(fresh, st.v, zero), cell=cell)

    def tile_bias(self, m: int, dtype: torch.dtype, device: torch.device, call: Call) -> Tensor:
        """[H, m, W + m] additive attention bias (grouped as the queries: ``group_bias``) of a tile
        of m consecutive queries over the keys they can see: query t (0 <= t < m) at window index i sees window indices
        i .. i + W - 1 of [previous block ; current block], i.e. key j of the tile's slice when
        1 <= W + t - j <= W (the W previous tokens, not the token itself). T5 bias (or 0 with RoPE)
        where visible, -inf elsewhere; the same for every tile, so each layer builds it once per call.
        The last key (the tile's last query itself) is hidden from every query: it rounds the key
        count up to W + m (128 for W = m = 64), on which the batched matmuls ran ~10% faster."""
        W = self.cfg.block_size

        def buckets() -> tuple[Tensor, Tensor]:
            dist = W + torch.arange(m, device=device)[:, None] - torch.arange(W + m, device=device)[None, :]
            return t5_buckets(dist, self.cfg.t5_buckets, self.cfg.t5_max_distance), (dist >= 1) & (dist <= W)

        def bias() -> Tensor:
            bucket, vis = call.shared(("brt-tile", W, m, device), buckets)  # shared by all layers
            if self.cfg.position == "t5":
                b = self.rel_bias(bucket).permute(2, 0, 1).to(dtype)
            else:
                b = torch.zeros(1, *bucket.shape, dtype=dtype, device=device)
            return group_bias(self.qk.bias(b.masked_fill(~vis, float("-inf"))), self.n_heads, self.kv_heads)

        return call.shared(("brt-bias", self, m, dtype), bias)

    @float32_under_cpu_autocast  # cast once, not per tile
    def window_attend(self, q: Tensor, k: Tensor, v: Tensor, r: int, call: Call, dtype: torch.dtype) -> Tensor:
        """Token self-attention of n queries at block offsets r..r+n-1 over the window keys
        k, v [B, Hkv, W + r + n, d] -> [B, n, D] (heads merged), the bias in ``dtype`` (the residual
        stream's); ``q`` scaled for ``biased_attend``. Query j sees keys r + j .. r + j + W - 1
        (its W previous tokens) whatever block it is in, so the queries of a call go in tiles of
        m = min(``query_tile``, W) regardless of blocks: a tile reads only the W + m - 1 keys its
        queries can see and the next one (``tile_bias``), a view, which gives the softmax of the
        whole masked window (the keys left out weigh exp(-inf) = 0)."""
        n, W = q.shape[2], self.cfg.block_size
        m = min(self.cfg.query_tile, W, n)
        B, H, _, d = q.shape
        G, nt = H // self.kv_heads, n // m  # query heads per key/value head; whole tiles
        outs = []
        if nt:  # the whole tiles in one batch: tile t reads keys r + t m .. r + t m + W + m - 1 (``unfold``: a view)
            # tiles first, [nt, B, Hkv, ...]: the bias's gradient then sums over the two leading dimensions
            qt = q[:, :, : nt * m].unflatten(1, (self.kv_heads, G)).unflatten(3, (nt, m)).permute(3, 0, 1, 2, 4, 5)
            kt, vt = (u[:, :, r : r + nt * m + W].unfold(2, W + m, m).permute(2, 0, 1, 4, 3) for u in (k, v))
            o = biased_attend(
                qt.flatten(3, 4), kt, vt, self.tile_bias(m, dtype, q.device, call)
            )  # [nt, B, Hkv, G m, d]
            outs.append(o.unflatten(3, (G, m)).permute(1, 2, 3, 0, 4, 5).flatten(1, 2).flatten(2, 3))  # [B, H, nt m, d]
        if n % m:  # the last, partial tile
            a, mt = r + nt * m, n % m
            o = biased_attend(
                group_heads(q[:, :, nt * m :], self.kv_heads),
                k[:, :, a : a + W + mt],
                v[:, :, a : a + W + mt],
                self.tile_bias(mt, dtype, q.device, call),
            )
            outs.append(ungroup_heads(o, self.n_heads))
        return merge_heads(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])

    def forward(self, x: Tensor, st: BlockRecurrentState, call: Call) -> tuple[Tensor, BlockRecurrentState]:
        """x [B, T, D] (normed) -> (Wo [self ; cross] [B, T, D], new state). The projections and
        the token self-attention run over the whole call; only the state's recurrence (and the
        tokens' reads of it) goes block by block."""
        cfg, W, H, T, D = self.cfg, self.cfg.block_size, self.n_heads, x.shape[1], self.cfg.dim
        r = st.k.shape[2] - W  # offset inside the current block
        ws = (self.wq.weight, self.wk.weight, self.wv.weight) + ((self.wq2.weight,) if self.cell is not None else ())
        parts = project_heads(x, ws, (H, self.kv_heads, self.kv_heads, H)[: len(ws)])
        q, k = self.qk.query(parts[0], sdpa=False), self.qk.key(parts[1])  # [B, H, T, d], for biased_attend
        kx, vx = torch.cat((st.k, k), dim=2), torch.cat((st.v, parts[2]), dim=2)  # [B, H, W + r + T, d]
        kr, rope = kx, None  # the keys as the token queries see them
        if cfg.position == "rope":  # positions in the window of the first block: 0 .. W + r + T - 1
            L = W + r + T
            cos, sin = call.shared(
                ("brt-rope", L, x.dtype),
                lambda: rope_cos_sin(torch.arange(L, device=x.device), cfg.head_dim, cfg.rope_theta, x.dtype),
            )
            q, kr = apply_rope(q, cos[W + r :], sin[W + r :]), apply_rope(kx, cos, sin)
            rope = cos, sin
        o = self.window_attend(q, kr, vx, r, call, x.dtype)  # [B, T, D]
        cell = st.cell
        if self.cell is not None:
            assert cell is not None
            cross, cell = self.recurrent(parts[3], kx, vx, r, cell, rope, call)
            if tap.active():  # the read-out: share of Wo [self ; cross] that comes from the state
                tap.record(self, tap.output_share(cross @ self.wo.weight[:, D:].T, o @ self.wo.weight[:, :D].T))
            o = torch.cat((o, cross), dim=-1)
        keep = W + (r + T) % W  # the cache: the previous block and the current one's tokens so far
        kc, vc = kx[:, :, -keep:], vx[:, :, -keep:]
        if keep < kx.shape[2]:  # a copy, so the state does not hold the whole call's keys
            kc, vc = kc.clone(), vc.clone()
        return self.wo(o), BlockRecurrentState(kc, vc, cell)

    def recurrent(
        self, q2: Tensor, kx: Tensor, vx: Tensor, r: int, cell: Tensor, rope: tuple[Tensor, Tensor] | None, call: Call
    ) -> tuple[Tensor, Tensor]:
        """The tokens' reads of the state and the state's updates, block by block. q2 [B, H, T, d]:
        token -> state queries (untreated); kx, vx [B, Hkv, W + r + T, d]: the un-rotated window keys
        and values of ``forward`` (call token t at index W + r + t); ``rope``: its cos/sin table
        (RoPE only); cell [B, S, D]. Returns (cross [B, T, D], the new cell)."""
        assert self.cell is not None
        W, T = self.cfg.block_size, q2.shape[2]
        ns = pieces(call.pos % W, T, W)
        nd = len(ns) - bool((r + T) % W)  # the blocks the call completes: pieces 0 .. nd - 1
        kcs, vcs = [], []
        if nd:  # block i's window (the previous block and itself) is kx[i W : i W + 2W]: all of them, a view
            kb, vb = (u[:, :, : (nd + 1) * W].unfold(2, 2 * W, W).transpose(-1, -2) for u in (kx, vx))
            if rope is not None:  # window positions 0 .. 2W - 1, as the block's queries saw them
                kb = apply_rope(kb, rope[0][: 2 * W], rope[1][: 2 * W])
            for kbi, vbi in zip(kb.unbind(2), vb.unbind(2), strict=True):  # each block reads the state, then updates it
                kc, vc, cell = self.block_step(cell, kbi, vbi)
                kcs.append(kc)
                vcs.append(vc)
        if nd < len(ns):  # the call ends inside a block: its tokens read the state, which stays
            kc, vc, _, _ = self.cell.project(cell, queries=False)
            kcs.append(self.qk2.key(kc))
            vcs.append(vc)
        if len(ns) == 1:  # one block (e.g. decoding a token): its tokens read the state as they are
            return merge_heads(grouped_attend(self.qk2.query(q2), kcs[0], vcs[0])), cell
        # the tokens' reads of the state, every block at once: the queries padded to whole blocks
        qb = F.pad(self.qk2.query(q2), (0, 0, call.pos % W, len(ns) * W - T - call.pos % W))
        qb = qb.unflatten(2, (len(ns), W)).transpose(1, 2).flatten(0, 1)  # [B nb, H, W, d]
        o = grouped_attend(qb, torch.stack(kcs, dim=1).flatten(0, 1), torch.stack(vcs, dim=1).flatten(0, 1))
        o = o.unflatten(0, (q2.shape[0], len(ns))).permute(0, 1, 3, 2, 4).flatten(1, 2).flatten(2, 3)  # [B, nb W, D]
        return o[:, call.pos % W : call.pos % W + T], cell

    @compiled_region
    def block_step(self, cell: Tensor, kb: Tensor, vb: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One block of the recurrence: the state's keys/values (which the block's tokens read) and
        the state after the block, from the window keys/values kb, vb [B, Hkv, 2W, d] of the
        previous block and this one. A compiled region (``modules.compiled_region``): a compiled
        layer traces it once and runs the same graph for every block."""
        assert self.cell is not None
        kc, vc, qs, qs2 = self.cell.project(cell, queries=True)
        assert qs is not None and qs2 is not None
        kc = self.qk2.key(kc)
        return kc, vc, self.cell.update(cell, qs, qs2, kc, vc, kb, vb)


@register_layer("block_recurrent", BlockRecurrentConfig)
def block_recurrent_layer(cfg: BlockRecurrentConfig, index: int) -> Layer:
    return Block(cfg, BlockAttention(cfg, index in cfg.recurrent_layer_ids), mlp=cfg.mlp)


class BlockRecurrent(StreamingLM):
    kind = "block_recurrent"
    config: BlockRecurrentConfig

    def param_breakdown(self) -> dict[str, int]:
        """Parameters: embedding (tied head), state side of the recurrent cells (IDs, state
        projections, gates, state FFN, initial state), token side of the recurrent layers, the
        other layers, final norm."""
        out = {"embedding": self.tok_emb.weight.numel(), "recurrent cell (state side)": 0}
        out["recurrent layers (token side)"] = out["other layers"] = 0
        for layer in self.layers:
            total = sum(p.numel() for p in layer.parameters())
            attn = cast(Block, layer).attn  # a window or full layer of a hybrid stack has no cell
            if isinstance(attn, BlockAttention) and attn.cell is not None:
                cell = sum(p.numel() for p in attn.cell.parameters()) + attn.initial_state.numel()
                out["recurrent cell (state side)"] += cell
                out["recurrent layers (token side)"] += total - cell
            else:
                out["other layers"] += total
        out["final norm"] = self.norm.weight.numel()
        return out

    def info_lines(self) -> list[str]:
        c = self.config
        rec = c.recurrent_layer_ids
        kv_dim = c.key_value_heads * c.head_dim
        per_row = c.n_layers * 2 * kv_dim * (c.block_size + c.block_size - 1) + len(rec) * c.states * c.dim
        per_row += c.conv_floats
        parts = self.param_breakdown()
        total = sum(parts.values())
        lines = super().info_lines() + [
            f"blocks of W={c.block_size} tokens, S={c.states} states; recurrent layers "
            f"{[i + 1 for i in rec]} (1-based) of {c.n_layers}; gate={c.gate}, cell={c.cell}, position={c.position}",
            f"state per row: {c.n_layers} x 2 x (W + r) x {kv_dim} window keys/values + {len(rec)} x S x D cell "
            f"(<= {per_row:,} numbers)",
        ]
        lines += [f"params {k}: {v:,} ({100 * v / total:.1f}%)" for k, v in parts.items()]
        lines.append(f"params without embedding: {total - parts['embedding']:,}")
        return lines


register(
    "block_recurrent",
    BlockRecurrentConfig,
    BlockRecurrent,
    "Block-Recurrent Transformer: recurrent cell states updated once per block",
)
