"""Gated DeltaNet's layer: its chunked form equals its per-token form in every parameter gradient
(the recurrence itself: tests/ops/test_delta_rule.py); the initialisation gives a_t = decay_init;
the floors hold the state exactly; the state survives a safetensors file; bad settings give one line."""

from __future__ import annotations

import pytest
import torch
from helpers import randomize_params
from safetensors.torch import load_file, save_file

from recurformer import RecurformerError, build_model
from recurformer.models.gated_deltanet import DeltaState, GatedDeltaNetLayer
from recurformer.registry import make_config
from recurformer.state import Call

F64 = dict(dtype=torch.float64)
TIGHT = dict(rtol=1e-10, atol=1e-10)


def layer_pair(**values) -> tuple[GatedDeltaNetLayer, GatedDeltaNetLayer]:
    cfg = make_config("gated_deltanet", dict(dim=24, n_heads=2, chunk_size=8, **values))
    torch.manual_seed(3)
    chunked = GatedDeltaNetLayer(cfg).double()
    randomize_params(chunked, 0.3)
    naive = GatedDeltaNetLayer(make_config("gated_deltanet", dict(dim=24, n_heads=2, impl="naive", **values)))
    naive.double().load_state_dict(chunked.state_dict())
    return chunked, naive


@pytest.mark.parametrize(
    "conv_size, floors",
    [(4, {}), (1, {}), (4, {"write_floor": 0.3}), (4, {"decay_floor": 0.6, "decay_init": 0.3})],
    ids=["conv4", "conv1", "write_floor", "decay_floor"],
)
def test_layer_chunked_equals_naive_in_every_parameter_gradient(conv_size: int, floors: dict) -> None:
    """The whole layer (projections, convolution, gates, norm, output gate): outputs, final state
    and the gradients of its input, of a nonzero initial state and of every parameter (with a
    write floor: some writes exactly 0, the others rescaled; with a decay floor: some tokens
    exactly without decay)."""
    chunked, naive = layer_pair(conv_size=conv_size, **floors)
    B, T = 2, 29
    x = torch.randn(B, T, 24, **F64, requires_grad=True)
    s0 = chunked.init_state(B, "cpu", torch.float64)
    s0 = DeltaState(S=torch.randn_like(s0.S).requires_grad_(), conv=torch.randn_like(s0.conv).requires_grad_())
    w = torch.randn(B, T, 24, **F64)
    results = []
    for layer in (chunked, naive):
        y, s = layer(x, s0, Call(0, torch.zeros(B, dtype=torch.long)))
        wrt = [x, s0.S, *([s0.conv] if conv_size > 1 else []), *layer.parameters()]
        gs = torch.autograd.grad((y * w).sum() + s.S.sum() + s.conv.sum(), wrt, allow_unused=False)
        results.append([y, s.S, s.conv, *gs])
    names = ["y", "S", "conv", "dx", "dS0", *(["dconv0"] if conv_size > 1 else []), *dict(chunked.named_parameters())]
    assert len(names) == len(results[0])
    for n, a, b in zip(names, *results):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=n: f"{n}: {m}")


def test_initial_decay_and_write_strength() -> None:
    cfg = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, decay_init=0.9995, write_init=0.25)
    model = build_model("gated_deltanet", cfg).double()
    layer = model.layers[0].attn
    with torch.no_grad():
        b, g = layer.gates(torch.randn(3, 11, 32, **F64) * 5)
        b0, _ = layer.gates(torch.zeros(1, 1, 32, **F64))
    # (to 1e-7: dt_bias and c_b were set in float32, before the cast to float64)
    torch.testing.assert_close(g.exp(), torch.full_like(g, 0.9995), rtol=0, atol=1e-7)
    torch.testing.assert_close(b0, torch.full_like(b0, 0.25), rtol=0, atol=1e-7)
    assert float(b.std()) > 0.01  # W_b is random: b depends on the input
    assert model.info_lines()[0] == "layers: 0:delta(K=4), 1:delta(K=4)"


