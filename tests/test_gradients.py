"""Gradients follow the streaming contract too: for every test config of every registered model,
the parameter gradients of one call over T tokens equal those of the same tokens split over
several calls with the state carried (not detached), and a learned initial state receives the same
gradient both ways."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from helpers import all_cases, case_id, randomize_params

from recurformer import build_model

CASES = all_cases()
INITIAL = ("init_memory", "initial_state")  # learned initial states (Memory Attention, Block-Recurrent)


def grads(model, tokens, weights, cuts) -> dict[str, torch.Tensor]:
    """d/dθ of sum(logits * weights) over the calls that the ``cuts`` make, state carried."""
    model.zero_grad()
    state, a, loss = None, 0, 0.0
    for b in list(cuts) + [tokens.shape[1]]:
        out = model(tokens[:, a:b], state=state)
        loss = loss + (out.logits * weights[:, a:b]).sum()
        state, a = out.state, b
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_split_calls_give_the_gradient_of_one_call(case) -> None:
    name, cfg = case
    rng = random.Random(zlib.crc32(case_id(case).encode()))
    model = build_model(name, cfg).double()
    randomize_params(model, 0.2)
    B, T = 2, 23
    tokens = torch.randint(0, cfg["vocab_size"], (B, T))
    weights = torch.randn(B, T, cfg["vocab_size"], dtype=torch.float64)
    whole = grads(model, tokens, weights, [])
    assert len(whole) == len(list(model.parameters()))  # every parameter is used
    for cuts in (sorted(rng.sample(range(1, T), 3)), range(1, T)):
        split = grads(model, tokens, weights, cuts)
        assert split.keys() == whole.keys()
        for n in whole:
            torch.testing.assert_close(split[n], whole[n], rtol=1e-9, atol=1e-9, msg=n)
    learned = [n for n in whole if n.endswith(INITIAL)]
    assert all(whole[n].abs().max() > 0 for n in learned)  # the learned initial state is trained
    if cfg.get("init_memory") == "learned" or name in ("block_recurrent", "rmt"):
        assert learned
