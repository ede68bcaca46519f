"""benchmarks/extrapolation.py: the paired differences the results page rests on are taken at the
right lengths (the longest both rows measured, or the one a claim names) and flagged as excluding 0
only when their interval does."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import extrapolation  # noqa: E402

from recurformer.evaluate.results import LengthResult  # noqa: E402

DOCS = 40
TOKENS = np.full(DOCS, 100.0)


def rows(lengths: list[int], per_token: np.ndarray) -> list[LengthResult]:
    """Results at ``lengths`` whose document d has mean loss per_token[d] at every length."""
    loss = per_token * TOKENS
    return [
        LengthResult(
            L, float(loss.sum() / TOKENS.sum()), 0.0, 0.0, 0.0, 4000, 16, DOCS, "documents", 1.0, 1.0, loss, TOKENS
        )
        for L in lengths
    ]


def test_claims_pick_their_lengths_and_say_whether_zero_is_excluded() -> None:
    rng = np.random.default_rng(0)
    base = 3.0 + rng.normal(0, 0.3, DOCS)  # documents differ much more than the models do
    long, dense = [256, 512, 4096, 16384], [256, 512, 4096]
    noise = rng.normal(0, 0.05, DOCS)
    results = {
        "Memory Attention": rows(long, base),
        "Memory Attention, warm start": rows(long, base),
        "Llama (RoPE)": rows(dense, base + 0.5),  # worse everywhere
        "Llama, 256 window": rows(long, base + 0.01),  # slightly worse, but in every document
        "Transformer-XL": rows(long, base + noise - noise.mean()),  # no difference on average
        "Mem (Full Stateful)": rows(long, base),
    }
    got = {(c["model"], c["reference"]): c for c in extrapolation.claims(results)}
    assert set(got) == {
        ("Llama (RoPE)", "Memory Attention"),
        ("Llama, 256 window", "Memory Attention"),
        ("Transformer-XL", "Memory Attention"),
        ("Llama (RoPE)", "Llama, 256 window"),
        ("Memory Attention", "Memory Attention, warm start"),
    }  # rows not evaluated (sliding window, Block-Recurrent, Table 2's strategies) are left out
    llama = got[("Llama (RoPE)", "Memory Attention")]
    assert llama["length"] == 4096 and abs(llama["diff"] - 0.5) < 1e-12 and llama["excludes_0"]
    window = got[("Llama, 256 window", "Memory Attention")]
    assert window["length"] == 16384 and window["low"] > 0 and window["excludes_0"]
    xl = got[("Transformer-XL", "Memory Attention")]
    assert abs(xl["diff"]) < 1e-12 and xl["low"] < 0 < xl["high"] and not xl["excludes_0"]
    assert got[("Llama (RoPE)", "Llama, 256 window")]["length"] == 4096
    cold = got[("Memory Attention", "Memory Attention, warm start")]
    assert cold["length"] == 256 and cold["diff"] == 0.0 and not cold["excludes_0"]
    table = extrapolation.claims_table(list(got.values()))
    assert "| Llama (RoPE) − Memory Attention | 4096 | +0.500 [+0.500, +0.500] | yes |" in table


def test_saved_results_come_back_only_for_the_same_settings(tmp_path) -> None:
    rs = rows([256, 512], 3.0 + np.random.default_rng(1).normal(0, 0.3, DOCS))
    rs[1].doc_loss = rs[1].doc_loss + 1.0
    what = dict(checkpoint="runs/x/step_000100", saved=1, lengths=[256, 512], windows=16, context=17408)
    path = tmp_path / "raw" / "x.npz"
    assert extrapolation.load_results(path, what) is None
    assert extrapolation.save_results(path, what, rs) is rs
    back = extrapolation.load_results(path, what)
    assert back is not None and [r.to_dict() for r in back] == [r.to_dict() for r in rs]
    assert all(
        np.array_equal(a.doc_loss, b.doc_loss) and np.array_equal(a.doc_tokens, b.doc_tokens) for a, b in zip(back, rs)
    )
    assert extrapolation.load_results(path, what | {"windows": 32}) is None  # other windows: evaluate again
    assert extrapolation.load_results(path, what | {"saved": 2}) is None  # the checkpoint was rewritten
