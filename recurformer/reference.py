"""Slow references, read literally from the papers, that the fast models are tested against (as
fla keeps ``naive.py`` beside each kernel). They run the model's own weights without caching or
batching tricks; the fast code lives in ``models/`` and ``ops/``."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import RecurformerError
from .models.memory_attention import MemoryAttention, MemoryAttentionConfig, MemoryAttentionLayer
from .modules import apply_rope, rope_cos_sin
from .nn import Block


def algorithm_1(model: MemoryAttention, tokens: Tensor) -> Tensor:
    """Algorithm 1 of "Block-wise Recurrent Transformer" (Liang), read literally: the slow
    reference that the tests hold ``MemoryAttention`` to, and a row of benchmarks/throughput.py. One chunk at a time, nothing batched or cached: Q/K/V of
    the concatenation [M'; X_t] (memory queries computed, then their rows discarded), RoPE over the
    concatenation at positions 0..2C-1, a square causal mask, O_t = output[:, C:]. Returns the
    logits [B, T, V] of a fresh state; T must be a multiple of C, and every layer a memory layer."""
    c = cast(MemoryAttentionConfig, model.config)
    C, H = c.chunk_size, c.n_heads
    B, T = tokens.shape
    blocks = [cast(Block, b) for b in model.layers]
    if T % C or any(not isinstance(b.attn, MemoryAttentionLayer) for b in blocks):
        raise RecurformerError("algorithm_1 reads whole chunks through memory layers only")
    h = model.tok_emb(tokens)
    cos, sin = rope_cos_sin(torch.arange(2 * C, device=h.device), c.head_dim, c.rope_theta, h.dtype)
    for block in blocks:
        att = cast(MemoryAttentionLayer, block.attn)
        x_all = block.attn_norm(h)
        mem = att.init_memory.expand(B, C, c.dim) if c.init_memory == "learned" else x_all.new_zeros(B, C, c.dim)
        outs = []
        for t in range(T // C):
            x = x_all[:, t * C : (t + 1) * C]
            m = mem
            if c.memory_ffn:
                m = m + att.mem_ffn(att.mem_ffn_norm(m))
            if c.memory_norm:
                m = att.mem_norm(m)
            wk, wv = (att.wkm, att.wvm) if c.memory_qkv == "separate" else (att.wk, att.wv)
            seq_q = torch.cat((att.wq(m), att.wq(x)), 1)  # memory queries from wq (the code used wk: a bug)
            seq_k = torch.cat((wk(m), att.wk(x)), 1)
            seq_v = torch.cat((wv(m), att.wv(x)), 1)
            q, k, v = (s.view(B, 2 * C, H, -1).transpose(1, 2) for s in (seq_q, seq_k, seq_v))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, 2C, d]
            o = o.transpose(1, 2).reshape(B, 2 * C, c.dim)[:, C:]  # discard the memory rows
            out = att.wo(o)
            new = o if c.memory_source == "pre_wo" else out
            if c.memory_update == "gated":  # g = sigmoid(W_g [M'; O]), M <- g M' + (1 - g) O
                g = torch.sigmoid(att.mem_gate(torch.cat((m, new), -1)))
                new = g * m + (1 - g) * new
            elif c.memory_update == "write_gate":  # g = sigmoid(W_g O), M <- M + g (O - M)
                new = mem + torch.sigmoid(att.write_gate.proj(new)) * (new - mem)
            mem = new
            outs.append(out)
        h = h + torch.cat(outs, 1)
        h = h + block.ffn(block.ffn_norm(h))
    return F.linear(model.norm(h), model.tok_emb.weight)
