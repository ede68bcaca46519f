"""Transformer-XL (Dai et al. 2019; seed 004): segment-level recurrence with relative positions.

The stream is cut into segments of L tokens. Layer n of segment τ attends over its own input for
the last M positions before the segment (the memory, with stop-gradient) followed by the segment:

    h~_τ^{n-1} = StopGrad(h_{τ-1}^{n-1}) ∘ h_τ^{n-1}           (memory: last M inputs of layer n)
    q = W_q h_τ^{n-1},   k = W_{k,E} h~_τ^{n-1},   v = W_v h~_τ^{n-1}
    score[i, j] = (q_i + u)·k_j + (q_i + v)·W_{k,R} R_{i-j}     (terms (a)+(c), (b)+(d); /sqrt(d_head))

Queries come from the segment only; every (valid) memory position is visible and the segment is
causal. R_δ is the sinusoid of the distance δ (base ``rope_theta``), capped at ``clamp_len``;
u, v are learned per layer and head; (b)+(d) use the relative shift (``ops/relative.py``). With
``same_length`` every query sees exactly the last M keys (itself included), as in the original
evaluation. The block is the same pre-norm RMSNorm + SwiGLU block as the other models, so that
comparisons isolate the recurrence and the position scheme (the paper uses post-LayerNorm + ReLU):

    y = x + W_o RelAttn(n(x), n(memory)),   out = y + SwiGLU(n(y)),   n = RMSNorm

The memory holds the residual stream entering the layer (before the norm). Positions before the
start of a document are masked. One call processes its tokens segment by segment; the state holds
the memory of the current segment and the inputs of every layer for the segment's tokens read so
far, so whole == chunked == stepwise. Gradients flow inside a segment (also across calls, until the
trainer detaches the state); the memory never carries gradient. A row can be reset only at a
segment boundary (segments are aligned across the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import RecurformerError
from .._legacy_nn import ModelConfig, RMSNorm, State, StreamingLM, SwiGLU, merge_heads, split_heads
from ..ops.relative import relative_scores, sinusoid_table


@dataclass
class TransformerXLConfig(ModelConfig):
    context_field = "segment_len"
    segment_len: int = 64  # L: tokens per segment
    mem_len: int | None = None  # M: cached positions per layer (None: M = L; 0: no recurrence)
    clamp_len: int | None = None  # distances beyond clamp_len use R_clamp_len (None: no cap)
    same_length: bool = False  # every query sees exactly the last M keys

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.segment_len < 1:
            raise RecurformerError(f"config key 'segment_len' must be >= 1, got {self.segment_len}")
        if self.mem_len is not None and self.mem_len < 0:
            raise RecurformerError(f"config key 'mem_len' must be >= 0, got {self.mem_len}")
        if self.clamp_len is not None and self.clamp_len < 0:
            raise RecurformerError(f"config key 'clamp_len' must be >= 0, got {self.clamp_len}")
        if self.same_length and self.memory_len == 0:
            raise RecurformerError("same_length needs mem_len >= 1 (a query would see no key)")

    @property
    def memory_len(self) -> int:
        return self.segment_len if self.mem_len is None else self.mem_len


@dataclass
class XLState(State):
    """Per layer n: ``mem`` [B, M, D], the inputs of layer n at the M positions before the current
    segment (detached; left-padded with zeros where ``mem_valid`` says they precede the document);
    ``seg`` [B, r, D], the inputs of layer n for the r tokens of the current segment read so far
    (same r for all rows). ``mem_valid`` [B]: how many of the M memory positions are in the
    current document."""

    mem: list[Tensor]
    seg: list[Tensor]
    mem_valid: Tensor  # [B] int64

    @property
    def offset(self) -> int:
        """r: tokens of the current segment already read."""
        return self.seg[0].shape[1]


class RelAttention(nn.Module):
    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.scale = cfg.head_dim**-0.5
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)  # W_{k,E}
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wr = nn.Linear(cfg.dim, cfg.dim, bias=False)  # W_{k,R}
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.u = nn.Parameter(torch.zeros(cfg.n_heads, cfg.head_dim))  # global content bias
        self.v = nn.Parameter(torch.zeros(cfg.n_heads, cfg.head_dim))  # global position bias

    def forward(self, x: Tensor, ctx: Tensor, r: Tensor, mask: Tensor) -> Tensor:
        """x [B, n, D] (normed queries' inputs), ctx [B, K, D] (normed [memory; segment so far; x]),
        r [H, K, d] (W_{k,R} R_δ, δ = 0..K-1), mask [B, 1, n, K] bool -> [B, n, D]."""
        q = split_heads(self.wq(x), self.n_heads)  # [B, H, n, d]
        k = split_heads(self.wk(ctx), self.n_heads)  # [B, H, K, d]
        v = split_heads(self.wv(ctx), self.n_heads)
        s = relative_scores(q, k, r, self.u, self.v) * self.scale  # [B, H, n, K]
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return self.wo(merge_heads(p @ v))


class Block(nn.Module):
    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = RelAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.dim, cfg.hidden)

    def forward(self, x: Tensor, past: Tensor, r: Tensor, mask: Tensor) -> Tensor:
        """x [B, n, D] new tokens, past [B, M + r, D] (memory, detached; segment so far)."""
        ctx = self.attn_norm(torch.cat((past, x), dim=1))
        h = x + self.attn(ctx[:, past.shape[1] :], ctx, r, mask)
        return h + self.ffn(self.ffn_norm(h))


class TransformerXL(StreamingLM):
    kind = "xl"
    state_cls = XLState

    def __init__(self, config: TransformerXLConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.init_weights()

    @property
    def reset_boundary(self) -> int:
        return self.config.segment_len  # type: ignore[attr-defined]

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> XLState:  # type: ignore[override]
        c: TransformerXLConfig = self.config  # type: ignore[assignment]
        dt = self.tok_emb.weight.dtype
        return XLState(
            fresh=torch.ones(batch_size, dtype=torch.bool, device=device),
            mem=[torch.zeros(batch_size, c.memory_len, c.dim, device=device, dtype=dt) for _ in range(c.n_layers)],
            seg=[torch.zeros(batch_size, 0, c.dim, device=device, dtype=dt) for _ in range(c.n_layers)],
            mem_valid=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    def body(self, h: Tensor, state: XLState) -> tuple[Tensor, XLState]:  # type: ignore[override]
        c: TransformerXLConfig = self.config  # type: ignore[assignment]
        L, M, T = c.segment_len, c.memory_len, h.shape[1]
        r0 = state.offset
        if state.mem[0].shape[1] != M or r0 >= L:
            raise RecurformerError(f"state does not fit this TransformerXL (memory {state.mem[0].shape[1]} vs {M}, offset {r0} vs segment {L})")
        mem, valid = list(state.mem), state.mem_valid
        if bool(state.fresh.any()):
            if r0:
                raise RecurformerError(
                    f"transformer_xl can reset a row only at a segment boundary (current segment has {r0} of {L} tokens)"
                )
            f = state.fresh[:, None, None]
            mem = [torch.where(f, torch.zeros_like(m), m) for m in mem]
            valid = torch.where(state.fresh, torch.zeros_like(valid), valid)

        # pieces of the call: (start a, length n, offset r in the segment, valid memory positions)
        pieces: list[tuple[int, int, int, Tensor]] = []
        a, r = 0, r0
        while a < T:
            n = min(L - r, T - a)
            pieces.append((a, n, r, valid))
            a, r = a + n, r + n
            if r == L:
                r, valid = 0, (valid + L).clamp(max=M)

        # sinusoid R_δ for every distance a piece can see (δ = 0 .. M+L-1), capped at clamp_len
        dist = torch.arange(M + L, device=h.device)
        if c.clamp_len is not None:
            dist = dist.clamp(max=c.clamp_len)
        pos_emb = sinusoid_table(dist, c.dim, c.rope_theta, h.dtype)  # [M+L, D]
        masks = [self._mask(M, r, n, v) for _, n, r, v in pieces]

        new_mem, new_seg = [], []
        for layer, m, seg in zip(self.layers, mem, state.seg):
            rel = layer.attn.wr(pos_emb).view(M + L, c.n_heads, c.head_dim).transpose(0, 1)  # [H, M+L, d]
            outs = []
            for (a, n, r, _), mask in zip(pieces, masks):
                x = h[:, a : a + n]
                outs.append(layer(x, torch.cat((m, seg), dim=1), rel[:, : M + r + n], mask))
                seg = torch.cat((seg, x), dim=1)
                if r + n == L:  # segment complete: its inputs become the memory (stop-gradient)
                    m = torch.cat((m, seg), dim=1)[:, L:].detach()
                    seg = seg[:, :0]
            new_mem.append(m)
            new_seg.append(seg)
            h = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return h, XLState(fresh=torch.zeros_like(state.fresh), mem=new_mem, seg=new_seg, mem_valid=valid)

    def _mask(self, M: int, r: int, n: int, valid: Tensor) -> Tensor:
        """[B, 1, n, M+r+n] bool: query i (segment offset r+i) sees key j (segment offset j-M) iff
        the distance δ = M + r + i - j is >= 0, the key is in the document (j >= M - valid), and,
        with same_length, δ < M."""
        dev = valid.device
        i = torch.arange(n, device=dev)[:, None]
        j = torch.arange(M + r + n, device=dev)[None, :]
        d = M + r + i - j
        vis = d >= 0
        if self.config.same_length:  # type: ignore[attr-defined]
            vis = vis & (d < M)
        return (vis[None] & (j[None] >= (M - valid)[:, None, None])).unsqueeze(1)

    def receptive_start(self, p: int) -> int:
        """Earliest position of a document whose token can change the logits at position p (positions
        from the document start): each layer reaches back to the memory of the query's segment,
        S(q) - M (with same_length: q - (M-1)), and a logit goes through n_layers layers."""
        c: TransformerXLConfig = self.config  # type: ignore[assignment]
        q = p
        for _ in range(c.n_layers):
            q = q - (c.memory_len - 1) if c.same_length else (q // c.segment_len) * c.segment_len - c.memory_len
        return max(q, 0)

    def max_context(self) -> int:
        """The largest p - receptive_start(p) + 1 far from the document start: the effective context
        (the seed's N·L + L for M = L; N·M + L when L divides M; N·(M-1) + 1 with same_length)."""
        c: TransformerXLConfig = self.config  # type: ignore[assignment]
        far = (c.n_layers + 1) * (c.memory_len + c.segment_len)
        return max(p - self.receptive_start(p) + 1 for p in range(far, far + c.segment_len))

    def info_lines(self) -> list[str]:
        c: TransformerXLConfig = self.config  # type: ignore[assignment]
        L, M, N, D = c.segment_len, c.memory_len, c.n_layers, c.dim
        per_row = M * D * N
        rule = "N·(M-1) + 1 with same_length" if c.same_length else "the seed's N·L + L when M = L; N·M + L when L divides M"
        return [
            f"segment L = {L}, memory M = {M}, clamp_len = {c.clamp_len}, same_length = {c.same_length}",
            f"XL memory = M × d × layers × batch = {M} × {D} × {N} × B = {per_row:,} floats per batch row"
            f" = {4 * per_row:,} bytes ({4 * per_row / 2**20:.2f} MiB) per row at fp32",
            f"+ partial segment in the state: up to (L-1) × d × layers = {(L - 1) * D * N:,} floats per row",
            f"effective context (receptive field of a logit): up to {self.max_context():,} tokens ({rule})",
        ]
