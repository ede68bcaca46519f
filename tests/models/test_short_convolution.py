"""The short causal convolution as one module (``modules.ShortConvolution``), run by ``nn.Block`` for
every attention memory with ``qkv_conv`` (one field, ``nn.ConvConfig``); and the checkpoints
written before it was one module (``tests/fixtures/conv_v2``, see its README), which load and
compute the logits of the old code bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TEST_CONFIGS, conv_literal
from safetensors.torch import load_file

from recurformer.hub import load
from recurformer.modules import ShortConvolution
from recurformer.nn import Block, ConvConfig, ConvLayer
from recurformer.registry import build_model, config_keys, lookup, model_names

FIXTURES = Path(__file__).parent.parent / "fixtures" / "conv_v2"
CONV_MODELS = ("memory_attention", "transformer_xl", "block_recurrent", "rmt")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The fixtures were computed with one thread: another count may reorder BLAS sums."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_short_convolution_is_the_literal_convolution_continued_across_calls() -> None:
    conv = ShortConvolution(5, 3).double()
    conv.init_extra(0.02)
    x = torch.randn(2, 9, 5, dtype=torch.float64)
    whole, cache = conv(x)  # no cache: from zeros
    torch.testing.assert_close(whole, conv_literal(x, conv.weight))
    assert torch.equal(cache, x[:, -2:])
    state, parts = conv.init_state(2, None, torch.float64), []
    for piece in x.split([4, 1, 4], dim=1):
        y, state = conv(piece, state)
        parts.append(y)
    assert torch.equal(torch.cat(parts, 1), whole) and torch.equal(state, cache)
    fresh = conv.reset(state, torch.tensor([True, False]))
    assert torch.equal(fresh[0], torch.zeros(2, 5, dtype=torch.float64)) and torch.equal(fresh[1], state[1])


def test_short_convolution_checks_its_piece_of_the_state() -> None:
    conv = ShortConvolution(5, 3)
    assert conv.check_state(conv.init_state(4, "meta", torch.float32)) is None
    assert conv.check_state(None) == "'conv' is missing"
    assert conv.check_state(torch.zeros(4, 3, 5)) == "'conv' has shape (4, 3, 5), expected (4, 2, 5)"


@pytest.mark.parametrize("name", CONV_MODELS)
def test_qkv_conv_is_one_module_of_the_mixer_run_by_the_block(name: str) -> None:
    """Every layer with ``qkv_conv`` holds one ``ShortConvolution`` (its mixer's ``conv``, the first
    module of the mixer) and no other parameter of it; its state piece is made, checked and
    carried by the block."""
    cfg = next(c for c in TEST_CONFIGS[name] if c.get("qkv_conv"))
    model = build_model(name, cfg)
    for layer in model.layers:
        assert isinstance(layer, Block) and isinstance(layer.conv, ShortConvolution)
        assert next(iter(layer.attn.children())) is layer.conv
        assert layer.conv.weight.shape == (cfg["dim"], cfg["qkv_conv"])
    assert not [n for n, _ in model.named_parameters() if "conv" in n and not n.endswith(".attn.conv.weight")]
    state = model.init_state(2)
    assert all(s.conv.shape == (2, cfg["qkv_conv"] - 1, cfg["dim"]) for s in state.layers)
    out = model(torch.randint(0, cfg["vocab_size"], (2, 3)), state=state)
    assert all(not torch.equal(s.conv, torch.zeros_like(s.conv)) for s in out.state.layers)


@pytest.mark.parametrize("case", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def test_checkpoint_of_before_the_module_loads_and_computes_the_same_bits(case: str, one_thread: None) -> None:
    """A checkpoint saved with the parameter ``attn.conv_weight`` (and ARMT inside rmt.py) loads
    (``compat.upgrade_weights``), with its saved state, and gives the old logits bit for bit."""
    model = load(FIXTURES / case).model.double()
    exp = load_file(FIXTURES / case / "expected.safetensors")
    with torch.no_grad():
        out = model(exp["tokens"])
        assert torch.equal(out.logits, exp["logits"])
        assert torch.equal(model(exp["tokens"], state=out.state).logits, exp["logits_from_state"])
        # a state read from disk has no host-side bound on the document starts (``start_floor``):
        # Transformer-XL then attends its memory in another grouping, equal to rounding
        saved = model.state_from_flat(load_file(FIXTURES / case / "state.safetensors"))
        logits = model(exp["tokens"], state=saved).logits
    torch.testing.assert_close(logits, exp["logits_from_state"], rtol=1e-12, atol=1e-12)


def test_qkv_conv_is_one_field_of_conv_config() -> None:
    """``qkv_conv`` is declared once (``nn.ConvConfig``): the configs that take it are exactly the
    ConvConfigs, and their attention mixers are ``ConvLayer``s."""
    takes = {name for name in model_names() if "qkv_conv" in config_keys(name)}
    assert takes == {name for name in model_names() if issubclass(lookup(name)[0], ConvConfig)}
    assert takes == set(CONV_MODELS)
    for name in CONV_MODELS:
        cfg = next(c for c in TEST_CONFIGS[name] if c.get("qkv_conv"))
        assert all(isinstance(layer.attn, ConvLayer) for layer in build_model(name, cfg).layers)
