"""FLOP counting and the matmul peak (flops.py): counts checked against the closed form where one
exists (the trainer's fraction of peak: tests/training/test_trainer.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recurformer import build_model
from recurformer.flops import forward_flops_per_token, matmul_peak, train_flops_per_token
from recurformer.models.llama import Attention

CFG = dict(vocab_size=97, dim=32, n_layers=3, n_heads=4)


def closed_form(model: torch.nn.Module, T: int, window: int | None) -> float:
    """2 x parameters (tied embedding: the lookup is free, the output head is a matmul) plus, per
    layer, 2 x (d for q.k + d for p.v) x the (query, key) pairs the causal (windowed) mask shows."""
    c = model.config
    pairs = sum(min(i + 1, window or T) for i in range(T))
    return 2 * sum(p.numel() for p in model.parameters() if p.dim() >= 2) + c.n_layers * 2 * pairs * 2 * c.dim / T


@pytest.mark.parametrize("name,extra,window", [("llama", {}, None), ("sliding_window", dict(window=7), 7)])
def test_attention_counted_by_visible_pairs(name, extra, window) -> None:
    model = build_model(name, dict(CFG, **extra))
    T = 40
    assert forward_flops_per_token(model, T) == pytest.approx(closed_form(model, T, window), rel=1e-12)
    assert train_flops_per_token(model, T) == pytest.approx(3 * closed_form(model, T, window), rel=1e-12)


def test_memory_attention_counts_its_memory() -> None:
    """Memory Attention's extra work over Llama: the evolved memory's FFN and K/V (one memory row per
    chunk token, eq. 2) and C more keys for every query; Wq of memory rows is never computed."""
    T, C = 64, 8
    ma = build_model("memory_attention", dict(CFG, chunk_size=C))
    llama = build_model("llama", CFG)
    c = ma.config
    ffn = sum(p.numel() for p in ma.layers[0].attn.mem_ffn.parameters())
    per_layer = 2 * ffn + 2 * 2 * c.dim**2  # memory FFN + memory K and V, per token
    attn_diff = 2 * 2 * c.dim * (sum(C + i % C + 1 for i in range(T)) - sum(i + 1 for i in range(T))) / T
    want = forward_flops_per_token(llama, T) + c.n_layers * (per_layer + attn_diff)
    assert forward_flops_per_token(ma, T) == pytest.approx(want, rel=1e-12)


def test_matmul_peak_is_positive_and_leaves_the_rng_alone() -> None:
    torch.manual_seed(3)
    want = torch.rand(3)
    torch.manual_seed(3)
    peak = matmul_peak(torch.float32, "cpu", n=128, seconds=0.05)
    assert torch.equal(torch.rand(3), want)
    assert 1e6 < peak < 1e15


class Attend(torch.nn.Module):
    """One SDPA call over fixed q, k, v with a mask given as booleans, as an additive bias, or as
    the causal flag."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 7, 8), torch.zeros(2, 3, 7, 4)
        visible = torch.ones(5, 7, dtype=torch.bool).tril()  # SDPA's causal mask: query i sees keys 0..i
        if self.how == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = visible if self.how == "bool" else torch.zeros(5, 7).masked_fill(~visible, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("how", ["bool", "additive", "causal"])
def test_sdpa_counted_by_visible_pairs_whatever_the_mask(how) -> None:
    """On CPU an additive mask runs SDPA's math path (dense bmm): still only the visible pairs count."""
    visible = sum(i + 1 for i in range(5))
    assert forward_flops_per_token(Attend(how), 1) == 2 * 2 * 3 * visible * (8 + 4)


def test_block_recurrent_count_does_not_depend_on_query_tiles() -> None:
    """Query tiles read W + m - 1 keys of which W are visible: the count is the visible pairs, the
    same at any tile size (a dense count of the tiles' keys would not be)."""
    cfg = dict(CFG, block_size=8)
    counts = {
        m: forward_flops_per_token(build_model("block_recurrent", dict(cfg, query_tile=m)), 20) for m in (1, 3, 8)
    }
    assert counts[1] == counts[3] == counts[8]


def test_window_count_does_not_depend_on_query_tiles() -> None:
    """A window layer's bands of W + m - 1 keys: the count is the visible pairs, the same as the
    single masked attention's (query_tile None) and the closed form, at any tile size."""
    model = build_model("sliding_window", dict(CFG, window=4))
    counts = {}
    for m in (None, 1, 3, 8):
        for a in model.modules():
            if isinstance(a, Attention):
                a.query_tile = m
        counts[m] = forward_flops_per_token(model, 20)
    assert counts[None] == counts[1] == counts[3] == counts[8] == closed_form(model, 20, 4)
