"""Transformer-XL: the relative-shift scores against the explicit (i, j) loop, the whole model
against a naive per-position reference, stop-gradient on the memory, and the receptive field /
effective context of Brenndoerfer, "Recurrent Memory: Extending Transformer Context with
Segment-Level State Caching" measured by perturbing tokens."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TEST_CONFIGS, conv_literal, randomize_params

from recurformer import RecurformerError, build_model
from recurformer.ops.relative import rel_shift, relative_scores, relative_scores_reference, sinusoid_table

BASE = dict(vocab_size=61, dim=16, n_heads=2)


@pytest.mark.parametrize("Tq,Tk", [(1, 1), (1, 6), (5, 5), (4, 11), (7, 9)])
def test_relative_shift_equals_double_loop(Tq, Tk) -> None:
    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    B, H, d = 2, 3, 4
    q, k = (
        torch.randn(B, H, Tq, d, generator=g, dtype=torch.float64),
        torch.randn(B, H, Tk, d, generator=g, dtype=torch.float64),
    )
    r = torch.randn(H, Tk, d, generator=g, dtype=torch.float64)
    u, v = torch.randn(H, d, generator=g, dtype=torch.float64), torch.randn(H, d, generator=g, dtype=torch.float64)
    fast = relative_scores(q, k, r, u, v)
    slow = relative_scores_reference(q, k, r, u, v)
    causal = ~slow.isnan()
    i, j = torch.arange(Tq)[:, None], torch.arange(Tk)[None, :]
    assert torch.equal(causal, (j <= i + Tk - Tq).expand(B, H, Tq, Tk))  # every non-future pair is compared
    torch.testing.assert_close(fast[causal], slow[causal], rtol=1e-10, atol=1e-10)


def test_rel_shift_aligns_distances() -> None:
    """Column t of the input holds distance Tk-1-t; after the shift, (i, j) holds distance Tk-Tq+i-j."""
    Tq, Tk = 4, 7
    x = (Tk - 1 - torch.arange(Tk, dtype=torch.float64)).expand(Tq, Tk)  # each entry = its distance
    y = rel_shift(x)
    i, j = torch.arange(Tq)[:, None], torch.arange(Tk)[None, :]
    dist = (Tk - Tq + i - j).to(torch.float64)
    torch.testing.assert_close(y[dist >= 0], dist[dist >= 0], rtol=0, atol=0)


def test_sinusoid_table_matches_formula() -> None:
    dim, base = 6, 10000.0
    got = sinusoid_table(torch.tensor([0, 1, 5, 1000]), dim, base, torch.float64)
    for row, delta in zip(got, [0, 1, 5, 1000]):
        w = [base ** (-2 * m / dim) for m in range(dim // 2)]
        want = [math.sin(delta * x) for x in w] + [math.cos(delta * x) for x in w]
        torch.testing.assert_close(row, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Naive Transformer-XL over one document from its start, one query position at a time on the
    absolute timeline: layer n's query at p (segment start S) attends to layer n's inputs at
    positions max(0, S-M) .. p (with same_length only p-M < t), score (a)+(b)+(c)+(d) per key; the
    keys/values of the memory (t < S) read the detached inputs (stop-gradient)."""
    c = model.config
    L, M, H, d = c.segment_len, c.memory_len, c.n_heads, c.head_dim
    x = model.tok_emb(tokens)
    B, T, D = x.shape

    def r_proj(layer, delta: int) -> torch.Tensor:
        delta = delta if c.clamp_len is None else min(delta, c.clamp_len)
        w = [c.rope_theta ** (-2 * m / D) for m in range(D // 2)]
        R = torch.tensor([math.sin(delta * a) for a in w] + [math.cos(delta * a) for a in w], dtype=x.dtype)
        return layer.attn.wr(R).view(H, d)

    for layer in model.layers:
        A, xn = layer.attn, layer.attn_norm(x)
        if c.qkv_conv:  # q/k/v (and the memory) read the convolved inputs
            xn = conv_literal(xn, A.conv.weight)
        out = []
        for p in range(T):
            S = p // L * L
            keys = [t for t in range(max(0, S - M), p + 1) if not (c.same_length and p - t >= M)]
            q = A.wq(xn[:, p]).view(B, H, d)
            scores, values = [], []
            for t in keys:
                xt = xn[:, t] if t >= S else xn[:, t].detach()  # the memory: stop-gradient
                k = A.wk(xt).view(B, H, d)
                rr = r_proj(layer, p - t)
                scores.append(((q + A.u) * k).sum(-1) + ((q + A.v) * rr).sum(-1))  # (a)+(c) + (b)+(d)
                values.append(A.wv(xt).view(B, H, d))
            w = torch.softmax(torch.stack(scores, -1) / math.sqrt(d), dim=-1)  # [B, H, K]
            o = (w[..., None] * torch.stack(values, 2)).sum(2).reshape(B, D)
            h = x[:, p] + A.wo(o)
            out.append(h + layer.ffn(layer.ffn_norm(h)))
        x = torch.stack(out, 1)
    return F.linear(model.norm(x), model.tok_emb.weight)


@pytest.mark.parametrize(
    "cfg",
    [c for c in TEST_CONFIGS["transformer_xl"] if "layers" not in c],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k not in BASE),
)
def test_model_equals_naive_reference(cfg) -> None:
    model = build_model("transformer_xl", cfg).double().eval()
    randomize_params(model)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 23))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference_logits(model, tokens), rtol=1e-10, atol=1e-10)


