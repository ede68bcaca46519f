"""Hybrid stacks: layer kinds from config (``layers``, ``memory_layers``), one-line errors for
stacks that cannot be built, and the receptive field that ``recurformer info`` reports."""

from __future__ import annotations

import pytest
import torch
from helpers import randomize_params

from recurformer import RecurformerError, build_model

BASE = dict(vocab_size=61, dim=32, n_heads=4)


def kinds(model) -> list[str]:
    return [layer.kind for layer in model.layers]


def test_layer_kinds_from_config() -> None:
    assert kinds(build_model("memory_attention", dict(BASE, n_layers=3, chunk_size=4, memory_layers=[1]))) == [
        "full",
        "memory",
        "full",
    ]
    m = build_model(
        "memory_attention",
        dict(BASE, n_layers=4, chunk_size=4, window=8, layers=["window", "window", "memory", "window"]),
    )
    assert kinds(m) == ["window", "window", "memory", "window"]
    assert m.info_lines()[0] == "layers: 0:window(W=8), 1:window(W=8), 2:memory(C=4), 3:window(W=8)"
    assert m.reset_boundary == 4 and m.bounded_state
    assert not build_model(
        "memory_attention", dict(BASE, n_layers=2, chunk_size=4, memory_layers=[0])
    ).bounded_state  # a full KV cache
    xl = build_model("transformer_xl", dict(BASE, n_layers=2, segment_len=4, window=3, layers=["xl", "window"]))
    assert kinds(xl) == ["xl", "window"] and xl.reset_boundary == 4


@pytest.mark.parametrize(
    "name, values, message",
    [
        ("llama", dict(n_layers=2, layers=["full"]), "'layers' names 1 layers, n_layers is 2"),
        ("llama", dict(n_layers=2, layers=["full", "windw"]), "unknown layer kind 'windw' for layer 1 .*'window'"),
        (
            "llama",
            dict(n_layers=2, layers=["full", "memory"]),
            "a 'memory' layer needs the config of a MemoryAttentionConfig",
        ),
        ("llama", dict(n_layers=2, layers=["full", "window"]), "layer 1 is a 'window' layer: set config key 'window'"),
        ("memory_attention", dict(n_layers=2, memory_layers=[2]), "'memory_layers' names layer 2, outside 0..1"),
        (
            "memory_attention",
            dict(n_layers=2, memory_layers=[0], layers=["memory", "full"]),
            "either 'layers' or 'memory_layers'",
        ),
        ("memory_attention", dict(n_layers=2, window=8), "'window' is set, but no layer is a 'window' layer"),
    ],
)
def test_stacks_that_cannot_be_built(name, values, message) -> None:
    with pytest.raises(RecurformerError, match=message):
        build_model(name, dict(BASE, **values))


def influence(model, T: int) -> torch.Tensor:
    """[T, T] bool: changing token j changes the logits at position p."""
    tokens = torch.randint(0, 61, (1, T))
    with torch.no_grad():
        base = model(tokens).logits[0]
        out = torch.zeros(T, T, dtype=torch.bool)
        for j in range(T):
            pert = tokens.clone()
            pert[0, j] = (pert[0, j] + 1) % 61
            out[j] = (model(pert).logits[0] - base).abs().amax(-1) > 1e-9
    return out


@pytest.mark.parametrize(
    "name, values, span",
    [
        ("llama", dict(n_layers=3, window=3, layers=["window", "full", "window"]), None),
        ("sliding_window", dict(n_layers=2, window=3), 5),  # (W-1) per layer, plus the token itself
        ("transformer_xl", dict(n_layers=2, segment_len=4, mem_len=2, window=3, layers=["window", "xl"]), None),
    ],
)
def test_receptive_field_matches_measurement(name, values, span) -> None:
    model = build_model(name, dict(BASE, **values)).double().eval()
    randomize_params(model)
    T = 24
    inf = influence(model, T)
    for p in range(T):
        assert inf[:, p].nonzero().min().item() == model.receptive_start(p), p
    if span is not None:
        assert model.max_context() == span
        assert f"up to {span:,} tokens" in model.info_lines()[1]


def test_a_layer_kind_registered_outside_the_package_stacks_with_the_others() -> None:
    """``@register_layer(kind, config_cls)`` on a factory is all a new layer kind needs: a hybrid
    stack of any model can then name it, and registering another factory under the same kind is
    a one-line error."""
    from recurformer.models.llama import Attention
    from recurformer.nn import Block, ModelConfig
    from recurformer.registry import LAYER_KINDS, register_layer

    @register_layer("test_window2", ModelConfig)
    def make(cfg: ModelConfig, index: int) -> Block:
        return Block(cfg, Attention(cfg, 2))

    try:
        m = build_model("transformer_xl", dict(BASE, n_layers=2, segment_len=4, layers=["xl", "test_window2"]))
        assert kinds(m) == ["xl", "window"] and m.layers[1].attn.window == 2
        assert register_layer("test_window2", ModelConfig)(make) is make  # the same factory again: no change
        with pytest.raises(RecurformerError, match="^layer kind 'test_window2' is registered twice$"):
            register_layer("test_window2", ModelConfig)(lambda cfg, index: make(cfg, index))
    finally:
        LAYER_KINDS.pop("test_window2", None)
