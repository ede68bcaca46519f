"""Decoding with the sampling inside the captured step, the host reading the tokens in blocks
(``capture.SampleGraphs`` through ``stream(graphs=...)``, ``generate --cuda-graphs``): on the CPU
("eager" and "trace" backends) it yields what the eager ``stream`` yields, token for token, greedy
and sampled from the session's generator, at batch 1 and 4, with stop tokens mid-block and a
length that is no multiple of the block, and leaves the session where the eager loop leaves it;
the host reads once per block; a non-finite logit, a model it cannot hold, a failed capture and a
consumer that stops early each behave as without graphs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TEST_CONFIGS
from safetensors.torch import load_file
from test_host_sync import HostReads

import recurformer.capture as capture
import recurformer.device
from recurformer import RecurformerError
from recurformer.api import generate_text
from recurformer.capture import DecodeGraphs, SampleGraphs
from recurformer.generate import Session, new_session, stream
from recurformer.models import build_model
from recurformer.nn import StreamingLM

MODELS = ["memory_attention", "rmt", "block_recurrent"]  # a partial-chunk cache, memory tokens, a recurrent block
SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.9, top_k=20, top_p=0.95)}


def make(name: str) -> StreamingLM:
    """A tiny model in float64 whose weights (but the embedding) are drawn at unit gain, so that
    greedy decoding does not repeat the last token (as one at the usual small init does)."""
    torch.manual_seed(0)
    model = build_model(name, TEST_CONFIGS[name][0]).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and p is not model.tok_emb.weight:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def prompt(model: StreamingLM, batch: int) -> torch.Tensor:
    """5 tokens, so that decoding starts off the chunk grid."""
    return torch.randint(0, model.config.vocab_size, (batch, 5), generator=torch.Generator().manual_seed(1))


def generation(
    model: StreamingLM, batch: int, n: int, graphs: DecodeGraphs | None = None, **kw: object
) -> tuple[list[list[int]], Session]:
    session = new_session(model, batch, seed=3)
    out = [t.tolist() for t in stream(model, prompt(model, batch), n, session=session, graphs=graphs, block=4, **kw)]  # type: ignore[arg-type]
    return out, session


def assert_same_session(a: Session, b: Session) -> None:
    assert a.state.pos == b.state.pos and a.logits is not None and b.logits is not None
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-12, atol=1e-12)
    fa, fb = a.state.to_flat(), b.state.to_flat()
    assert fa.keys() == fb.keys()
    for k in fa:
        torch.testing.assert_close(fa[k], fb[k], rtol=1e-12, atol=1e-12, msg=k)
    assert torch.equal(a.generator.get_state(), b.generator.get_state())


def stops_for(model: StreamingLM, batch: int, n: int, **sampling: object) -> list[int]:
    """Stop tokens that end the rows at different steps, mid-block: row b's token at step 2 + 2b
    (from an eager run without stops; a row may stop earlier on the same id)."""
    tokens, _ = generation(model, batch, n, **sampling)
    return sorted({tokens[2 + 2 * b][b] for b in range(batch)})


@pytest.mark.parametrize("kind", sorted(SAMPLING))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("backend", ["eager", "trace"])
@pytest.mark.parametrize("name", MODELS)
def test_blocks_generate_what_the_eager_stream_does(name, backend, batch, kind) -> None:
    """Sampled, the "trace" record holds the session's generator: every replay draws new numbers,
    the draws of the eager loop (the generator's state after them the same too)."""
    model, sampling, n = make(name), SAMPLING[kind], 2 * make(name).reset_boundary + 3
    stops = stops_for(model, batch, n, **sampling)
    want, want_session = generation(model, batch, n, stop_tokens=stops, **sampling)
    graphs = DecodeGraphs(model, backend)  # type: ignore[arg-type]
    got, session = generation(model, batch, n, graphs, stop_tokens=stops, **sampling)
    assert got == want and len(want) % 4 != 0, (got, want)  # ends mid-block
    assert any(-1 in row for row in want) or batch == 1  # a row stopped before the others
    assert_same_session(session, want_session)
    if backend == "eager":  # no stops: max_new_tokens, not a multiple of 4 (a new record for "trace")
        free, _ = generation(model, batch, n, **sampling)
        assert generation(model, batch, n, graphs, **sampling)[0] == free and len(free) == n and n % 4


@pytest.mark.parametrize("backend", ["eager", "trace"])
def test_the_host_reads_once_per_block(backend) -> None:
    """After the graphs are recorded (a first generation of the same kind), the n tokens after
    the prompt cost one host read per block of 4, where the eager loop reads at least twice per
    token (whether the logits are finite, whether every row stopped; and the model's check of
    the token's range); the same tokens."""
    model, n = make("memory_attention"), 18
    graphs = DecodeGraphs(model, backend)  # type: ignore[arg-type]
    want = generation(model, 2, n, temperature=0.0)[0]
    assert generation(model, 2, n, graphs, temperature=0.0)[0] == want

    def reads(g: DecodeGraphs | None, tokens: int) -> int:
        x = prompt(model, 2)
        with HostReads() as mode:
            mode.mark_host(x)
            list(stream(model, x, tokens, 0.0, session=new_session(model, 2), graphs=g, block=4))
        return len(mode.reads)

    assert reads(None, n) - reads(None, 0) >= 2 * n
    assert reads(graphs, n) - reads(graphs, 0) == math.ceil(n / 4)


def test_a_non_finite_logit_raises_at_the_block_read_after_the_tokens_before_it() -> None:
    """Reading one token id gives nan logits (a hook makes its embedding nan): the tokens before
    it are yielded, then the one-line error, as in the eager loop."""
    model = make("memory_attention")
    tokens, _ = generation(model, 1, 12, temperature=0.0)
    seen_before = lambda i: prompt(model, 1).tolist()[0] + [t[0] for t in tokens[:i]]  # noqa: E731
    at = next(i for i in range(2, 12) if tokens[i][0] not in seen_before(i) and i % 4)  # mid-block
    bad = tokens[at][0]
    model.tok_emb.register_forward_hook(lambda m, args, h: h + torch.where(args[0] == bad, torch.nan, 0.0)[..., None])
    for graphs in (None, DecodeGraphs(model, "trace")):
        seen: list[list[int]] = []
        with pytest.raises(RecurformerError) as e:
            for t in stream(model, prompt(model, 1), 12, 0.0, session=new_session(model, 1), graphs=graphs, block=4):
                seen.append(t.tolist())
        assert seen == tokens[:at] and str(e.value).count("\n") == 0 and "non-finite logits" in str(e.value)


def test_a_consumer_that_stops_mid_block_leaves_the_session_where_the_eager_loop_does() -> None:
    model = make("rmt")
    sessions = []
    for graphs in (None, DecodeGraphs(model, "eager")):
        session = new_session(model, 2, seed=5)
        it = stream(model, prompt(model, 2), 20, 1.0, session=session, graphs=graphs, block=4)
        [next(it) for _ in range(6)]
        it.close()  # after 6 tokens: mid-block
        sessions.append(session)
    assert_same_session(sessions[1], sessions[0])


def test_a_model_it_cannot_hold_decodes_eagerly_with_one_line() -> None:
    model = make("llama")
    want, _ = generation(model, 2, 6, temperature=0.0)
    notes: list[str] = []
    session = new_session(model, 2, seed=3)
    graphs = DecodeGraphs(model, "eager")
    got = [
        t.tolist() for t in stream(model, prompt(model, 2), 6, 0.0, session=session, graphs=graphs, note=notes.append)
    ]
    assert got == want and len(notes) == 1 and "decoding eagerly" in notes[0], notes


def test_a_capture_that_fails_mid_generation_is_one_line_and_decoding_goes_on(monkeypatch) -> None:
    """The graphs of the first positions record, a later one runs out of memory: one line, and
    the generation goes on eagerly from the block's start, the same tokens and session."""
    model = make("memory_attention")
    want, want_session = generation(model, 2, 19, temperature=1.0)
    real, calls = capture.record, []

    def record(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB\ndetail")
        return real(*args, **kwargs)

    monkeypatch.setattr(capture, "record", record)
    notes: list[str] = []
    session = new_session(model, 2, seed=3)
    graphs = DecodeGraphs(model, "eager")
    x = prompt(model, 2)
    got = [t.tolist() for t in stream(model, x, 19, 1.0, session=session, graphs=graphs, block=4, note=notes.append)]
    assert got == want and len(notes) == 1, notes
    assert "CUDA out of memory. Tried to allocate 1.00 GiB" in notes[0] and "decoding eagerly" in notes[0]
    assert_same_session(session, want_session)


def test_a_step_and_graphs_together_are_one_line() -> None:
    model = make("rmt")
    graphs = DecodeGraphs(model, "eager")
    with pytest.raises(RecurformerError, match="^give stream\\(\\) a step or graphs, not both$"):
        next(stream(model, [1, 2], 3, step=graphs.or_eager(print), graphs=graphs))


def test_generate_text_decodes_through_the_blocks_where_graphs_are_asked(run, tmp_path, monkeypatch) -> None:
    """``generate_text(cuda_graphs=True)`` (``generate --cuda-graphs``) samples through
    ``SampleGraphs`` in blocks of ``decode_block``: on the CPU with the "eager" backend put in for
    "cuda", the text and the saved session are those of the plain run."""
    kw = dict(max_new_tokens=11, temperature=1.0, top_k=40, seed=4, device="cpu", note=lambda s: None)
    plain = generate_text(run.dir, "the", save_state=tmp_path / "a", **kw)  # type: ignore[arg-type]
    made: list[SampleGraphs] = []
    real = DecodeGraphs.sampler

    def sampler(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(real(self, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(recurformer.device, "graphs_or_eager", lambda asked, *a, **k: "eager" if asked else None)
    monkeypatch.setattr(DecodeGraphs, "sampler", sampler)
    graphed = generate_text(run.dir, "the", save_state=tmp_path / "b", cuda_graphs=True, decode_block=3, **kw)  # type: ignore[arg-type]
    assert graphed.text == plain.text and graphed.tokens == plain.tokens > 0
    assert len(made) == 1 and made[0].block == 3
    a, b = (load_file(tmp_path / f) for f in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
