"""The naive recurrent attention: one block at a time over the growing prefix, a plain softmax over
every visible key (O(N^2) K/V reads); the reference that ``tiled`` is tested against, and the
fallback where its custom backward cannot run."""

from __future__ import annotations

import torch
from torch import Tensor

from ...modules import acc_dtype
from .common import RecurrentInputs, block_edges, scores, visible


def recurrent_attention_naive(inputs: RecurrentInputs) -> tuple[Tensor, Tensor, Tensor]:
    """Reference: one block at a time, each query block attending (plain softmax) to the whole
    visible prefix of persistent pairs plus its block's temporary pairs. Same I/O as the tiled op."""
    q, tk, tv, finish, block, pos0, bias_fn = (
        inputs.q, inputs.tk, inputs.tv, inputs.finish, inputs.block, inputs.pos0, inputs.bias_fn
    )  # fmt: skip
    B, H, T, d = q.shape
    past_k, past_v, past_tk, past_tv, start, scale = inputs.filled()
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
        sp, stt = scores(qb, Kp, scale, acc), scores(qb, Kt, scale, acc)
        if bias_fn is not None:
            sp = sp + bias_fn(qpos[:, None] - kpos_p[None, :]).to(acc)
            stt = stt + bias_fn(qpos[:, None] - kpos_t[None, :]).to(acc)
        sp = sp.masked_fill(~visible(qpos, kpos_p, block, start, temporary=False)[:, None], float("-inf"))
        stt = stt.masked_fill(~visible(qpos, kpos_t, block, start, temporary=True)[:, None], float("-inf"))
        p = torch.softmax(torch.cat((sp, stt), -1), -1)
        a = torch.matmul(p.to(Vp.dtype), torch.cat((Vp, Vt), 2)).to(acc)
        z, k, v = finish(a, s0, e0)
        zs.append(z)
        ks.append(k)
        vs.append(v)
    return torch.cat(zs, 1), torch.cat(ks[1:], 2), torch.cat(vs[1:], 2)
