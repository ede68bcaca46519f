"""Hub layout, offline: ``save_pretrained``/``from_pretrained`` round trips, the model card and results
row, ``export`` of a run's weights and tokenizer, a repo id through a fake Hub, ``push_to_hub``."""

from __future__ import annotations

import json
import random
import types
from pathlib import Path

import pytest
import torch
from helpers import MODEL, WORDS, tiny_config

import recurformer
from recurformer import RecurformerError, build_model
from recurformer.cli import main as cli_main
from recurformer.data import Tokenizer


def test_save_pretrained_round_trip_and_card(run, tmp_path) -> None:
    out = run.model.save_pretrained(
        tmp_path / "hf", tokenizer=run.tokenizer, config=run.config, results={"val_loss": 1.25}
    )
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", "tokenizer.json"]
    model = type(run.model).from_pretrained(out)
    x = torch.randint(0, 258, (1, 30))
    assert torch.equal(model(x).logits, run.model(x).logits)
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: recurformer\n")
    assert "Memory Attention" in card and "chunk_size: 8" in card and "text files: corpus.txt" in card
    assert "| val_loss |" in card and "| 1.2500 |" in card
    run.model.save_pretrained(out)  # saved again without a tokenizer: the old one must not stay beside it
    assert not (out / "tokenizer.json").exists() and recurformer.load(out)[1] is None
    with pytest.raises(RecurformerError, match="holds a MemoryAttention, not a Llama"):
        type(build_model("llama", {"dim": 16, "n_layers": 1, "n_heads": 2})).from_pretrained(out)


