"""Needle in a haystack: prompts of exactly L tokens with the needle at d% of the haystack; the
scores equal one parallel forward of prompt + answer; an oracle that reads the next token is
retrieved exactly at every cell (the scored positions are the answer's); the transformers class
gives the same cells; the CLI writes the JSON and the heatmap; a short haystack is one line."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import TEST_CONFIGS, randomize_params
from torch import nn

from recurformer import RecurformerError, build_model
from recurformer.cli import main as cli_main
from recurformer.data import Tokenizer
from recurformer.niah import NEEDLE, haystack_tokens, make_prompt, niah

TOK = Tokenizer.byte()


@pytest.fixture
def hay_file(tmp_path):
    rng = random.Random(0)
    words = ["river", "stone", "the", "of", "and", "light", "house", "morning", "quiet", "road"]
    path = tmp_path / "hay.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(1500)) + ".")
    return path


def model_of(name: str) -> nn.Module:
    model = build_model(name, dict(TEST_CONFIGS[name][0], vocab_size=TOK.vocab_size))
    randomize_params(model, std=0.1)
    return model.eval()


def test_prompt_has_length_and_needle_at_depth(hay_file) -> None:
    hay = haystack_tokens(TOK, [hay_file])
    for depth in (0, 30, 100):
        prompt, answer = make_prompt(hay, TOK, 300, depth, random.Random(1))
        assert len(prompt) == 300 and prompt[0] == TOK.bos_id
        key = TOK.decode(answer).strip()
        needle = TOK.encode(NEEDLE.format(key=key))
        body = 300 - 1 - len(needle) - len(TOK.encode(" What is the secret passkey? The secret passkey is"))
        at = 1 + round(depth / 100 * body)
        assert prompt[at : at + len(needle)] == needle
    with pytest.raises(
        RecurformerError, match=r"the haystack has 1,000 tokens, fewer than the 1,8\d\d that length 2,000 needs"
    ):
        make_prompt(hay[:1000], TOK, 2000, 50, random.Random(0))


@pytest.mark.parametrize("name", ["memory_attention", "transformer_xl", "llama"])
def test_scores_equal_one_parallel_forward(name, hay_file) -> None:
    model = model_of(name)
    cells = niah(model, TOK, lengths=[160, 300], depths=[0, 50, 100], trials=3, chunk=7, text=[hay_file], seed=3)
    hay = haystack_tokens(TOK, [hay_file])
    for cell in cells:
        rng = random.Random(f"3-{cell.length}-{cell.depth}")  # the trials niah drew for this cell
        lls, exact = [], []
        for _ in range(3):
            prompt, answer = make_prompt(hay, TOK, cell.length, cell.depth, rng)
            x = torch.tensor([prompt + answer])
            with torch.no_grad():
                logp = model(x[:, :-1]).logits.float().log_softmax(-1)[0, len(prompt) - 1 :]
            lls.append(float(logp[range(len(answer)), answer].sum()))
            greedy = model.generate(prompt, len(answer), temperature=0)[0]
            exact.append(float(greedy == answer))
        assert cell.logprob == pytest.approx(sum(lls) / 3, abs=1e-4)
        assert cell.exact == sum(exact) / 3


class Induction(nn.Module):
    """A 'transformers' model that copies: after an 8-token context seen before, it predicts
    (logit 50) the token that followed it then. It retrieves the passkey exactly, and only if the
    scored positions are the answer's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor):  # type: ignore[no-untyped-def]
        logits = torch.zeros(*input_ids.shape, TOK.vocab_size)
        for b, seq in enumerate(input_ids.tolist()):
            last: dict[tuple[int, ...], int] = {}
            for t in range(7, len(seq)):
                key = tuple(seq[t - 7 : t + 1])
                if key in last:
                    logits[b, t, seq[last[key] + 1]] = 50.0
                last[key] = t
        return type("Out", (), {"logits": logits})()


def test_a_copying_model_is_retrieved_everywhere(hay_file) -> None:
    cells = niah(Induction(), TOK, lengths=[160, 300], depths=[0, 50, 100], trials=2, chunk=16, text=[hay_file])
    assert all(c.exact == 1.0 and c.logprob > -1e-6 for c in cells), cells


