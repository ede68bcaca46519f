"""Every registered model through ``transformers`` (``recurformer.hf``), offline: bitwise logits,
aligned weights and buffers after ``save_pretrained`` -> ``AutoModelForCausalLM.from_pretrained`` (and
``recurformer.load`` of the same directory), greedy ``generate`` == ours (batch 2 included), beam
search with the state cache == without a cache, continuing from a returned cache == one run,
and the errors: padding, unknown keywords, unknown models, assisted decoding."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import TEST_CONFIGS, all_cases, case_id, randomize_params  # noqa: E402

import recurformer  # noqa: E402
from recurformer import RecurformerError, build_model  # noqa: E402
from recurformer.hf import RecurformerCache, RecurformerForCausalLM  # noqa: E402
from recurformer.models import REGISTRY  # noqa: E402

AutoModelForCausalLM = transformers.AutoModelForCausalLM
CASES = all_cases()


def wrapped(
    name: str, cfg: dict, dtype: torch.dtype = torch.float32
) -> tuple[recurformer.StreamingLM, RecurformerForCausalLM]:
    model = build_model(name, cfg)
    randomize_params(model, std=0.2)
    model = model.to(dtype).eval()
    return model, RecurformerForCausalLM.from_model(model)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_save_pretrained_round_trip_is_bitwise(case, offline) -> None:
    name, cfg = case
    model, hf = wrapped(name, cfg)
    hf.save_pretrained(offline / "m")
    loaded = AutoModelForCausalLM.from_pretrained(offline / "m")
    assert type(loaded) is RecurformerForCausalLM
    # aligned for CPU BLAS, whose kernels (and last bits) depend on the address (``realign``)
    assert all(t.data_ptr() % 64 == 0 for t in [*loaded.parameters(), *loaded.buffers()])
    tokens = torch.randint(0, cfg["vocab_size"], (2, 23))
    with torch.no_grad():
        want = model(tokens).logits
        assert torch.equal(loaded(tokens).logits, want)
        ours, _ = recurformer.load(offline / "m")  # one directory serves both libraries
        assert torch.equal(ours(tokens).logits, want)
    fresh = dict(model.named_buffers())  # non-persistent buffers (ALiBi slopes) rebuilt, not garbage
    for key, buf in loaded.model.named_buffers():
        assert torch.equal(buf, fresh[key]), key


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_greedy_generate_matches_ours(name, offline) -> None:
    cfg = TEST_CONFIGS[name][0]
    model, hf = wrapped(name, cfg)
    for batch in (1, 2):
        prompt = torch.randint(0, cfg["vocab_size"], (batch, 7))
        got = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert got[:, :7].tolist() == prompt.tolist()
        assert got[:, 7:].tolist() == model.generate(prompt, 12, temperature=0)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_beam_search_with_cache_equals_without(name, offline) -> None:
    cfg = TEST_CONFIGS[name][0]
    _, hf = wrapped(name, cfg, torch.float64)
    prompt = torch.randint(0, cfg["vocab_size"], (2, 6))
    kw = dict(max_new_tokens=8, min_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False)
    with_cache = hf.generate(prompt, use_cache=True, **kw)
    without = hf.generate(prompt, use_cache=False, **kw)
    assert with_cache.tolist() == without.tolist()


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_continue_from_returned_cache_equals_one_run(name, offline) -> None:
    cfg = TEST_CONFIGS[name][0]
    _, hf = wrapped(name, cfg)
    prompt = torch.randint(0, cfg["vocab_size"], (2, 5))
    kw = dict(do_sample=False, return_dict_in_generate=True)
    whole = hf.generate(prompt, max_new_tokens=11, min_new_tokens=11, **kw).sequences
    first = hf.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kw)
    cache = getattr(first, "cache", None) or first.past_key_values
    assert isinstance(cache, RecurformerCache) and cache.get_seq_length() == 5 + 4 - 1  # the last token is not read yet
    second = (
        hf.generate(first.sequences, cache=cache, max_new_tokens=7, min_new_tokens=7, **kw)
        if "cache" in type(first).__dataclass_fields__
        else hf.generate(first.sequences, past_key_values=cache, max_new_tokens=7, min_new_tokens=7, **kw)
    )
    assert second.sequences.tolist() == whole.tolist()


def test_forward_contract(offline) -> None:
    cfg = TEST_CONFIGS["memory_attention"][0]
    model, hf = wrapped("memory_attention", cfg)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 10))
    with torch.no_grad():
        out = hf(tokens, use_cache=False)
        assert out.get("cache") is None and out.get("past_key_values") is None  # use_cache=False: no cache
        part = hf(tokens[:, :6])  # the returned cache continues under either argument name
        for key in ("cache", "past_key_values"):
            c = (part.get("cache") or part.get("past_key_values")).state
            rest = hf(tokens[:, 6:], **{key: RecurformerCache(c)}).logits
            assert torch.allclose(rest, model(tokens).logits[:, 6:], atol=1e-5)
        loss = hf(tokens, labels=tokens).loss
        want = torch.nn.functional.cross_entropy(model(tokens).logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        assert torch.allclose(loss, want)
    with pytest.raises(RecurformerError, match="unknown keyword argument.*position_ids"):
        hf(tokens, position_ids=torch.arange(10)[None])
    with pytest.raises(RecurformerError, match="padded"):
        hf(tokens, attention_mask=torch.tensor([[1] * 10, [0] * 3 + [1] * 7]))
    with pytest.raises(RecurformerError, match="padded"):  # generate with a padded batch: the same one line
        hf.generate(tokens, attention_mask=torch.tensor([[1] * 10, [0] * 3 + [1] * 7]), max_new_tokens=2)


def test_assisted_decoding_refused_as_stateful(offline) -> None:
    cfg = TEST_CONFIGS["llama"][0]
    _, hf = wrapped("llama", cfg)
    with pytest.raises(ValueError, match="stateful"):
        hf.generate(torch.randint(0, 61, (1, 5)), assistant_model=hf, max_new_tokens=3, do_sample=False)


def test_unknown_model_in_directory_is_one_line(offline) -> None:
    _, hf = wrapped("llama", TEST_CONFIGS["llama"][0])
    d = offline / "bad"
    hf.save_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    config["model"]["name"] = "lstm_xl"
    (d / "config.json").write_text(json.dumps(config))
    for auto in (transformers.AutoConfig, AutoModelForCausalLM):
        with pytest.raises(RecurformerError, match="unknown model 'lstm_xl'"):
            auto.from_pretrained(d)
    config["model"] = {"name": "llama", "dimm": 8}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(RecurformerError, match="dimm"):
        AutoModelForCausalLM.from_pretrained(d)
    del config["model"]["name"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(RecurformerError, match="no model.name"):
        AutoModelForCausalLM.from_pretrained(d)


def test_export_format_transformers(offline) -> None:
    """``recurformer export --format transformers``: both libraries read the directory, the
    tokenizer knows BOS/EOS and generation stops at EOS."""
    from recurformer.cli import main as cli_main
    from recurformer.data import Tokenizer

    rng = torch.Generator().manual_seed(0)
    words = "the cat sat on a mat and ran to the big red house".split()
    text = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (30,), generator=rng)) for _ in range(40)]
    tok = Tokenizer.train_bpe(text, 300)
    model = build_model("llama", dict(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4)).eval()
    model.save_pretrained(offline / "ours", tokenizer=tok)
    assert (
        cli_main(
            ["export", "--checkpoint", str(offline / "ours"), "--out", str(offline / "hf"), "--format", "transformers"]
        )
        == 0
    )
    hf = AutoModelForCausalLM.from_pretrained(offline / "hf")
    ids = torch.tensor([[tok.bos_id, *tok.encode("the cat sat")]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids).logits)
    at = transformers.AutoTokenizer.from_pretrained(offline / "hf")
    assert (at.bos_token_id, at.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert at("the cat sat")["input_ids"] == [tok.bos_id, *tok.encode("the cat sat")]  # BOS first, as our documents
    assert at.decode(at("the cat sat")["input_ids"], skip_special_tokens=True) == "the cat sat"
    assert hf.generation_config.eos_token_id == tok.eos_id
    again, tok2 = recurformer.load(offline / "hf")
    assert tok2 is not None and torch.equal(again(ids).logits, model(ids).logits)
    assert tok2.encode("the cat sat") == tok.encode("the cat sat")  # our tokenizer adds no BOS of its own
    pipe = transformers.pipeline("text-generation", model=str(offline / "hf"))
    text = pipe("the cat sat", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert text == "the cat sat" + tok.decode(model.generate(ids, 6, temperature=0, stop_tokens=[tok.eos_id])[0])
    assert not [p.name for p in (offline / "hf").iterdir() if p.name.startswith(".")]  # nothing half-written left


def test_offline_fixture_refuses_sockets(offline) -> None:
    import socket

    with pytest.raises(AssertionError, match="network connection"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)


@pytest.mark.parametrize("fmt", ["recurformer", "transformers"])
def test_export_of_a_run_lower_cases_as_generate_does(offline, fmt) -> None:
    """A run's checkpoint keeps the tokenizer it was trained with (no normalizer); exported in
    either format, its tokenizer lower-cases a prompt for a lower-case model, as ``recurformer
    generate`` does, and the card says so."""
    from tokenizers import Tokenizer as HFTokenizer

    from recurformer import checkpoint as ckpt
    from recurformer.cli import main as cli_main
    from recurformer.data import Tokenizer

    rng = torch.Generator().manual_seed(0)
    words = "once upon a time the cat sat on a mat and ran to the big red house".split()
    text = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (30,), generator=rng)) for _ in range(40)]
    tok = Tokenizer.train_bpe(text, 300)
    assert tok.lowercase
    model = build_model("llama", dict(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4)).eval()
    run = offline / "run"
    config = {"model": {"name": "llama", **dict(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4)}}
    ckpt.save_checkpoint(run, 1, model.state_dict(), config, (lambda p: p.read_text())(tok.save(offline / "t")))
    assert json.loads((run / "step_000001" / "tokenizer.json").read_text())["normalizer"] is None
    out = offline / "out"
    assert cli_main(["export", "--checkpoint", str(run), "--out", str(out), "--format", fmt]) == 0
    prompt = "Once upon a time"
    want = tok.encode(prompt.lower())
    assert want != tok.encode(prompt)
    assert HFTokenizer.from_file(str(out / "tokenizer.json")).encode(prompt, add_special_tokens=False).ids == want
    assert recurformer.load(out)[1].encode(prompt) == want
    if fmt == "transformers":
        assert transformers.AutoTokenizer.from_pretrained(out)(prompt)["input_ids"] == [tok.bos_id, *want]
    assert "lower-cases its input" in (out / "README.md").read_text()
