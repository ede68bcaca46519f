"""One loader (``hub.load``) for every command: a local run, checkpoint or pretrained directory, or
a Hub repo id read from the Hub cache (built here by hand, offline: no network), gives the same
model; ``generate`` and ``eval`` take a Hub id as their help says. One run-directory reader
(``checkpoint.metrics``, ``checkpoint.train_json``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import TEST_CONFIGS

import recurformer
from recurformer import RecurformerError, build_model
from recurformer.checkpoint import metrics, train_json
from recurformer.cli import main as cli_main
from recurformer.data import Tokenizer
from recurformer.hub import FILES, Loaded, load

REPO = "someone/tiny-ma"


@pytest.fixture
def hub_repo(offline):  # type: ignore[no-untyped-def]
    """A pretrained model saved into the Hub cache as ``snapshot_download`` leaves it
    (``models--owner--name/refs/main`` -> ``snapshots/<commit>/``), and the model."""
    from huggingface_hub import constants

    model = build_model("memory_attention", {**TEST_CONFIGS["memory_attention"][0], "vocab_size": 260}).eval()
    local = model.save_pretrained(offline / "pre", tokenizer=Tokenizer.byte())
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline / "hf_home" / "hub" / "models--someone--tiny-ma"
    assert constants.HF_HUB_CACHE == str(offline / "hf_home" / "hub")
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in FILES:
        shutil.copy(local / name, repo / "snapshots" / commit / name)
    return model, repo / "snapshots" / commit


def test_hub_id_loads_from_the_cache(hub_repo) -> None:
    model, snapshot = hub_repo
    loaded = load(REPO)
    assert isinstance(loaded, Loaded) and loaded.name == "memory_attention" and loaded.path == snapshot
    assert loaded.tokenizer is not None and loaded.config["model"]["name"] == "memory_attention"
    assert torch.equal(loaded.model.tok_emb.weight, model.tok_emb.weight)
    ours, tok = recurformer.load(REPO)  # the documented two-name form, through the same loader
    assert torch.equal(ours.tok_emb.weight, model.tok_emb.weight) and tok is not None
    assert torch.equal(type(model).from_pretrained(REPO).tok_emb.weight, model.tok_emb.weight)


def test_generate_takes_a_hub_id(hub_repo, capsys) -> None:
    argv = ["generate", "--checkpoint", REPO, "--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0"]
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("ab")


def test_eval_takes_a_hub_id_and_writes_in_the_working_directory(hub_repo, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    argv = ["eval", "--checkpoint", REPO, "--lengths", "32", "--last", "16", "--windows", "2", "--chunk", "16"]
    assert cli_main([*argv, "--text", str(text)]) == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "eval.json").read_text())
    assert list(results["results"]) == [REPO] and results["complete"]  # labelled by the repo id
    assert not list(hub_repo[1].glob("eval*"))  # nothing written into the Hub cache


def test_missing_hub_id_and_missing_path_are_one_line(offline, tmp_path, capsys) -> None:
    assert cli_main(["generate", "--checkpoint", "nobody/nothing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recurformer: error: nobody/nothing is no local directory, and getting it from the Hub")
    assert "\n" not in err
    with pytest.raises(RecurformerError, match="checkpoint not found: .*neither a local directory nor a Hub repo id"):
        load(tmp_path / "nowhere")


def test_run_directory_reader(tmp_path) -> None:
    """Rows up to a step, a torn last line skipped; a pretrained directory has no train state."""
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "val_loss": 2.5}, {"step": 3, "loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    assert metrics(tmp_path) == rows and metrics(tmp_path, 2) == rows[:2] and metrics(tmp_path / "none") == []
    assert train_json(tmp_path) is None
    (tmp_path / "train_state.json").write_text('{"step": 3, "tokens_seen": 96}')
    assert train_json(tmp_path) == {"step": 3, "tokens_seen": 96}


def test_a_mistyped_local_path_is_missing_with_a_suggestion_not_a_hub_id(
    offline, tmp_path, monkeypatch, capsys
) -> None:
    """``runs/typo`` where ``runs/`` exists (or ``./x``, ``~/x``) is a local path: reported as
    missing, naming the closest directory beside it, never looked up on the Hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tinystories-cpu").mkdir(parents=True)
    assert cli_main(["eval", "--checkpoint", "runs/tinystories-cpuu"]) == 2
    assert capsys.readouterr().err == (
        "recurformer: error: checkpoint not found: runs/tinystories-cpuu (neither a local directory nor a Hub repo "
        "id owner/name; did you mean 'runs/tinystories-cpu'?)\n"
    )
    with pytest.raises(RecurformerError, match=r"^checkpoint not found: runs/typo \(neither .* owner/name\)$"):
        load("runs/typo")
    with pytest.raises(RecurformerError, match=r"^checkpoint not found: ~/no-such-run-here \(neither"):
        load("~/no-such-run-here")