def test_export_command_writes_the_results_row(run, tmp_path, capsys) -> None:
    assert cli_main(["export", "--checkpoint", str(run.dir), "--out", str(tmp_path / "x")]) == 0
    assert "wrote" in capsys.readouterr().out
    card = (tmp_path / "x" / "README.md").read_text()
    last_val = [
        json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in line
    ][-1]
    assert f"{last_val['val_loss']:.4f}" in card and "4 steps of 96 tokens" in card
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "x"), "--prompt", "the", "--max-new-tokens", "3"]) == 0
    assert cli_main(["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "y")]) == 2
    assert capsys.readouterr().err.strip().startswith("recurformer: error: checkpoint not found")


def test_export_writes_the_runs_weights_and_tokenizer(corpus, tmp_path) -> None:
    """The exported directory holds the checkpoint's own weights (logits bitwise equal: the last
    checkpoint's for a run, the named one's for a checkpoint) and its BPE tokenizer."""
    cfg = tiny_config(corpus, tmp_path, tokenizer="bpe")
    cfg["train"].update(steps=2, save_every=1, eval_every=2)
    run = recurformer.train(cfg, progress=False)
    x = torch.randint(0, run.model.config.vocab_size, (2, 40))
    step1, _ = recurformer.load(run.dir / "step_000001")
    for source, want in ((run.dir, run.model(x).logits), (run.dir / "step_000001", step1(x).logits)):
        out = recurformer.export(source, tmp_path / source.name / "out")
        model, tok = recurformer.load(out)
        assert torch.equal(model(x).logits, want)
        exported, own = (json.loads(p.read_text()) for p in (out / "tokenizer.json", run.checkpoint / "tokenizer.json"))
        assert exported["normalizer"] == {"type": "Lowercase"}  # a lower-case BPE: the file lower-cases, as we do
        assert {**exported, "normalizer": own["normalizer"]} == own
    text = "the big dog sat on a red mat."
    assert tok.kind == "bpe" and tok.encode(text) == run.tokenizer.encode(text) != Tokenizer.byte().encode(text)
    assert not torch.equal(step1(x).logits, run.model(x).logits)  # the two checkpoints differ


def test_export_holds_no_path_of_this_machine(run, tmp_path) -> None:
    out = recurformer.export(run.dir, tmp_path / "x")
    assert str(run.dir) in json.dumps(run.config)  # the run's own config does name its paths
    for f in out.iterdir():
        if f.suffix != ".safetensors":
            text = f.read_text()
            assert str(tmp_path.anchor + tmp_path.parts[1]) not in text, f.name  # e.g. no /tmp/... anywhere
    config = json.loads((out / "config.json").read_text())
    assert (
        "dir" not in config["data"]
        and "out_dir" not in config["train"]
        and config["data"]["text_files"] == ["corpus.txt"]
    )


def test_exported_tokenizer_file_lower_cases_as_we_do(tmp_path) -> None:
    """Through HF ``tokenizers`` alone, the exported file encodes cased text as recurformer does
    (lower-cased first, as ``generate`` does for such a model); the card says so."""
    from tokenizers import Tokenizer as HFTokenizer

    lower = Tokenizer.train_bpe([" ".join(random.Random(i).choices(WORDS, k=50)) for i in range(50)], 300)
    model = build_model(
        "memory_attention", {**{k: v for k, v in MODEL.items() if k != "name"}, "vocab_size": lower.vocab_size}
    )
    out = model.save_pretrained(tmp_path / "lc", tokenizer=lower, config={"data": {"dataset": "tinystories-sample"}})
    text = "The Cat SAT on the mat. A Big red Tree"
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    assert hf.encode(text, add_special_tokens=False).ids == lower.encode(text.lower()) != lower.encode(text)
    assert recurformer.load(out)[1].encode(text) == lower.encode(text.lower())
    assert "lower-case" in (out / "README.md").read_text()


def test_exported_lower_case_model_evaluates_on_its_prepared_data(corpus, tmp_path, capsys) -> None:
    """The lower-case normalizer of an exported tokenizer does not make eval take the model's own
    prepared data for another tokenizer's; another tokenizer's data is still refused."""
    from recurformer.data import prepare

    prepare(tmp_path / "bpe", text_files=[str(corpus)], tokenizer="bpe", vocab_size=300)
    prepare(tmp_path / "byte", text_files=[str(corpus)], tokenizer="byte")
    lower = Tokenizer.load(tmp_path / "bpe")
    assert lower.lowercase
    model = build_model("memory_attention", {**{k: v for k, v in MODEL.items() if k != "name"}, "vocab_size": 300})
    out = model.save_pretrained(tmp_path / "x", tokenizer=lower)
    argv = ["eval", "--checkpoint", str(out), "--lengths", "32", "--last", "32", "--windows", "2", "--chunk", "16"]
    assert cli_main([*argv, "--data", str(tmp_path / "bpe")]) == 0
    assert cli_main([*argv, "--data", str(tmp_path / "byte")]) == 2
    assert "was tokenized with another tokenizer" in capsys.readouterr().err


def test_from_pretrained_repo_id_downloads_offline(run, tmp_path, monkeypatch) -> None:
    """A repo id goes through ``snapshot_download`` (mocked: no network here) and loads the same."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    import recurformer.hub as hub

    local = run.model.save_pretrained(tmp_path / "snap", tokenizer=run.tokenizer)
    calls = []
    monkeypatch.setattr(
        hub, "snapshot_download", lambda repo, revision, allow_patterns: calls.append(repo) or str(local)
    )
    model, tok = recurformer.load("someone/tiny-ma")
    assert (
        calls == ["someone/tiny-ma"] and tok is not None and torch.equal(model.tok_emb.weight, run.model.tok_emb.weight)
    )

    def offline(*a, **k):
        raise LocalEntryNotFoundError("no network and no cached copy")

    monkeypatch.setattr(hub, "snapshot_download", offline)
    with pytest.raises(
        RecurformerError, match="someone/tiny-ma is no local directory, and getting it from the Hub failed: no network"
    ):
        recurformer.load("someone/tiny-ma")
    with pytest.raises(RecurformerError, match="neither a local directory nor a Hub repo id"):
        recurformer.load(str(tmp_path / "nowhere"))


def test_push_to_hub_uploads_the_pretrained_directory(run, monkeypatch) -> None:
    from huggingface_hub import HfApi

    seen: dict = {}
    monkeypatch.setattr(
        HfApi, "create_repo", lambda self, repo_id, private, exist_ok: seen.update(repo=repo_id, private=private)
    )

    def upload_folder(self, repo_id, folder_path, commit_message, allow_patterns):
        seen["files"] = sorted(p.name for p in Path(folder_path).iterdir())
        seen["config"] = json.loads((Path(folder_path) / "config.json").read_text())
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc")

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    url = run.model.push_to_hub("someone/tiny-ma", tokenizer=run.tokenizer, config=run.config)
    assert url.endswith("someone/tiny-ma/commit/abc") and seen["repo"] == "someone/tiny-ma" and not seen["private"]
    assert seen["files"] == ["README.md", "config.json", "model.safetensors", "tokenizer.json"]
    assert seen["config"]["model"]["name"] == "memory_attention"
