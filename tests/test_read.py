"""``StreamingLM.read``, the one chunked reader every tool calls (evaluation, probes, synthetic
tasks, needle in a haystack, the read-out, the trainer's evaluation, lm-eval): its outputs equal
one call over all the tokens, for chunk sizes that divide the length and ones that do not, with
the loss of each call's targets; the logits at least float32; one line when a logit is not
finite, or a chunk or targets do not fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TEST_CONFIGS, randomize_params
from test_streaming import assert_states_equal

from recurformer import RecurformerError, build_model
from recurformer.nn import IGNORE_INDEX, NonFiniteLogits, StreamingLM

T = 23  # prime: no chunk size below it divides it, nor most of the models' chunk, segment or block lengths


def model_of(name: str, dtype: torch.dtype = torch.float64) -> StreamingLM:
    torch.manual_seed(0)
    model = build_model(name, TEST_CONFIGS[name][0]).to(dtype).eval()
    randomize_params(model, 0.3 if dtype == torch.float64 else 0.1)
    return model


@pytest.mark.parametrize("name", sorted(TEST_CONFIGS))
def test_read_equals_one_call(name) -> None:
    """Chunks of 1, 5, 7, T and more than T, from a fresh state and from one after 6 tokens:
    the logits, each call's loss of its targets and the final state equal one call's."""
    model = model_of(name)
    V = model.config.vocab_size
    tokens = torch.randint(0, V, (2, 6 + T))
    targets = torch.randint(0, V, (2, 6 + T))
    targets[0, 10:15] = IGNORE_INDEX
    with torch.no_grad():
        before = model(tokens[:, :6]).state
        whole = model(tokens[:, 6:], state=before)
        for chunk in (1, 5, 7, T, T + 4):
            outs = list(model.read(tokens[:, 6:], chunk, before, targets[:, 6:]))
            assert len(outs) == -(-T // chunk)
            torch.testing.assert_close(torch.cat([o.logits for o in outs], 1), whole.logits, rtol=1e-10, atol=1e-10)
            assert_states_equal(outs[-1].state, whole.state, 1e-10, 1e-10)
            for a, o in zip(range(0, T, chunk), outs):
                y = targets[:, 6 + a : 6 + a + chunk]
                want = F.cross_entropy(
                    whole.logits[:, a : a + chunk].flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX
                )
                assert o.loss is not None
                torch.testing.assert_close(o.loss, want, rtol=1e-10, atol=1e-10)
            assert all(o.loss is None for o in model.read(tokens, 7))


def test_read_from_the_start_and_gradients() -> None:
    """No state: a document's start. Gradients flow through the carried state to every call."""
    model = model_of("memory_attention", torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (2, T))
    with torch.no_grad():
        whole = model(tokens)
    outs = list(model.read(tokens, 8))
    torch.testing.assert_close(torch.cat([o.logits for o in outs], 1), whole.logits, rtol=1e-5, atol=1e-5)
    w = model.tok_emb.weight
    (g,) = torch.autograd.grad(outs[-1].logits.sum(), w)
    (want,) = torch.autograd.grad(model(tokens).logits[:, 16:].sum(), w)
    torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


def test_read_promotes_the_logits_to_float32_at_least() -> None:
    tokens = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        bf16 = model_of("llama", torch.bfloat16)
        assert {o.logits.dtype for o in bf16.read(tokens, 4)} == {torch.float32}
        assert {o.logits.dtype for o in model_of("llama").read(tokens, 4)} == {torch.float64}
        fp32 = model_of("llama", torch.float32)
        (o,) = fp32.read(tokens, 9, precision="bf16")  # under the autocast of its precision
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = fp32(tokens).logits
        assert want.dtype == torch.bfloat16 and o.logits.dtype == torch.float32
        assert torch.equal(o.logits, want.float())


def test_non_finite_logits_are_one_line() -> None:
    model = model_of("memory_attention", torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (2, T))
    with torch.no_grad():
        model.layers[1].attn.wo.weight[0, 0] = float("nan")  # the second layer: every token's logits
    outs = model.read(tokens, 10)
    with pytest.raises(NonFiniteLogits) as e:
        next(outs)
    assert isinstance(e.value, RecurformerError)
    assert str(e.value) == (
        f"the model produced non-finite logits (NaN/inf) at tokens 0..9 of {T} (fp32): its weights are broken or overflow"
    )


def test_bad_chunk_and_targets_are_one_line() -> None:
    model = model_of("llama")
    tokens = torch.randint(0, 61, (2, T))
    with pytest.raises(RecurformerError, match=r"^chunk must be >= 1, got 0$"):
        model.read(tokens, 0)
    with pytest.raises(RecurformerError, match=r"^targets shape \(2, 24\) != tokens shape \(2, 23\)$"):
        model.read(tokens, 5, targets=torch.zeros(2, T + 1, dtype=torch.long))
    with pytest.raises(
        RecurformerError, match=r"^tokens must be an integer tensor \[batch, time\], got \(23,\) torch.int64$"
    ):
        model.read(tokens[0], 5)
