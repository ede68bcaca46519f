"""Checkpoints written by the format-1 code (tests/fixtures/ckpt_v1, see its README) load with
today's names and compute the logits the old code computed, fresh and from the carried state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recurformer.hub import load

FIXTURES = Path(__file__).parent / "fixtures" / "ckpt_v1"
# the models that the format-1 code had (the RMT came later, with format 2)
FORMAT1 = ("block_recurrent", "llama", "memory_attention", "recurrent_transformer", "sliding_window", "transformer_xl")


@pytest.mark.parametrize("name", FORMAT1)
def test_format1_checkpoint_loads_and_computes_the_same(name) -> None:
    loaded = load(FIXTURES / name)
    model, got_name = loaded.model, loaded.name
    assert got_name == name
    model = model.double()
    exp = load_file(FIXTURES / name / "expected.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(model(exp["tokens"]).logits[..., :8], exp["logits"], rtol=1e-9, atol=1e-9)
        state = model.state_from_flat(load_file(FIXTURES / name / "state.safetensors")).to(torch.float64)
        logits = model(exp["tokens"], state=state).logits[..., :8]
    torch.testing.assert_close(logits, exp["logits_from_state"], rtol=1e-9, atol=1e-9)
