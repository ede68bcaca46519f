"""Recurrent Memory Transformer: the streaming model against the paper read literally (each
segment one pass over [memory; tokens; memory] with one causal mask), the memory as the only path
between segments (and ``detach`` cutting it), constant-size state while generating, and clear
errors for bad configs and foreign states. The ``associative`` option (ARMT): its read and write
against the equations written per token, the whole model against a segment-at-a-time reference,
its state through reset, detach, ``to`` and safetensors, and the option off against the outputs
the code gave before the option existed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import randomize_params, run_config
from safetensors.torch import load_file, save_file

from recurformer import RecurformerError, build_model
from recurformer.generate import new_session, read
from recurformer.models.armt import Associative
from recurformer.reference import armt_segments, read_literal, rmt_segments, write_literal
from recurformer.training.trainer import Trainer

BASE = dict(vocab_size=61, dim=32, n_heads=4)
ARMT = dict(BASE, associative=True, assoc_dim=4)
FIXTURE = Path(__file__).parent.parent / "fixtures" / "rmt_plain" / "expected.safetensors"


@pytest.mark.parametrize(
    "extra",
    [
        dict(n_layers=2, segment_len=7, memory_size=3),
        dict(n_layers=3, segment_len=4, memory_size=6),
        dict(n_layers=2, segment_len=6, memory_size=3, memory_update="write_gate"),
    ],
)
def test_matches_the_paper_read_literally(extra) -> None:
    model = build_model("rmt", dict(BASE, **extra)).double().eval()
    randomize_params(model, 0.2)
    tokens = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        ref = rmt_segments(model, tokens)
        torch.testing.assert_close(model(tokens).logits, ref, rtol=1e-10, atol=1e-10)
        state, steps = None, []
        for t in range(tokens.shape[1]):
            out = model(tokens[:, t : t + 1], state=state)
            state = out.state
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-10, atol=1e-10)


def test_memory_is_the_only_path_between_segments() -> None:
    """A token in segment 2 depends on segment 1 only through the memory: with the memory of a
    different first segment put into the state, segment 2's logits follow the memory, not the
    cached tokens; the gradient reaches segment 1 through it and ``detach`` cuts it."""
    model = build_model("rmt", dict(BASE, n_layers=2, segment_len=5, memory_size=2)).double()
    randomize_params(model, 0.2)
    a, b, x = (torch.randint(0, 61, (1, 5)) for _ in range(3))
    with torch.no_grad():
        sa, sb = model(a).state, model(b).state
        assert all(s.k.shape[2] == 0 for s in sa.layers)  # a segment boundary: no token cached
        swapped = dataclasses.replace(
            sa, layers=[dataclasses.replace(sa.layers[0], memory=sb.layers[0].memory)] + sa.layers[1:]
        )
        torch.testing.assert_close(model(x, state=swapped).logits, model(x, state=sb).logits, rtol=0, atol=0)
    emb = model.tok_emb(a).detach().requires_grad_()
    h, state = model.body(emb, model.init_state(1))
    for cut in (False, True):
        st = state.detach() if cut else state
        out = model(x, state=st)
        if cut:
            assert out.logits.grad_fn is not None and not st.layers[0].memory.requires_grad
        else:
            (g,) = torch.autograd.grad(out.logits.sum(), emb, retain_graph=True)
            assert g.abs().max() > 0


def test_generation_state_stays_the_same_size() -> None:
    """Token by token, the state after L tokens has the same size for L = 3S + 4 and 40S + 4 (at
    the same offset in a segment), never more than M·D + 2(M + S - 1)·D·N numbers, and the
    decoding buffers are the state itself (nothing else kept between tokens)."""
    c = dict(BASE, n_layers=2, segment_len=6, memory_size=3)
    model = build_model("rmt", c).eval()
    S, M, D, N = 6, 3, 32, 2
    size = lambda st: sum(t.numel() for t in st.to_flat().values() if t.is_floating_point())  # noqa: E731
    s, sizes = new_session(model, 1), {}
    for t in range(40 * S + 4):
        read(model, s, torch.randint(0, 61, (1, 1)))
        sizes[t + 1] = size(s.state)
    assert sizes[3 * S + 4] == sizes[40 * S + 4]
    assert max(sizes.values()) == M * D + 2 * (M + S - 1) * D * N


def test_bad_configs_and_foreign_states_are_one_line_errors() -> None:
    with pytest.raises(RecurformerError, match="config key 'memory_size' must be >= 1, got 0"):
        build_model("rmt", dict(BASE, memory_size=0))
    with pytest.raises(RecurformerError, match="config key 'memory_size' must be >= 1, got -2"):
        build_model("rmt", dict(BASE, memory_size=-2))
    with pytest.raises(RecurformerError, match="config key 'segment_len' must be >= 1, got 0"):
        build_model("rmt", dict(BASE, segment_len=0))
    with pytest.raises(
        RecurformerError, match="config key 'layers' names 'full': an RMT runs its memory slots through every layer"
    ):
        build_model("rmt", dict(BASE, n_layers=2, layers=["rmt", "full"]))
    m4 = build_model("rmt", dict(BASE, n_layers=2, segment_len=5, memory_size=4))
    m8 = build_model("rmt", dict(BASE, n_layers=2, segment_len=5, memory_size=8))
    llama = build_model("llama", dict(BASE, n_layers=2))
    x = torch.tensor([[1, 2]])
    with pytest.raises(
        RecurformerError, match=r"state does not fit this RMT: layer 0 \(rmt\) holds a KVState, expected a RMTState"
    ):
        m4(x, state=llama(x).state)
    with pytest.raises(
        RecurformerError, match=r"layer 0 \(rmt\) 'memory' has shape \(1, 8, 32\), expected \(1, 4, 32\)"
    ):
        m4(x, state=m8(torch.tensor([[1, 2, 3, 4, 5]])).state)
    with pytest.raises(
        RecurformerError, match=r"layer 0 \(rmt\) 'memory' has shape \(1, 8, 32\), expected \(1, 4, 32\)"
    ):
        m4(x, state=m8(x).state)
    with pytest.raises(RecurformerError, match=r"'k' holds 6 positions, expected 7 \(the 4 read slots and 3 tokens\)"):
        m4(x, state=dataclasses.replace(m4(x).state, pos=3))
    with pytest.raises(
        RecurformerError, match=r"RMT can reset a row only at a segment boundary \(current segment has 2 of 5 tokens\)"
    ):
        m4(x, state=m4(x).state.reset(torch.tensor([True])))


def test_info_names_segment_memory_and_state_size() -> None:
    model = build_model("rmt", dict(BASE, n_layers=2, segment_len=6, memory_size=3))
    lines = "\n".join(model.info_lines())
    assert "rmt(S=6, M=3)" in lines and "receptive field of a logit: unbounded" in lines
    assert f"at most {3 * 32 + 2 * 8 * 32 * 2:,} floats" in lines
    assert model.max_context() is None and model.reset_boundary == 6 and model.bounded_state


def test_trains_with_a_carried_state_and_refuses_a_segment_that_does_not_fit(tmp_path) -> None:
    """The trainer runs an RMT (a carried state across steps, two segments backpropagated
    together); a segment length that does not divide train.seq_len is a one-line error naming both."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "<|endoftext|>".join(f"story {i}: the cat sat on the mat and ran to the tree." for i in range(200))
    )
    rmt = dict(name="rmt", dim=32, n_layers=2, n_heads=2, segment_len=8, memory_size=3)
    train = dict(batch_size=2, seq_len=16, steps=3, warmup=1, eval_every=3, eval_batches=1, save_every=3)
    train.update(grad_accum=2, truncation=2)  # two segments backpropagated together
    trainer = Trainer(run_config(corpus, tmp_path, rmt, **train), show_progress=False)
    losses = [trainer.train_step() for _ in range(3)]
    assert all(0 < loss < 10 for loss in losses) and trainer.state is not None and trainer.state.pos > 0
    with pytest.raises(
        RecurformerError,
        match=r"train.seq_len \(16\) must be a multiple of the model's chunk/segment/block length \(12\)",
    ):
        Trainer(
            run_config(corpus, tmp_path, rmt | dict(segment_len=12), **train, out_dir=tmp_path / "bad"),
            show_progress=False,
        )
    assert not (tmp_path / "bad").exists()


