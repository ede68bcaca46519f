"""The length-extrapolation evaluator: streaming equals one whole-window forward, exactly K
scored tokens, and bounded memory for a recurrent model at long lengths."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TEST_CONFIGS, randomize_params

from recurformer import build_model
from recurformer.evaluate import evaluate_lengths, score_windows


@pytest.mark.parametrize("name", ["memory_attention", "llama", "transformer_xl", "block_recurrent"])
def test_chunked_streaming_loss_equals_whole_forward(name) -> None:
    model = build_model(name, TEST_CONFIGS[name][0]).double().eval()
    randomize_params(model, 0.1)
    windows = torch.randint(0, 61, (3, 90 + 1))
    loss, correct, n = score_windows(model, windows, last=25, chunk=13, batch_size=2)
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits[:, -25:]
    ref = F.cross_entropy(logits.flatten(0, 1), windows[:, -25:].flatten(), reduction="sum")
    assert n == 3 * 25
    assert abs(loss - float(ref)) < 1e-9 * abs(float(ref))
    assert correct == float((logits.argmax(-1) == windows[:, -25:]).sum())


def test_last_k_counts_exactly_k_tokens() -> None:
    model = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0]).eval()
    tokens = np.random.default_rng(0).integers(0, 61, 5000)
    rs = evaluate_lengths(model, tokens, [64, 300], last=50, windows=3, chunk=32)
    assert [r.scored_tokens for r in rs] == [150, 150]
    from recurformer.data import eval_windows

    short, long = (eval_windows(tokens, L, 4, seed=1, context=300) for L in (64, 300))
    assert torch.equal(short, long[:, -65:])  # every length scores the same targets
    with pytest.raises(Exception, match="shorter than --last"):
        evaluate_lengths(model, tokens, [20], last=50, windows=1)


PROBE = """
import json, sys, numpy as np, torch
from recurformer import build_model
from recurformer.evaluate import evaluate_lengths
torch.manual_seed(0)
name, L = sys.argv[1], int(sys.argv[2])
extra = {"memory_attention": {"chunk_size": 32}}.get(name, {})
model = build_model(name, dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, **extra)).eval()
tokens = np.random.default_rng(0).integers(0, 256, 20000)
evaluate_lengths(model, tokens, [256], last=256, windows=1, chunk=256)  # warm-up: lazy allocations
(r,) = evaluate_lengths(model, tokens, [L], last=256, windows=1, chunk=256)
print(json.dumps({"peak": r.peak_memory_mb}))
"""


def peak(name: str, L: int) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, name, str(L)], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": ""})
    return json.loads(out.stdout)["peak"]


@pytest.mark.slow
def test_recurrent_memory_is_bounded_at_long_lengths() -> None:
    """Peak RSS while evaluating one window (a fresh process, the peak counter restarted after a
    warm-up): Memory Attention and the RMT at L=16384 stay within 1.2x of L=1024; the same measurement on
    Llama (its KV cache grows with L) exceeds 1.2x, so the measurement can tell them apart."""
    peaks = {(m, L): peak(m, L) for m in ("memory_attention", "rmt", "llama") for L in (1024, 16384)}
    ma = peaks["memory_attention", 16384] / peaks["memory_attention", 1024]
    rmt = peaks["rmt", 16384] / peaks["rmt", 1024]
    llama = peaks["llama", 16384] / peaks["llama", 1024]
    assert ma <= 1.2, peaks
    assert rmt <= 1.2, peaks
    assert llama > 1.2, peaks
