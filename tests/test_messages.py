"""Every command's bad option, from the command line and from Python: one line, naming the option as
the user typed it (``--top-p`` there, ``top_p`` here), the same check behind both (each command's
options dataclass, ``config.option``), before any checkpoint is read or anything is written."""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
from helpers import TEST_CONFIGS

import recurformer
from recurformer import RecurformerError, build_model
from recurformer.cli import main as cli_main
from recurformer.data import Tokenizer

MISSING = "no-such-run"  # options are checked before the checkpoint is looked for


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):  # type: ignore[no-untyped-def]
    model = build_model("memory_attention", {**TEST_CONFIGS["memory_attention"][0], "vocab_size": 260}).eval()
    return model.save_pretrained(tmp_path_factory.mktemp("m") / "pre", tokenizer=Tokenizer.byte())


CLI = [
    (["generate", "--checkpoint", MISSING, "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["generate", "--checkpoint", MISSING, "--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["eval", "--checkpoint", MISSING, "--windows", "0"], "--windows must be >= 1, got 0"),
    (["eval", "--checkpoint", MISSING, "--lengths", "0"], "--lengths must be positive integers, got '0'"),
    (["eval", "--checkpoint", MISSING, "--lengths", "a"], "--lengths must be comma-separated integers, got 'a'"),
    (["eval", "--checkpoint", MISSING, "--lengths", "100"], "--lengths: 100 is shorter than --last 256"),
    (["eval", "--checkpoint", MISSING, "--window", "0"], "--window must be >= 1, got 0"),
    (
        ["eval", "--checkpoint", MISSING, "--cuda-graphs", "--device", "cpu"],
        "--cuda-graphs needs a CUDA GPU; this evaluation runs on cpu",
    ),
    (["probe", "--checkpoint", MISSING, "--docs", "0"], "--docs must be >= 1, got 0"),
    (["probe", "--checkpoint", MISSING, "--task", "nope"], "unknown probe task 'nope'; valid tasks: repeat, swap"),
    (
        ["probe", "--checkpoint", MISSING, "--warm-min", "9", "--warm-max", "3"],
        "need 0 <= --warm-min <= --warm-max, got 9 and 3",
    ),
    (["probe", "--checkpoint", MISSING, "--warm-min", "-1"], "--warm-min/--warm-max must be >= 0, got -1"),
    (
        ["probe", "--checkpoint", MISSING, "--distances", "4,x"],
        "--distances must be comma-separated integers, got '4,x'",
    ),
    (["readout", "--checkpoint", MISSING, "--segments", "0"], "--segments must be >= 1, got 0"),
    (["readout", "--checkpoint", MISSING, "--rows", "0"], "--rows must be >= 1, got 0"),
    (["niah", "--checkpoint", MISSING, "--trials", "0"], "--trials must be >= 1, got 0"),
    (["niah", "--checkpoint", MISSING, "--lengths", "0"], "--lengths must be positive integers, got '0'"),
    (["niah", "--checkpoint", MISSING, "--depths", "a"], "--depths must be comma-separated numbers, got 'a'"),
    (
        ["prepare", "--dataset", "tinystories-sample", "--vocab-size", "10"],
        "--vocab-size must be in [258, 1048576], got 10",
    ),
    (["prepare", "--tokenizer", "byte"], "give --dataset NAME or --text FILE ..."),
    (["synth", "--evaluate", MISSING], "synth --evaluate needs --lengths, e.g. --lengths 128,256,512"),
    (
        ["export", "--checkpoint", MISSING, "--out", "x", "--format", "transformers", "--push-to-hub", "a/b"],
        "--push-to-hub goes with --format recurformer; upload a transformers directory with `hf upload`",
    ),
]


@pytest.mark.parametrize("argv, message", CLI, ids=[" ".join(a[:1] + a[3:]) for a, _ in CLI])
def test_cli_bad_option_is_one_line_naming_the_flag(argv, message, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"recurformer: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def command(module: str, name: str):  # type: ignore[no-untyped-def]
    """A command as Python calls it: the function beside its options, in its own module."""
    return getattr(importlib.import_module(f"recurformer.{module}"), name)


PYTHON = [
    ("api", "generate_text", (MISSING,), {"top_p": 2}, "top_p must be in (0, 1], got 2"),
    ("api", "generate_text", (MISSING,), {"top_q": 0.5}, "unknown option 'top_q' (did you mean 'top_p'?)"),
    ("evaluate.command", "evaluate_checkpoints", ([MISSING],), {"windows": 0}, "windows must be >= 1, got 0"),
    ("evaluate.command", "evaluate_checkpoints", ([MISSING],), {"lengths": [0]}, "lengths must be >= 1, got 0"),
    (
        "evaluate.command",
        "evaluate_checkpoints",
        ([MISSING],),
        {"cuda_graphs": True, "device": "cpu"},
        "cuda_graphs needs a CUDA GPU; this evaluation runs on cpu",
    ),
    ("probe.command", "probe_checkpoints", ([MISSING],), {"warm": (-1, 5)}, "warm must be >= 0, got -1"),
    ("probe.command", "probe_checkpoints", ([MISSING],), {"passage": 0}, "passage must be >= 1, got 0"),
    ("readout", "readout_checkpoint", (MISSING,), {"rows": 0}, "rows must be >= 1, got 0"),
    ("niah", "niah_checkpoint", (MISSING,), {"trials": 0}, "trials must be >= 1, got 0"),
    ("niah", "niah_checkpoint", (MISSING,), {"chunks": 8}, "unknown option 'chunks' (did you mean 'chunk'?)"),
    (
        "api",
        "export",
        (MISSING, "x", "a/b"),
        {"format": "transformers"},
        "push_to_hub goes with format='recurformer'; upload a transformers directory with `hf upload`",
    ),
]


@pytest.mark.parametrize("module, name, args, kwargs, message", PYTHON, ids=[f"{p[1]} {p[3]}" for p in PYTHON])
def test_python_bad_option_is_one_line_naming_the_keyword(module, name, args, kwargs, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecurformerError, match=f"^{re.escape(message)}$"):
        command(module, name)(*args, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_the_facade_names_its_keywords(pretrained) -> None:
    model, tok = recurformer.load(pretrained)
    tokens = np.zeros(600, dtype=np.int64)
    with pytest.raises(RecurformerError, match=r"^chunk must be >= 1, got 0$"):
        recurformer.evaluate(model, tokens=tokens, lengths=[256], chunk=0)
    with pytest.raises(RecurformerError, match=r"^unknown option 'lenghts' \(did you mean 'lengths'\?\)$"):
        recurformer.evaluate(model, tokens=tokens, lenghts=[256])
    with pytest.raises(RecurformerError, match=r"^docs must be >= 1, got 0$"):
        recurformer.probe(model, tok, docs=0)


def test_an_option_in_the_middle_of_a_message_is_spelled_for_its_reader(pretrained, tmp_path, capsys) -> None:
    """A message that names an option mid-sentence (``config.opt``): a flag with its value on the
    command line, a keyword with a Python value from Python."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    argv = ["eval", "--checkpoint", str(pretrained), "--lengths", "32", "--last", "16", "--chunk", "16"]
    assert cli_main([*argv, "--json", str(blocker / "e.json")]) == 2
    assert capsys.readouterr().err == (
        f"recurformer: error: cannot write --json file {blocker / 'e.json'}: {blocker} is not a directory\n"
    )
    with pytest.raises(RecurformerError, match=r"^cannot write out file "):
        command("evaluate.command", "evaluate_checkpoints")(
            [str(pretrained)], [32], blocker / "e.json", last=16, chunk=16
        )
    assert cli_main(["readout", "--checkpoint", str(pretrained), "--json", str(blocker / "r.json")]) == 2
    assert capsys.readouterr().err.startswith("recurformer: error: cannot write --json file ")
    with pytest.raises(RecurformerError, match=r"^cannot write save_state file "):
        command("api", "generate_text")(pretrained, "a", save_state=blocker / "s")
    assert cli_main(["generate", "--checkpoint", str(pretrained), "--save-state", str(blocker / "s")]) == 2
    assert capsys.readouterr().err.startswith("recurformer: error: cannot write --save-state file ")


def test_a_swapped_pair_of_letters_is_one_edit(tmp_path, monkeypatch, capsys) -> None:
    """The did-you-mean counts a transposition as one edit: ``nmae`` is one edit from ``name``
    (a run config's model section names its model beside the model's own keys)."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "--config", "tinystories-cpu", "--set", "model.nmae=rmt"]) == 2
    assert capsys.readouterr().err == "recurformer: error: unknown config key 'model.nmae' (did you mean 'name'?)\n"
    assert cli_main(["train", "--config", "tinystories-cpu", "--set", "train.bet1a=0.8"]) == 2
    assert capsys.readouterr().err == "recurformer: error: unknown config key 'train.bet1a' (did you mean 'beta1'?)\n"
    assert list(tmp_path.iterdir()) == []


def test_eval_text_too_short_names_the_lengths_that_fit(pretrained, tmp_path, monkeypatch, capsys) -> None:
    """The default lengths on a short text: the error names ``--lengths`` with those that fit and
    the longest, and that value evaluates; an empty text file is named as such."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "short.txt").write_text("a" * 417)  # bytes: a BOS and 417 tokens
    argv = ["eval", "--checkpoint", str(pretrained), "--text", "short.txt", "--chunk", "64", "--windows", "1"]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err == (
        "recurformer: error: 418 evaluation tokens are too few for windows of 4096 tokens (+1): "
        "use --lengths 256,417 (the longest that fits is 417)\n"
    )
    with pytest.raises(RecurformerError, match=re.escape("use lengths=[256, 417] (the longest that fits is 417)")):
        command("evaluate.command", "evaluate_checkpoints")([str(pretrained)], text=["short.txt"])
    assert cli_main([*argv, "--lengths", "256,417"]) == 0
    (tmp_path / "empty.txt").write_text("\n")
    assert cli_main([*argv[:3], "--text", "empty.txt"]) == 2
    assert capsys.readouterr().err.endswith(
        "recurformer: error: empty.txt holds no text; give --text a file with text to evaluate on\n"
    )