def test_closed_write_gate_holds_the_memory_exactly() -> None:
    """``memory_update: write_gate``: with the gate shut (g = sigmoid(-1e4) = 0) the memory after
    any number of segments is bit for bit the one before them (the keep path is the identity: no
    final norm or gain reapplied); at its initial bias (-5) the segments move it. The gate starts
    closed (b_g = -5) with W_g drawn as every weight."""
    model = build_model("rmt", dict(BASE, n_layers=2, segment_len=5, memory_size=3, memory_update="write_gate"))
    assert torch.equal(model.write_gate.proj.bias, torch.full((32,), -5.0))
    assert 0.01 < float(model.write_gate.proj.weight.std()) < 0.03
    model = model.double().eval()
    randomize_params(model, 0.2)
    tokens = torch.randint(0, 61, (2, 4 * 5 + 2))
    with torch.no_grad():
        state = model(tokens[:, :5]).state  # a memory written by an open gate (bias ~1)
        before = state.layers[0].memory
        model.write_gate.proj.bias.fill_(-5.0)
        moved = model(tokens[:, 5:], state=state).state.layers[0].memory
        model.write_gate.proj.bias.fill_(-1e4)
        held = model(tokens[:, 5:], state=state).state.layers[0].memory
    assert float(before.abs().min()) > 0
    assert torch.equal(held, before) and not torch.equal(moved, before)


