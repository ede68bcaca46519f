"""The custom backward of the tiled recurrent attention ("The Recurrent Transformer: Greater
Effective Depth and Efficient Decoding", §"The backward pass"): its gradients (layer input, state of
an earlier call, every parameter) equal plain autograd through the naive reference in float64, it is
the model's training path, it saves O(N d) bytes where autograd through the tiled forward saves
O(N^2), a learned bias falls back to autograd, and in bf16 (autocast or weights) it stays as close
to fp32 as the naive path."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, randomize_params

from recurformer import build_model
from recurformer.ops.recurrent_attention import (
    RecurrentInputs,
    finish_vjp,
    recurrent_attention_naive,
    recurrent_attention_tiled,
)

BASE = dict(vocab_size=53, dim=16, n_layers=1, n_heads=2)
CUSTOM = "_TiledRecurrentAttentionBackward"


def _graph_nodes(t: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind t."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(type(f).__name__)
        stack += [g for g, _ in f.next_functions]
    return names


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while fn runs (unique storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


# (T, extra config, pos0 = tokens of an earlier call, document start of row 1)
LAYER_CASES = [
    (37, dict(), 0, 0),
    (1, dict(), 5, 2),  # one decoding step
    (29, dict(position="rope", block_size=3), 7, 3),  # an unfinished block (r0 = 1) in the state
    (50, dict(block_size=4, residual_scale=True), 10, 4),
    (100, dict(position="rope", block_size=5, qk_norm=False, n_heads=4), 0, 0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T,extra,pos0,start1",
    LAYER_CASES,
    ids=[f"T={c[0]}-b={c[1].get('block_size', 1)}-{c[1].get('position', 'alibi')}" for c in LAYER_CASES],
)
def test_layer_gradients_equal_naive(T, extra, pos0, start1, device) -> None:
    """One layer on fresh random inputs x and state (persistent cache of pos0 positions, the
    temporaries of the unfinished block), a loss on z and the new state: gradients of x, of the
    state and of every parameter agree with autograd through the naive op to 1e-10."""
    torch.manual_seed(T)
    model = build_model("recurrent_transformer", dict(BASE, **extra)).double()
    randomize_params(model, 0.3)
    model.to(device)
    layer = model.layers[0]
    B, H, D = 2, layer.n_heads, layer.cfg.dim
    d, r0 = D // H, pos0 % layer.period
    f64 = dict(dtype=torch.float64, device=device)
    x = torch.randn(B, T, D, **f64, requires_grad=True)
    past = {
        n: torch.randn(B, H, S, d, **f64, requires_grad=True)
        for n, S in (("k", pos0), ("v", pos0), ("tk", r0), ("tv", r0))
    }
    start = torch.tensor([0, start1], device=device)
    rope, bias_fn = layer.position_signal(pos0, T, x.device, x.dtype)
    weights = {
        n: torch.randn(B, *shape, **f64)
        for n, shape in (("z", (T, D)), ("k", (H, pos0 + T, d)), ("v", (H, pos0 + T, d)))
    }
    grads = {}
    for impl in ("tiled", "naive"):
        model.zero_grad()
        z, new = layer.run(x, past, pos0=pos0, start=start, rope=rope, bias_fn=bias_fn, impl=impl)
        assert (CUSTOM in _graph_nodes(z)) == (impl == "tiled")
        loss = (z * weights["z"]).sum() + (new["k"] * weights["k"]).sum() + (new["v"] * weights["v"]).sum()
        inputs = [x, *(past[n] for n in ("k", "v", "tk", "tv") if past[n].numel()), *model.parameters()]
        grads[impl] = torch.autograd.grad(loss, inputs, allow_unused=True)
    names = (
        ["x"]
        + [f"past {n}" for n in ("k", "v", "tk", "tv") if past[n].numel()]
        + [n for n, _ in model.named_parameters()]
    )
    for name, gt, gn in zip(names, grads["tiled"], grads["naive"]):
        if gn is None:  # embedding / head: not in this layer's graph
            assert gt is None, name
            continue
        assert gn.abs().sum() > 0, name
        torch.testing.assert_close(gt, gn, rtol=1e-10, atol=1e-10 * max(1.0, gn.abs().max().item()), msg=name)


def _op_inputs(block: int, pos0: int, T: int = 37, seed: int = 0):
    """Random op inputs (cache, unfinished block, a document start inside the cache for row 1)
    and a finish that closes over x and W: z = tanh(x + a), (k, v) = z W."""
    g = torch.Generator().manual_seed(seed)
    B, H, d = 2, 2, 4
    r0 = pos0 % block
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    tensors = dict(
        q=rnd(B, H, T, d),
        tk=rnd(B, H, T, d),
        tv=rnd(B, H, T, d),
        past_k=rnd(B, H, pos0, d),
        past_v=rnd(B, H, pos0, d),
        past_tk=rnd(B, H, r0, d),
        past_tv=rnd(B, H, r0, d),
    )
    x, W = rnd(B, T, H * d), (torch.randn(H * d, 2 * H * d, generator=g, dtype=torch.float64) * 0.5).requires_grad_()

    def finish(a, s, e):
        z = torch.tanh(x[:, s:e] + a.transpose(1, 2).reshape(B, e - s, H * d))
        k, v = (z @ W).view(B, e - s, 2, H, d).permute(2, 0, 3, 1, 4)
        return z, k, v

    start = torch.tensor([0, max(pos0 - r0 - block, 0)])
    return tensors, finish, (x, W), start


@pytest.mark.parametrize("block,pos0,chunk", [(1, 0, 3), (1, 6, 512), (2, 5, 5), (3, 7, 1), (4, 9, 7)])
def test_op_gradients_equal_naive(block, pos0, chunk) -> None:
    """The op alone with a generic bias, tile updates cut into query chunks, a cache and an
    unfinished block: gradients of q, k~, v~, the state and finish's x and W."""
    tensors, finish, closed, start = _op_inputs(block, pos0, seed=block + pos0)
    kw = dict(block=block, pos0=pos0, start=start, bias_fn=lambda dist: -0.3 * dist[None].double())
    q, tk, tv = (tensors.pop(n) for n in ("q", "tk", "tv"))
    inputs = [q, tk, tv, *(t for t in tensors.values() if t.numel()), *closed]
    g = torch.Generator().manual_seed(7)
    grads = []
    for custom in (True, False):
        if custom:
            outs = recurrent_attention_tiled(
                RecurrentInputs(q, tk, tv, finish, **tensors, **kw), query_chunk=chunk, finish_inputs=closed
            )
            assert CUSTOM in _graph_nodes(outs[0])
        else:
            outs = recurrent_attention_naive(RecurrentInputs(q, tk, tv, finish, **tensors, **kw))
        g.manual_seed(7)
        loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs)
        grads.append(torch.autograd.grad(loss, inputs))
    for gt, gn in zip(*grads):
        assert gn.abs().sum() > 0
        torch.testing.assert_close(gt, gn, rtol=1e-10, atol=1e-10)


