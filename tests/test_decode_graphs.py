"""Decoding through captured steps (``capture.DecodeGraphs``, ``generate --cuda-graphs``): the
static-buffer protocol, run with the ``eager`` and ``trace`` backends on the CPU, generates what the
plain model generates (the same tokens, the same next-token logits) for every model it can hold,
with at most one graph per position within the reset boundary; a model it cannot hold and a failed
capture are one line and decode eagerly; on the CPU the flag is a one-line error before any work."""

from __future__ import annotations

import pytest
import torch
from helpers import TEST_CONFIGS, cuda

import recurformer.capture as capture
from recurformer import RecurformerError
from recurformer.api import generate_text
from recurformer.capture import DecodeGraphs
from recurformer.cli import main as cli_main
from recurformer.generate import new_session, stream
from recurformer.models import build_model, model_names
from recurformer.nn import StreamingLM

HELD = ["block_recurrent", "memory_attention", "rmt", "transformer_xl"]  # bounded, shift-invariant


def make(name: str, device: str = "cpu") -> StreamingLM:
    torch.manual_seed(0)
    return build_model(name, TEST_CONFIGS[name][0]).double().eval().to(device)


def decode(model: StreamingLM, step: object, n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after a 5-token prompt (so decoding starts off the chunk grid), and the last logits."""
    prompt = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    session = new_session(model, 2)
    toks = [t.tolist() for t in stream(model, prompt, n, 0.0, session=session, step=step)]  # type: ignore[arg-type]
    assert session.logits is not None
    return sum(toks, []), session.logits


def test_the_models_held_are_the_bounded_shift_invariant_ones() -> None:
    assert [n for n in model_names() if DecodeGraphs(make(n)).why_not is None] == HELD


@pytest.mark.parametrize("backend", ["eager", "trace", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("name", HELD)
def test_captured_decoding_generates_what_the_model_does(name, backend) -> None:
    """On a GPU (``cuda``) the steps are CUDA graphs: captured once per position, replayed from
    static buffers (an H200 gave the Block-Recurrent model at 125M parameters non-finite logits
    this way, with finite weights, where eager decoding ran)."""
    model = make(name, "cuda" if backend == "cuda" else "cpu")
    n = 2 * model.reset_boundary + 3
    want, want_logits = decode(model, None, n)
    graphs = DecodeGraphs(model, backend)  # type: ignore[arg-type]
    notes: list[str] = []
    got, logits = decode(model, graphs.or_eager(notes.append), n)
    assert not notes and got == want
    torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-9)
    assert 1 <= len(graphs.graphs) <= model.reset_boundary  # one per position within the boundary, reused


@pytest.mark.parametrize("name", ["llama", "gated_deltanet"])
def test_a_model_it_cannot_hold_decodes_eagerly_with_one_line(name) -> None:
    model = make(name)
    want, _ = decode(model, None, 6)
    notes: list[str] = []
    got, _ = decode(model, DecodeGraphs(model).or_eager(notes.append), 6)
    assert got == want and len(notes) == 1 and "decoding eagerly" in notes[0], notes


def test_a_failed_capture_is_one_line_and_decoding_goes_on(monkeypatch) -> None:
    model = make("memory_attention")
    want, _ = decode(model, None, 12)

    def oom(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB\ndetail")

    monkeypatch.setattr(capture, "record", oom)
    notes: list[str] = []
    got, _ = decode(model, DecodeGraphs(model).or_eager(notes.append), 12)
    assert got == want and len(notes) == 1, notes
    assert "CUDA out of memory. Tried to allocate 1.00 GiB" in notes[0] and "eagerly" in notes[0]


def test_cuda_graphs_on_the_cpu_is_one_line_before_any_work(tmp_path, capsys) -> None:
    with pytest.raises(RecurformerError) as e:  # no such checkpoint: the flag is refused before it is read
        generate_text(tmp_path / "missing", "hi", cuda_graphs=True, device="cpu")
    assert str(e.value).count("\n") == 0 and "cuda_graphs needs a CUDA GPU" in str(e.value), e.value
    argv = ["generate", "--checkpoint", str(tmp_path / "missing"), "--cuda-graphs", "--device", "cpu"]
    assert cli_main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--cuda-graphs needs a CUDA GPU" in err, err


def test_a_replay_leaves_the_states_it_returned_alone() -> None:
    """The logits and state of a call are copies: the next replay (which rewrites the graph's
    outputs) does not change them."""
    model = make("memory_attention")
    graphs = DecodeGraphs(model, "eager")
    P = model.reset_boundary
    state = model(torch.randint(0, model.config.vocab_size, (2, P + 1)), model.init_state(2)).state
    tok = torch.randint(0, model.config.vocab_size, (2, 1))
    logits, after = graphs(tok, state)
    kept = (logits.clone(), {k: v.clone() for k, v in after.to_flat().items()})
    later = after
    for _ in range(P):  # round the chunk, back to the first graph
        _, later = graphs(tok, later)
    assert torch.equal(logits, kept[0]) and all(torch.equal(v, kept[1][k]) for k, v in after.to_flat().items())
