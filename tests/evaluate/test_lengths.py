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
from helpers import ROOT, TEST_CONFIGS, randomize_params

from recurformer import build_model
from recurformer.config import RecurformerError
from recurformer.evaluate.lengths import evaluate_lengths, score_windows, window_ends
from recurformer.evaluate.results import figure, markdown_table, paired_differences, save_json
from recurformer.intervals import bootstrap_weights, ratio_interval


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
    with pytest.raises(RecurformerError, match="lengths: 20 is shorter than last 50"):
        evaluate_lengths(model, tokens, [20], last=50, windows=1)


def test_scored_blocks_tile_the_text_after_the_context() -> None:
    ends = window_ends(1000, 300, 50)
    assert ends[0] == 301 and ends[-1] <= 1000 and set(np.diff(ends)) == {50}
    assert len(ends) == (1000 - 301) // 50 + 1  # every block of 50 targets after the context, none twice
    picked = window_ends(1000, 300, 50, windows=4)
    assert len(picked) == 4 and set(picked) <= set(ends) and picked[0] == ends[0] and picked[-1] == ends[-1]


def test_eval_is_deterministic_and_shared_by_lengths() -> None:
    """No seed anywhere: the same numbers whatever the global RNG state; every length scores the
    same documents; the interval covers the mean."""
    model = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0]).eval()
    tokens = np.random.default_rng(0).integers(1, 61, 3000)
    tokens[::97] = 0  # BOS: documents of 97 tokens
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        np.random.seed(seed)
        runs.append(evaluate_lengths(model, tokens, [40, 120], last=40, windows=None, chunk=16, bos=0))
    for a, b in zip(*runs):
        assert (a.loss, a.loss_low, a.loss_high, a.accuracy) == (b.loss, b.loss_low, b.loss_high, b.accuracy)
    short, long = runs[0]
    assert np.array_equal(short.doc_tokens, long.doc_tokens) and short.units == long.units and short.unit == "documents"
    assert short.windows == len(window_ends(3000, 120, 40)) and short.units == len(
        np.unique(np.cumsum(tokens == 0)[81:2961])
    )
    one_doc = evaluate_lengths(model, np.where(tokens == 0, 1, tokens), [40], last=40, chunk=16, bos=0)[0]
    assert one_doc.unit == "windows" and one_doc.units == one_doc.windows and one_doc.loss_low < one_doc.loss_high
    for r in runs[0]:
        assert r.loss_low < r.loss < r.loss_high
        assert abs(r.doc_loss.sum() / r.doc_tokens.sum() - r.loss) < 1e-9


def test_interval_covers_the_population_mean() -> None:
    """The bootstrap interval's width is right: with documents of known per-token losses drawn
    at random, the 95% interval covers the population mean in roughly 95% of 200 draws."""
    rng = np.random.default_rng(0)
    weights = bootstrap_weights(60, samples=500)
    hits = 0
    for _ in range(200):
        counts = rng.integers(20, 80, 60).astype(float)
        sums = counts * rng.normal(3.0, 0.3, 60)
        low, high = ratio_interval(sums, counts, weights)
        hits += low <= 3.0 <= high
    assert 170 <= hits <= 200


def test_paired_difference_with_itself_is_zero_and_detects_a_worse_model() -> None:
    model = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0]).eval()
    torch.manual_seed(0)
    other = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0]).eval()
    randomize_params(other, 0.5)
    tokens = np.random.default_rng(1).integers(1, 61, 2000)
    tokens[::50] = 0
    a = evaluate_lengths(model, tokens, [60], last=30, chunk=16, bos=0)
    a2 = evaluate_lengths(model, tokens, [60], last=30, chunk=16, bos=0)
    (same,) = paired_differences(a2, a)
    assert (same.diff, same.low, same.high) == (0.0, 0.0, 0.0)
    b = evaluate_lengths(other, tokens, [60], last=30, chunk=16, bos=0)
    (d,) = paired_differences(b, a)
    assert abs(d.diff - (b[0].loss - a[0].loss)) < 1e-9 and d.low <= d.diff <= d.high
    c = evaluate_lengths(model, tokens[:1500], [60], last=30, chunk=16, bos=0)
    with pytest.raises(RecurformerError, match="same tokens"):
        paired_differences(c, a)