def test_associative_read_and_write_match_the_equations_per_slot() -> None:
    """The vectorised read and write of ``Associative`` against the equations written one row and
    one slot at a time (float64), with a z that sends some gammas to the clip at 0 and leaves
    others inside (0, 1); the gradients agree too (gamma detached in both)."""
    cfg = build_model("rmt", dict(ARMT, n_layers=1)).config
    assoc = Associative(cfg).double()
    randomize_params(assoc, 0.3)
    B, M, K, D = 2, 5, Associative.features(cfg.assoc_dim), cfg.dim
    A = torch.randn(B, K, D, dtype=torch.float64, requires_grad=True)
    z = (torch.rand(B, K, dtype=torch.float64) * torch.tensor([[0.02], [3.0]], dtype=torch.float64)).requires_grad_()
    m = torch.randn(B, M, D, dtype=torch.float64, requires_grad=True)
    x = torch.randn(B, 7, D, dtype=torch.float64)
    got_read = assoc.read(x, A, z)
    got_A, got_z = assoc.write(m, A, z)
    want_read = torch.stack(
        [torch.stack([read_literal(assoc, x[b, j], A[b], z[b]) for j in range(7)]) for b in range(B)]
    )
    want = [write_literal(assoc, m[b], A[b], z[b]) for b in range(B)]
    gammas = [g for _, _, gs in want for g in gs]
    assert any(g == 0 for g in gammas) and any(0 < g < 1 for g in gammas)
    torch.testing.assert_close(got_read, want_read, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_A, torch.stack([w[0] for w in want]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_z, torch.stack([w[1] for w in want]), rtol=1e-12, atol=1e-12)
    wA, wz = torch.randn_like(got_A), torch.randn_like(got_z)
    inputs = [m, A, z, *assoc.parameters()]
    g_got = torch.autograd.grad((got_A * wA).sum() + (got_z * wz).sum(), inputs, allow_unused=True)
    g_want = torch.autograd.grad(
        sum((w[0] * wA[b]).sum() + (w[1] * wz[b]).sum() for b, w in enumerate(want)), inputs, allow_unused=True
    )
    for name, g, w in zip(["m", "A", "z", *(n for n, _ in assoc.named_parameters())], g_got, g_want):
        if g is None or w is None:  # W_q: read only
            assert g is None and w is None and name == "wq.weight", name
        else:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize(
    "extra",
    [
        dict(n_layers=2, segment_len=7, memory_size=3),
        dict(n_layers=1, segment_len=4, memory_size=2),
        dict(n_layers=2, segment_len=6, memory_size=4, read_slots=False),
        dict(n_layers=1, segment_len=5, memory_size=2, read_slots=False),
    ],
)
def test_associative_model_matches_the_reference(extra) -> None:
    """Whole and token by token, the associative RMT gives the logits and every layer's (A, z) of
    ``reference.armt_segments`` (the slots constant, A and z the only path between segments), with read
    slots and without them (the authors' code)."""
    model = build_model("rmt", dict(ARMT, **extra)).double().eval()
    randomize_params(model, 0.2)
    tokens = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        ref, A, z = armt_segments(model, tokens)
        whole = model(tokens)
        torch.testing.assert_close(whole.logits, ref, rtol=1e-10, atol=1e-10)
        for i, s in enumerate(whole.state.layers):
            torch.testing.assert_close(s.assoc, torch.stack(A[i]), rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(s.assoc_z, torch.stack(z[i]), rtol=1e-10, atol=1e-10)
            assert s.memory is None
        assert float(whole.state.layers[0].assoc.abs().max()) > 0
        state, steps = None, []
        for t in range(tokens.shape[1]):
            out = model(tokens[:, t : t + 1], state=state)
            state = out.state
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-10, atol=1e-10)


def test_associative_read_is_whole_at_initialisation(monkeypatch) -> None:
    """At the library's initialisation (float32, no randomised parameters), after one segment every
    layer's read returns what the memory holds: a memory that stored one value v under every key
    the write slots wrote (A = z v^T, as a first write with beta = 1 and every v_i = v gives) is
    read back by every row of the next segment as >= 0.99 v. Without the authors' L2-normalised
    features, z . phi(q) sits far below eps there and the read returns ~1% of v."""
    torch.manual_seed(0)
    S, D = 8, 128
    model = build_model("rmt", dict(ARMT, dim=D, n_layers=2, segment_len=S, memory_size=4, assoc_dim=16))
    tokens = torch.randint(0, 61, (3, 2 * S))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        state = model(tokens[:, :S]).state
        for i, block in enumerate(model.layers):
            read = block.assoc.read
            monkeypatch.setattr(
                block.assoc, "read", lambda x, A, z, i=i, read=read: seen.setdefault(i, (x, z)) and read(x, A, z)
            )
        model(tokens[:, S:], state=state)
        assert sorted(seen) == [0, 1]
        for i, (x, z) in seen.items():
            held = model.layers[i].assoc.read(x, z[:, :, None].expand(-1, -1, D), z)  # v = 1 in every channel
            assert float(held.min()) >= 0.99, (i, float(held.min()))


def test_associative_fresh_model_writes_nothing_and_its_state_round_trips(tmp_path) -> None:
    """W_v starts at zero, so a fresh model's A stays zero (z grows); a state saved with
    safetensors mid-segment continues exactly; ``detach`` cuts A and z; ``to`` casts them."""
    model = build_model("rmt", dict(ARMT, n_layers=2, segment_len=5, memory_size=2))
    x = torch.randint(0, 61, (2, 12))
    st = model(x).state
    assert all(float(s.assoc.detach().abs().max()) == 0 and float(s.assoc_z.detach().sum()) > 0 for s in st.layers)
    model = model.double()
    randomize_params(model, 0.2)
    y = torch.randint(0, 61, (2, 9))
    out = model(x)
    save_file(out.state.to_flat(), tmp_path / "state.safetensors")
    again = model.state_from_flat(load_file(tmp_path / "state.safetensors"))
    with torch.no_grad():
        assert torch.equal(model(y, state=again).logits, model(y, state=out.state).logits)
    assert "layers.1.assoc" in out.state.to_flat() and "layers.0.memory" not in out.state.to_flat()
    assert out.state.layers[1].assoc.requires_grad
    det = out.state.detach()
    assert not det.layers[1].assoc.requires_grad and not det.layers[1].assoc_z.requires_grad
    assert out.state.to(torch.float32).layers[0].assoc.dtype == torch.float32
    K, D, M, S, N = 24, 32, 2, 5, 2  # the state's size in ``recurformer info``: A, z and the caches
    assert f"at most {(K * D + K) * N + 2 * (M + S - 1) * D * N:,} floats" in "\n".join(model.info_lines())


def test_associative_off_gives_the_outputs_of_before_the_option() -> None:
    """The default (``associative: false``) computes what the RMT computed before the option
    existed (``tests/fixtures/rmt_plain``): the same parameters from the same seed, the same state
    fields, and the logits fresh and from the carried state and the state itself to float64
    rounding (bit for bit with the same thread count; another count reorders BLAS sums by ~1e-15)."""
    exp = load_file(FIXTURE)
    torch.manual_seed(0)
    model = build_model("rmt", dict(BASE, n_layers=2, segment_len=6, memory_size=3))
    assert not model.config.associative
    randomize_params(model, 0.2)
    model = model.double().eval()
    with torch.no_grad():
        out = model(exp["tokens"])
        torch.testing.assert_close(out.logits, exp["logits"], rtol=1e-13, atol=1e-13)
        more = model(exp["more"], state=out.state).logits
        torch.testing.assert_close(more, exp["logits_more"], rtol=1e-13, atol=1e-13)
    flat = out.state.to_flat()
    assert sorted(flat) == sorted(k.removeprefix("state.") for k in exp if k.startswith("state."))
    for k, t in flat.items():
        torch.testing.assert_close(t, exp["state." + k], rtol=1e-13, atol=1e-13, msg=k)


def test_associative_bad_configs_and_states_are_one_line_errors() -> None:
    with pytest.raises(RecurformerError, match="config key 'assoc_dim' must be >= 1, got 0"):
        build_model("rmt", dict(ARMT, assoc_dim=0))
    with pytest.raises(RecurformerError, match="config key 'model.associative' is a setting of rmt, not of llama"):
        build_model("llama", dict(BASE, associative=True))
    with pytest.raises(
        RecurformerError,
        match="config key 'memory_update' is 'write_gate', but an associative RMT carries no memory slots",
    ):
        build_model("rmt", dict(ARMT, memory_update="write_gate"))
    with pytest.raises(
        RecurformerError, match="config key 'read_slots' is false, but a plain RMT reads its memory only"
    ):
        build_model("rmt", dict(BASE, read_slots=False))
    with pytest.raises(
        RecurformerError, match=r"memory_update' must be one of \['replace', 'write_gate'\], got 'gated'"
    ):
        build_model("rmt", dict(BASE, memory_update="gated"))
    with pytest.raises(RecurformerError, match="config key 'layers' names 'window'"):
        build_model("rmt", dict(ARMT, n_layers=2, window=3, layers=["rmt", "window"]))
    x = torch.tensor([[1, 2, 3, 4, 5]])
    plain = build_model("rmt", dict(BASE, n_layers=2, segment_len=5, memory_size=2))
    armt = build_model("rmt", dict(ARMT, n_layers=2, segment_len=5, memory_size=2))
    wide = build_model("rmt", dict(ARMT, n_layers=2, segment_len=5, memory_size=2, assoc_dim=5))
    with pytest.raises(RecurformerError, match=r"state does not fit this RMT: layer 0 \(rmt\) 'memory' is unexpected"):
        armt(x, state=plain(x).state)
    with pytest.raises(RecurformerError, match=r"layer 0 \(rmt\) 'memory' is missing"):
        plain(x, state=armt(x).state)
    with pytest.raises(
        RecurformerError, match=r"layer 0 \(rmt\) 'assoc' has shape \(1, 30, 32\), expected \(1, 24, 32\)"
    ):
        armt(x, state=wide(x).state)