def test_model_training_path_uses_custom_backward() -> None:
    model = build_model("recurrent_transformer", dict(BASE, n_layers=2))
    out = model(torch.randint(0, BASE["vocab_size"], (2, 9)))
    assert CUSTOM in _graph_nodes(out.logits)


@pytest.mark.parametrize("rope", [False, True])
def test_finish_vjp_traced_equals_eager(rope) -> None:
    """The two ways of finish's vector-Jacobian product (``torch.func.vjp`` under Dynamo,
    ``torch.autograd.grad`` eagerly) give the same da, on a real layer's finish (RMSNorm, RoPE)."""
    torch.manual_seed(1)
    model = build_model("recurrent_transformer", dict(BASE, position="rope" if rope else "alibi")).double()
    randomize_params(model, 0.3)
    layer, B, T = model.layers[0], 2, 6
    x = torch.randn(B, T, layer.cfg.dim, dtype=torch.float64)
    cos_sin, _ = layer.position_signal(0, T, x.device, x.dtype)

    def finish(a, s, e):
        h = x[:, s:e] + layer.wo(a.transpose(1, 2).reshape(B, e - s, -1))
        z = h + layer.ffn(layer.ffn_norm(h))
        return (z, *layer.kv(z, None if cos_sin is None else (cos_sin[0][s:e], cos_sin[1][s:e])))

    a = torch.randn(B, layer.n_heads, 3, layer.cfg.head_dim, dtype=torch.float64)
    outs = finish(a, 2, 5)
    grads = [torch.randn_like(o) for o in outs]
    eager, traced = (finish_vjp(finish, a, 2, 5, grads, t) for t in (False, True))
    assert eager.abs().sum() > 0
    torch.testing.assert_close(traced, eager, rtol=1e-12, atol=1e-12)


def test_learned_bias_falls_back_to_autograd() -> None:
    """A bias whose output requires grad (learned slopes) takes plain autograd; its gradient is
    the naive path's."""
    tensors, finish, closed, start = _op_inputs(2, 5)
    slopes = torch.tensor([0.2, 0.7], dtype=torch.float64, requires_grad=True)
    kw = dict(block=2, pos0=5, start=start, bias_fn=lambda dist: -slopes.view(-1, 1, 1) * dist.double())
    q, tk, tv = (tensors.pop(n) for n in ("q", "tk", "tv"))
    inputs = RecurrentInputs(q, tk, tv, finish, **tensors, **kw)
    z, _, _ = recurrent_attention_tiled(inputs, finish_inputs=closed)
    assert CUSTOM not in _graph_nodes(z)
    (g_tiled,) = torch.autograd.grad(z.sum(), slopes)
    (g_naive,) = torch.autograd.grad(recurrent_attention_naive(inputs)[0].sum(), slopes)
    torch.testing.assert_close(g_tiled, g_naive, rtol=1e-10, atol=1e-10)