def test_table_json_and_plot_show_intervals(tmp_path) -> None:
    model = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0]).eval()
    tokens = np.random.default_rng(1).integers(1, 61, 1500)
    tokens[::50] = 0
    results = {"a": evaluate_lengths(model, tokens, [30, 60, 90], last=30, chunk=16, bos=0)}
    results["b"] = results["a"]
    table = markdown_table(results)
    r = results["a"][0]
    assert f"{r.loss:.3f} [{r.loss_low:.3f}, {r.loss_high:.3f}]" in table and "paired difference from a" in table
    save_json(results, tmp_path / "e.json", {})
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["results"]["a"][0]["loss_low"] == r.loss_low
    assert doc["paired_differences"]["models"]["b"][0]["diff"] == 0.0
    fig = figure(results, "t", 30)
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert high - low >= 0.5  # nats: a small gap is drawn small
    assert all(
        line.get_linestyle() in ("None", "") for line in ax.lines if len(line.get_xdata()) > 1
    )  # no line between lengths
    assert "cold start" in " ".join(t.get_text() for t in ax.texts)

    def hollow(fig) -> int:
        return sum(line.get_markerfacecolor() == "white" for line in fig.axes[0].lines)

    assert hollow(figure(results, "t", 30)) == 2  # both models' L = 30 points: no history
    assert hollow(figure(results, "t", 30, warm={"b": 60})) == 1  # b read 60 tokens first: not a cold start


PROBE = """
import json, sys, numpy as np, torch
from recurformer import build_model
from recurformer.evaluate.lengths import evaluate_lengths
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
    out = subprocess.run(
        [sys.executable, "-c", PROBE, name, str(L)],
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "", "PYTHONPATH": str(ROOT)},
    )
    return json.loads(out.stdout)["peak"]


@pytest.mark.slow
def test_recurrent_memory_is_bounded_at_long_lengths() -> None:
    """Peak RSS while evaluating one window (a fresh process, the peak counter restarted after a
    warm-up), from L=1024 to L=16384: Llama's grows by at least half of its KV cache's growth (the
    control: the measurement sees the cache), Memory Attention's and the RMT's by less than a tenth
    of it. Differences, not ratios, so torch's own footprint (larger in a CUDA build) drops out."""
    peaks = {(m, L): peak(m, L) for m in ("memory_attention", "rmt", "llama") for L in (1024, 16384)}
    grow = {m: peaks[m, 16384] - peaks[m, 1024] for m in ("memory_attention", "rmt", "llama")}  # MB
    cache = 2 * 2 * (16384 - 1024) * 128 * 4 / 2**20  # K and V, 2 layers, dim 128, float32: 30 MB
    assert grow["llama"] > cache / 2, peaks
    assert grow["memory_attention"] < cache / 10, peaks
    assert grow["rmt"] < cache / 10, peaks


def test_length_options_are_checked_where_they_are_built(tmp_path) -> None:
    """``LengthOptions`` checks itself when built, so ``recurformer.evaluate`` refuses options that
    do not fit together before it reads any text (here: a dataset that does not exist)."""
    import recurformer
    from recurformer.evaluate.lengths import LengthOptions

    with pytest.raises(RecurformerError, match=r"^lengths: 8 is shorter than last 16$"):
        LengthOptions(lengths=[8], last=16)
    with pytest.raises(RecurformerError, match=r"^context 10 is shorter than warm-up \+ the longest length \(24\)$"):
        LengthOptions(lengths=[16], last=16, warm_state=8, context=10)
    with pytest.raises(RecurformerError, match=r"^chunk must be >= 1, got 0$"):
        LengthOptions(chunk=0)
    o = LengthOptions(lengths=[16, 32], last=16, warm_state=8)
    assert o.context_for(41) == 40
    with pytest.raises(RecurformerError, match=r"^40 evaluation tokens are too few for windows of 40 tokens \(\+1\)"):
        o.context_for(40)
    model = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0])
    with pytest.raises(RecurformerError, match=r"^lengths: 8 is shorter than last 16$"):
        recurformer.evaluate(model, dataset="no-such-dataset", lengths=[8], last=16)