GRAD_CASES = [c for c in TEST_CONFIGS["transformer_xl"] if "layers" not in c] + [
    dict(BASE, n_layers=2, segment_len=3, mem_len=5, same_length=True, clamp_len=4),
    dict(BASE, n_layers=2, segment_len=4, mem_len=2),
]


@pytest.mark.parametrize("cfg", GRAD_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k not in BASE))
def test_gradients_equal_naive_reference(cfg) -> None:
    """With autograd (projections once per call, whole segments attended as a batch of windows):
    the logits, every parameter's gradient and the input's (the embeddings') equal the naive
    reference's in float64, over calls of several segments, partial segments continued across
    calls (the state not detached, so gradient flows through it) and a document start in row 0
    (row 1 reads on); the reference reads each document from its start."""
    model = build_model("transformer_xl", cfg).double()
    randomize_params(model)
    L, V = model.config.segment_len, cfg["vocab_size"]
    g = torch.Generator().manual_seed(L)
    calls, reset = [3 * L + 1, 1, L - 2, L - 1, 2 * L + 2], 4 * L  # row 0 starts a document at 4L
    T = sum(calls)
    tokens = torch.randint(0, V, (2, T), generator=g)
    weights = torch.randn(2, T, V, generator=g, dtype=torch.float64)
    emb: list[torch.Tensor] = []

    def keep(_m, _i, out):
        out.retain_grad()
        emb.append(out)

    hook = model.tok_emb.register_forward_hook(keep)

    def run(forward) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        emb.clear()
        model.zero_grad()
        logits, x_grad = forward()
        (logits * weights).sum().backward()
        return logits.detach(), x_grad(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def model_calls():
        state, outs, a = None, [], 0
        for n in calls:
            if a == reset:
                state = state.reset(torch.tensor([True, False]))
            out = model(tokens[:, a : a + n], state)
            outs.append(out.logits)
            state, a = out.state, a + n
        return torch.cat(outs, 1), lambda: torch.cat([e.grad for e in emb], 1)

    def reference():
        row1 = reference_logits(model, tokens[1:])
        row0 = torch.cat([reference_logits(model, tokens[:1, :reset]), reference_logits(model, tokens[:1, reset:])], 1)
        return torch.cat([row0, row1]), lambda: torch.cat([torch.cat([e.grad for e in emb[1:]], 1), emb[0].grad])

    got, want = run(model_calls), run(reference)
    hook.remove()
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-10, msg="input gradient")
    for name, grad in want[2].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got[2][name], grad, rtol=1e-9, atol=1e-10, msg=name)


def test_clamp_len_changes_only_far_distances() -> None:
    """clamp_len >= every distance seen changes nothing; a small one changes the logits."""
    cfg = dict(BASE, n_layers=1, segment_len=4, mem_len=4)
    tokens = torch.randint(0, 61, (1, 16))
    outs = {}
    for clamp in (None, 7, 2):
        torch.manual_seed(1)
        model = build_model("transformer_xl", dict(cfg, clamp_len=clamp)).double()
        randomize_params(model)
        outs[clamp] = model(tokens).logits
    torch.testing.assert_close(outs[7], outs[None], rtol=0, atol=0)  # max distance M + L - 1 = 7
    assert not torch.allclose(outs[2], outs[None])


def test_no_gradient_into_memory() -> None:
    """Loss on segment 1 only: its own tokens' embeddings get gradient, segment 0's get exactly none,
    although segment 0 does change segment 1's logits; the returned memory carries no graph. Inside
    a segment split across two calls, gradient does flow through the state."""
    L = 4
    model = build_model("transformer_xl", dict(BASE, n_layers=2, segment_len=L)).double()
    randomize_params(model)
    tokens = torch.randint(0, 61, (2, 2 * L))
    emb: list[torch.Tensor] = []

    def keep(_m, _i, out):
        if out.requires_grad:
            out.retain_grad()
            emb.append(out)

    hook = model.tok_emb.register_forward_hook(keep)
    out = model(tokens)
    out.logits[:, L:].pow(2).sum().backward()
    g = emb[0].grad
    assert torch.count_nonzero(g[:, :L]) == 0
    assert (g[:, L:].abs().sum(-1) > 0).all()
    assert all(not s.mem.requires_grad for s in out.state.layers)
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in model.named_parameters()
        if n.endswith(("wk.weight", "wr.weight"))
    )
    # segment 0 does influence segment 1 (through the memory), so the zero gradient is the stop-gradient
    pert = tokens.clone()
    pert[:, 0] = (pert[:, 0] + 1) % 61
    with torch.no_grad():
        assert not torch.allclose(model(pert).logits[:, L:], out.logits[:, L:])
    # a segment split over two calls: the loss of the second call reaches the first call's tokens
    emb.clear()
    model.zero_grad()
    first = model(tokens[:, :2])
    second = model(tokens[:, 2:L], state=first.state)
    second.logits.pow(2).sum().backward()
    assert (emb[0].grad.abs().sum(-1) > 0).all()
    hook.remove()


