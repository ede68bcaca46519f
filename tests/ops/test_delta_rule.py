"""The gated delta rule (``recurformer.ops.delta_rule``): the chunked (WY/UT) form equals the
per-token one in outputs, final state and every gradient; the per-token one is the paper's update
written literally; the chunked one stays stable in float32 where a trained layer writes hard; a = 1,
b = 0 holds the state exactly."""

from __future__ import annotations

import pytest
import torch

from recurformer.ops.delta_rule import delta_rule_chunked, delta_rule_naive

F64 = dict(dtype=torch.float64)
TIGHT = dict(rtol=1e-10, atol=1e-10)


def inputs(B: int, H: int, T: int, dk: int, dv: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random q, k (unit rows), v, b in (0, 1), g = log a from strong to no decay, S0, all float64
    and requiring grad."""
    r = lambda *s: torch.randn(*s, generator=gen, **F64)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, H, T, dk), dim=-1)
    k = torch.nn.functional.normalize(r(B, H, T, dk), dim=-1)
    b = torch.rand(B, H, T, generator=gen, **F64)
    g = -torch.rand(B, H, T, generator=gen, **F64) * torch.tensor([3.0, 0.3, 1e-3])[:H, None]
    return [t.requires_grad_() for t in (q, k, r(B, H, T, dv), b, g, r(B, H, dv, dk))]


def literal(q, k, v, b, g, S):
    """S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t, as written."""
    eye = torch.eye(k.shape[-1], **F64)
    outs = []
    for t in range(q.shape[2]):
        kt, a, bt = k[:, :, t], g[:, :, t].exp()[..., None, None], b[:, :, t, None, None]
        S = a * S @ (eye - bt * kt[..., :, None] * kt[..., None, :]) + bt * v[:, :, t, :, None] * kt[..., None, :]
        outs.append((S @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, 2), S


def grads(fn, xs: list[torch.Tensor], w: torch.Tensor, wS: torch.Tensor) -> tuple[torch.Tensor, ...]:
    o, S = fn(*xs)
    return (o, S, *torch.autograd.grad((o * w).sum() + (S * wS).sum(), xs))


def test_naive_is_the_update_as_written() -> None:
    gen = torch.Generator().manual_seed(1)
    xs = inputs(2, 3, 9, 4, 5, gen)
    for got, want in zip(delta_rule_naive(*xs), literal(*xs)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T, chunk", [(37, 8), (5, 8), (64, 16), (70, 64), (1, 4), (13, 1)])
def test_chunked_equals_naive_with_every_gradient(T: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(T * 100 + chunk)
    xs = inputs(2, 3, T, 6, 5, gen)
    w, wS = torch.randn(2, 3, T, 5, generator=gen, **F64), torch.randn(2, 3, 5, 6, generator=gen, **F64)
    want = grads(delta_rule_naive, xs, w, wS)
    got = grads(lambda *a: delta_rule_chunked(*a, chunk), xs, w, wS)
    names = ["o", "S_T", "dq", "dk", "dv", "db", "dg", "dS0"]
    for n, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_is_stable_in_float32_where_a_trained_layer_writes_hard(chunk: int) -> None:
    """What a trained layer does (keys of one chunk nearly parallel, write strengths near 1, little
    decay) makes the in-chunk system ill-suited to a power series: its terms grow like binomial
    coefficients and cancel. In float32 the chunked form must stay as close to the float64
    reference as the per-token form does (a series inverse was off by O(1) here)."""
    gen = torch.Generator().manual_seed(chunk)
    B, H, T, d = 2, 2, 3 * chunk, 8
    r = lambda *s: torch.randn(*s, generator=gen, **F64)  # noqa: E731
    k = torch.nn.functional.normalize(r(B, H, 1, d) + 0.05 * r(B, H, T, d), dim=-1)
    q = torch.nn.functional.normalize(r(B, H, T, d), dim=-1)
    b = 0.9 + 0.1 * torch.rand(B, H, T, generator=gen, **F64)
    g = -1e-3 * torch.rand(B, H, T, generator=gen, **F64)
    xs = [q, k, r(B, H, T, d), b, g, r(B, H, d, d)]
    want = delta_rule_naive(*xs)
    naive32 = delta_rule_naive(*(t.float() for t in xs))
    got = delta_rule_chunked(*(t.float() for t in xs), chunk)
    for n, a, ref, w in zip(("o", "S_T"), got, naive32, want):
        err, base = float((a.double() - w).abs().max()), float((ref.double() - w).abs().max())
        assert err <= max(10 * base, 1e-4), f"{n}: chunked float32 off by {err:.2e} (per-token float32: {base:.2e})"


def test_a_closed_write_and_no_decay_hold_the_state_exactly() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v, b, g, S0 = (t.detach() for t in inputs(1, 2, 50, 4, 4, gen))
    for fn in (delta_rule_naive, lambda *a: delta_rule_chunked(*a, 8)):
        o, S = fn(q, k, v, torch.zeros_like(b), torch.zeros_like(g), S0)
        assert torch.equal(S, S0)
        torch.testing.assert_close(o, (S0[:, :, None] @ q[..., None])[..., 0].expand_as(o), rtol=0, atol=1e-15)


def fla_naive():  # type: ignore[no-untyped-def]
    """flash-linear-attention's own pure-PyTorch references of the gated delta rule
    (``fla/ops/gated_delta_rule/naive.py``), read from the installed ``fla-core`` without importing
    the ``fla`` package, whose ``__init__`` needs Triton; skipped where fla-core is not installed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (pip install fla-core)")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "gated_delta_rule" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    assert module_spec is not None and module_spec.loader is not None, path
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("form, T, chunk", [("chunk", 37, 16), ("chunk", 64, 64), ("recurrent", 29, 8)])
def test_chunked_equals_flash_linear_attentions_reference(form: str, T: int, chunk: int) -> None:
    """An external reference: fla's ``naive_chunk_gated_delta_rule`` / ``naive_recurrent_gated_delta_rule``
    (q, k [B, T, H, K], v [B, T, H, V], log-decay g and write strength beta [B, T, H], the state
    [B, H, K, V]: ours transposed; ``scale=1``: our q is normalised, not scaled). They compute in
    float32 whatever they are given, so our chunked form runs in float64 as the truth, and their
    outputs, final state and every gradient must agree with it to float32 rounding."""
    fla = fla_naive()
    gen = torch.Generator().manual_seed(T + chunk)
    xs = inputs(2, 3, T, 8, 6, gen)
    w, wS = torch.randn(2, 3, T, 6, generator=gen, **F64), torch.randn(2, 3, 6, 8, generator=gen, **F64)
    want = grads(lambda *a: delta_rule_chunked(*a, chunk), xs, w, wS)

    def theirs(q, k, v, b, g, S):  # type: ignore[no-untyped-def]
        heads_second = [t.transpose(1, 2) for t in (q, k, v, b, g)]  # [B, H, T, ...] -> [B, T, H, ...]
        q_, k_, v_, b_, g_ = heads_second
        kw = dict(scale=1.0, initial_state=S.transpose(-1, -2), output_final_state=True)
        if form == "chunk":
            o, S_T = fla.naive_chunk_gated_delta_rule(q_, k_, v_, g_, b_, chunk_size=chunk, **kw)
        else:
            o, S_T = fla.naive_recurrent_gated_delta_rule(q_, k_, v_, b_, g_, **kw)
        return o.transpose(1, 2).double(), S_T.transpose(-1, -2).double()

    got = grads(theirs, xs, w, wS)
    for n, a, b in zip(["o", "S_T", "dq", "dk", "dv", "db", "dg", "dS0"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize(
    "floors", [{}, {"write_floor": 0.3, "decay_floor": 0.6, "decay_init": 0.3}], ids=["", "floors"]
)
def test_a_layer_on_flas_kernel_equals_ours(monkeypatch: pytest.MonkeyPatch, floors: dict) -> None:
    """``model.impl: fla`` maps our tensors onto fla's ``chunk_gated_delta_rule`` exactly: with
    the kernel (which needs CUDA) replaced by fla's own pure-PyTorch ``naive_chunk_gated_delta_rule``,
    called with the same arguments, the whole layer over two calls (the state carried, the floors
    applied) gives ours's outputs, states and the gradients of its input, of a nonzero initial
    state and of every parameter. fla computes in float32 whatever it is given, so the layer runs
    in float64 and agrees to float32 rounding."""
    import recurformer.models.gated_deltanet as gdn
    from recurformer.models.gated_deltanet import DeltaState, GatedDeltaNetLayer
    from recurformer.ops.delta_rule import fla as fla_ops
    from recurformer.registry import make_config
    from recurformer.state import Call

    fla = fla_naive()
    calls = []

    def kernel(q, k, v, g, beta, *, use_qk_l2norm_in_kernel, **kw):  # type: ignore[no-untyped-def]
        assert not use_qk_l2norm_in_kernel  # q and k arrive normalised
        calls.append(q.shape)
        return fla.naive_chunk_gated_delta_rule(q, k, v, g, beta, **kw)

    monkeypatch.setattr(fla_ops, "fla_kernel", lambda: kernel)
    monkeypatch.setattr(gdn, "use_fla", lambda impl, device, chunk: True)  # (the CPU stands in for CUDA)
    layers = {}
    for impl in ("chunked", "fla"):
        layers[impl] = GatedDeltaNetLayer(
            make_config("gated_deltanet", dict(dim=32, n_heads=2, chunk_size=16, impl=impl, **floors))
        )
    torch.manual_seed(3)
    for p in layers["chunked"].parameters():
        p.data.normal_(0.0, 0.3)
    layers["chunked"].double()
    layers["fla"].double().load_state_dict(layers["chunked"].state_dict())
    B, lengths = 2, (37, 20)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(B, sum(lengths), 32, generator=gen, **F64, requires_grad=True)
    w = torch.randn(B, sum(lengths), 32, generator=gen, **F64)
    s0 = layers["chunked"].init_state(B, "cpu", torch.float64)
    s0 = DeltaState(S=torch.randn(s0.S.shape, generator=gen, **F64).requires_grad_(), conv=s0.conv)
    results = {}
    for impl, layer in layers.items():
        s, ys = s0, []
        for part in x.split(lengths, dim=1):
            y, s = layer(part, s, Call(0, torch.zeros(B, dtype=torch.long)))
            ys.append(y)
        y = torch.cat(ys, dim=1)
        gs = torch.autograd.grad((y * w).sum() + s.S.sum(), [x, s0.S, *layer.parameters()])
        results[impl] = [y, s.S, s.conv, *gs]
    assert len(calls) == len(lengths)  # the kernel ran every call
    names = ["y", "S", "conv", "dx", "dS0", *dict(layers["chunked"].named_parameters())]
    for n, a, b in zip(names, results["fla"], results["chunked"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
