"""Streaming generation for every registered model: forced decoding equals one parallel
forward, greedy is deterministic, top-k/top-p never sample outside their sets, and a saved
session continues exactly like an uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from helpers import TEST_CONFIGS

from recurformer import RecurformerError, build_model
from recurformer.generate import filter_logits, generate, load_session, new_session, read, sample, save_session, stream
from recurformer.models import REGISTRY


def small(name: str):
    cfg = TEST_CONFIGS[name][0]
    torch.manual_seed(0)
    return build_model(name, cfg).double().eval(), cfg


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_forced_decoding_matches_parallel_forward(name) -> None:
    model, cfg = small(name)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 37))
    with torch.no_grad():
        full = model(tokens).logits
    s = read(model, new_session(model, 2), tokens[:, :5])
    got = [s.logits]
    for t in range(5, 37):
        got.append(read(model, s, tokens[:, t : t + 1]).logits)
    torch.testing.assert_close(torch.stack(got[:-1], 1), full[:, 4:-1].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_greedy_is_deterministic_and_matches_argmax(name) -> None:
    model, cfg = small(name)
    prompt = torch.randint(0, cfg["vocab_size"], (1, 9))
    a = generate(model, prompt, 20, temperature=0)
    b = generate(model, prompt, 20, temperature=0, seed=123)
    assert a == b and len(a[0]) == 20
    seq = torch.cat((prompt, torch.tensor(a)), 1)
    with torch.no_grad():
        argmax = model(seq).logits[0, 8:-1].argmax(-1).tolist()
    assert argmax == a[0]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_session_save_load_continue_equals_uninterrupted(name, tmp_path) -> None:
    model, cfg = small(name)
    prompt = torch.randint(0, cfg["vocab_size"], (2, 7))
    whole = generate(model, prompt, 30, temperature=1.0, top_k=10, seed=5)
    s = new_session(model, 2, seed=5)
    first = generate(model, prompt, 12, temperature=1.0, top_k=10, session=s)
    save_session(s, tmp_path / "s.safetensors", name)
    s2 = load_session(tmp_path / "s.safetensors", model, name)
    second = generate(model, None, 18, temperature=1.0, top_k=10, session=s2)
    assert [a + b for a, b in zip(first, second)] == whole


def test_top_k_top_p_sets() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50)
    top5 = logits.topk(5, -1).indices
    for _ in range(200):
        tok = sample(logits, 1.5, 5, None, g)
        assert all(int(tok[b]) in top5[b].tolist() for b in range(4))
    probs = logits.softmax(-1)
    kept = filter_logits(logits, None, 0.5).isfinite()
    for b in range(4):  # the nucleus: the smallest prefix (by probability) reaching 0.5
        order = probs[b].argsort(descending=True)
        cum = probs[b][order].cumsum(0)
        n = int((cum < 0.5).sum()) + 1
        assert set(order[:n].tolist()) == set(kept[b].nonzero().flatten().tolist())
    for _ in range(200):
        tok = sample(logits, 1.0, None, 0.5, g)
        assert all(bool(kept[b, tok[b]]) for b in range(4))


def test_stop_tokens_and_errors(tmp_path) -> None:
    model, cfg = small("llama")
    prompt = torch.randint(0, cfg["vocab_size"], (1, 4))
    first = generate(model, prompt, 5, temperature=0)[0]
    out = generate(model, prompt, 50, temperature=0, stop_tokens=[first[2]])
    assert out[0] == first[: first.index(first[2]) + 1]
    with pytest.raises(RecurformerError, match="temperature"):
        generate(model, prompt, 3, temperature=-1)
    with pytest.raises(RecurformerError, match="needs a prompt"):
        list(stream(model, None, 3, temperature=0))
    s = new_session(model, 1)
    generate(model, prompt, 2, temperature=0, session=s)
    save_session(s, tmp_path / "s.safetensors", "llama")
    ma, _ = small("memory_attention")
    with pytest.raises(RecurformerError, match="made by a 'llama' model"):
        load_session(tmp_path / "s.safetensors", ma, "memory_attention")
