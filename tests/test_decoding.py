"""The decoding rooms (``KVRoom`` of full attention, ``XLRoom`` of Transformer-XL), used only
without autograd: token-by-token decoding through them gives the logits of one whole forward with
autograd (which never uses them) over a long stream; Llama's cache grows in place with doubling
capacity; a state read twice (two continuations of one prefix) is not corrupted by the in-place
writes; a room never outlives a change of the weights or of the state's tensors."""

from __future__ import annotations

import pytest
import torch
from helpers import TEST_CONFIGS, randomize_params

from recurformer import build_model
from recurformer.models.llama import KVRoom
from recurformer.models.transformer_xl import XLRoom

CASES = [("llama", cfg) for cfg in TEST_CONFIGS["llama"]] + [
    ("transformer_xl", cfg) for cfg in TEST_CONFIGS["transformer_xl"]
]


def model_of(name: str, cfg: dict):
    torch.manual_seed(0)
    model = build_model(name, cfg).double().eval()
    randomize_params(model, 0.2)
    return model


def decode(model, tokens: torch.Tensor, prompt: int, state=None):
    """Logits of reading ``prompt`` tokens in one call, then one token per call (no autograd)."""
    with torch.no_grad():
        out = model(tokens[:, :prompt], state=state)
        logits, state = [out.logits], out.state
        for t in range(prompt, tokens.shape[1]):
            out = model(tokens[:, t : t + 1], state=state)
            logits.append(out.logits)
            state = out.state
    return torch.cat(logits, 1), state


@pytest.mark.parametrize("name,cfg", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_decoding_through_the_rooms_equals_one_forward(name, cfg) -> None:
    model = model_of(name, cfg)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 300))
    whole = model(tokens).logits.detach()  # with autograd: no room
    stepwise, state = decode(model, tokens, 5)
    torch.testing.assert_close(stepwise, whole, rtol=1e-10, atol=1e-10)
    kinds = [layer.kind for layer in model.layers]
    rooms = [type(s.room) for s in state.layers]
    assert rooms == [{"full": KVRoom, "xl": XLRoom}.get(k, type(None)) for k in kinds]


def test_llama_cache_grows_in_place_with_doubling_capacity() -> None:
    model = model_of("llama", TEST_CONFIGS["llama"][0])
    tokens = torch.randint(0, 61, (1, 200))
    with torch.no_grad():
        state = model(tokens[:, :5]).state
        seen = []  # (data pointer of layer 0's keys, capacity) after every step
        for t in range(5, 200):
            state = model(tokens[:, t : t + 1], state=state).state
            room = state.layers[0].room
            assert state.layers[0].k.data_ptr() == room.k.data_ptr() and room.used == t + 1
            seen.append((room.k.data_ptr(), room.k.shape[2]))
    runs = [seen[0]] + [b for a, b in zip(seen, seen[1:]) if a != b]  # one entry per allocation
    assert [cap for _, cap in runs] == [12, 26, 54, 110, 222]  # 2 * (length when the room was full)
    assert len({ptr for ptr, _ in runs}) == len(runs)


@pytest.mark.parametrize("name,cfg", CASES[:1] + CASES[2:3], ids=["llama", "transformer_xl"])
def test_a_state_read_twice_is_not_corrupted(name, cfg) -> None:
    """Two continuations of one prefix state: the second must not overwrite what the first
    continuation's state holds (both write after the prefix in the same room)."""
    model = model_of(name, cfg)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 60))
    other = torch.randint(0, cfg["vocab_size"], (2, 60))
    _, prefix = decode(model, tokens[:, :30], 20)
    _, first = decode(model, tokens[:, 30:40], 1, prefix)
    decode(model, other[:, 30:45], 1, prefix)  # a second continuation of the same prefix
    got, _ = decode(model, tokens[:, 40:], 1, first)
    torch.testing.assert_close(got, model(tokens).logits.detach()[:, 40:], rtol=1e-10, atol=1e-10)


def test_xl_room_follows_the_weights_and_the_state() -> None:
    model = model_of("transformer_xl", TEST_CONFIGS["transformer_xl"][0])
    tokens = torch.randint(0, 61, (2, 40))
    _, state = decode(model, tokens[:, :30], 20)
    room = state.layers[0].room
    assert state.detach().layers[0].room is room  # detach keeps the values, hence the room
    assert state.to(torch.float32).layers[0].room is None  # new tensors: rebuilt when needed
    with torch.no_grad():
        model.layers[0].attn.wk.weight.mul_(1.5)  # new weights: the room's keys are stale
        got = model(tokens[:, 30:], state=state).logits
    want = model(tokens[:, 30:], state=state).logits.detach()  # with autograd: projected anew
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,cfg", CASES[:1] + CASES[2:3], ids=["llama", "transformer_xl"])
def test_a_room_made_in_inference_mode_is_not_written_outside_it(name, cfg) -> None:
    """PyTorch refuses in-place writes into inference tensors outside ``inference_mode``: a state
    decoded there continues under ``no_grad`` in a new room."""
    model = model_of(name, cfg)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 40))
    with torch.inference_mode():
        _, state = decode(model, tokens[:, :25], 20)
    got, _ = decode(model, tokens[:, 25:], 1, state)
    torch.testing.assert_close(got, model(tokens).logits.detach()[:, 25:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,cfg", CASES[:1] + CASES[2:3], ids=["llama", "transformer_xl"])
def test_training_from_a_decoded_state_gets_its_gradient(name, cfg) -> None:
    """A call with autograd from a state that has a room (and a no-autograd continuation of the
    same state, writing into that room before the backward pass) gives the gradient of the same
    call from a copy of the state without one."""
    model = model_of(name, cfg)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 50))
    _, state = decode(model, tokens[:, :30], 20)

    def grads(s, between=lambda: None) -> list[torch.Tensor]:
        model.zero_grad()
        loss = model(tokens[:, 30:40], state=s).logits.pow(2).sum()
        between()
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = grads(state.map(torch.clone))
    got = grads(state, lambda: decode(model, tokens[:, 30:], 1, state))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
