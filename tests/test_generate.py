"""Streaming generation for every registered model: forced decoding equals one parallel
forward, greedy decoding of a model with random weights equals an argmax loop over the growing
sequence, a stop token ends only its row, top-k/top-p never sample outside their sets, a saved
session continues exactly like an uninterrupted run (in the API and through ``generate
--save-state/--load-state``), and a bounded state keeps generation's memory constant."""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch
from helpers import DEVICES, TEST_CONFIGS, randomize_params

import recurformer
from recurformer import RecurformerError, build_model
from recurformer.cli import build_parser
from recurformer.cli import main as cli_main
from recurformer.data import Tokenizer
from recurformer.generate import filter_logits, generate, load_session, new_session, read, sample, save_session, stream
from recurformer.models import REGISTRY
from recurformer.nn import StreamingLM


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
@pytest.mark.parametrize("device", DEVICES)
def test_session_save_load_continue_equals_uninterrupted(name, tmp_path, device) -> None:
    model, cfg = random_model(name, device)
    prompt = torch.randint(0, cfg["vocab_size"], (2, 7)).to(device)
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


def random_model(name: str, device: str = "cpu"):
    """A model with random weights (std 0.3, norm gains around 1): its greedy output depends on
    the context, unlike a default-initialised model's (the last prompt token repeated)."""
    cfg = TEST_CONFIGS[name][0]
    torch.manual_seed(0)
    model = build_model(name, cfg).double().eval()
    randomize_params(model)
    return model.to(device), cfg


def argmax_loop(model, prompt: torch.Tensor, n: int) -> list[list[int]]:
    """Greedy decoding by hand: the whole growing sequence through one stateless forward per step."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat((seq, model(seq).logits[:, -1].float().argmax(-1, keepdim=True)), 1)
    return seq[:, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_generation_equals_an_argmax_loop_over_the_growing_sequence(name, device) -> None:
    model, cfg = random_model(name, device)
    prompt = torch.randint(0, cfg["vocab_size"], (2, 9)).to(device)
    want = argmax_loop(model, prompt, 24)
    assert all(len(set(row)) >= 4 for row in want)  # the output reads its context: not one token repeated
    assert generate(model, prompt, 24, temperature=0) == want
    s = new_session(model, 2)  # the same through a session continued over three calls
    got = generate(model, prompt, 7, temperature=0, session=s)
    for n in (9, 8):
        got = [a + b for a, b in zip(got, generate(model, None, n, temperature=0, session=s))]
    assert got == want


@pytest.mark.parametrize("device", DEVICES)
def test_a_stop_token_ends_only_its_row_after_what_came_before(device) -> None:
    """Greedy rows of a model with random weights; the stop token is one that row 0 first makes
    at an index >= 2 and row 1 never makes."""
    model, cfg = random_model("llama", device)
    prompt = torch.randint(0, cfg["vocab_size"], (2, 6)).to(device)
    free = argmax_loop(model, prompt, 30)
    i, stop = next((i, t) for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i] and t not in free[1])
    out = generate(model, prompt, 30, temperature=0, stop_tokens=[stop])
    assert out[0] == free[0][: i + 1]  # the tokens before the stop token, and the stop token itself
    assert out[1] == free[1]  # the other row goes on to max_new_tokens
    steps = list(stream(model, prompt, 30, temperature=0, stop_tokens=[stop]))
    assert [int(s[0]) for s in steps[i + 1 :]] == [-1] * (30 - i - 1)


# -- the generate command ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A Memory Attention model with random weights and the byte tokenizer, saved in Hub layout."""
    torch.manual_seed(0)
    model = build_model("memory_attention", dict(TEST_CONFIGS["memory_attention"][0], vocab_size=258))
    randomize_params(model)
    path = tmp_path_factory.mktemp("pretrained") / "model"
    model.save_pretrained(path, tokenizer=Tokenizer.byte())
    return path, recurformer.load(path)[0]


def cli_tokens(args: list[str], monkeypatch) -> list[int]:
    """Run ``recurformer generate`` and return the token ids it generated."""
    import recurformer.generate as gen

    seen: list[int] = []
    real = gen.stream

    def recording(*a, **k):
        for step in real(*a, **k):
            seen.append(int(step[0]))
            yield step

    monkeypatch.setattr(gen, "stream", recording)
    assert cli_main(["generate", *args]) == 0
    monkeypatch.setattr(gen, "stream", real)
    return [t for t in seen if t >= 0]


