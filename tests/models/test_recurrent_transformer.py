"""Recurrent Transformer ("The Recurrent Transformer: Greater Effective Depth and Efficient
Decoding"): the exact tiled forward against the naive reference (logits and every parameter
gradient), the temporary pair at the self position, the token-to-token recurrence under attention
forced onto the previous position, the paper's Stirling-number theorem, the tile schedule, bf16
accumulators and the decoding cost."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import DEVICES, randomize_params

from recurformer import RecurformerError, build_model
from recurformer.ops.recurrent_attention import (
    RecurrentInputs,
    block_edges,
    kv_reads,
    recurrent_attention_naive,
    recurrent_attention_tiled,
    tile_schedule,
    tile_update,
)

OPS = {"tiled": recurrent_attention_tiled, "naive": recurrent_attention_naive}
BASE = dict(vocab_size=53, dim=16, n_layers=2, n_heads=2)
# (N, extra config, tokens of an earlier call whose state is passed in)
CASES = [
    (1, dict(), 3),  # one decoding step after 3 tokens (with no past, q_1 would not matter)
    (7, dict(position="rope", block_size=3), 4),
    (64, dict(n_heads=4, residual_scale=True), 0),
    (100, dict(block_size=4, qk_norm=False), 6),
    (257, dict(n_layers=1), 0),
]


def _pair(extra: dict, dtype: torch.dtype, std: float, device: str = "cpu"):
    tiled = build_model("recurrent_transformer", dict(BASE, **extra, impl="tiled")).to(dtype)
    naive = build_model("recurrent_transformer", dict(BASE, **extra, impl="naive")).to(dtype)
    randomize_params(tiled, std)
    naive.load_state_dict(tiled.state_dict())
    return tiled.to(device), naive.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,std,tol", [(torch.float64, 0.3, 1e-10), (torch.float32, 0.1, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("N,extra,p0", CASES, ids=[f"N={c[0]}" for c in CASES])
def test_tiled_equals_naive_logits_and_gradients(N, extra, p0, dtype, std, tol, device) -> None:
    tiled, naive = _pair(extra, dtype, std, device)
    B, V = 2, BASE["vocab_size"]
    pre = torch.randint(0, V, (B, p0)).to(device)
    tokens = torch.randint(0, V, (B, N)).to(device)
    targets = torch.randint(0, V, (B, N)).to(device)
    outs = {}
    for name, model in (("tiled", tiled), ("naive", naive)):
        state = model(pre).state if p0 else None  # an earlier call: cache (+ an unfinished block)
        out = model(tokens, state=state, targets=targets)
        w = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(1), dtype=dtype).to(device)
        (out.loss + (out.logits * w).mean()).backward()
        outs[name] = (out.logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    (lt, gt), (ln, gn) = outs["tiled"], outs["naive"]
    torch.testing.assert_close(lt, ln, rtol=tol, atol=tol)
    assert gt.keys() == gn.keys()
    for n in gt:
        assert gn[n] is not None and gn[n].abs().sum() > 0, n
        scale = max(1.0, gn[n].abs().max().item())  # gradients can be O(10-100) at std 0.3
        torch.testing.assert_close(gt[n], gn[n], rtol=tol, atol=tol * scale, msg=n)


def _layer(extra: dict | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model("recurrent_transformer", dict(BASE, n_layers=1, **(extra or {}))).double()
    randomize_params(model, 0.3)
    return model, model.layers[0]


def _run_layer(model, layer, x, impl, bias_fn="model"):
    B, T, _ = x.shape
    rope, alibi = layer.position_signal(0, T, x.device, x.dtype)
    empty = x.new_zeros(B, layer.n_heads, 0, x.shape[-1] // layer.n_heads)
    past = {k: empty for k in ("k", "v", "tk", "tv")}
    start = torch.zeros(B, dtype=torch.long)
    return layer.run(
        x, past, pos0=0, start=start, rope=rope, bias_fn=alibi if bias_fn == "model" else bias_fn, impl=impl
    )


@pytest.mark.parametrize("impl", ["tiled", "naive"])
def test_self_position_uses_the_temporary_pair(impl) -> None:
    """The layer's output is the fixed point of the paper's equations: recomputing a_i by hand
    from the returned z (persistent pairs of j < i) and the temporary pair of x_i gives z back;
    using the persistent pair of i at i instead does not."""
    model, layer = _layer()
    T, H = 12, layer.n_heads
    x = torch.randn(2, T, BASE["dim"], dtype=torch.float64)
    with torch.no_grad():
        z, st = _run_layer(model, layer, x, impl)
        q = layer.q_norm(layer.wq(layer.attn_norm(x))).view(2, T, H, -1).transpose(1, 2)
        tk, tv = layer.kv(x, None)
        k, v = layer.kv(z, None)
        torch.testing.assert_close(st["k"], k, rtol=0, atol=1e-12)
        slopes = layer.slopes.double()

        def rebuild(use_persistent_self: bool):
            out = []
            for i in range(T):
                ki = torch.cat((k[:, :, :i], (k if use_persistent_self else tk)[:, :, i : i + 1]), 2)
                vi = torch.cat((v[:, :, :i], (v if use_persistent_self else tv)[:, :, i : i + 1]), 2)
                s = (q[:, :, i : i + 1] @ ki.transpose(-1, -2)) / math.sqrt(q.shape[-1])
                s = s - slopes[:, None, None] * torch.arange(i, -1, -1, dtype=torch.float64)
                a = (s.softmax(-1) @ vi).transpose(1, 2).reshape(2, 1, -1)
                h = x[:, i : i + 1] + layer.wo(a)
                out.append(h + layer.ffn(layer.ffn_norm(h)))
            return torch.cat(out, 1)

        torch.testing.assert_close(rebuild(False), z, rtol=1e-10, atol=1e-10)
        assert (rebuild(True) - z).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["tiled", "naive"])
def test_attention_on_previous_position_is_a_token_recurrence(impl) -> None:
    """The paper's §"Representing token-to-token recurrence": with V = Wo = I and attention forced onto
    the previous persistent pair, z_i = RMS(z_{i-1}) + x_i + MLP(RMS(x_i + RMS(z_{i-1})))."""
    model, layer = _layer(dict(dim=16, n_heads=2))
    D, T = 16, 20
    with torch.no_grad():
        layer.wv.weight.copy_(torch.eye(D))
        layer.wo.weight.copy_(torch.eye(D))
        layer.attn_norm.weight.fill_(1.0)
    x = torch.randn(1, T, D, dtype=torch.float64)

    def previous_only(dist):  # a large negative bias everywhere but at distance 1
        return torch.where(dist == 1, 0.0, -1e4).to(torch.float64).unsqueeze(0)

    with torch.no_grad():
        z, _ = _run_layer(model, layer, x, impl, bias_fn=previous_only)
        rms = layer.attn_norm  # RMS with unit gain (its eps is the model's)
        ref = []
        for i in range(T):
            carry = rms(ref[-1]) if i else layer.wv(rms(x[:, 0]))  # position 1 sees only its temporary pair
            h = x[:, i] + carry
            ref.append(h + layer.ffn(layer.ffn_norm(h)))
        torch.testing.assert_close(z, torch.stack(ref, 1), rtol=1e-12, atol=1e-12)


def _stirling_first(k: int) -> list[int]:
    """Unsigned Stirling numbers of the first kind [k, r], r = 0..k: c(n+1, r) = n c(n, r) + c(n, r-1)."""
    c = [1]
    for n in range(k):
        c = [(n * (c[r] if r < len(c) else 0)) + (c[r - 1] if r >= 1 else 0) for r in range(n + 2)]
    return c


@pytest.mark.parametrize("impl", ["tiled", "tiled-custom", "naive"])
def test_uniform_attention_gradient_matches_stirling_formula(impl) -> None:
    """Theorem (the paper's §paths): for z_k = x_k + (α/k)(V x_k + V Σ_{j<k} z_j),
    ∂z_k/∂x_1 = (1/k!) Σ_r [k r] α^r V^r. Run through the op itself: zero queries give uniform
    attention over the k-1 persistent pairs and the temporary one ("tiled-custom": the tiled op
    told what finish reads, so its custom backward runs)."""
    D, n, alpha = 5, 7, 0.7
    g = torch.Generator().manual_seed(3)
    Vm = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]  # orthonormal, as in the paper
    x = torch.randn(1, n, D, generator=g, dtype=torch.float64)

    def layer(x1: torch.Tensor) -> torch.Tensor:
        xs = torch.cat((x1.view(1, 1, D), x[:, 1:]), 1)
        q = xs.new_zeros(1, 1, n, D)
        tv = (xs @ Vm.T).unsqueeze(1)

        def finish(a, s, e):
            z = xs[:, s:e] + alpha * a.squeeze(1)
            return z, torch.zeros_like(a), (z @ Vm.T).unsqueeze(1)

        kw = dict(finish_inputs=(xs,)) if impl == "tiled-custom" else {}
        return OPS[impl.removesuffix("-custom")](RecurrentInputs(q, torch.zeros_like(q), tv, finish), **kw)[0][0]

    J = torch.autograd.functional.jacobian(layer, x[0, 0].clone())  # [n, D, D]
    torch.testing.assert_close(J[0], torch.eye(D, dtype=torch.float64) + alpha * Vm, rtol=1e-12, atol=1e-12)
    for k in range(2, n + 1):
        c = _stirling_first(k)
        assert sum(c) == math.factorial(k)
        ref = sum(c[r] * alpha**r * torch.linalg.matrix_power(Vm, r) for r in range(1, k + 1)) / math.factorial(k)
        torch.testing.assert_close(J[k - 1], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_blocks", list(range(1, 40)) + [64, 100, 257])
def test_tile_schedule_covers_each_pair_once(n_blocks) -> None:
    seen = torch.zeros(n_blocks, n_blocks, dtype=torch.long)
    for t, P, hi in tile_schedule(n_blocks):
        seen[t + 1 : hi + 1, t - P + 1 : t + 1] += 1
    assert torch.equal(seen, torch.ones_like(seen).tril(-1))


def test_kv_reads_n_log_n_vs_quadratic() -> None:
    for n in (64, 100, 1024, 4096):
        assert kv_reads(n, schedule="naive") == n * (n - 1) // 2
        tiled = kv_reads(n)
        assert n * math.log2(n) / 4 <= tiled <= n * math.log2(n)
    assert kv_reads(64, block=4) == 4 * kv_reads(16)  # blocks: the same schedule on n/b block indices
    assert block_edges(5, 10, 4) == [0, 3, 7, 10]


def test_bf16_autocast_keeps_fp32_accumulators() -> None:
    """One tile update under bf16 autocast on bf16 queries, keys and values: the accumulators stay
    fp32 and hold the float64 result on the same inputs up to the bf16 matmuls' rounding."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g).bfloat16() for _ in range(3))
    stats = (torch.zeros(1, 2, 3), torch.ones(1, 2, 3), torch.zeros(1, 2, 3, 4))
    ref = tuple(t.double() for t in stats)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tile_update(q, k, v, None, *stats)
    tile_update(q.double(), k.double(), v.double(), None, *ref)
    for low, high in zip(stats, ref):
        assert low.dtype == torch.float32
        torch.testing.assert_close(low.double(), high, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_tiled_op_under_bf16_autocast_is_as_exact_as_its_bf16_inputs_allow(block, device) -> None:
    """The tiled op on bf16 inputs under autocast against float64 on the same inputs, 1024
    positions whose attention sums run over up to 1023 keys of values centred on 1 (sums that
    grow past bf16's 8 bits). With fp32 accumulators the attention output a is off by at most
    0.64 x 2^-8 of its largest value (the rounding of each tile's bf16 matmul); an accumulator
    rounded to bf16 after every merge makes it 2.9 x 2^-8. The bound is 2^-8."""
    g = torch.Generator().manual_seed(0)
    B, H, T, d = 1, 2, 1024, 8
    q = (torch.randn(B, H, T, d, generator=g) * 0.1).bfloat16().to(device)
    tk = torch.randn(B, H, T, d, generator=g).bfloat16().to(device)
    tv = (torch.randn(B, H, T, d, generator=g) + 1.0).bfloat16().to(device)
    x = torch.randn(B, T, H * d, generator=g).bfloat16().to(device)

    def finish(x: torch.Tensor, seen: list):
        def f(a, s, e):  # z = x + a / 2 in the input dtype, as a layer's projections would give
            seen.append(a)
            z = (x[:, s:e].to(a.dtype) + 0.5 * a.transpose(1, 2).reshape(B, e - s, H * d)).to(x.dtype)
            k = z.view(B, e - s, H, d).transpose(1, 2)
            return z, k, k + 1.0

        return f

    low: list[torch.Tensor] = []
    ref: list[torch.Tensor] = []
    with torch.autocast(device, dtype=torch.bfloat16):
        recurrent_attention_tiled(RecurrentInputs(q, tk, tv, finish(x, low), block=block))
    recurrent_attention_tiled(
        RecurrentInputs(q.double(), tk.double(), tv.double(), finish(x.double(), ref), block=block)
    )
    a, r = torch.cat(low, 2), torch.cat(ref, 2)
    assert a.dtype == torch.float32
    assert float((a.double() - r).abs().max()) <= 2**-8 * float(r.abs().max())


def test_decoding_costs_one_extra_kv_projection() -> None:
    """Per decoded token and layer: one query projection and two K/V projections (the temporary
    pair from x and the persistent pair from z), i.e. one more than a Transformer step."""
    model = build_model("recurrent_transformer", BASE)
    calls = {"wq": 0, "wk": 0, "wv": 0}
    for layer in model.layers:
        for name in calls:
            getattr(layer, name).register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    state = model(torch.tensor([[1, 2, 3]])).state
    calls.update(wq=0, wk=0, wv=0)
    for t in range(5):
        state = model(torch.tensor([[t]]), state=state).state
    L = BASE["n_layers"]
    assert calls == {"wq": 5 * L, "wk": 10 * L, "wv": 10 * L}
    assert state.layers[0].k.shape[2] == 8


def test_errors() -> None:
    with pytest.raises(RecurformerError, match="block_size"):
        build_model("recurrent_transformer", dict(BASE, block_size=0))
    model = build_model("recurrent_transformer", dict(BASE, block_size=4))
    s = model(torch.tensor([[1, 2, 3, 4, 5]])).state
    with pytest.raises(RecurformerError, match="only at a block boundary"):
        model(torch.tensor([[1]]), state=s.reset(torch.tensor([True])))


@pytest.mark.parametrize("block,pos0,chunk", [(1, 0, 3), (2, 5, 5), (3, 7, 1)])
def test_ops_tiled_query_chunks_equal_naive(block, pos0, chunk) -> None:
    """The op alone, with a cache, an unfinished block, a document start inside the cache, ALiBi
    and tile updates cut into query chunks of ``chunk`` rows."""
    g = torch.Generator().manual_seed(block)
    B, H, T, d, S = 2, 2, 37, 4, pos0
    r0 = pos0 % block
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, tk, tv = rnd(B, H, T, d), rnd(B, H, T, d), rnd(B, H, T, d)
    past = dict(past_k=rnd(B, H, S, d), past_v=rnd(B, H, S, d), past_tk=rnd(B, H, r0, d), past_tv=rnd(B, H, r0, d))
    W = rnd(H * d, 2 * H * d) * 0.5
    x = rnd(B, T, H * d)

    def finish(a, s, e):
        z = torch.tanh(x[:, s:e] + a.transpose(1, 2).reshape(B, e - s, H * d))
        k, v = (z @ W).view(B, e - s, 2, H, d).permute(2, 0, 3, 1, 4)
        return z, k, v

    kw = dict(
        block=block,
        pos0=pos0,
        start=torch.tensor([0, max(pos0 - r0 - block, 0)]),
        bias_fn=lambda dist: -0.3 * dist[None].double(),
        **past,
    )
    ref = recurrent_attention_naive(RecurrentInputs(q, tk, tv, finish, **kw))
    out = recurrent_attention_tiled(RecurrentInputs(q, tk, tv, finish, **kw), query_chunk=chunk)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "extra,p0", [(dict(), 5), (dict(position="rope", block_size=3), 7)], ids=["b=1-alibi", "b=3-rope"]
)
def test_compiled_tile_update_equals_eager(extra, p0) -> None:
    """``compile`` (what the trainer's ``train.compile`` calls): the tile update under
    ``torch.compile(dynamic=False)`` gives the eager logits and gradients, with a carried state
    (cache and an unfinished block). Backend aot_eager (Dynamo capture and functionalisation of
    the in-place update into the caller's buffers; inductor's code generation takes minutes on
    a small CPU); the compiled region must have run."""
    eager, _ = _pair(dict(extra, n_layers=2), torch.float64, 0.3)
    compiled = copy.deepcopy(eager)
    for layer in compiled.layers:
        layer.compile(backend="aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(p0)
    pre, tokens, targets = (torch.randint(0, BASE["vocab_size"], (2, n), generator=g) for n in (p0, 21, 21))
    outs = []
    for model in (eager, compiled):
        out = model(tokens, state=model(pre).state, targets=targets)
        out.loss.backward()
        outs.append((out.logits, {n: p.grad for n, p in model.named_parameters()}))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3
    (le, ge), (lc, gc) = outs
    torch.testing.assert_close(lc, le, rtol=1e-12, atol=1e-12)
    for n in ge:
        assert ge[n].abs().sum() > 0, n
        torch.testing.assert_close(gc[n], ge[n], rtol=1e-12, atol=1e-12, msg=n)
