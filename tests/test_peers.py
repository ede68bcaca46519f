"""benchmarks/peers.py counts a peer's FLOPs in the peer's own process with its own copy of
``recurformer.flops``' rule (FlopCounterMode, SDPA by the pairs its mask shows): on our models the
copy must give our count, or the per-FLOP ratios compare different rules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import peers  # noqa: E402

from recurformer import build_model  # noqa: E402
from recurformer.flops import train_flops_per_token  # noqa: E402

TINY = dict(vocab_size=64, dim=16, n_layers=2, n_heads=2)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("llama", {}),
        ("sliding_window", dict(window=8)),  # an SDPA mask, not is_causal
        ("rmt", dict(segment_len=8, memory_size=4)),
        ("block_recurrent", dict(block_size=8, recurrent_layers=(0,))),
        ("memory_attention", dict(chunk_size=8)),
    ],
)
def test_peer_flop_count_matches_ours(name: str, extra: dict) -> None:
    torch.manual_seed(0)
    model = build_model(name, {**TINY, **extra})
    T = 24
    theirs = peers.peer_train_flops(model, lambda x: model(x[:, :-1]), T)
    assert theirs == train_flops_per_token(model, T)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_train_step_runs_under_the_precision(precision: str, dtype: torch.dtype) -> None:
    """--precision bf16 puts each side's forward under CPU bf16 autocast; the weights stay fp32 and
    are updated."""
    model = build_model("llama", TINY)
    seen: set[torch.dtype] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda _m, _i, o: seen.add(o.dtype))
    x = torch.randint(0, TINY["vocab_size"], (2, 9))
    before = [p.detach().clone() for p in model.parameters()]
    peers.train_step(model, lambda: model(x[:, :-1], targets=x[:, 1:]).loss, precision)()
    assert seen == {dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_ours_set_reaches_our_model_and_a_wrong_key_is_one_line(monkeypatch, capsys) -> None:
    """--ours-set configures our side of every pair; a key our model lacks stops the run before any
    worker starts, in one line naming it."""
    c = dict(vocab=64, dim=16, depth=3, heads=2, segment=8, memory=4, chunk=8, batch=1, seq=16, precision="fp32")
    model, _, _ = peers.build_ours("block_recurrent", {**c, "ours_set": {"position": "rope"}})
    assert model.config.position == "rope"
    monkeypatch.setattr(
        sys, "argv", ["peers.py", "--pairs", "block_recurrent", "--venv", "/nonexistent", "--ours-set", "positon=rope"]
    )
    with pytest.raises(SystemExit) as e:
        peers.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--ours-set" in err[-1] and "positon" in err[-1]