def test_through_the_transformers_class(hay_file, offline) -> None:
    pytest.importorskip("transformers")
    from recurformer.hf import RecurformerForCausalLM

    model = model_of("memory_attention")
    ours = niah(model, TOK, lengths=[200], depths=[0, 100], trials=2, chunk=9, text=[hay_file])
    theirs = niah(
        RecurformerForCausalLM.from_model(model),
        TOK,
        lengths=[200],
        depths=[0, 100],
        trials=2,
        chunk=9,
        text=[hay_file],
    )
    for a, b in zip(ours, theirs):
        assert (a.exact, a.logprob) == (b.exact, pytest.approx(b.logprob, abs=1e-5))


def test_cli_writes_json_and_heatmap(hay_file, tmp_path, capsys) -> None:
    model_of("block_recurrent").save_pretrained(tmp_path / "m", tokenizer=TOK)
    out = tmp_path / "n.json"
    assert len(haystack_tokens(TOK)) > 500_000  # the default haystack: the bundled books
    assert (
        cli_main(
            [
                "niah",
                "--checkpoint",
                str(tmp_path / "m"),
                "--lengths",
                "160,256",
                "--depths",
                "0,50,100",
                "--trials",
                "2",
                "--chunk",
                "16",
                "--device",
                "cpu",
                "--json",
                str(out),
                "--text",
                str(hay_file),
            ]
        )
        == 0
    )
    cells = json.loads(out.read_text())["cells"]
    assert [(c["length"], c["depth"]) for c in cells] == [(L, d) for L in (160, 256) for d in (0.0, 50.0, 100.0)]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 50% |" in capsys.readouterr().out
    assert (
        cli_main(
            [
                "niah",
                "--checkpoint",
                str(tmp_path / "m"),
                "--lengths",
                "20000",
                "--text",
                str(hay_file),
                "--json",
                str(tmp_path / "x.json"),
            ]
        )
        == 2
    )
    assert "fewer than" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_cli_writes_under_the_run_not_the_working_directory_and_says_how_to_read_it(
    hay_file, tmp_path, monkeypatch, capsys
) -> None:
    """Without ``--json`` the JSON and heatmap go into the checkpoint's run directory; the table
    comes with a line on reading it, and the heatmap's two-line title fits inside the figure."""
    from recurformer.niah import Cell, figure

    model_of("block_recurrent").save_pretrained(tmp_path / "m", tokenizer=TOK)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    args = ["--lengths", "160", "--depths", "0,100", "--trials", "1", "--chunk", "16", "--device", "cpu"]
    assert cli_main(["niah", "--checkpoint", str(tmp_path / "m"), *args, "--text", str(hay_file)]) == 0
    assert list((tmp_path / "cwd").iterdir()) == []
    assert (tmp_path / "m" / "niah.json").is_file() and (tmp_path / "m" / "niah.png").is_file()
    assert "exact match: share of trials whose passkey came out whole (1.00 best)" in capsys.readouterr().out

    cells = [Cell(L, d, -0.5, 1.0, 4) for L in (256, 512) for d in (0.0, 50.0, 100.0)]
    fig = figure(cells, "tinystories-cpu step_001000")
    fig.canvas.draw()
    title = fig.axes[0].title.get_window_extent()
    assert 0 <= title.x0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1


@pytest.mark.parametrize("via", ["recurformer", "transformers"])
def test_the_command_loads_its_model_once(via, hay_file, offline, monkeypatch) -> None:
    """``niah_checkpoint`` reads the weights once: through recurformer's loader, or (``via``
    transformers) through ``from_pretrained`` alone, the tokenizer read beside them."""
    import recurformer
    import recurformer.hub as hub
    from recurformer.niah import niah_checkpoint

    model_of("memory_attention").save_pretrained(offline / "m", tokenizer=TOK)
    path = offline / "m"
    if via == "transformers":
        pytest.importorskip("transformers")
        path = recurformer.export(offline / "m", offline / "hf", format="transformers")
    loads: list[str] = []
    real = hub.load
    monkeypatch.setattr(hub, "load", lambda *a, **k: loads.append("recurformer") or real(*a, **k))
    if via == "transformers":
        from recurformer.hf import RecurformerForCausalLM

        real_hf = RecurformerForCausalLM.from_pretrained.__func__  # type: ignore[attr-defined]

        def from_pretrained(cls, *a, **k):  # type: ignore[no-untyped-def]
            loads.append("transformers")
            return real_hf(cls, *a, **k)

        monkeypatch.setattr(RecurformerForCausalLM, "from_pretrained", classmethod(from_pretrained))
    cells = niah_checkpoint(path, [160], [50], offline / "n.json", via=via, trials=1, text=[str(hay_file)], log=str)
    assert len(cells) == 1 and loads == [via]
