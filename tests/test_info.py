"""``recurformer info``'s state size (every model, a config, a hybrid stack), ``prepare``'s one-line
refusal, and lower-case prompts for a lower-case tokenizer."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import MODEL, WORDS

import recurformer
from recurformer import build_model
from recurformer.cli import main as cli_main
from recurformer.data import Tokenizer


@pytest.mark.parametrize("name", recurformer.model_names())
def test_info_gives_the_state_size_for_every_model(name, capsys) -> None:
    from helpers import TEST_CONFIGS

    cfg = TEST_CONFIGS[name][0]
    assert cli_main(["info", "--model", name] + [f"--set={k}={v}" for k, v in cfg.items()]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("state size per row (measured): ")]
    size = line.split(": ", 1)[1]
    grows = name in ("llama", "recurrent_transformer")  # a KV cache of every token read (persistent for the RT)
    assert size.startswith("grows with the text") == grows and ("the same at any length" in size) != grows
    if (
        name == "memory_attention"
    ):  # per layer: memory, its K and V (C x D each) + a partial chunk's K, V, output ((C-1) x D)
        C, D, N = cfg["chunk_size"], cfg["dim"], cfg["n_layers"]
        assert size.startswith(f"{N * (3 * C * D + 3 * (C - 1) * D):,} numbers")
    if name == "llama":  # K and V of every layer
        assert size.endswith(f"({2 * cfg['n_layers'] * cfg['dim']:,} per token)")
    if name == "block_recurrent":  # the bound of the model's own formula is reached
        assert f"(<= {size.split()[0]} numbers)" in out


def test_every_test_config_describes_itself() -> None:
    """Every model's parameter groups and info lines build on each of its test configs, hybrid
    stacks included (Block-Recurrent's once read a cell from a window layer that has none)."""
    from helpers import TEST_CONFIGS

    for name, configs in TEST_CONFIGS.items():
        for cfg in configs:
            model = build_model(name, cfg)
            assert sum(model.param_groups().values()) == model.num_params(), (name, cfg)
            assert model.info_lines(), (name, cfg)


def test_info_takes_the_model_from_a_config_and_needs_one(tmp_path, capsys) -> None:
    """Without --model, ``info`` reads model.name from --config (or a --set); with neither it is a
    one-line error."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  name: transformer_xl\n  dim: 48\n  n_heads: 4\n  n_layers: 2\n")
    assert cli_main(["info", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model: transformer_xl, the model section of {cfg}\n") and "  dim: 48\n" in out
    assert cli_main(["info", "--set", "model.name=llama", "--set", "dim=96"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("model: llama, its defaults (the size of its paper) with --set overrides;")
        and "  dim: 96\n" in out
    )
    assert cli_main(["info"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "recurformer: error: give --model NAME (or a --config with model.name)"
    ]


def test_prepare_needs_a_dataset_or_text(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main(["prepare"]) == 2
    assert capsys.readouterr().err.splitlines() == ["recurformer: error: give --dataset NAME or --text FILE ..."]
    assert list(tmp_path.iterdir()) == []  # nothing prepared, nothing half-written


def test_info_measures_a_hybrid_stack_past_every_layers_reach(capsys) -> None:
    """Window layers of 256 tokens beside a memory layer with chunks of 32: the state stops
    growing once every window is full, and info says so with the size a long text leaves."""
    cfg = {
        "vocab_size": 61,
        "dim": 16,
        "n_layers": 4,
        "n_heads": 2,
        "chunk_size": 32,
        "window": 256,
        "layers": "[window,window,memory,window]",
    }
    assert cli_main(["info", "--model", "memory_attention"] + [f"--set={k}={v}" for k, v in cfg.items()]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: memory_attention, its defaults (the size of its paper) with --set overrides")
    (line,) = [ln for ln in out.splitlines() if ln.startswith("state size per row (measured): ")]
    model = build_model("memory_attention", {**cfg, "layers": ["window", "window", "memory", "window"]}).eval()
    with torch.no_grad():
        state = model(torch.zeros(1, 32 * 40 - 1, dtype=torch.long)).state  # far past every reach, chunk phase 31
    long = sum(t.numel() for t in state.to_flat().values() if t.is_floating_point())
    assert line.split(": ", 1)[1].startswith(f"{long:,} numbers") and "the same at any length" in line


def test_lowercase_tokenizer_lowercases_the_prompt(run, tmp_path, capsys) -> None:
    lower = Tokenizer.train_bpe([" ".join(random.Random(i).choices(WORDS, k=50)) for i in range(50)], 300)
    cased = Tokenizer.train_bpe([" ".join(random.Random(i).choices(WORDS, k=50)).title() for i in range(50)], 300)
    assert lower.lowercase and not cased.lowercase and not Tokenizer.byte().lowercase
    model = build_model(
        "memory_attention", {**{k: v for k, v in MODEL.items() if k != "name"}, "vocab_size": lower.vocab_size}
    )
    path = model.save_pretrained(tmp_path / "lc", tokenizer=lower)
    assert cli_main(["generate", "--checkpoint", str(path), "--prompt", "The Cat", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("the cat") and "the prompt is lower-cased" in out.err
    assert cli_main(["generate", "--checkpoint", str(path), "--prompt", "the cat", "--max-new-tokens", "2"]) == 0
    assert "lower-cased" not in capsys.readouterr().err


def test_cased_tinystories_is_the_lower_case_sample_in_original_case() -> None:
    from recurformer.data.prepare import DATASETS, load_documents

    train, val, source = load_documents("tinystories-cased", None, 0.05)
    lower_train, lower_val, _ = load_documents("tinystories-sample", None, 0.05)
    assert "tinystories-cased" in DATASETS and "original case" in source
    assert len(train) == 2316 and [d.lower() for d in train] == lower_train[:2316]
    assert len(val) == 1000 and [d.lower() for d in val] == lower_val
    assert train[0].startswith("One day, a little girl named Lily")
    assert (
        not Tokenizer.train_bpe(train[:300], 1024).lowercase and Tokenizer.train_bpe(lower_train[:300], 1024).lowercase
    )
