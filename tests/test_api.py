"""The Python API against the CLI: ``recurformer.train``/``evaluate``/``probe`` give what the commands
give, and the API's errors name its keywords."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import yaml
from helpers import tiny_config

import recurformer
from recurformer import RecurformerError
from recurformer.cli import main as cli_main


def test_train_returns_the_run(run) -> None:
    assert run.checkpoint == run.dir / "step_000004" and run.metrics["step"] == 4 and "val_loss" in run.metrics
    assert run.config["model"]["chunk_size"] == 8 and run.tokenizer.kind == "byte" and not run.model.training
    model, tok = recurformer.load(run.dir)
    x = torch.randint(0, 258, (2, 40))
    assert torch.equal(model(x).logits, run.model(x).logits) and tok.encode("the cat") == run.tokenizer.encode(
        "the cat"
    )


def test_train_overrides_and_resume(corpus, tmp_path) -> None:
    cfg = tiny_config(corpus, tmp_path)
    a = recurformer.train(cfg, {"train.steps": 2}, progress=False, model={"dim": 16})  # a dict and a keyword
    assert a.metrics["step"] == 2 and a.model.config.dim == 16
    b = recurformer.train(resume=a.dir, progress=False, **{"train.steps": 4})
    assert b.metrics["step"] == 4 and b.model.config.dim == 16 and b.dir == a.dir
    with pytest.raises(RecurformerError, match="unknown config key 'train.stepz'"):
        recurformer.train(cfg, progress=False, train={"stepz": 2})


@pytest.fixture
def overrides_given(monkeypatch) -> list[dict]:
    """The overrides ``recurformer.train`` hands to the trainer (which is not run)."""
    given: list[dict] = []

    def train_main(config, over, *args):  # type: ignore[no-untyped-def]
        given.append(over)
        raise RecurformerError("stopped before training")

    monkeypatch.setattr(importlib.import_module("recurformer.training.command"), "train_main", train_main)
    return given


@pytest.mark.parametrize(
    "args, keywords",
    [
        (({"train.steps": 20, "model.dim": 64},), {}),  # the dict of dotted keys, as --set takes them
        (({"train": {"steps": 20}, "model": {"dim": 64}},), {}),  # the dict of sections
        ((), {"train": {"steps": 20}, "model": {"dim": 64}}),  # sections as keywords
        ((), {"train.steps": 20, "model.dim": 64}),  # dotted keys as keywords
        (({"train.steps": 20},), {"model": {"dim": 64}}),  # both
        (({"train.steps": 1, "model.dim": 64},), {"train": {"steps": 20}}),  # both: the keywords win
    ],
)
def test_overrides_as_a_dict_or_as_keywords(overrides_given, args, keywords) -> None:
    with pytest.raises(RecurformerError, match="stopped before training"):
        recurformer.train("tinystories-cpu", *args, progress=False, **keywords)
    assert overrides_given == [{"train": {"steps": 20}, "model": {"dim": 64}}]


@pytest.mark.parametrize(
    "args, keywords, message",
    [
        ((20,), {}, 'overrides must be a dict of config keys, as {"train.steps": 20} or train={"steps": 20}, got 20'),
        (
            (),
            {"steps": 20},
            """'steps' is a config key, not a section: give it as train={"steps": 20} or {"train.steps": 20}""",
        ),
        (({"trian.steps": 5},), {}, "'trian.steps' names no config section (did you mean 'train'?); override as"),
        ((), {"trian": {"steps": 5}}, "'trian' names no config section (did you mean 'train'?); override as"),
        ((), {"train": 5}, 'train takes a dict of its config keys, as train={"KEY": 5} or {"train.KEY": 5}; got 5'),
        (({"train": 5},), {}, 'train takes a dict of its config keys, as train={"KEY": 5} or {"train.KEY": 5}; got 5'),
    ],
)
def test_bad_overrides_are_one_line_in_the_callers_spelling(overrides_given, args, keywords, message) -> None:
    with pytest.raises(RecurformerError) as e:
        recurformer.train("tinystories-cpu", *args, progress=False, **keywords)
    assert str(e.value).startswith(message) and "\n" not in str(e.value) and overrides_given == []


def test_evaluate_matches_the_cli(run, corpus, tmp_path, capsys) -> None:
    out = tmp_path / "e.json"
    argv = [
        "eval",
        "--checkpoint",
        str(run.dir),
        "--text",
        str(corpus),
        "--lengths",
        "64,128",
        "--last",
        "32",
        "--windows",
        "3",
        "--chunk",
        "24",
        "--json",
        str(out),
    ]
    assert cli_main(argv) == 0
    (cli_rows,) = json.loads(out.read_text())["results"].values()
    model, tok = recurformer.load(run.checkpoint)
    rs = recurformer.evaluate(model, tok, text=[corpus], lengths=[64, 128], last=32, windows=3, chunk=24)
    assert [r.loss for r in rs] == [r["loss"] for r in cli_rows] and [r.accuracy for r in rs] == [
        r["accuracy"] for r in cli_rows
    ]
    assert [r.loss_low for r in rs] == [r["loss_low"] for r in cli_rows]
    with pytest.raises(RecurformerError, match="exactly one of dataset"):
        recurformer.evaluate(model, tok)


def test_probe_matches_the_cli(run, corpus, tmp_path) -> None:
    out = tmp_path / "p.json"
    argv = [
        "probe",
        "--checkpoint",
        str(run.dir),
        "--task",
        "swap",
        "--text",
        str(corpus),
        "--docs",
        "6",
        "--distances",
        "1,8",
        "--span",
        "8",
        "--warm-min",
        "4",
        "--warm-max",
        "40",
        "--chunk",
        "16",
        "--json",
        str(out),
    ]
    assert cli_main(argv) == 0
    (cli_result,) = json.loads(out.read_text())["results"]
    model, tok = recurformer.load(run.dir)
    r = recurformer.probe(
        model, tok, task="swap", text=[corpus], docs=6, distances=[1, 8], span=8, warm=(4, 40), chunk=16
    )
    assert [b.mean for b in r.metrics["swap_delta"]] == [b["mean"] for b in cli_result["metrics"]["swap_delta"]]
    with pytest.raises(RecurformerError, match="unknown probe task"):
        recurformer.probe(model, tok, task="copy")


def test_train_errors_name_the_python_keywords(run, tmp_path, capsys) -> None:
    """From Python, a run directory that is taken is explained with ``train``'s keywords, not with
    the command line's flags (which the command line still gets); so is generate's state file."""
    with pytest.raises(RecurformerError) as e:
        recurformer.train(run.config | {"train": {**run.config["train"], "out_dir": str(run.dir)}}, progress=False)
    message = str(e.value)
    assert f"continue it with resume={str(run.dir)!r}" in message and "--" not in message
    assert 'train into another directory (train={"out_dir": DIR}), or pass overwrite=True to replace it' in message
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run.config))
    assert cli_main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    assert "--resume" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecurformerError, match=r"^cannot write save_state file "):
        recurformer.api.generate_text(run.dir, "the", max_new_tokens=2, save_state=tmp_path / "file" / "s")