def test_the_write_floor_makes_small_writes_exactly_zero() -> None:
    """b = max(0, sigmoid(z) - eps) / (1 - eps): exactly 0 where sigmoid(z) <= eps (so, with
    a = 1, the token leaves the state as it was: test_a_closed_write_and_no_decay_hold_the_state_exactly),
    the paper's b rescaled above; the decay untouched; below the floor no gradient reaches W_b."""
    torch.manual_seed(4)
    base = GatedDeltaNetLayer(make_config("gated_deltanet", dict(dim=24, n_heads=2))).double()
    randomize_params(base, 0.3)
    floored = GatedDeltaNetLayer(make_config("gated_deltanet", dict(dim=24, n_heads=2, write_floor=0.4))).double()
    floored.load_state_dict(base.state_dict())
    x = torch.randn(3, 40, 24, **F64) * 3
    b0, g0 = base.gates(x)
    xg = x.clone().requires_grad_()
    b, g = floored.gates(xg)
    closed = b0 <= 0.4
    assert 0 < int(closed.sum()) < closed.numel()  # both sides of the floor are exercised
    assert torch.equal(b[closed], torch.zeros_like(b[closed]))
    torch.testing.assert_close(b[~closed], (b0[~closed] - 0.4) / 0.6, rtol=1e-12, atol=0)
    assert torch.equal(g, g0)  # the decay is untouched
    grad = torch.autograd.grad(b[closed].sum(), xg)[0]
    assert torch.equal(grad, torch.zeros_like(grad))


def test_the_decay_floor_makes_weak_decays_exactly_none() -> None:
    """log a = min(0, g + delta): exactly 0 (no decay: with b = 0 the state is held exactly)
    where the paper's g >= -delta, g + delta below; the write untouched; no gradient where held."""
    torch.manual_seed(5)
    values = dict(dim=24, n_heads=2, decay_init=0.3)
    base = GatedDeltaNetLayer(make_config("gated_deltanet", values)).double()
    randomize_params(base, 0.3)
    floored = GatedDeltaNetLayer(make_config("gated_deltanet", dict(values, decay_floor=0.6))).double()
    floored.load_state_dict(base.state_dict())
    x = torch.randn(3, 40, 24, **F64) * 3
    b0, g0 = base.gates(x)
    xg = x.clone().requires_grad_()
    b, g = floored.gates(xg)
    held = g0 >= -0.6
    assert 0 < int(held.sum()) < held.numel()  # both sides of the floor are exercised
    assert torch.equal(g[held], torch.zeros_like(g[held]))
    torch.testing.assert_close(g[~held], g0[~held] + 0.6, rtol=1e-12, atol=0)
    assert torch.equal(b, b0)  # the write is untouched
    grad = torch.autograd.grad(g[held].sum(), xg)[0]
    assert torch.equal(grad, torch.zeros_like(grad))


def test_state_survives_a_safetensors_file(tmp_path) -> None:
    cfg = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=8)
    model = build_model("gated_deltanet", cfg).double().eval()
    randomize_params(model, 0.3)
    tokens = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        whole = model(tokens).logits
        state = model(tokens[:, :17]).state
        save_file(state.to_flat(), tmp_path / "state.safetensors")
        again = model.state_from_flat(load_file(tmp_path / "state.safetensors"))
        torch.testing.assert_close(model(tokens[:, 17:], state=again).logits, whole[:, 17:], **TIGHT)


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(decay_init=1.0), "'decay_init' must lie strictly between 0 and 1, got 1.0"),
        (dict(decay_init=0.0), "'decay_init' must lie strictly between 0 and 1, got 0.0"),
        (dict(write_init=1.5), "'write_init' must lie strictly between 0 and 1, got 1.5"),
        (dict(write_floor=-0.1), "'write_floor' must be >= 0 and below write_init = 0.5 .*, got -0.1"),
        (dict(write_floor=0.5), "'write_floor' must be >= 0 and below write_init = 0.5 .*, got 0.5"),
        (
            dict(decay_floor=-1e-4),
            r"'decay_floor' must be >= 0 and below -log\(decay_init\) = 0.001001 .*, got -0.0001",
        ),
        (dict(decay_floor=2e-3), r"'decay_floor' must be >= 0 and below -log\(decay_init\) = 0.001001 .*, got 0.002"),
        (dict(conv_size=0), "'conv_size' must be >= 1, got 0"),
        (dict(chunk_size=0), "'chunk_size' must be >= 1, got 0"),
        (dict(dim=30, n_heads=4), r"dim \(30\) must be divisible by n_heads \(4\)"),
        (dict(impl="fast"), r"'model.impl' must be one of \['auto', 'chunked', 'naive', 'fla'\], got 'fast'"),
        (
            dict(impl="fla", chunk_size=8),
            r"'model.chunk_size' must be 16, 32 or 64 for flash-linear-attention's kernel "
            r"\(model=\{\"impl\": 'fla'\}\), got 8: use model=\{\"chunk_size\": 64\}",
        ),
        (dict(n_layers=2, layers=["delta", "window"]), "layer 1 is a 'window' layer: set config key 'window'"),
    ],
)
def test_bad_settings_give_one_line(values, message) -> None:
    with pytest.raises(RecurformerError, match=message) as e:
        build_model("gated_deltanet", dict(dict(vocab_size=61, dim=32, n_layers=2, n_heads=4), **values))
    assert "\n" not in str(e.value)


