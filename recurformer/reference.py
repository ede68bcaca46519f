"""Slow references, read literally from the papers, that the fast models are tested against (as
fla keeps ``naive.py`` beside each kernel): Memory Attention's Algorithm 1, the RMT and ARMT one
segment at a time. They run the model's own weights without caching or
batching tricks; the fast code lives in ``models/`` and ``ops/``."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import RecurformerError
from .models.armt import Associative, AssociativeBlock
from .models.memory_attention import MemoryAttention, MemoryAttentionConfig, MemoryAttentionLayer
from .models.rmt import RMT, RMTAttention
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


def rmt_segments(model: RMT, tokens: Tensor) -> Tensor:
    """The Recurrent Memory Transformer (Bulatov et al. 2022, §3, the decoder) read literally: the
    slow reference that the tests hold ``RMT`` to. Logits [B, T, V] of a fresh state, one segment
    at a time: [H^mem; E(x); H^mem] through every block with a square causal mask and RoPE at
    0..2M+S-1 (``block_literal``); the new memory is the final-normed output of the write slots
    (held by the write gate with ``memory_update: write_gate``). T need not be a multiple of S (the
    last segment is short and writes no memory)."""
    c = model.config
    S, M = c.segment_len, c.memory_size
    B, T = tokens.shape
    memory = model.init_memory.expand(B, M, c.dim)
    out = []
    for a in range(0, T, S):
        x = model.tok_emb(tokens[:, a : a + S])
        n = x.shape[1]
        h = torch.cat((memory, x, memory), 1)
        cos, sin = rope_cos_sin(torch.arange(h.shape[1]), c.head_dim, c.rope_theta, h.dtype)
        for block in model.layers:
            h = block_literal(cast(Block, block), h, cos, sin)
        out.append(model.norm(h[:, M : M + n]))
        new = model.norm(h[:, -M:])
        if model.write_gate is not None:  # g = sigmoid(W_g new + b_g), M <- M + g (new - M)
            new = memory + torch.sigmoid(model.write_gate.proj(new)) * (new - memory)
        memory = new
    return F.linear(torch.cat(out, 1), model.tok_emb.weight)


def block_literal(block: Block, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """One pre-norm RMT block over a whole extended segment h [B, L, D], one causal mask."""
    att = cast(RMTAttention, block.attn)
    c = att.cfg
    B, u = h.shape[0], block.attn_norm(h)
    q, k, v = (w(u).view(B, -1, c.n_heads, c.head_dim).transpose(1, 2) for w in (att.wq, att.wk, att.wv))
    o = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True)
    h = h + att.wo(o.transpose(1, 2).reshape(B, -1, c.dim))
    return h + block.ffn(block.ffn_norm(h))


def phi_literal(x: Tensor, nu: int = 3) -> Tensor:
    """DPFP of one vector x [d]: r = (relu(x_1..x_d), relu(-x_1..-x_d)), phi = (r_i r_{i-j mod 2d})
    for j = 1..nu, i = 1..2d."""
    r = [a.clamp(min=0) for a in x] + [(-a).clamp(min=0) for a in x]
    n = len(r)
    return torch.stack([r[i] * r[(i - j) % n] for j in range(1, nu + 1) for i in range(n)])


def feature_literal(x: Tensor) -> Tensor:
    """ARMT's feature of one vector (the authors' code): DPFP divided by its Euclidean length."""
    f = phi_literal(x)
    return f / torch.sqrt(sum(a * a for a in f))


def read_literal(assoc: Associative, x: Tensor, A: Tensor, z: Tensor) -> Tensor:
    """ARMT's read (Rodkin et al. 2024, §3) of one row x [D]: phi(W_q x) A / (z . phi(W_q x) + eps)."""
    q = feature_literal(assoc.wq.weight @ x)
    return cast(Tensor, sum(q[f] * A[f] for f in range(len(q))) / (sum(z[f] * q[f] for f in range(len(q))) + assoc.eps))


def write_literal(assoc: Associative, m: Tensor, A: Tensor, z: Tensor) -> tuple[Tensor, Tensor, list[float]]:
    """ARMT's write (§3) of the slots' outputs m [M, D], one slot at a time, every slot reading the
    A and z of before the segment; returns (A, z, the gammas)."""
    A_new, z_new, gammas = A, z, []
    for mi in m:
        k = feature_literal(assoc.wk.weight @ mi)
        v = assoc.wv.weight @ mi
        beta = torch.sigmoid(assoc.wb.weight[0] @ mi + assoc.wb.bias[0])
        vbar = (k @ A) / (z @ k + assoc.eps)
        gamma = torch.clamp(1 - (z @ k) / (k @ k), 0, 1).detach()
        A_new = A_new + beta * torch.outer(k, v - vbar)
        z_new = z_new + gamma * k
        gammas.append(float(gamma))
    return A_new, z_new, gammas


def armt_segments(model: RMT, tokens: Tensor) -> tuple[Tensor, list[list[Tensor]], list[list[Tensor]]]:
    """The Associative Recurrent Memory Transformer (Rodkin et al. 2024, §3) read literally, in
    float64: logits of a fresh state and every layer's final (A, z) per batch row, one segment at a
    time: the same learned slots [init_memory; E(x); init_memory] every segment ([E(x);
    init_memory] with ``read_slots: false``); before each layer every row of every batch row gets
    its read added (``read_literal``); after a full segment each layer writes its write slots'
    outputs (``write_literal``)."""
    c = model.config
    S, M, N, R = c.segment_len, c.memory_size, c.n_layers, c.n_read
    B, T = tokens.shape
    K = Associative.features(c.assoc_dim)
    A = [[torch.zeros(K, c.dim, dtype=torch.float64) for _ in range(B)] for _ in range(N)]
    z = [[torch.zeros(K, dtype=torch.float64) for _ in range(B)] for _ in range(N)]
    slots = model.init_memory.expand(B, M, c.dim)
    out = []
    for a in range(0, T, S):
        x = model.tok_emb(tokens[:, a : a + S])
        n = x.shape[1]
        h = torch.cat((slots[:, :R], x, slots), 1)
        cos, sin = rope_cos_sin(torch.arange(h.shape[1]), c.head_dim, c.rope_theta, h.dtype)
        for i, layer in enumerate(model.layers):
            block = cast(AssociativeBlock, layer)
            reads = [
                [read_literal(block.assoc, h[b, p], A[i][b], z[i][b]) for p in range(h.shape[1])] for b in range(B)
            ]
            h = h + torch.stack([torch.stack(r) for r in reads])
            h = block_literal(block, h, cos, sin)
            if n == S:
                for b in range(B):
                    A[i][b], z[i][b], _ = write_literal(block.assoc, h[b, -M:], A[i][b], z[i][b])
        out.append(model.norm(h[:, R : R + n]))
    return F.linear(torch.cat(out, 1), model.tok_emb.weight), A, z
