"""Recurrent Memory Transformer: the streaming model against the paper read literally (each
segment one pass over [memory; tokens; memory] with one causal mask), the memory as the only path
between segments (and ``detach`` cutting it), constant-size state while generating, and clear
errors for bad configs and foreign states."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import randomize_params

from recurformer import RecurformerError, build_model
from recurformer.generate import new_session, read
from recurformer.modules import apply_rope, rope_cos_sin
from recurformer.train import Trainer, load_run_config

BASE = dict(vocab_size=61, dim=32, n_heads=4)


def reference(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a fresh state, one segment at a time as the paper's decoder (§3): the sequence
    [H^mem; E(x); H^mem] through every block with a square causal mask and RoPE at 0..2M+S-1; the
    new memory is the final-normed output of the write slots. T need not be a multiple of S (the
    last segment is short and writes no memory)."""
    c = model.config
    S, M, H = c.segment_len, c.memory_size, c.n_heads
    B, T = tokens.shape
    memory = model.init_memory.expand(B, M, c.dim)
    out = []
    for a in range(0, T, S):
        x = model.tok_emb(tokens[:, a : a + S])
        n = x.shape[1]
        h = torch.cat((memory, x, memory), 1)
        cos, sin = rope_cos_sin(torch.arange(h.shape[1]), c.head_dim, c.rope_theta, h.dtype)
        for block in model.layers:
            att, u = block.attn, block.attn_norm(h)
            q, k, v = (w(u).view(B, -1, H, c.head_dim).transpose(1, 2) for w in (att.wq, att.wk, att.wv))
            o = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True)
            h = h + att.wo(o.transpose(1, 2).reshape(B, -1, c.dim))
            h = h + block.ffn(block.ffn_norm(h))
        out.append(model.norm(h[:, M : M + n]))
        memory = model.norm(h[:, -M:])
    return F.linear(torch.cat(out, 1), model.tok_emb.weight)


@pytest.mark.parametrize(
    "extra", [dict(n_layers=2, segment_len=7, memory_size=3), dict(n_layers=3, segment_len=4, memory_size=6)]
)
def test_matches_the_paper_read_literally(extra) -> None:
    model = build_model("rmt", dict(BASE, **extra)).double().eval()
    randomize_params(model, 0.2)
    tokens = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        ref = reference(model, tokens)
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
    with pytest.raises(
        RecurformerError, match=r"'k' holds 6 positions, expected 7 \(the M = 4 read slots and 3 tokens\)"
    ):
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
    over = [
        "model.name=rmt", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.segment_len=8", "model.memory_size=3",
        "data.dataset=null", f"data.text_files=[{corpus}]", "data.tokenizer=byte", f"data.dir={tmp_path / 'prepared'}",
        f"train.out_dir={tmp_path / 'run'}", "train.batch_size=2", "train.seq_len=16", "train.steps=3", "train.warmup=1",
        "train.precision=fp32", "train.eval_every=3", "train.eval_batches=1", "train.save_every=3", "train.grad_accum=2", "train.truncation=2",
    ]  # fmt: skip
    trainer = Trainer(load_run_config(None, over), show_progress=False)
    losses = [trainer.train_step() for _ in range(3)]
    assert all(0 < loss < 10 for loss in losses) and trainer.state is not None and trainer.state.pos > 0
    with pytest.raises(
        RecurformerError,
        match=r"train.seq_len \(16\) must be a multiple of the model's chunk/segment/block length \(12\)",
    ):
        Trainer(
            load_run_config(None, over + ["model.segment_len=12", f"train.out_dir={tmp_path / 'bad'}"]),
            show_progress=False,
        )
    assert not (tmp_path / "bad").exists()
