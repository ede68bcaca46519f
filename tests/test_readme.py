"""The README's Python blocks run as written after its command 1."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml
from helpers import ckpt_steps

import recurformer
from recurformer.cli import main as cli_main
from recurformer.config import load_yaml

ROOT = Path(__file__).resolve().parent.parent


# The README's Python blocks run as written after its command 1, in a fresh directory, with these
# substitutions only, for time: the bundled config (minutes on the real data) becomes the same
# config at a tiny size on the test corpus (command 1 trains it too), and the first block's model
# at its paper's size a small one; `runs/NAME` in the transformers export command is command 1's run.
README_SUBSTITUTIONS = {
    'recurformer.train("tinystories-cpu",': "recurformer.train(TINY_CONFIG,",
    '{"dim": 288, "n_layers": 6, "n_heads": 6, "chunk_size": 32}': '{"dim": 32, "n_layers": 2, "n_heads": 2, "chunk_size": 32}',
}
README_EXPORT = "recurformer export --checkpoint runs/NAME --out my-model --format transformers"
TINY = {
    "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "chunk_size": 8},
    "data": {"dataset": None, "vocab_size": 300},
    "train": {"batch_size": 2, "seq_len": 32, "steps": 4, "warmup": 2, "eval_every": 2, "eval_batches": 1},
}
TINY_TRAIN = {"save_every": 2, "log_every": 1, "precision": "fp32", "loggers": []}


@pytest.mark.slow
def test_readme_python_blocks_run_after_command_1(corpus, tmp_path, monkeypatch, capsys) -> None:
    """Every ```python block of the README, in order, after command 1 (``recurformer train
    --config tinystories-cpu``, here the tiny config): the API tour trains a run of its own beside
    command 1's, and the transformers block reads command 1's run exported as the README says,
    its tokenizer lower-casing "Once upon a time" for this lower-case model."""
    from recurformer.config import merge

    monkeypatch.chdir(tmp_path)
    config = merge(load_yaml("tinystories-cpu"), TINY)
    config["data"]["text_files"] = [str(corpus)]
    config["train"].update(TINY_TRAIN)
    tiny_path = tmp_path / "tinystories-cpu.yaml"
    tiny_path.write_text(yaml.safe_dump(config))
    assert config["train"]["out_dir"] == "runs/tinystories-cpu"  # where command 1 writes, as the README says
    assert cli_main(["train", "--config", str(tiny_path)]) == 0  # command 1
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    for old in README_SUBSTITUTIONS:
        assert sum(old in b for b in blocks) == 1, old  # each substitution applies once, where it is meant to
    transformers_block = [b for b in blocks if "AutoModelForCausalLM" in b]
    assert len(transformers_block) == 1 and README_EXPORT in readme
    if importlib.util.find_spec("transformers") is not None:
        argv = README_EXPORT.replace("runs/NAME", "runs/tinystories-cpu").split()[1:]
        assert cli_main(argv) == 0
    scopes = []
    for block in blocks:
        if block in transformers_block and importlib.util.find_spec("transformers") is None:
            compile(block, "README.md", "exec")  # needs recurformer[hf]: tests/test_hf.py runs it where installed
            continue
        for old, new in README_SUBSTITUTIONS.items():
            block = block.replace(old, new)
        scope: dict = {"TINY_CONFIG": str(tiny_path)}
        exec(compile(block, "README.md", "exec"), scope)
        scopes.append(scope)
    what, decode, tour = scopes[:3]
    assert len(what["ids"]) == 2 and len(what["ids"][0]) == 50
    assert isinstance(decode["text"], str) and decode["text"]
    assert tour["run"].dir == Path("runs/api-tour") and tour["run"].metrics["step"] == 20
    assert ckpt_steps(tmp_path / "runs" / "tinystories-cpu") == [2, 4]  # command 1's run untouched
    assert [r.length for r in tour["rows"]] == [256, 512] and (
        tmp_path / "exported" / "api-tour" / "README.md"
    ).is_file()
    if len(scopes) == 4:
        tok = recurformer.load(tmp_path / "runs" / "tinystories-cpu")[1]
        assert tok is not None and tok.lowercase
        assert scopes[3]["ids"][0].tolist() == [tok.bos_id, *tok.encode("once upon a time")]