def test_cli_save_and_load_state_continue_one_run_over_the_joined_prompt(pretrained, tmp_path, monkeypatch) -> None:
    path, model = pretrained
    common = ["--checkpoint", str(path), "--temperature", "0", "--no-stop-at-eos"]
    st = tmp_path / "s.safetensors"
    first = cli_tokens([*common, "--prompt", "the cat", "--max-new-tokens", "6", "--save-state", str(st)], monkeypatch)
    second = cli_tokens([*common, "--prompt", " sat", "--load-state", str(st), "--max-new-tokens", "9"], monkeypatch)
    tok = Tokenizer.byte()
    joined = [tok.bos_id] + tok.encode("the cat") + first + tok.encode(" sat")
    want = argmax_loop(model, torch.tensor([joined]), 9)[0]
    assert len(set(first + want)) >= 4  # a model whose output depends on its context
    assert second == want


def test_cli_missing_or_corrupt_session_file_is_one_line(pretrained, tmp_path, capsys) -> None:
    path, _ = pretrained
    args = ["generate", "--checkpoint", str(path), "--prompt", "x", "--max-new-tokens", "2", "--load-state"]
    missing = tmp_path / "none.safetensors"
    assert cli_main([*args, str(missing)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"recurformer: error: session file not found: {missing}"]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert cli_main([*args, str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"recurformer: error: cannot read session {bad}: ")


def test_cli_top_k_top_p_and_seed(pretrained, monkeypatch) -> None:
    path, _ = pretrained
    common = ["--checkpoint", str(path), "--prompt", "the", "--max-new-tokens", "16", "--no-stop-at-eos"]
    greedy = cli_tokens([*common, "--temperature", "0"], monkeypatch)
    assert cli_tokens([*common, "--temperature", "1", "--top-k", "1", "--seed", "3"], monkeypatch) == greedy
    assert cli_tokens([*common, "--temperature", "1", "--top-p", "1e-6", "--seed", "4"], monkeypatch) == greedy
    a = cli_tokens([*common, "--temperature", "1", "--seed", "1"], monkeypatch)
    assert a == cli_tokens([*common, "--temperature", "1", "--seed", "1"], monkeypatch)
    assert a != cli_tokens([*common, "--temperature", "1", "--seed", "2"], monkeypatch)
    assert a != greedy


def test_python_generation_defaults_are_the_command_lines() -> None:
    """``model.generate(prompt)`` and ``generate.generate``/``stream`` default to what the
    ``generate`` command's parser defaults to, so the two cannot drift apart."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    cli = {a.dest: a.default for a in commands.choices["generate"]._actions}
    sampling = ["max_new_tokens", "temperature", "top_k", "top_p", "seed"]
    for fn, names in [
        (generate, sampling),
        (stream, sampling),
        (StreamingLM.generate, sampling[:2]),  # the rest are passed on to generate
        (StreamingLM.stream, sampling[:2]),
    ]:
        params = inspect.signature(fn).parameters
        assert {n: params[n].default for n in names} == {n: cli[n] for n in names}, fn.__qualname__


def test_model_generate_with_its_defaults_samples_as_the_cli(pretrained, monkeypatch) -> None:
    path, model = pretrained
    tok = Tokenizer.byte()
    cli = cli_tokens(["--checkpoint", str(path), "--prompt", "the", "--no-stop-at-eos"], monkeypatch)
    (python,) = model.generate(torch.tensor([[tok.bos_id, *tok.encode("the")]]))
    assert python == cli and len(set(cli)) > 4


def held_bytes(state) -> int:
    """Bytes of every tensor storage a state holds, its decoding rooms' buffers included."""
    storages: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for t in (state.fresh, state.start):
        add(t)
    for s in state.layers:
        for f in s.__dataclass_fields__:
            v = getattr(s, f)
            add(v)
            for w in vars(v).values() if hasattr(v, "__dict__") and not isinstance(v, torch.Tensor) else ():
                add(w)
    return sum(storages.values())


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("device", DEVICES)
def test_generation_memory_is_constant_in_length_for_a_bounded_state(name, device) -> None:
    """The session's state, decoding buffers included, is as big after 4n tokens as after n
    (n >= 64, a multiple of every chunk, segment and block length: the same phase) for every model
    with a bounded state; a full KV cache grows."""
    model, cfg = random_model(name, device)
    n = -(-64 // model.reset_boundary) * model.reset_boundary
    s = new_session(model, 2)
    generate(model, torch.randint(0, cfg["vocab_size"], (2, 5)).to(device), n - 5, temperature=1.0, session=s)
    first = held_bytes(s.state)
    generate(model, None, 3 * n, temperature=1.0, session=s)
    assert s.state.pos == 4 * n
    if model.bounded_state:
        assert held_bytes(s.state) == first
    else:
        assert held_bytes(s.state) > 2 * first