def test_finish_closure_found_without_finish_inputs() -> None:
    """Without ``finish_inputs``, a finish that reads tensors requiring grad (x and W, none of them
    the op's own inputs) is found by running it on the first block: the call records a graph
    (through the naive op) and x and W get the naive path's gradients."""
    tensors, finish, closed, start = _op_inputs(2, 5)
    tensors = {n: t.detach() for n, t in tensors.items()}
    q, tk, tv = (tensors.pop(n) for n in ("q", "tk", "tv"))
    kw = dict(block=2, pos0=5, start=start, bias_fn=lambda dist: -0.3 * dist[None].double())
    grads = []
    for op in (recurrent_attention_tiled, recurrent_attention_naive):
        z, k, _ = op(RecurrentInputs(q, tk, tv, finish, **tensors, **kw))
        assert z.requires_grad
        grads.append(torch.autograd.grad(z.sum() + k.square().sum(), closed))
    for gt, gn in zip(*grads):
        assert gn.abs().sum() > 0
        torch.testing.assert_close(gt, gn, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("custom", [True, False], ids=["custom", "autograd"])
def test_saved_bytes_grow_linearly_in_n(custom) -> None:
    """Saved-tensor bytes at N and 4N: ~4x with the custom backward (O(N d)); autograd through
    the tiled forward keeps every tile's scores and probabilities (O(N^2)), > 8x — the check
    tells them apart."""
    saved = []
    for T in (256, 1024):
        tensors, finish, closed, start = _op_inputs(1, 0, T=T)
        q, tk, tv = (tensors.pop(n) for n in ("q", "tk", "tv"))
        fn = lambda: recurrent_attention_tiled(
            RecurrentInputs(q, tk, tv, finish, start=start, **tensors), finish_inputs=closed if custom else None
        )  # noqa: E731
        saved.append(_saved_bytes(fn))
    ratio = saved[1] / saved[0]
    assert (ratio < 4.4) if custom else (ratio > 8), ratio


def test_model_layer_saved_bytes_linear() -> None:
    """The same through the model's layer (its default, training path), blocks of 1 and 4."""
    for extra in (dict(), dict(block_size=4, position="rope")):
        model = build_model("recurrent_transformer", dict(BASE, **extra))
        layer = model.layers[0]
        saved = []
        for T in (256, 1024):
            x = torch.randn(1, T, BASE["dim"], requires_grad=True)
            empty = x.new_zeros(1, layer.n_heads, 0, BASE["dim"] // layer.n_heads)
            rope, bias_fn = layer.position_signal(0, T, x.device, x.dtype)
            past = {n: empty for n in ("k", "v", "tk", "tv")}
            saved.append(
                _saved_bytes(
                    lambda: layer.run(
                        x, past, pos0=0, start=torch.zeros(1, dtype=torch.long), rope=rope, bias_fn=bias_fn
                    )
                )
            )
        assert saved[1] / saved[0] < 4.4, (extra, saved)


@pytest.mark.parametrize("mode", ["autocast", "weights"])
def test_bf16_gradients_close_to_fp32(mode) -> None:
    """In bf16 (autocast: finish recomputed under the same autocast in backward; or bf16
    weights), with fp32 accumulators, the custom backward's parameter gradients are as close to
    the fp32 ones as the naive path's autograd gradients are."""
    torch.manual_seed(0)
    cfg = dict(BASE, n_layers=2, block_size=2)
    tiled = build_model("recurrent_transformer", cfg)
    naive = build_model("recurrent_transformer", dict(cfg, impl="naive"))
    naive.load_state_dict(tiled.state_dict())
    tokens = torch.randint(0, BASE["vocab_size"], (2, 30))

    def grads(model, bf16: bool) -> dict[str, torch.Tensor]:
        model.to(torch.bfloat16 if bf16 and mode == "weights" else torch.float32).zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and mode == "autocast"):
            loss = model(tokens, targets=tokens).loss
        loss.backward()
        return {n: p.grad.float() for n, p in model.named_parameters()}

    ref = grads(naive, False)
    low_tiled, low_naive = grads(tiled, True), grads(naive, True)
    for n in ref:
        err_tiled = (low_tiled[n] - ref[n]).norm() / ref[n].norm()
        err_naive = (low_naive[n] - ref[n]).norm() / ref[n].norm()
        assert 0 < err_tiled < 2 * err_naive + 0.01, (n, err_tiled.item(), err_naive.item())