def influence(model, T: int) -> torch.Tensor:
    """[T, T] bool: entry (t, p) is True iff changing token t changes the logits at position p."""
    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(0, model.config.vocab_size, (1, T), generator=g)
    with torch.no_grad():
        base = model(tokens).logits[0]
        rows = []
        for t in range(T):
            pert = tokens.clone()
            pert[0, t] = (pert[0, t] + 5) % model.config.vocab_size
            rows.append((model(pert).logits[0] != base).any(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_receptive_field_is_n_layers_segments(n_layers) -> None:
    """With M = L, a token in segment s' changes logits in segment s only if s - s' <= n_layers,
    and it does change logits in each of those segments."""
    L = 3
    model = build_model("transformer_xl", dict(BASE, n_layers=n_layers, segment_len=L)).double().eval()
    randomize_params(model)
    n_seg = n_layers + 3
    inf = influence(model, n_seg * L)
    seg = torch.arange(n_seg * L) // L
    reach = seg[None, :] - seg[:, None]  # [t, p]: segments between the token and the logit
    assert not inf[reach > n_layers].any()
    assert not inf[reach < 0].any()
    for k in range(n_layers + 1):
        assert inf[reach == k].any(), f"no influence at segment distance {k}"


def test_effective_context_two_layers() -> None:
    """The tutorial's claim: an N-layer XL with segment L (M = L) sees N·L + L tokens (direct span 2L per
    layer). Measured on a 2-layer model: logit p is changed by exactly the tokens S(p) - N·L .. p,
    so the largest influence distance is N·L + L - 1; one layer alone reaches S(p) - L (2L span)."""
    L, N, T = 4, 2, 24
    spans = {}
    for n_layers in (1, N):
        model = build_model("transformer_xl", dict(BASE, n_layers=n_layers, segment_len=L)).double().eval()
        randomize_params(model)
        inf = influence(model, T)
        t, p = torch.arange(T)[:, None], torch.arange(T)[None, :]
        start = (p // L * L - n_layers * L).clamp(min=0)
        assert torch.equal(inf, (t >= start) & (t <= p)), f"{n_layers} layers"
        spans[n_layers] = int((p - t)[inf].max()) + 1
        assert spans[n_layers] == model.max_context()
    assert spans[1] == 2 * L  # the tutorial's "direct attention span"
    assert spans[N] == N * L + L  # the tutorial's "max theoretical span"
    # without recurrence (M = 0) the span collapses to the segment: context fragmentation
    model = build_model("transformer_xl", dict(BASE, n_layers=N, segment_len=L, mem_len=0)).double().eval()
    randomize_params(model)
    inf = influence(model, 12)
    assert int((torch.arange(12)[None] - torch.arange(12)[:, None])[inf].max()) + 1 == L


@pytest.mark.parametrize("extra", [dict(segment_len=3, mem_len=5), dict(segment_len=4, mem_len=6, same_length=True)])
def test_receptive_start_matches_measurement(extra) -> None:
    """The receptive field that info_lines reports, for M != L and same_length, equals the measured one."""
    model = build_model("transformer_xl", dict(BASE, n_layers=2, **extra)).double().eval()
    randomize_params(model)
    T = 26
    inf = influence(model, T)
    for p in range(T):
        assert inf[:, p].nonzero().min().item() == model.receptive_start(p), p
        assert inf[model.receptive_start(p) : p + 1, p].all() and not inf[p + 1 :, p].any()


def test_reset_only_at_segment_boundary() -> None:
    model = build_model("transformer_xl", dict(BASE, n_layers=1, segment_len=4))
    s = model(torch.randint(0, 61, (2, 6))).state.reset(torch.tensor([True, False]))
    with pytest.raises(RecurformerError, match="only at a segment boundary"):
        model(torch.randint(0, 61, (2, 1)), state=s)
    other = build_model("transformer_xl", dict(BASE, n_layers=1, segment_len=4, mem_len=6))
    with pytest.raises(RecurformerError, match="does not fit"):
        model(torch.randint(0, 61, (1, 3)), state=other.init_state(1))
    with pytest.raises(RecurformerError, match="same_length"):
        build_model("transformer_xl", dict(BASE, mem_len=0, same_length=True))
    with pytest.raises(RecurformerError, match="segment_len"):
        build_model("transformer_xl", dict(BASE, segment_len=0))


def test_info_lines_memory_formula() -> None:
    model = build_model("transformer_xl", dict(BASE, n_layers=3, segment_len=8, mem_len=10))
    text = "\n".join(model.info_lines())
    assert "M × d × layers × batch = 10 × 16 × 3 × B = 480 floats per batch row = 1,920 bytes" in text
    st = model(torch.randint(0, 61, (5, 20))).state  # the state's memory has exactly that size
    assert sum(s.mem.numel() for s in st.layers) == 480 * 5
