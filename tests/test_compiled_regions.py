"""The loop bodies as compiled regions (``modules.compiled_region``): RMT's whole segment
(``RMT.segment``), Block-Recurrent's block step (``BlockAttention.block_step``), Gated
DeltaNet's chunk step (``ops.delta_rule.chunk_step``) and Memory Attention's whole chunk
(``MemoryAttentionLayer.whole_chunk``). Compiled with ``fullgraph=True`` (no graph
break), the model equals the eager one in logits, loss, state and every gradient over calls of
several units, the second call continuing a partial unit from the first. Without gradients the
compiled graph calls the region (``invoke_subgraph``) once per unit, one traced body for them all,
where the loop would be unrolled; with gradients the region is inlined (inductor's gradients
through a region are wrong in torch 2.13: ``test_inductor_gradients_of_a_compiled_layer``, and
dev/repro_inductor_region_grad.py, cut down to three steps of one multiplication)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from recurformer.models import build_model
from recurformer.modules import compiled_region

REPRO = Path(__file__).resolve().parent.parent / "dev" / "repro_inductor_region_grad.py"

CASES = {
    # (config, the lengths of two calls: several units, then the rest of a partial one and more)
    "rmt": (dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=6, memory_size=3), (20, 16)),
    "rmt-associative": (
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=6, memory_size=3, associative=True),
        (18, 12),  # (associative: the caches start over at a segment end, so every call ends on one)
    ),
    "block_recurrent": (
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, block_size=4, query_tile=3, recurrent_layers=(0,)),
        (14, 11),
    ),
    "gated_deltanet": (dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=4), (14, 11)),
    "memory_attention": (dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=4), (14, 11)),
}


def regions_seen(graphs: list[torch.fx.GraphModule]) -> tuple[int, int]:
    """(calls of a region, distinct region bodies) in the graphs dynamo made."""
    calls = [n for g in graphs for n in g.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    return len(calls), len({(id(g), n.args[0].target) for g in graphs for n in g.graph.nodes if n in calls})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_region_equals_eager_and_is_traced_once(case: str) -> None:
    cfg, lengths = CASES[case]
    torch.manual_seed(0)
    eager = build_model(case.split("-")[0], cfg)
    for p in eager.parameters():  # weights large enough that every path moves the output
        p.data.normal_(0.0, 0.3)
    model = copy.deepcopy(eager)
    eager.check_tokens = model.check_tokens = False  # (the token check reads the device: a graph break)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    se = sc = None
    for T in lengths:
        x = torch.randint(0, 61, (2, T))
        a, b = eager(x, se, x), compiled(x, sc, x)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
        for k, t in a.state.to_flat().items():
            torch.testing.assert_close(b.state.to_flat()[k], t, rtol=1e-4, atol=1e-5, msg=k)
        se, sc = a.state, b.state
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert regions_seen(graphs) == (0, 0)  # with gradients: inlined
    graphs.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    se = sc = None
    with torch.no_grad():
        for T in lengths:
            x = torch.randint(0, 61, (2, T))
            a, b = eager(x, se), compiled(x, sc)
            torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-5)
            se, sc = a.state, b.state
    calls, bodies = regions_seen(graphs)
    assert calls >= 4 and bodies < calls, (calls, bodies)  # every unit calls a region, few bodies serve them


@pytest.mark.slow
def test_inductor_gradients_of_a_compiled_layer() -> None:
    """``train.compile`` (``compile_layers``, inductor) trains with the eager model's gradients.
    Through a region, torch 2.13's inductor gave Gated DeltaNet's write-gate bias a gradient off by
    a relative 4.7 (logits right): the reason ``compiled_region`` inlines under autograd."""
    torch.manual_seed(0)
    eager = build_model("gated_deltanet", dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, chunk_size=8))
    model = copy.deepcopy(eager)
    model.compile_layers()
    x = torch.randint(0, 64, (2, 40))
    for m in (eager, model):  # two calls of 20 (chunks of 8, 8, 4), the state carried
        first = m(x[:, :20], targets=x[:, :20])
        (first.loss + m(x[:, 20:], first.state, x[:, 20:]).loss).backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("size", [1, 4])
def test_compiled_region_gives_eager_gradients_in_the_minimal_reproduction(size: int) -> None:
    """dev/repro_inductor_region_grad.py's gated recurrence, three steps through
    ``compiled_region`` and compiled by inductor: eager's gradient. Through a bare region torch
    2.13's inductor gets it wrong (sizes 1 and 4: two ways, both of them inlining avoids), so this
    goes red if ``compiled_region`` stops inlining under autograd; it passes as well where the
    bug is fixed."""
    spec = importlib.util.spec_from_file_location("repro_inductor_region_grad", REPRO)
    assert spec is not None and spec.loader is not None
    repro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repro)
    eager, compiled = repro.gradients(compiled_region(repro.body), size)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-8)
