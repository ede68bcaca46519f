"""Building blocks with a hand-written gradient against autograd's, on fresh random inputs: the
training loss (``recurformer.modules.cross_entropy``, gradient computed in the forward, block by
block) against ``F.cross_entropy`` over float32 logits, RMSNorm against the graph of its ops, and
RoPE against the rotation written as complex multiplication."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import conv_literal

from recurformer import build_model
from recurformer.config import RecurformerError
from recurformer.modules import RMSNorm, WriteGate, _CrossEntropy, apply_rope, cross_entropy, rope_cos_sin, short_conv


def reference(logits: torch.Tensor, targets: torch.Tensor, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().requires_grad_()
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    loss = F.cross_entropy(x.to(acc), targets, ignore_index=-100)
    (loss * scale).backward()
    return loss.detach(), x.grad


def ours(logits: torch.Tensor, targets: torch.Tensor, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().requires_grad_()
    loss = _CrossEntropy.apply(x, targets, -100)  # in every dtype, though only float16/bfloat16 logits take it
    (loss * scale).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("V", [7, 4096, 70000])  # one block, 64-row blocks, 3-row blocks with a short last one
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [3.0, 1.0])  # 1: the backward hands back the saved gradient as it is
def test_loss_and_gradient_match_torch(V: int, dtype: torch.dtype, scale: float) -> None:
    N = 130
    logits = (torch.randn(N, V, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, V, (N,))
    targets[torch.rand(N) < 0.2] = -100
    (l0, g0), (l1, g1) = reference(logits, targets, scale), ours(logits, targets, scale)
    assert l1.dtype == l0.dtype and g1.dtype == dtype
    assert torch.allclose(l1, l0, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
    # elementwise, within a few roundings in the logits' dtype (softmax, the scale, the backward's
    # product) of the entry, or of the row's scale 3 / n where p - 1 cancels at the target
    err, row_scale = (g1.double() - g0.double()).abs(), scale / int((targets != -100).sum())
    assert (err <= 4 * torch.finfo(dtype).eps * (g0.double().abs() + row_scale)).all()
    assert g1[targets == -100].abs().sum() == 0


def test_every_target_ignored_gives_nan_and_a_zero_gradient() -> None:
    logits, targets = torch.randn(5, 11), torch.full((5,), -100)
    (l0, g0), (l1, g1) = reference(logits, targets), ours(logits, targets)
    assert l0.isnan() and l1.isnan()
    assert torch.equal(g1, g0) and g1.abs().sum() == 0


def test_under_bf16_autocast_the_loss_is_float32() -> None:
    logits = torch.randn(64, 300).bfloat16()
    targets = torch.randint(0, 300, (64,))
    x = logits.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy(x, targets)
    assert loss.dtype == torch.float32 and loss.grad_fn is not None and "_CrossEntropy" in type(loss.grad_fn).__name__
    assert torch.allclose(loss, reference(logits, targets)[0], rtol=1e-6, atol=0)


def test_the_model_loss_is_the_cross_entropy_of_its_logits() -> None:
    torch.manual_seed(0)
    model = build_model("llama", dict(vocab_size=97, dim=32, n_layers=2, n_heads=2)).double()
    x = torch.randint(0, 97, (3, 20))
    y = torch.randint(0, 97, (3, 20))
    y[0, :5] = -100
    out = model(x, targets=y)
    assert torch.allclose(out.loss, F.cross_entropy(out.logits.flatten(0, 1), y.flatten()), rtol=1e-12, atol=0)
    out.loss.backward()
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).backward()
    for a, b in zip(g, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


def test_a_target_outside_the_vocabulary_is_a_clear_error() -> None:
    model = build_model("llama", dict(vocab_size=97, dim=32, n_layers=1, n_heads=2))
    x = torch.randint(0, 97, (2, 8))
    for bad in (97, -3):
        y = x.clone()
        y[1, 4] = bad
        with pytest.raises(RecurformerError, match=f"target id {bad} is outside the vocabulary"):
            model(x, targets=y)


def rms_norm_by_autograd(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the graph of its operations (what autograd differentiates)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * g


@pytest.mark.parametrize("shape", [(3, 5, 48), (2, 0, 48), (7, 48)])
def test_rms_norm_gradient_matches_autograd_in_float64(shape: tuple[int, ...]) -> None:
    norm = RMSNorm(48, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(*shape, dtype=torch.float64) * 3).requires_grad_()
    dy = torch.randn(*shape, dtype=torch.float64)
    got = torch.autograd.grad(norm(x), (x, norm.weight), dy)
    want = torch.autograd.grad(rms_norm_by_autograd(x, norm.weight, 1e-5), (x, norm.weight), dy)
    assert torch.equal(norm(x), rms_norm_by_autograd(x, norm.weight, 1e-5))
    with torch.no_grad():  # without a graph the ops run alone: the same values
        assert torch.equal(norm(x), rms_norm_by_autograd(x, norm.weight, 1e-5))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-13)


def test_rms_norm_under_bf16_autocast_and_without_an_input_gradient() -> None:
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    for dtype in (torch.float32, torch.bfloat16):  # the residual stream (float32) and a bf16 memory
        x0, dy = torch.randn(4, 9, 64).to(dtype), torch.randn(4, 9, 64)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x)
            y_ref = rms_norm_by_autograd(x, norm.weight, norm.eps)
        assert y.dtype == y_ref.dtype == torch.float32 and torch.equal(y, y_ref)
        got = torch.autograd.grad(y, (x, norm.weight), dy)
        want = torch.autograd.grad(y_ref, (x, norm.weight), dy)
        assert got[0].dtype == dtype
        for a, b in zip(got, want):  # dx cancels (dn - x r^2 mean(dn x)): a few units of x's dtype at the largest entry
            assert (a.float() - b.float()).abs().max() <= 4 * torch.finfo(dtype).eps * b.float().abs().max()
    x = torch.randn(4, 9, 64)  # no gradient to x: the gain's alone
    (dw,) = torch.autograd.grad(norm(x), norm.weight, dy)
    (dw_ref,) = torch.autograd.grad(rms_norm_by_autograd(x, norm.weight, norm.eps), norm.weight, dy)
    assert torch.allclose(dw, dw_ref, rtol=1e-6, atol=1e-6)


def rope_reference(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The pairs (x[i], x[i + d/2]) as complex numbers times e^{i angle}, in complex128."""
    h = x.shape[-1] // 2
    z = torch.complex(x[..., :h].double(), x[..., h:].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("table", ["shared", "per_row"])  # cos/sin [T, d/2] or [B, 1, T, d/2]
def test_rope_and_its_gradient_match_the_complex_rotation(table: str) -> None:
    B, H, T, d = 3, 2, 7, 8
    x = torch.randn(B, H, T, d, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 10**6, (T,)) if table == "shared" else torch.randint(0, 10**6, (B, 1, T))
    cos, sin = rope_cos_sin(pos, d, 1e4, torch.float64)
    inv_freq = 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = pos.double().unsqueeze(-1) * inv_freq
    y, ref = apply_rope(x, cos, sin), rope_reference(x.detach(), angles)
    assert torch.allclose(y, ref, rtol=0, atol=1e-12)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().requires_grad_()
    (gref,) = torch.autograd.grad(rope_reference(xr, angles), xr, dy)
    assert torch.allclose(gx, gref, rtol=0, atol=1e-12)
    with torch.no_grad():  # decoding takes the plain ops: the same values to rounding
        assert torch.allclose(apply_rope(x, cos, sin), ref, rtol=0, atol=1e-12)


def test_rope_of_bf16_under_float32_tables_is_float32_with_a_bf16_gradient() -> None:
    """Under CPU autocast the projections give bf16 and the tables are float32: the rotation runs
    in float32 (one cast of x), and the gradient reaching x is bf16 again."""
    x = torch.randn(2, 2, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(5), 8, 1e4, torch.float32)
    y = apply_rope(x, cos, sin)
    assert y.dtype == torch.float32
    assert torch.allclose(
        y,
        rope_reference(x.detach().float(), torch.arange(5.0)[:, None] * 1e4 ** (-torch.arange(0, 8, 2) / 8)).float(),
        atol=1e-6,
    )
    y.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("K", [1, 2, 4])
def test_short_conv_is_the_causal_convolution_continued_across_calls(K) -> None:
    """``short_conv`` over a whole sequence equals the convolution read literally (zeros before the
    start), and split into calls of 1, 2 and 4 positions with the returned cache it gives the same
    outputs and final cache (the last K-1 inputs)."""
    x, w = torch.randn(2, 9, 5, dtype=torch.float64), torch.randn(5, K, dtype=torch.float64)
    zero = x.new_zeros(2, K - 1, 5)
    y, cache = short_conv(x, zero, w)
    torch.testing.assert_close(y, conv_literal(x, w), rtol=1e-12, atol=1e-12)
    assert torch.equal(cache, x[:, 9 - (K - 1) :])
    parts, c = [], zero
    for a, b in [(0, 1), (1, 3), (3, 7), (7, 9)]:
        out, c = short_conv(x[:, a:b], c, w)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 1), y, rtol=1e-12, atol=1e-12)
    assert torch.equal(c, cache)


def test_write_gate_is_the_equation_and_starts_closed() -> None:
    """M + sigmoid(W_g W + b_g) * (W - M) per slot and channel; b_g = -5 after ``init_extra``."""
    gate = WriteGate(6).double()
    m, new = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64)
    g = torch.sigmoid(new @ gate.proj.weight.T + gate.proj.bias)
    torch.testing.assert_close(gate(m, new), (1 - g) * m + g * new, rtol=1e-12, atol=1e-12)
    gate.init_extra(0.02)
    assert torch.equal(gate.proj.bias, torch.full((6,), -5.0, dtype=torch.float64))
