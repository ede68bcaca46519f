"""The exact tiled recurrent attention (the Recurrent Transformer's appendix algorithms "Exact tiled
forward pass" and UpdateTile, on blocks) and its custom backward; see the package docstring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ...modules import acc_dtype
from .common import BiasFn, Finish, RecurrentInputs, Stats, TileUpdate, block_edges, visible
from .naive import recurrent_attention_naive


def tile_scores(q: Tensor, k: Tensor, bias: Tensor | None) -> Tensor:
    """s = q k^T + bias in the accumulator dtype: q [..., n, d] already scaled by 1/sqrt(d) (once
    per call, not per tile), k [..., nk, d], bias broadcast to [..., n, nk] (-inf = invisible)."""
    s = torch.matmul(q, k.transpose(-1, -2)).to(acc_dtype(q.dtype))
    return s if bias is None else s + bias


def tile_update(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, m: Tensor, l: Tensor, o: Tensor) -> None:
    """UpdateTile (the paper's appendix), in place: the scores s = q k^T + bias of n scaled queries
    q [B, H, n, d] against a tile of keys k [B, H, P, d] and its values v are folded into the
    queries' running max m [B, H, n], normaliser l and numerator o [B, H, n, d] (accumulator
    dtype; views of the caller's buffers):

        m' = max(m, max_j s_j),   c = exp(m - m'),   l <- c l + sum_j exp(s_j - m'),
        o <- c o + sum_j exp(s_j - m') v_j,   m <- m'

    Tensors in, nothing out, one tile's shapes: the region ``compiled_tile_update`` compiles."""
    s = tile_scores(q, k, bias)
    m_new = torch.maximum(m, s.amax(-1))
    c = torch.exp(m - m_new)
    p = torch.exp(s - m_new.unsqueeze(-1))
    l.mul_(c).add_(p.sum(-1))
    o.mul_(c.unsqueeze(-1)).add_(torch.matmul(p.to(v.dtype), v).to(o.dtype))
    m.copy_(m_new)


def compiled_tile_update(backend: str = "inductor") -> TileUpdate:
    """``tile_update`` under ``torch.compile(dynamic=False)``, as the paper's authors compile their
    tile update: one graph per tile shape. A call of N positions meets about 2 log2 N shapes (tile
    sizes, query chunks, the truncated last tiles), hence a recompile limit of at least 64."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return cast(TileUpdate, torch.compile(tile_update, dynamic=False, backend=backend))


@dataclass(frozen=True)
class _Tiling:
    """The non-tensor arguments of one tiled call (see ``recurrent_attention_tiled``)."""

    finish: Finish
    block: int
    pos0: int
    start: Tensor
    scale: float
    bias_fn: BiasFn | None
    query_chunk: int
    update: TileUpdate


def softmax_backward(
    s: Tensor, lse: Tensor, delta: Tensor, da: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The part of the attention gradient carried by one group of keys (FlashAttention backward).
    s [..., nq, nk]: recomputed scores (``tile_scores`` of the scaled queries q = scale q_raw);
    lse [..., nq] = m + log l, the queries' final log-normaliser over *all* their keys;
    da [..., nq, d] = dL/da; delta [..., nq] = sum_d da * a. With P = exp(s - lse) (the final
    softmax restricted to the group):

        dS = P * (da v^T - delta),   dq_raw = scale dS k,   dk = dS^T q,   dv = P^T da

    Returns (dq_raw, dk, dv) in the accumulator dtype (that of s)."""
    acc = s.dtype
    p = torch.exp(s - lse.unsqueeze(-1))
    ds = p * (torch.matmul(da.to(v.dtype), v.transpose(-1, -2)).to(acc) - delta.unsqueeze(-1))
    dq = torch.matmul(ds.to(k.dtype), k).to(acc) * scale
    dk = torch.matmul(ds.transpose(-1, -2).to(q.dtype), q).to(acc)
    dv = torch.matmul(p.transpose(-1, -2).to(v.dtype), da.to(v.dtype)).to(acc)
    return dq, dk, dv


def _blocks(t: Tensor, front: int, n_blocks: int, block: int, value: float = 0.0) -> Tensor:
    """[B, H, n, *rest] -> [B, H, n_blocks, block, *rest], padded with ``value``: ``front`` rows
    before, the rest after."""
    back = n_blocks * block - front - t.shape[2]
    pad = [0, 0] * (t.dim() - 3) + [front, back]
    return torch.nn.functional.pad(t, pad, value=value).view(*t.shape[:2], n_blocks, block, *t.shape[3:])


def _unblock(t: Tensor, lo: int, hi: int) -> Tensor:
    """Inverse of ``_blocks``: rows lo..hi-1 of the flattened [B, H, n_blocks * block, *rest]."""
    return t.reshape(*t.shape[:2], t.shape[2] * t.shape[3], *t.shape[4:])[:, :, lo:hi]


def _temporary_scores(qq: Tensor, kk: Tensor, bias_fn: BiasFn | None) -> Tensor:
    """[B, H, nb, b, b] scores of blocked scaled queries against their own block's temporary keys."""
    i = torch.arange(qq.shape[3], device=qq.device)
    dist = i[:, None] - i[None, :]
    acc = acc_dtype(qq.dtype)
    bias = torch.zeros((), dtype=acc, device=qq.device) if bias_fn is None else bias_fn(dist).to(acc).unsqueeze(1)
    return tile_scores(qq, kk, torch.where(dist >= 0, bias, float("-inf")))


def temporary_stats(
    q: Tensor, tk: Tensor, tv: Tensor, past_tk: Tensor, past_tv: Tensor, block: int, bias_fn: BiasFn | None
) -> Stats:
    """Accumulators of the T scaled queries after their own block's temporary pairs (causal within
    the block, including the r0 temporaries of an unfinished block from an earlier call). The call
    starts r0 positions after a block boundary, so blocks are aligned after prepending them."""
    r0, T = past_tk.shape[2], q.shape[2]
    nb = -(-(r0 + T) // block)
    kk, vv = (_blocks(torch.cat(pair, 2), 0, nb, block) for pair in ((past_tk, tk), (past_tv, tv)))
    s = _temporary_scores(_blocks(q, r0, nb, block), kk, bias_fn)
    m = s.amax(-1)
    p = torch.exp(s - m.unsqueeze(-1))
    o = torch.matmul(p.to(vv.dtype), vv).to(s.dtype)
    return _unblock(m, r0, r0 + T), _unblock(p.sum(-1), r0, r0 + T), _unblock(o, r0, r0 + T)


def _cache_bias(tiling: _Tiling, q0: int, n: int, S: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """[B, H or 1, n, S] additive bias of the call's queries q0..q0+n-1 (absolute positions
    pos0 + q0..) against the S cached keys: the position bias, -inf where invisible."""
    p0 = tiling.pos0
    qpos = torch.arange(p0 + q0, p0 + q0 + n, device=device)
    kpos = torch.arange(p0 - S, p0, device=device)
    bias = (
        torch.zeros((), dtype=dtype, device=device)
        if tiling.bias_fn is None
        else tiling.bias_fn(qpos[:, None] - kpos[None, :]).to(dtype)
    )
    return torch.where(visible(qpos, kpos, tiling.block, tiling.start, temporary=False)[:, None], bias, float("-inf"))


def _tile_bias(
    tiling: _Tiling,
    cache: dict[tuple[int, int, int], Tensor],
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor | None:
    """Bias of query rows q0..q1-1 against keys k0..k1-1 (call-relative; None without a bias); it
    depends only on the distances, so it is memoised by (q0 - k0, q1 - q0, k1 - k0)."""
    if tiling.bias_fn is None:
        return None
    key = (q0 - k0, q1 - q0, k1 - k0)
    if key not in cache:
        i, j = torch.arange(q0, q1, device=device), torch.arange(k0, k1, device=device)
        cache[key] = tiling.bias_fn(i[:, None] - j[None, :]).to(dtype)
    return cache[key]


def _position_major(t: Tensor) -> Tensor:
    """A new contiguous [n, B, H, ...] copy of t [B, H, n, ...]: rows of consecutive positions are
    contiguous slices, and ``_heads_first`` of any such slice folds B and H without a copy."""
    return t.movedim(2, 0).clone(memory_format=torch.contiguous_format)


def _heads_first(t: Tensor) -> Tensor:
    """The [B, H, n, ...] view of a position-major [n, B, H, ...] tensor."""
    return t.movedim(0, 2)


def _tiled_forward(
    tiling: _Tiling,
    q: Tensor,
    tk: Tensor,
    tv: Tensor,
    past_k: Tensor,
    past_v: Tensor,
    past_tk: Tensor,
    past_tv: Tensor,
    finish_last: bool = True,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """The tiled schedule, without autograd (it writes its buffers in place). Returns a [B, H, T, d]
    (finish's inputs), lse = m + log l [B, H, T] (each query's final softmax statistics) and z, k,
    v; without ``finish_last`` (the caller runs finish itself), finish is left out at the last
    block, which no query waits for, and z, k, v are None.

    Layout, as in the authors' code: the scaled queries, the accumulators (m, l, o) and the call's
    persistent pairs live in buffers allocated once per call, position-major ([T, B, H, ...]), so
    that a block's write and a tile's keys and query rows are contiguous slices, read as views;
    o turns into a = o / l in place, block by block (a block's rows are final once it is reached)."""
    T, update, chunk = q.shape[2], tiling.update, tiling.query_chunk
    qs = q * tiling.scale
    m, l, o = temporary_stats(qs, tk, tv, past_tk, past_tv, tiling.block, tiling.bias_fn)
    if past_k.shape[2]:
        update(qs, past_k, past_v, _cache_bias(tiling, 0, T, past_k.shape[2], q.device, m.dtype), m, l, o)
    qp, m, l, o = (_position_major(t) for t in (qs, m, l, o))
    rows = lambda t, r0, r1: _heads_first(t[r0:r1])  # noqa: E731
    edges = block_edges(tiling.pos0, T, tiling.block)
    n_blocks = len(edges) - 1
    zs: list[Tensor] = []
    kv: tuple[Tensor, Tensor] | None = None  # persistent pairs [T, B, H, d], allocated at block 0 (finish's dtype)
    bias_cache: dict[tuple[int, int, int], Tensor] = {}
    for t in range(n_blocks):
        s0, e0 = edges[t], edges[t + 1]
        a = o[s0:e0].div_(l[s0:e0].unsqueeze(-1))  # block t is complete
        if t == n_blocks - 1 and not finish_last:
            break
        z, k, v = tiling.finish(_heads_first(a), s0, e0)
        if kv is None:
            kv = (k.new_empty(T, *k.shape[:2], k.shape[3]), v.new_empty(T, *v.shape[:2], v.shape[3]))
        kv[0][s0:e0] = k.movedim(2, 0)
        kv[1][s0:e0] = v.movedim(2, 0)
        zs.append(z)
        P = (t + 1) & -(t + 1)  # tile: keys of blocks t-P+1..t, queries of blocks t+1..t+P
        k0, qe = edges[t - P + 1], edges[min(t + P, n_blocks - 1) + 1]
        for c0 in range(e0, qe, chunk):  # rows are independent: bound the [B, H, rows, P] scores
            c1 = min(qe, c0 + chunk)
            bias = _tile_bias(tiling, bias_cache, c0, c1, k0, e0, q.device, m.dtype)
            update(
                rows(qp, c0, c1), rows(kv[0], k0, e0), rows(kv[1], k0, e0), bias, *(rows(x, c0, c1) for x in (m, l, o))
            )
    lse = _heads_first(m + torch.log(l))
    if not finish_last:
        return _heads_first(o), lse, None
    assert kv is not None
    return _heads_first(o), lse, (torch.cat(zs, 1), _heads_first(kv[0]), _heads_first(kv[1]))


def finish_vjp(finish: Finish, a: Tensor, s: int, e: int, grads: Sequence[Tensor], traced: bool) -> Tensor:
    """dL/da of finish's outputs (z, k, v) at a for their gradients ``grads``: finish recomputed
    and its vector-Jacobian product taken with respect to a only. Eagerly through
    ``torch.autograd.grad`` (the lighter call: one graph, no transform); under Dynamo
    (``traced``) through ``torch.func.vjp``, which it traces where it cannot trace a nested
    ``torch.autograd.grad`` (the training step then captures as one graph). The same numbers."""
    if traced:
        with torch.enable_grad():
            outs, vjp = torch.func.vjp(lambda a_: finish(a_, s, e), a)  # type: ignore[misc]
        return cast(Tensor, vjp(tuple(g.to(o.dtype) for o, g in zip(outs, grads)))[0])
    a = a.detach().requires_grad_()
    with torch.enable_grad():
        outs = finish(a, s, e)
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, grads) if o.requires_grad]
    (da,) = torch.autograd.grad([o for o, _ in pairs], a, [g for _, g in pairs], allow_unused=True)
    return torch.zeros_like(a) if da is None else da


class _TiledRecurrentAttention(torch.autograd.Function):
    """The backward of the tiled op. Its forward is the identity on z, k, v = finish(a) (computed
    over all positions at once by the caller, under autograd) and saves only inputs: the tiled
    forward's a (finish's inputs) and lse = m + log l, the queries, temporary pairs, persistent
    pairs k, v and the state of earlier calls, O(N d).

    Backward, blocks t = nB..1 (reverse): the gradient reaching a_t is that of finish at a_t
    applied to (dz_t, dk_t, dv_t), where dk_t, dv_t collect the output gradient and the
    contribution of every later query that attended to (k_t, v_t). Those queries belong to the
    tiles whose key range holds t, i.e. tiles t' >= t, so running tile t's backward (dq of its
    queries, dk/dv of its keys, from the already known da of blocks > t) completes dk_t, dv_t;
    then finish's vector-Jacobian product at a_t (``finish_vjp``: finish recomputed) gives da_t. The temporaries' and the cache's part of dq and their own
    gradients are batched after the loop (the paper's §"The backward pass"). The gradients of
    what finish reads (layer input, parameters) are not computed here: the returned dk, dv
    (outputs' plus attention's) flow on through the caller's batched finish, whose autograd gives
    them for all positions in one pass (finish acts on each position separately)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, tiling: _Tiling, a: Tensor, lse: Tensor, z: Tensor, k: Tensor, v: Tensor,
        q: Tensor, tk: Tensor, tv: Tensor, past_k: Tensor, past_v: Tensor, past_tk: Tensor, past_tv: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        device = q.device.type
        ctx.tiling = tiling  # type: ignore[attr-defined]
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))  # type: ignore[attr-defined]
        ctx.save_for_backward(q, tk, tv, past_k, past_v, past_tk, past_tv, a, lse, k, v)
        return z.view_as(z), k.view_as(k), v.view_as(v)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dz: Tensor, dk_out: Tensor, dv_out: Tensor) -> tuple[Tensor | None, ...]:
        q, tk, tv, past_k, past_v, past_tk, past_tv, a, lse, k, v = ctx.saved_tensors
        autocast = lambda: torch.autocast(*ctx.autocast)  # noqa: E731 (finish is recomputed as it ran in forward)
        bwd = _Backward(ctx.tiling, q, lse, dk_out.to(a.dtype), dv_out.to(a.dtype))
        bwd.recurrence(k, v, a, dz, autocast)
        d_past = bwd.cache(past_k, past_v)
        dtk, dtv = bwd.temporaries(tk, tv, past_tk, past_tv)
        dq, dk, dv = (_heads_first(g) for g in (bwd.dq, bwd.dk, bwd.dv))
        r0 = past_tk.shape[2]
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return (
            None, None, None, dz, cast(dk, k), cast(dv, v), cast(dq, q), cast(dtk[:, :, r0:], tk),
            cast(dtv[:, :, r0:], tv), cast(d_past[0], past_k), cast(d_past[1], past_v), cast(dtk[:, :, :r0], past_tk),
            cast(dtv[:, :, :r0], past_tv),
        )  # fmt: skip


class _Backward:
    """Gradient accumulators of one backward of ``_TiledRecurrentAttention`` (accumulator dtype),
    position-major like the forward's buffers ([T, B, H, ...], a tile's rows are contiguous
    slices): dq, da, delta = sum_d da * a per query, and dk, dv of the call's persistent pairs
    (started from the gradients of the k, v outputs); beside them the scaled queries and lse."""

    def __init__(self, tiling: _Tiling, q: Tensor, lse: Tensor, dk: Tensor, dv: Tensor) -> None:
        self.tiling, self.lse = tiling, lse.movedim(2, 0)
        self.qs = _position_major(q).mul_(tiling.scale)
        self.dk, self.dv = _position_major(dk), _position_major(dv)
        self.dq, self.da = torch.zeros_like(self.dk), torch.zeros_like(self.dk)
        self.delta = self.lse.new_zeros(self.lse.shape)

    def group(self, c0: int, c1: int, s: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Backward of query rows c0..c1-1 against one group of keys (scores s): adds to dq and
        returns (dk, dv) of the group."""
        rows = lambda x: _heads_first(x[c0:c1])  # noqa: E731
        dq, dk, dv = softmax_backward(
            s, rows(self.lse), rows(self.delta), rows(self.da), rows(self.qs), k, v, self.tiling.scale
        )
        rows(self.dq).add_(dq)
        return dk, dv

    def recurrence(self, k: Tensor, v: Tensor, a: Tensor, dz: Tensor, autocast: Callable[[], Any]) -> None:
        """Blocks in reverse: tile t's backward completes dk, dv of block t, then finish's
        vector-Jacobian product at a_t gives da_t (the tiles of blocks < t need it)."""
        tiling = self.tiling
        kp, vp = _position_major(k), _position_major(v)
        edges = block_edges(tiling.pos0, kp.shape[0], tiling.block)
        bias_cache: dict[tuple[int, int, int], Tensor] = {}
        n_blocks = len(edges) - 1
        for t in reversed(range(n_blocks)):
            P = (t + 1) & -(t + 1)
            k0, k1, qe = edges[t - P + 1], edges[t + 1], edges[min(t + P, n_blocks - 1) + 1]
            K, V = _heads_first(kp[k0:k1]), _heads_first(vp[k0:k1])
            for c0 in range(k1, qe, tiling.query_chunk):  # tile t: keys of blocks t-P+1..t, queries of t+1..t+P
                c1 = min(qe, c0 + tiling.query_chunk)
                bias = _tile_bias(tiling, bias_cache, c0, c1, k0, k1, kp.device, a.dtype)
                dk, dv = self.group(c0, c1, tile_scores(_heads_first(self.qs[c0:c1]), K, bias), K, V)
                _heads_first(self.dk[k0:k1]).add_(dk)
                _heads_first(self.dv[k0:k1]).add_(dv)
            s0, e0 = edges[t], edges[t + 1]
            at = a[:, :, s0:e0]
            grads = (dz[:, s0:e0], _heads_first(self.dk[s0:e0]), _heads_first(self.dv[s0:e0]))
            with autocast():
                da = finish_vjp(tiling.finish, at, s0, e0, grads, torch.compiler.is_dynamo_compiling())
            self.da[s0:e0] = da.movedim(2, 0)
            self.delta[s0:e0] = (da * at).sum(-1).movedim(2, 0)

    def cache(self, past_k: Tensor, past_v: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The cache's part of dq, and the gradients of the cache (None if empty)."""
        S = past_k.shape[2]
        if not S:
            return None, None
        dk, dv = torch.zeros_like(past_k, dtype=self.dq.dtype), torch.zeros_like(past_v, dtype=self.dq.dtype)
        T, chunk = self.qs.shape[0], self.tiling.query_chunk
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            bias = _cache_bias(self.tiling, c0, c1 - c0, S, past_k.device, self.dq.dtype)
            g = self.group(c0, c1, tile_scores(_heads_first(self.qs[c0:c1]), past_k, bias), past_k, past_v)
            dk += g[0]
            dv += g[1]
        return dk, dv

    def temporaries(self, tk: Tensor, tv: Tensor, past_tk: Tensor, past_tv: Tensor) -> tuple[Tensor, Tensor]:
        """The temporaries' part of dq, all blocks at once (the blocked layout of
        ``temporary_stats``; padded query rows get lse = +inf, hence P = 0), and the gradients of
        the r0 + T temporary keys and values (the earlier call's r0 first)."""
        r0, T, b = past_tk.shape[2], self.qs.shape[0], self.tiling.block
        nb = -(-(r0 + T) // b)
        rows = lambda t, value=0.0: _blocks(_heads_first(t), r0, nb, b, value)  # noqa: E731
        qq = rows(self.qs)
        kk, vv = (_blocks(torch.cat(pair, 2), 0, nb, b) for pair in ((past_tk, tk), (past_tv, tv)))
        s = _temporary_scores(qq, kk, self.tiling.bias_fn)
        dq, dk, dv = softmax_backward(
            s, rows(self.lse, float("inf")), rows(self.delta), rows(self.da), qq, kk, vv, self.tiling.scale
        )
        _heads_first(self.dq).add_(_unblock(dq, r0, r0 + T))
        return _unblock(dk, 0, r0 + T), _unblock(dv, 0, r0 + T)


def _bias_needs_grad(bias_fn: BiasFn | None, device: torch.device) -> bool:
    """Whether the bias has a gradient of its own (e.g. learned slopes): probed on one distance."""
    if bias_fn is None:
        return False
    with torch.enable_grad():
        return bias_fn(torch.zeros(1, dtype=torch.long, device=device)).requires_grad


def recurrent_attention_tiled(
    inputs: RecurrentInputs,
    *,
    query_chunk: int = 512,
    finish_inputs: Sequence[Tensor] | None = None,
    update: TileUpdate = tile_update,
) -> tuple[Tensor, Tensor, Tensor]:
    """The exact tiled forward (appendix Algorithm "Exact tiled forward pass", on blocks).
    ``inputs``: see ``RecurrentInputs`` (q, tk, tv [B, H, T, d]: the queries and temporary pairs
    of positions pos0..pos0+T-1). Returns z [B, T, D] and the new persistent pairs k, v [B, H, T, d]. A tile's queries are
    processed ``query_chunk`` rows at a time (memory bound, same result); ``update`` runs each
    tile (``tile_update``, or ``compiled_tile_update()``: the same numbers).

    Gradients. ``finish_inputs`` lists every tensor that finish reads and that may need a
    gradient (the layer input, the parameters); finish must act on each position separately.
    With it, the custom backward of ``_TiledRecurrentAttention`` runs: the tiled forward without
    a graph, then finish once over all positions under autograd (what the tensors finish reads
    get their gradients through), O(N d) saved by the op, scores recomputed; under Dynamo without
    ``torch.autograd.grad`` inside (a training step traces as one graph). The tiled forward
    writes its buffers in place, so it records no graph: where a graph is needed and the custom
    backward cannot run (``finish_inputs`` None and finish reads something that requires grad,
    found by running finish on the first block; or ``bias_fn``'s output requires grad, a
    learned bias), the call falls back to plain autograd through ``recurrent_attention_naive``
    (the same values; O(N^2 d) saved). The custom backward is once differentiable (no double
    backward) and recomputes finish, so finish must be deterministic."""
    q, tk, tv, finish, bias_fn = inputs.q, inputs.tk, inputs.tv, inputs.finish, inputs.bias_fn
    past_k, past_v, past_tk, past_tv, start, scale = inputs.filled()
    tiling = _Tiling(finish, inputs.block, inputs.pos0, start, scale, bias_fn, query_chunk, update)
    tensors = (q, tk, tv, past_k, past_v, past_tk, past_tv)
    if not _needs_graph(tiling, q, tensors, finish_inputs):
        with torch.no_grad():
            out = _tiled_forward(tiling, *tensors)[2]
        assert out is not None
        return out
    if finish_inputs is not None and not _bias_needs_grad(bias_fn, q.device):
        with torch.no_grad():
            a, lse, _ = _tiled_forward(tiling, *tensors, finish_last=False)
        z, k_grad, v_grad = finish(a, 0, q.shape[2])  # the same values, under autograd: see the class
        return _TiledRecurrentAttention.apply(tiling, a, lse, z, k_grad, v_grad, *tensors)
    return recurrent_attention_naive(inputs)


def _needs_graph(tiling: _Tiling, q: Tensor, tensors: Sequence[Tensor], finish_inputs: Sequence[Tensor] | None) -> bool:
    """Whether the call must record a graph: grad mode on and an input or something finish reads
    requires grad (``finish_inputs``; where it is None, finish's outputs on a first block of zeros)."""
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in (*tensors, *(finish_inputs or ()))):
        return True
    if finish_inputs is not None:
        return False
    n = block_edges(tiling.pos0, q.shape[2], tiling.block)[1]
    probe = tiling.finish(q.new_zeros(*q.shape[:2], n, q.shape[3], dtype=acc_dtype(q.dtype)), 0, n)
    return any(t.requires_grad for t in probe)
