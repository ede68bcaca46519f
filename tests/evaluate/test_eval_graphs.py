"""``eval --cuda-graphs``: the evaluation's chunk calls through captured forward steps
(``capture.DecodeGraphs`` behind ``StreamingLM.read``'s ``step``), run with the ``eager`` and
``trace`` backends on the CPU, score what the plain evaluation scores (the same losses and hits)
for every model the steps hold, with one graph per shape; a shorter last call, a model they cannot
hold and a failed capture are one line and read eagerly; on the CPU the flag is a one-line error
before any work (tests/test_messages.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import TEST_CONFIGS

import recurformer
import recurformer.capture as capture
from recurformer import RecurformerError
from recurformer.capture import DecodeGraphs
from recurformer.evaluate.lengths import evaluate_lengths, score_rows
from recurformer.models import build_model
from recurformer.nn import StreamingLM

HELD = ["block_recurrent", "memory_attention", "rmt", "transformer_xl"]  # bounded, shift-invariant


def make(name: str) -> StreamingLM:
    torch.manual_seed(0)
    return build_model(name, TEST_CONFIGS[name][0]).double().eval()


def windows(model: StreamingLM, k: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (k, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["eager", "trace"])
@pytest.mark.parametrize("name", HELD)
def test_the_captured_evaluation_scores_what_the_model_does(name, backend) -> None:
    model = make(name)
    P = model.reset_boundary
    w = windows(model, 5, 6 * P + 1)  # batches of 2, 2 and 1 windows; every call aligned
    want = score_rows(model, w, 3 * P, 2 * P, batch_size=2)
    graphs = DecodeGraphs(model, backend)  # type: ignore[arg-type]
    notes: list[str] = []
    got = score_rows(model, w, 3 * P, 2 * P, batch_size=2, step=graphs.or_eager(notes.append, True, "reading"))
    assert not notes, notes
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-9)
    assert torch.equal(got[1], want[1])
    assert len(graphs.graphs) == 2  # one per shape: batch 2 and batch 1, reused at every position


def test_a_shorter_last_call_reads_eagerly_with_one_line() -> None:
    model = make("memory_attention")
    P = model.reset_boundary
    w = windows(model, 4, 3 * P + 2)  # calls of 2P tokens, then P + 1: not aligned
    want = score_rows(model, w, P, 2 * P, batch_size=2)
    notes: list[str] = []
    graphs = DecodeGraphs(model, "trace")
    got = score_rows(model, w, P, 2 * P, batch_size=2, step=graphs.or_eager(notes.append, True))
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-9)
    assert len(notes) == 1 and f"of {P + 1} tokens at position {2 * P}" in notes[0] and "eagerly" in notes[0], notes
    assert len(graphs.graphs) == 1  # the aligned calls of 2P tokens did go through the captured step


@pytest.mark.parametrize("name", ["llama", "gated_deltanet"])
def test_a_model_it_cannot_hold_reads_eagerly_with_one_line(name) -> None:
    model = make(name)
    tokens = windows(model, 1, 400, seed=2)[0].numpy()
    want = evaluate_lengths(model, tokens, [32, 64], last=16, windows=4, chunk=16, batch_size=2)
    notes: list[str] = []
    got = evaluate_lengths(
        model, tokens, [32, 64], last=16, windows=4, chunk=16, batch_size=2, graphs="eager", note=notes.append
    )
    assert [r.loss for r in got] == [r.loss for r in want]
    assert len(notes) == 1 and "reading eagerly" in notes[0], notes


def test_evaluate_lengths_through_graphs_equals_the_plain_evaluation() -> None:
    model = make("block_recurrent")
    P = model.reset_boundary
    tokens = windows(model, 1, 40 * P, seed=3)[0].numpy()
    kw = dict(last=2 * P, windows=5, chunk=2 * P, warm=2 * P, batch_size=2)
    want = evaluate_lengths(model, tokens, [2 * P, 4 * P], **kw)  # type: ignore[arg-type]
    notes: list[str] = []
    got = evaluate_lengths(model, tokens, [2 * P, 4 * P], graphs="trace", note=notes.append, **kw)  # type: ignore[arg-type]
    assert not notes, notes
    for g, r in zip(got, want):
        assert g.loss == pytest.approx(r.loss, rel=1e-9) and g.accuracy == r.accuracy
        np.testing.assert_allclose(g.doc_loss, r.doc_loss, rtol=1e-9)


def test_a_failed_capture_is_one_line_and_the_evaluation_goes_on(monkeypatch) -> None:
    model = make("rmt")
    P = model.reset_boundary
    w = windows(model, 2, 4 * P + 1)
    want = score_rows(model, w, P, P, batch_size=8)

    def oom(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB\ndetail")

    monkeypatch.setattr(capture, "record", oom)
    notes: list[str] = []
    got = score_rows(model, w, P, P, batch_size=8, step=DecodeGraphs(model).or_eager(notes.append, True, "reading"))
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-9)
    assert len(notes) == 1 and "CUDA out of memory. Tried to allocate 1.00 GiB" in notes[0], notes
    assert "reading eagerly" in notes[0]


def test_the_facade_refuses_cuda_graphs_for_a_model_off_the_gpu() -> None:
    model = make("memory_attention")
    with pytest.raises(RecurformerError, match=r"^cuda_graphs needs a CUDA GPU; this model is on cpu$"):
        recurformer.evaluate(model, tokens=np.zeros(600, dtype=np.int64), lengths=[256], cuda_graphs=True)


def test_read_through_a_step_takes_no_targets() -> None:
    model = make("memory_attention")
    x = windows(model, 1, 8)
    with pytest.raises(RecurformerError, match="takes no targets"):
        model.read(x, 4, targets=x, step=DecodeGraphs(model).or_eager(print))
