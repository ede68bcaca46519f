"""Recurrent attention of the Recurrent Transformer layer (seed 003, §"The Recurrent Transformer
layer", §"Exact Tiling for Training and Prefill", appendix algorithms "Exact tiled forward pass"
and UpdateTile), generalised to blocks of b positions.

One layer, per head, positions grouped into blocks of b (b = 1 is the paper's layer):

    q_i, k~_i, v~_i                       from the layer input x_i (all known up front)
    a_i = softmax_j(q_i . k_j * s + bias(i - j)) v_j   over
          persistent pairs (k_j, v_j) of every position j in an earlier block, and
          temporary pairs (k~_j, v~_j) of positions j <= i in i's own block
    (z_i, k_i, v_i) = finish(a_i)         z_i: layer output; (k_i, v_i): persistent pair from z_i

Two exact evaluations:

* ``recurrent_attention_naive``: one block at a time over the growing prefix (softmax over all
  visible keys at once). O(N^2) K/V reads; the reference.
* ``recurrent_attention_tiled``: all queries up front; online-softmax accumulators (running max m,
  normaliser l, numerator o) per query, first filled with the temporary pairs and with the
  persistent pairs of earlier calls (the cache). Then for block t = 1..nB (1-indexed): its queries
  are complete, so a_t = o_t / l_t, finish() runs once for the whole block, and with P the largest
  power of two dividing t the key tile of blocks t-P+1..t updates the queries of blocks t+1..t+P
  (truncated at nB; any nB). Every (query block > key block) pair is visited exactly once, and
  each key is read O(log N) times. Accumulators are kept in fp32 under bf16/fp16.

Both take the state of earlier calls (persistent cache and the temporaries of an unfinished
block), so a sequence split across calls gives the same result as one call. Autograd runs
through both; the running max is detached (o / l does not depend on it), which keeps the
gradient exact.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# finish(a [B, H, n, d] (accumulator dtype), s, e) -> (z [B, n, D], k [B, H, n, d], v [B, H, n, d])
# for the call's positions s..e-1
Finish = Callable[[Tensor, int, int], tuple[Tensor, Tensor, Tensor]]
# bias(dist) -> additive logit bias [H or 1, *dist.shape] for integer distances dist = i - j >= 0
BiasFn = Callable[[Tensor], Tensor]
Stats = tuple[Tensor, Tensor, Tensor]  # m [B, H, n], l [B, H, n], o [B, H, n, d]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulators for half types, otherwise the input dtype (float64 stays float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def alibi_bias(slopes: Tensor) -> BiasFn:
    """ALiBi: bias_h(i, j) = -m_h (i - j)."""

    def fn(dist: Tensor) -> Tensor:
        return -slopes.view(-1, *([1] * dist.dim())) * dist.to(slopes.dtype)

    return fn


def block_edges(pos0: int, T: int, block: int) -> list[int]:
    """Boundaries (call-relative) of the blocks met by positions pos0..pos0+T-1; the first block
    may be the remainder of a block begun in an earlier call, the last may be unfinished."""
    edges = [0]
    e = min(T, block - pos0 % block)
    while True:
        edges.append(e)
        if e >= T:
            return edges
        e = min(T, e + block)


def tile_schedule(n_blocks: int) -> list[tuple[int, int, int]]:
    """The tiled schedule on block indices 0..n_blocks-1: after block ``t`` (0-based) is
    finished, the key tile of blocks ``t-P+1..t`` updates query blocks ``t+1..hi`` (inclusive),
    with P the largest power of two dividing t+1. Returns (t, P, hi) for the non-empty tiles."""
    out = []
    for t in range(n_blocks):
        P = (t + 1) & -(t + 1)
        hi = min(t + P, n_blocks - 1)
        if t + 1 <= hi:
            out.append((t, P, hi))
    return out


def merge(stats: Stats, s: Tensor, v: Tensor) -> Stats:
    """UpdateTile: fold scores ``s`` [B, H, nq, nk] (scaled, biased, -inf = invisible) and values
    ``v`` [B, H, nk, d] into the running (m, l, o) of the nq queries."""
    m, l, o = stats
    m_new = torch.maximum(m, s.amax(-1)).detach()
    c = torch.exp(m - m_new)
    p = torch.exp(s - m_new.unsqueeze(-1))
    return m_new, l * c + p.sum(-1), o * c.unsqueeze(-1) + torch.matmul(p.to(v.dtype), v).to(o.dtype)


def _visible(qpos: Tensor, kpos: Tensor, block: int, start: Tensor, temporary: bool) -> Tensor:
    """[B, nq, nk] bool: persistent key j is visible at i iff block(j) < block(i) and j >= start
    of the row's document; temporary key j iff block(j) == block(i) and j <= i."""
    qb, kb = (qpos // block)[:, None], (kpos // block)[None, :]
    vis = (qb == kb) & (kpos[None, :] <= qpos[:, None]) if temporary else kb < qb
    return vis[None] & (kpos[None, None, :] >= start[:, None, None])


def _scores(q: Tensor, k: Tensor, scale: float, acc: torch.dtype) -> Tensor:
    return torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale


def temporary_stats(
    q: Tensor, tk: Tensor, tv: Tensor, past_tk: Tensor, past_tv: Tensor, block: int, scale: float, bias_fn: BiasFn | None
) -> Stats:
    """Accumulators of the T queries after their own block's temporary pairs (causal within the
    block, including the r0 temporaries of an unfinished block from an earlier call). The call
    starts r0 positions after a block boundary, so blocks are aligned after prepending them."""
    B, H, T, d = q.shape
    r0 = past_tk.shape[2]
    acc = acc_dtype(q.dtype)
    k, v = torch.cat((past_tk, tk), 2), torch.cat((past_tv, tv), 2)
    R = r0 + T
    nb = -(-R // block)
    pad = nb * block - R
    qq = torch.nn.functional.pad(q, (0, 0, r0, pad)).view(B, H, nb, block, d)
    kk = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, H, nb, block, d)
    vv = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(B, H, nb, block, d)
    s = _scores(qq, kk, scale, acc)  # [B, H, nb, b, b]
    i = torch.arange(block, device=q.device)
    dist = i[:, None] - i[None, :]
    if bias_fn is not None:
        s = s + bias_fn(dist).to(acc).unsqueeze(1)
    s = s.masked_fill(dist < 0, float("-inf"))
    m = s.amax(-1).detach()
    p = torch.exp(s - m.unsqueeze(-1))
    o = torch.matmul(p.to(vv.dtype), vv).to(acc)
    cut = lambda t: t.reshape(B, H, nb * block, *t.shape[4:])[:, :, r0 : r0 + T]  # noqa: E731
    return cut(m), cut(p.sum(-1)), cut(o)


def cache_stats(
    stats: Stats, q: Tensor, past_k: Tensor, past_v: Tensor, pos0: int, block: int, start: Tensor, scale: float, bias_fn: BiasFn | None
) -> Stats:
    """Fold the persistent pairs of earlier calls (positions pos0-S..pos0-1) into the accumulators."""
    S, T = past_k.shape[2], q.shape[2]
    if S == 0:
        return stats
    qpos = torch.arange(pos0, pos0 + T, device=q.device)
    kpos = torch.arange(pos0 - S, pos0, device=q.device)
    s = _scores(q, past_k, scale, stats[0].dtype)
    if bias_fn is not None:
        s = s + bias_fn(qpos[:, None] - kpos[None, :]).to(s.dtype)
    s = s.masked_fill(~_visible(qpos, kpos, block, start, temporary=False)[:, None], float("-inf"))
    return merge(stats, s, past_v)


def recurrent_attention_tiled(
    q: Tensor,
    tk: Tensor,
    tv: Tensor,
    finish: Finish,
    *,
    block: int = 1,
    pos0: int = 0,
    past_k: Tensor | None = None,
    past_v: Tensor | None = None,
    past_tk: Tensor | None = None,
    past_tv: Tensor | None = None,
    start: Tensor | None = None,
    scale: float | None = None,
    bias_fn: BiasFn | None = None,
    query_chunk: int = 512,
) -> tuple[Tensor, Tensor, Tensor]:
    """The exact tiled forward (appendix Algorithm "Exact tiled forward pass", on blocks).
    q, tk, tv: [B, H, T, d] queries and temporary pairs of positions pos0..pos0+T-1.
    Returns z [B, T, D] and the new persistent pairs k, v [B, H, T, d]. A tile's queries are
    processed ``query_chunk`` rows at a time (memory bound, same result)."""
    B, H, T, d = q.shape
    past_k, past_v, past_tk, past_tv, start, scale = _defaults(q, past_k, past_v, past_tk, past_tv, start, scale)
    stats = temporary_stats(q, tk, tv, past_tk, past_tv, block, scale, bias_fn)
    stats = cache_stats(stats, q, past_k, past_v, pos0, block, start, scale, bias_fn)
    edges = block_edges(pos0, T, block)
    sizes = [b - a for a, b in zip(edges, edges[1:])]
    ms, ls, os_ = (list(t.split(sizes, 2)) for t in stats)
    zs: list[Tensor] = []
    ks: list[Tensor] = []
    vs: list[Tensor] = []
    bias_cache: dict[tuple[int, int, int], Tensor] = {}
    n_blocks = len(sizes)
    for t in range(n_blocks):
        s0, e0 = edges[t], edges[t + 1]
        z, k, v = finish(os_[t] / ls[t].unsqueeze(-1), s0, e0)  # block t is complete
        zs.append(z)
        ks.append(k)
        vs.append(v)
        P = (t + 1) & -(t + 1)
        lo, hi = t + 1, min(t + P, n_blocks - 1)
        if lo > hi:
            continue
        K = ks[t] if P == 1 else torch.cat(ks[t - P + 1 :], 2)
        V = vs[t] if P == 1 else torch.cat(vs[t - P + 1 :], 2)
        qs, qe, ks0 = edges[lo], edges[hi + 1], edges[t - P + 1]
        st = (ms[lo], ls[lo], os_[lo]) if lo == hi else tuple(torch.cat(x[lo : hi + 1], 2) for x in (ms, ls, os_))
        parts = []
        for c0 in range(qs, qe, query_chunk):  # rows are independent: bound the [B, H, rows, P] scores
            c1 = min(qe, c0 + query_chunk)
            s = _scores(q[:, :, c0:c1], K, scale, st[0].dtype)
            if bias_fn is not None:
                key = (c0 - ks0, c1 - c0, e0 - ks0)
                if key not in bias_cache:
                    i = torch.arange(c0, c1, device=q.device)
                    j = torch.arange(ks0, e0, device=q.device)
                    bias_cache[key] = bias_fn(i[:, None] - j[None, :]).to(s.dtype)
                s = s + bias_cache[key]
            parts.append(merge(tuple(x[:, :, c0 - qs : c1 - qs] for x in st), s, V))  # type: ignore[arg-type]
        m, l, o = parts[0] if len(parts) == 1 else (torch.cat(x, 2) for x in zip(*parts))
        if lo == hi:
            ms[lo], ls[lo], os_[lo] = m, l, o
        else:
            part = sizes[lo : hi + 1]
            ms[lo : hi + 1], ls[lo : hi + 1], os_[lo : hi + 1] = m.split(part, 2), l.split(part, 2), o.split(part, 2)
    return torch.cat(zs, 1), torch.cat(ks, 2), torch.cat(vs, 2)


def recurrent_attention_naive(
    q: Tensor,
    tk: Tensor,
    tv: Tensor,
    finish: Finish,
    *,
    block: int = 1,
    pos0: int = 0,
    past_k: Tensor | None = None,
    past_v: Tensor | None = None,
    past_tk: Tensor | None = None,
    past_tv: Tensor | None = None,
    start: Tensor | None = None,
    scale: float | None = None,
    bias_fn: BiasFn | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference: one block at a time, each query block attending (plain softmax) to the whole
    visible prefix of persistent pairs plus its block's temporary pairs. Same I/O as the tiled op."""
    B, H, T, d = q.shape
    past_k, past_v, past_tk, past_tv, start, scale = _defaults(q, past_k, past_v, past_tk, past_tv, start, scale)
    acc = acc_dtype(q.dtype)
    S, r0 = past_k.shape[2], past_tk.shape[2]
    edges = block_edges(pos0, T, block)
    zs: list[Tensor] = []
    ks: list[Tensor] = [past_k]
    vs: list[Tensor] = [past_v]
    for t in range(len(edges) - 1):
        s0, e0 = edges[t], edges[t + 1]
        qpos = torch.arange(pos0 + s0, pos0 + e0, device=q.device)
        Kp, Vp = torch.cat(ks, 2), torch.cat(vs, 2)  # persistent pairs of positions pos0-S .. pos0+s0-1
        kpos_p = torch.arange(pos0 - S, pos0 + s0, device=q.device)
        tlo = s0 - r0 if t == 0 else s0  # temporaries of this block (the unfinished one included)
        Kt = torch.cat((past_tk, tk[:, :, s0:e0]), 2) if t == 0 else tk[:, :, s0:e0]
        Vt = torch.cat((past_tv, tv[:, :, s0:e0]), 2) if t == 0 else tv[:, :, s0:e0]
        kpos_t = torch.arange(pos0 + tlo, pos0 + e0, device=q.device)
        qb = q[:, :, s0:e0]
        sp, stt = _scores(qb, Kp, scale, acc), _scores(qb, Kt, scale, acc)
        if bias_fn is not None:
            sp = sp + bias_fn(qpos[:, None] - kpos_p[None, :]).to(acc)
            stt = stt + bias_fn(qpos[:, None] - kpos_t[None, :]).to(acc)
        sp = sp.masked_fill(~_visible(qpos, kpos_p, block, start, temporary=False)[:, None], float("-inf"))
        stt = stt.masked_fill(~_visible(qpos, kpos_t, block, start, temporary=True)[:, None], float("-inf"))
        p = torch.softmax(torch.cat((sp, stt), -1), -1)
        a = torch.matmul(p.to(Vp.dtype), torch.cat((Vp, Vt), 2)).to(acc)
        z, k, v = finish(a, s0, e0)
        zs.append(z)
        ks.append(k)
        vs.append(v)
    return torch.cat(zs, 1), torch.cat(ks[1:], 2), torch.cat(vs[1:], 2)


def _defaults(q, past_k, past_v, past_tk, past_tv, start, scale):  # type: ignore[no-untyped-def]
    B, H, _, d = q.shape
    empty = q.new_zeros(B, H, 0, d)
    return (
        empty if past_k is None else past_k,
        empty if past_v is None else past_v,
        empty if past_tk is None else past_tk,
        empty if past_tv is None else past_tv,
        torch.zeros(B, dtype=torch.long, device=q.device) if start is None else start,
        d**-0.5 if scale is None else scale,
    )


def kv_reads(n: int, block: int = 1, schedule: str = "tiled") -> int:
    """Number of persistent K/V positions read (per batch row and head) by one layer over n
    positions: the naive schedule re-reads the whole prefix for every block (Θ(N^2)); the tiled
    one reads each key tile once per tile update (Θ(N log N)). Temporary pairs (read once each)
    are left out of both."""
    nb = -(-n // block)
    if schedule == "naive":
        return sum(min(t * block, n) for t in range(nb))
    edges = block_edges(0, n, block)
    return sum(edges[t + 1] - edges[t - P + 1] for t, P, _ in tile_schedule(nb))
