"""The captured training step (``recurformer/capture.py``), for every registered model and a hybrid
stack: (a) the step, forward and backward with a carried state, traces as one graph without a
break (``torch._dynamo.explain``: no host read, no Python branch on a device value); (b) the static-buffer protocol of a CUDA-graph replay (copy in, step, copy the
state out, resets as masks, gradient accumulation 2) equals the plain model over several calls:
losses, states and gradients, run eagerly and as a replay of one ``make_fx`` record per shape (a
shift-invariant model's one record replayed at every later position)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import TEST_CONFIGS, cuda

from recurformer.capture import StepGraphs, flatten, record
from recurformer.config import RecurformerError
from recurformer.models import build_model, model_names
from recurformer.nn import StreamingLM

HYBRID = ("memory_attention", 3)  # [window, window, memory, window]
CASES = [(name, 0) for name in model_names()] + [HYBRID]
IDS = [f"{name}-{i}" for name, i in CASES]
B = 2


def make(name: str, index: int, **extra: object) -> StreamingLM:
    torch.manual_seed(0)
    return build_model(name, dict(TEST_CONFIGS[name][index], **extra)).double()


def length(model: StreamingLM) -> int:
    """An aligned call of two chunks (three tokens for token-wise models)."""
    P = model.reset_boundary
    return 2 * P if P > 1 else 3


def batch(model: StreamingLM, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    V = model.config.vocab_size
    return torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()), default=0.0)


def check_protocol(name: str, index: int, backend: str, calls: int) -> None:
    """``calls`` aligned calls, gradient accumulation 2 (an SGD step after every second call), row 0
    reset before call 2: the captured steps against the plain model, exact to float64 rounding."""
    plain, model = make(name, index), make(name, index)
    steps = StepGraphs(model, grad_accum=2, backend=backend)  # type: ignore[arg-type]
    T = length(model)
    s_plain, s_cap = plain.init_state(B), model.init_state(B)
    for i in range(calls):
        x, y = batch(model, T)
        if i == 2:
            reset = torch.tensor([True, False])
            s_plain, s_cap = s_plain.reset(reset), s_cap.reset(reset)
        out = plain(x, s_plain, y)
        (out.loss / 2).backward()
        s_plain = out.state.detach()
        loss, s_cap = steps(x, y, s_cap)
        where = f"{name} call {i} ({backend})"
        assert abs(float(out.loss.detach()) - float(loss)) <= 1e-12, (
            f"{where}: loss {float(loss)} != {float(out.loss.detach())}"
        )
        assert s_cap.pos == s_plain.pos
        assert (d := max_diff(s_plain.to_flat(), s_cap.to_flat())) <= 1e-12, f"{where}: state off by {d}"
        grads = [(n, p.grad, q.grad) for (n, p), q in zip(plain.named_parameters(), model.parameters())]
        for n, g, h in grads:
            assert (g is None) == (h is None), f"{where}: {n} has a gradient in one model only"
            if g is not None and h is not None:
                assert (d := float((g - h).abs().max())) <= 1e-12 * (1 + float(g.abs().max())), (
                    f"{where}: {n} off by {d}"
                )
        if i % 2:
            for m in (plain, model):
                with torch.no_grad():
                    for p in m.parameters():
                        if p.grad is not None:
                            p -= 0.1 * p.grad
                m.zero_grad(set_to_none=True)
    if steps.shift:  # every aligned call after the first replays the step captured at position 0
        assert len(steps.graphs) == 1


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_replay_protocol_equals_plain_model(case: tuple[str, int]) -> None:
    check_protocol(*case, backend="eager", calls=4)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_recorded_step_replays_exactly(case: tuple[str, int]) -> None:
    """The step recorded once per shape (``make_fx``: its Python, host reads and positions frozen,
    as in a CUDA graph) and replayed."""
    check_protocol(*case, backend="trace", calls=3)


def compile_case(name: str, index: int, impl: dict[str, object]) -> None:
    model = make(name, index, **impl)
    model.check_tokens = False  # as the trainer and a captured step run it (the check reads the device)
    steps = StepGraphs(model)
    T = length(model)
    x, y = batch(model, T)
    state = model(x, model.init_state(B), y).state.detach()  # a carried state, one call in
    state = dataclasses.replace(state, any_fresh=None)  # nothing known on the host: the masked reset
    step = steps.function(state, state.pos)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # the backward inside the traced step
        seen = torch._dynamo.explain(step)(*batch(model, T), *flatten(state))
    # (fullgraph=True does not raise here at a break inside the model: explain counts them)
    assert seen.graph_break_count == 0 and seen.graph_count == 1, [str(b.reason)[:300] for b in seen.break_reasons]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_training_step_traces_without_graph_break(case: tuple[str, int]) -> None:
    compile_case(*case, {})


@pytest.mark.slow
def test_recurrent_transformer_naive_step_traces_without_graph_break() -> None:
    """The naive schedule (plain autograd through the loop over blocks) traces as well as the
    tiled one's custom backward (``finish``'s vector-Jacobian products, no ``torch.autograd.grad``)."""
    compile_case("recurrent_transformer", 0, {"impl": "naive"})


def test_bad_calls_are_one_line_errors() -> None:
    model = make("memory_attention", 0)
    steps = StepGraphs(model)
    C = model.reset_boundary
    with pytest.raises(RecurformerError, match="aligned calls"):
        steps(*batch(model, C + 1), model.init_state(B))
    x, y = batch(model, C)
    with pytest.raises(RecurformerError, match="outside the vocabulary"):
        steps(x, y.masked_fill(y == y[0, 0], model.config.vocab_size), model.init_state(B))
    with pytest.raises(RecurformerError, match="unknown capture backend"):
        StepGraphs(model, backend="graph")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(RecurformerError, match="needs a CUDA GPU"):
            StepGraphs(model, backend="cuda")


@cuda
@pytest.mark.parametrize("name", ["memory_attention", "llama"])
def test_cuda_graph_replay_equals_eager(name: str) -> None:
    """The same protocol under ``torch.cuda.graph``, against the eager protocol on the GPU (float32)."""
    models = [make(name, 0).float().cuda() for _ in range(2)]
    graphed, eager = StepGraphs(models[0], grad_accum=2, backend="cuda"), StepGraphs(models[1], grad_accum=2)
    T = length(models[0])
    states = [m.init_state(B, "cuda") for m in models]
    for i in range(4):
        x, y = (t.cuda() for t in batch(models[0], T))
        (la, sa), (lb, sb) = graphed(x, y, states[0]), eager(x, y, states[1])
        states = [sa, sb]
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
        for k, v in sa.to_flat().items():
            torch.testing.assert_close(v, sb.to_flat()[k], rtol=1e-4, atol=1e-5)
    for p, q in zip(*(m.parameters() for m in models)):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "trace"])
def test_a_step_is_recorded_without_the_autocast_cache(backend: str) -> None:
    """A step is recorded with autocast's weight-cast cache off (a CUDA graph recorded with it
    reads the cast copy made at capture: freed once the autocast context ends, stale once the
    weights change), and the cache is on again after."""
    seen = []

    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        seen.append(torch.is_autocast_cache_enabled())
        return [x * 2]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        record(fn, [torch.ones(3)], backend, warmup=2)  # type: ignore[arg-type]
        assert torch.is_autocast_cache_enabled()
    assert seen and not any(seen), seen


@cuda
def test_cuda_graph_under_bf16_autocast_follows_the_weights() -> None:
    """Captured steps under bf16 autocast (a context per call, as the trainer runs them) with the
    weights halved between calls: the graphed losses follow the eager ones (to bf16 rounding), which
    a graph that read autocast's cached weight copies would not."""
    models = [make("memory_attention", 0).float().cuda() for _ in range(2)]
    graphed, eager = StepGraphs(models[0], backend="cuda"), StepGraphs(models[1])
    T = length(models[0])
    for _ in range(3):
        x, y = (t.cuda() for t in batch(models[0], T))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            (la, _), (lb, _) = (
                graphed(x, y, models[0].init_state(B, "cuda")),
                eager(x, y, models[1].init_state(B, "cuda")),
            )
        torch.testing.assert_close(la.float(), lb.float(), rtol=2e-2, atol=1e-3)
        with torch.no_grad():
            for m in models:
                for p in m.parameters():
                    p.mul_(0.5)
                m.zero_grad(set_to_none=True)
