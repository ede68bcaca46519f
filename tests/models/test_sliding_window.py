"""A window layer's banded attention (queries in tiles of ``query_tile``, each over the W + m - 1
keys it can see) equals the single masked SDPA over all S + T keys, in logits and gradients,
with a carried cache, document resets that hide part of the cache, S = 0, T not a multiple of
m, T < m and W < m."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import randomize_params

from recurformer import build_model
from recurformer.models import llama
from recurformer.models.llama import Attention

# (window W, query tile m, call lengths T, rows reset before each call)
CASES = [
    (5, 2, [7, 3, 9], [None, [True, False], None]),  # T odd; row 0's start inside the cache
    (5, 3, [12, 2, 4, 13], [None, None, [False, True], None]),  # T < m, T = S + 1, resets
    (3, 8, [20, 5, 17], [None, [True, True], [True, False]]),  # W < m; S = 0 with T > W + m
    (6, 4, [16, 8, 1, 10], [None, [False, True], None, [True, False]]),  # T a multiple of m, T = 1
]


def run(model, calls, resets):
    """Sum of the calls' losses and their logits, the state passed along."""
    state, loss, logits = None, 0.0, []
    for (tokens, targets), fresh in zip(calls, resets):
        if fresh is not None:
            state = state.reset(torch.tensor(fresh))
        out = model(tokens, state=state, targets=targets)
        loss, state = loss + out.loss, out.state
        logits.append(out.logits)
    return loss, torch.cat(logits, 1)


@pytest.mark.parametrize("W, m, lengths, resets", CASES)
def test_banded_attention_equals_single_masked_attention(W, m, lengths, resets, monkeypatch) -> None:
    cfg = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, window=W)
    ref = build_model("sliding_window", cfg).double()
    randomize_params(ref)
    tiled = copy.deepcopy(ref)
    for model, tile in ((ref, None), (tiled, m)):
        for a in model.modules():
            if isinstance(a, Attention):
                a.query_tile = tile
    calls = [(torch.randint(0, 61, (2, T)), torch.randint(0, 61, (2, T))) for T in lengths]
    sdpa, counts = llama.attend, []

    def counting(*args, **kwargs):
        counts[-1] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(llama, "attend", counting)
    counts.append(0)
    loss_r, logits_r = run(ref, calls, resets)
    counts.append(0)
    loss_t, logits_t = run(tiled, calls, resets)
    assert counts[0] == 2 * len(calls) < counts[1]  # one SDPA per layer and call, against tiles
    torch.testing.assert_close(logits_t, logits_r, rtol=1e-10, atol=1e-10)
    loss_r.backward()
    loss_t.backward()
    for (name, p), q in zip(ref.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-10, msg=name)