def test_a_stack_without_its_config_gives_one_line() -> None:
    with pytest.raises(RecurformerError, match="a 'delta' layer needs the config of a GatedDeltaNetConfig") as e:
        build_model("llama", dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, layers=["full", "delta"]))
    assert "\n" not in str(e.value)


def test_a_training_step_reads_nothing_from_the_device() -> None:
    """The forward and backward over two calls (state carried) make no host read of a device
    tensor (``.item()``, ``bool(t)``, ...), as a CUDA graph needs (``HostReads`` of test_host_sync)."""
    from test_host_sync import HostReads

    model = build_model("gated_deltanet", dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=8))
    tokens = torch.randint(0, 61, (2, 20))
    mode = HostReads()
    mode.mark_host(tokens)
    with mode:
        state, loss = None, 0
        for a, b in ((0, 13), (13, 20)):
            out = model(tokens[:, a:b], state=state, targets=tokens[:, a:b])
            state, loss = out.state, loss + out.loss
        loss.backward()
    assert mode.reads == []


def test_fla_on_the_cpu_gives_one_line_before_any_work() -> None:
    """``model.impl: fla`` on a CPU tensor: one line naming the fix at the first call, before the
    kernel (or any recurrence) runs; the CLI spells the option as its ``--set``."""
    from recurformer.cli import cli_spelling

    model = build_model("gated_deltanet", dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=16, impl="fla"))
    with pytest.raises(RecurformerError) as e:
        model(torch.randint(0, 61, (2, 20)))
    assert str(e.value) == (
        "model={\"impl\": 'fla'} runs flash-linear-attention's Triton kernel on CUDA only, but this model runs "
        "on cpu: use model={\"impl\": 'auto'} (fla on CUDA, ours elsewhere)"
    )
    assert "use --set model.impl=auto " in cli_spelling("train")(e.value.args[0])


def test_fla_without_the_package_gives_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fla does not import, ``model.impl: fla`` names the install (on CUDA, checked first
    on the device: the CPU's message is the one above)."""
    from recurformer.ops.delta_rule import fla

    monkeypatch.setattr(fla, "fla_kernel", lambda: None)
    with pytest.raises(RecurformerError, match=r"needs flash-linear-attention, which does not import here: ") as e:
        fla.use_fla("fla", torch.device("cuda"), 64)
    assert "pip install 'fla-core[cuda]', or use model={\"impl\": 'auto'}" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "device, kernel, chunk, uses",
    [("cuda", True, 64, True), ("cuda", True, 16, True), ("cuda", False, 64, False), ("cpu", True, 64, False)]
    + [("cuda", True, 8, False)],
)
def test_auto_takes_fla_on_cuda_where_it_imports(monkeypatch, device, kernel, chunk, uses) -> None:
    """``model.impl: auto`` (the default): fla's kernel on CUDA where it imports and takes the
    chunk size, ours otherwise, with no error either way."""
    from recurformer.ops.delta_rule import fla

    monkeypatch.setattr(fla, "fla_kernel", lambda: (lambda: None) if kernel else None)
    assert fla.use_fla("auto", torch.device(device), chunk) is uses
    assert make_config("gated_deltanet", dict(dim=32, n_heads=4)).impl == "auto"


def test_the_state_and_weights_do_not_depend_on_impl() -> None:
    """A checkpoint is the same whichever form computes the recurrence: the same parameter names
    and shapes, the same state layout."""
    models = {
        impl: build_model(
            "gated_deltanet", dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=16, impl=impl)
        )
        for impl in ("auto", "chunked", "naive", "fla")
    }
    shapes = {impl: {k: v.shape for k, v in m.state_dict().items()} for impl, m in models.items()}
    states = {impl: {k: v.shape for k, v in m.init_state(2, "cpu").to_flat().items()} for impl, m in models.items()}
    assert all(s == shapes["chunked"] for s in shapes.values())
    assert all(s == states["chunked"] for s in states.values())
