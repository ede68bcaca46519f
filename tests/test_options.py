"""Bad numeric options: one line naming the option and its value, from the command line and from
Python alike (one shared check: the range each field declares, ``config.option(range=...)``, checked
as its dataclass is built, ``config.Checked``), before anything is printed or written."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers import ROOT, TEST_CONFIGS

import recurformer
from recurformer import RecurformerError, build_model
from recurformer.cli import main as cli_main
from recurformer.config import make_options
from recurformer.data import DataConfig, Tokenizer
from recurformer.evaluate.lengths import LengthOptions
from recurformer.generate import GenerateOptions
from recurformer.registry import make_config
from recurformer.synth.config import SynthConfig
from recurformer.training.config import TrainConfig


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    model = build_model("memory_attention", {**TEST_CONFIGS["memory_attention"][0], "vocab_size": 260}).eval()
    return model.save_pretrained(tmp_path_factory.mktemp("m") / "pre", tokenizer=Tokenizer.byte())


def files(root) -> set:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train", "--config", "tinystories-cpu", "--set", "train.lr=-1"],
            "config key 'train.lr' must be > 0, got -1.0",
        ),
        (["generate", "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
        (["generate", "--top-k", "0"], "--top-k must be >= 1, got 0"),
        (["generate", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 0, got -3"),
        (["generate", "--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
        (["eval", "--lengths", "100"], "--lengths: 100 is shorter than --last 256"),
        (["eval", "--windows", "0"], "--windows must be >= 1, got 0"),
        (["probe", "--docs", "0"], "--docs must be >= 1, got 0"),
        (
            ["prepare", "--dataset", "tinystories-sample", "--vocab-size", "10"],
            "--vocab-size must be in [258, 1048576], got 10",
        ),
        (
            ["train", "--config", "tinystories-cpu", "--set", "data.vocab_size=10"],
            "config key 'data.vocab_size' must be in [258, 1048576], got 10",
        ),
    ],
)
def test_cli_bad_number_is_one_line_and_nothing_is_written(
    argv, message, pretrained, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    if argv[0] not in ("train", "prepare"):
        argv = [argv[0], "--checkpoint", str(pretrained), *argv[1:]]
    if argv[0] == "generate":  # a prompt that would show if it were printed before the check
        argv += ["--prompt", "once upon a time"]
    before = files(pretrained.parent)
    assert cli_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"recurformer: error: {message}\n"
    assert files(tmp_path) == set() and files(pretrained.parent) == before


def test_python_train_bad_lr_is_a_recurformer_error(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecurformerError, match=r"^config key 'train.lr' must be > 0, got -1.0$"):
        recurformer.train("tinystories-cpu", progress=False, train={"lr": -1})
    assert files(tmp_path) == set()


def test_python_evaluate_names_its_own_arguments() -> None:
    model = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0])
    tokens = np.zeros(2000, dtype=np.int64)
    with pytest.raises(RecurformerError, match=r"^lengths: 100 is shorter than last 256$"):
        recurformer.evaluate(model, tokens=tokens, lengths=[100])
    with pytest.raises(RecurformerError, match=r"^windows must be >= 1, got 0$"):
        recurformer.evaluate(model, tokens=tokens, lengths=[256], windows=0)


@pytest.mark.parametrize(
    "call, kwargs, message",
    [
        ("evaluate_checkpoints", {"lengths": [100]}, "lengths: 100 is shorter than last 256"),
        ("evaluate_checkpoints", {"lengths": [256], "window": 0}, "window must be >= 1, got 0"),
        (
            "evaluate_checkpoints",
            {"lengths": [256], "context": 100},
            "context 100 is shorter than warm-up + the longest length (256)",
        ),
        ("probe_checkpoints", {"warm": (5, 2)}, "warm must be (min, max) with min <= max, got (5, 2)"),
        ("probe_checkpoints", {"task": "nope"}, "unknown probe task 'nope'; valid tasks: repeat, swap"),
        ("generate_text", {"top_k": 0}, "top_k must be >= 1, got 0"),
        ("readout_checkpoint", {"segments": 0}, "segments must be >= 1, got 0"),
    ],
)
def test_python_commands_check_their_options_first(call, kwargs, message, pretrained, tmp_path, monkeypatch) -> None:
    """What the CLI commands run, called from Python: the options are named as Python arguments and
    checked before any checkpoint is read or anything is written (the checkpoint does not exist)."""
    import sys

    import recurformer.api

    home = {
        "evaluate_checkpoints": sys.modules["recurformer.evaluate.command"],
        "probe_checkpoints": sys.modules["recurformer.probe.command"],
        "readout_checkpoint": sys.modules["recurformer.readout"],
    }
    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "no-such-run")
    first = [missing] if call in ("evaluate_checkpoints", "probe_checkpoints") else missing
    with pytest.raises(RecurformerError, match=f"^{re.escape(message)}$"):
        getattr(home.get(call, recurformer.api), call)(first, **kwargs)
    assert files(tmp_path) == set()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_p": 2.0}, "top_p must be in (0, 1], got 2.0"),
        ({"top_k": 0}, "top_k must be >= 1, got 0"),
        ({"max_new_tokens": -3}, "max_new_tokens must be >= 0, got -3"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": float("nan")}, "temperature must be >= 0, got nan"),
    ],
)
def test_python_generate_bad_number(kwargs, message) -> None:
    model = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0])
    args = {"max_new_tokens": 3, "temperature": 0.8, **kwargs}
    with pytest.raises(RecurformerError, match="^" + message.replace("(", r"\(").replace("]", r"\]") + "$"):
        model.generate([1, 2], **args)


def test_every_option_has_help_and_top_level_help_is_plain(capsys, monkeypatch) -> None:
    from recurformer.cli import build_parser

    monkeypatch.setenv("COLUMNS", "300")  # one line per option
    ap = build_parser()
    with pytest.raises(SystemExit):
        ap.parse_args(["--help"])
    assert "``" not in capsys.readouterr().out
    (sub,) = [a for a in ap._actions if a.__class__.__name__ == "_SubParsersAction"]
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
        text = p.format_help()
        if name == "generate":
            assert "(default: 200)" in text and "(default: 0.8)" in text
        if name == "eval":
            assert "(default: 256,512,1024,2048,4096)" in text and "(default: 8)" in text
        if name == "probe":
            assert "{repeat,swap}" in text


def test_every_commands_flags_come_from_its_options_dataclass() -> None:
    """Each command's flags are the fields of its options dataclass (``cli.add_options``), beside
    the few the command line adds itself; no command's flags are written by hand."""
    import dataclasses

    from recurformer.cli import COMMANDS, _options_classes, build_parser, flag_of

    own = {
        "info": {"--set"},
        "train": {"--set"},
        "eval": {"--all"},
        "generate": {"--stats"},
        "readout": {"--set"},
        "probe": {"--checkpoint", "--merge", "--warm-min", "--warm-max"},  # --checkpoint or --merge
    }
    (sub,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    classes = _options_classes()
    assert set(classes) == set(COMMANDS)
    for name, cls in classes.items():
        fields = {flag_of(f) for f in dataclasses.fields(cls) if f.metadata["cli"].get("cli", True)}
        flags = {s for a in sub.choices[name]._actions for s in a.option_strings if s.startswith("--")}
        flags -= {"--help"} | {f.replace("--", "--no-", 1) for f in fields}
        assert flags == fields | own.get(name, set()), name


def test_eval_and_probe_write_beside_the_checkpoint(pretrained, tmp_path, monkeypatch, capsys) -> None:
    import shutil

    model_dir = shutil.copytree(pretrained, tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("once upon a time there was a cat. " * 40)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    argv = [
        "eval",
        "--checkpoint",
        str(model_dir),
        "--text",
        str(text),
        "--lengths",
        "64",
        "--last",
        "32",
        "--windows",
        "2",
        "--chunk",
        "16",
    ]
    assert cli_main(argv) == 0
    assert f"wrote {model_dir / 'eval.json'} and {model_dir / 'eval.png'}" in capsys.readouterr().out
    argv = [
        "probe",
        "--checkpoint",
        str(model_dir),
        "--task",
        "swap",
        "--text",
        str(text),
        "--docs",
        "2",
        "--distances",
        "1,8",
        "--span",
        "8",
        "--warm-min",
        "4",
        "--warm-max",
        "20",
        "--chunk",
        "16",
    ]
    assert cli_main(argv) == 0
    assert (model_dir / "probe.json").is_file() and (model_dir / "probe.png").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []


def test_openmp_waits_passively_unless_the_user_says_otherwise() -> None:
    """Importing recurformer (as the command line does, before torch) sets OMP_WAIT_POLICY=PASSIVE
    for the OpenMP runtime torch loads next; a policy the user set is kept."""
    import os
    import subprocess
    import sys

    code = "import os, recurformer; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's recurformer, whatever the working directory
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "PASSIVE"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "ACTIVE"


THREADS_SEEN = """
import sys
import numpy as np
{imports}
import recurformer.device as device
from recurformer.models import build_model

torch.set_num_threads(2)
device.idle_cpus = lambda interval=0.25: 0  # a machine whose every CPU is busy with another job
model = build_model("memory_attention", dict(vocab_size=64, dim=16, n_layers=1, n_heads=2, chunk_size=8))
seen = set()
model.register_forward_pre_hook(lambda module, args: seen.add(torch.get_num_threads()))
tokens = np.random.default_rng(0).integers(0, 64, 400)
recurformer.evaluate(model, tokens=tokens, lengths=[32], last=16, windows=2, chunk=16)
print(sorted(seen), torch.get_num_threads())
"""


@pytest.mark.parametrize(
    "imports, policy, expected",
    [
        ("import torch, recurformer", None, "[1] 2"),  # OpenMP spins: one thread while every CPU is busy
        ("import recurformer, torch", None, "[2] 2"),  # passive waiting holds: every thread
        ("import torch, recurformer", "ACTIVE", "[2] 2"),  # the user's own policy is kept
    ],
)
def test_the_api_does_not_spin_against_a_busy_machine_when_torch_came_first(imports, policy, expected) -> None:
    """``import torch`` before ``recurformer`` loads OpenMP with its spinning default (too late for
    ``OMP_WAIT_POLICY=PASSIVE``); the API then runs on as many threads as CPUs are idle (here
    none: one thread, which never spins) and restores the count after the call."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(ROOT)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    code = THREADS_SEEN.format(imports=imports)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
    assert ("runs on 1 torch thread(s), not 2" in out.stderr) == (expected == "[1] 2")


def test_compile_on_torch_2_4_is_one_line_and_nothing_is_written(tmp_path, monkeypatch, capsys) -> None:
    """torch 2.4's inductor fails on the RoPE tables (``nn.check_compile``): --compile there is one
    line before anything is written, and so is ``compile_layers`` from Python."""
    from torch.torch_version import TorchVersion

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.4.1+cpu"))
    message = "compiling needs torch >= 2.5 (torch 2.4's inductor fails on the RoPE tables); this is 2.4.1+cpu"
    assert cli_main(["train", "--config", "tinystories-cpu", "--compile"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"recurformer: error: {message}\n"
    assert files(tmp_path) == set()
    with pytest.raises(RecurformerError, match=re.escape(message)):
        build_model("llama", TEST_CONFIGS["llama"][0]).compile_layers()


@pytest.mark.parametrize("name", ["memory_attention", "rmt", "block_recurrent", "transformer_xl"])
def test_memory_options_out_of_range_or_foreign_are_one_line(name) -> None:
    """``qkv_conv`` below 0 names itself and its value; ``qkv_conv`` or ``memory_update`` on a model
    that has no such option, and an unknown ``memory_update``, are refused before any model is built."""
    cfg = TEST_CONFIGS[name][0]
    with pytest.raises(RecurformerError, match=r"^config key 'model.qkv_conv' must be >= 0, got -1$"):
        build_model(name, {**cfg, "qkv_conv": -1})
    with pytest.raises(RecurformerError, match=r"^config key 'model.qkv_conv' is a setting of .*, not of llama"):
        build_model("llama", {**TEST_CONFIGS["llama"][0], "qkv_conv": 4})
    if name in ("memory_attention", "rmt"):
        with pytest.raises(RecurformerError, match=r"^config key 'model.memory_update' must be one of .*, got 'hold'$"):
            build_model(name, {**cfg, "memory_update": "hold"})
    else:
        with pytest.raises(
            RecurformerError, match=rf"^config key 'model.memory_update' is a setting of .*, not of {name}"
        ):
            build_model(name, {**cfg, "memory_update": "write_gate"})


def ranged_dataclasses() -> list[type]:
    """Every dataclass of the package with a field that declares a range (``option(range=...)``)."""
    import dataclasses
    import importlib
    import pkgutil

    found = []
    for m in pkgutil.walk_packages(recurformer.__path__, "recurformer."):
        if m.name.endswith("__main__"):
            continue
        module = importlib.import_module(m.name)
        for v in vars(module).values():
            if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == module.__name__:
                if any(f.metadata.get("bounds") for f in dataclasses.fields(v)):
                    found.append(v)
    return found


def test_every_declared_range_is_checked_as_its_dataclass_is_built() -> None:
    """Configs and options alike: a value just outside a field's range is refused by the
    constructor itself, in one line naming the field (a field declared anew in a subclass, as
    sliding_window's ``window``, must declare its range again)."""
    import dataclasses

    classes = ranged_dataclasses()
    names = {c.__name__ for c in classes}
    assert {
        "ModelConfig",
        "SlidingWindowConfig",
        "TrainConfig",
        "SynthConfig",
        "DataConfig",
        "GenerateOptions",
    } <= names
    for cls in classes:
        for f in dataclasses.fields(cls):
            if not f.metadata.get("bounds"):
                continue
            low, low_ok, _, _ = f.metadata["bounds"]
            bad = low - 1 if low_ok else low
            bad = int(bad) if float(bad).is_integer() else bad
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = type(default)([bad] * max(1, len(default))) if isinstance(default, (list, tuple)) else bad
            with pytest.raises(RecurformerError, match=rf"{f.name}'? must .*, got {bad!r}$"):
                cls(**{f.name: value})


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: TrainConfig(steps=0), "config key 'train.steps' must be >= 1, got 0"),
        (lambda: TrainConfig(beta2=1.0), "config key 'train.beta2' must be in [0, 1), got 1.0"),
        (lambda: SynthConfig(truncation=-1), "synth key 'truncation' must be >= 0 (0: the whole row), got -1"),
        (lambda: SynthConfig(warmup=1.0), "synth key 'warmup' must be in [0, 1) (a fraction of the steps), got 1.0"),
        (lambda: SynthConfig(lrs=[1e-3, 0.0]), "synth key 'lrs' must be > 0, got 0.0"),
        (lambda: SynthConfig(lrs=[]), "synth key 'lrs' is empty: give one or more learning rates (e.g. [1e-3])"),
        (lambda: SynthConfig(eval_memory_gb=float("nan")), "synth key 'eval_memory_gb' must be > 0, got nan"),
        (lambda: DataConfig(vocab_size=100), "config key 'data.vocab_size' must be in [258, 1048576], got 100"),
        (lambda: make_config("sliding_window", {"window": 0}), "config key 'window' must be >= 1, got 0"),
        (lambda: make_config("transformer_xl", {"mem_len": -1}), "config key 'mem_len' must be >= 0, got -1"),
        (lambda: make_config("llama", {"n_heads": 0}), "config key 'n_heads' must be > 0, got 0"),
        (lambda: GenerateOptions(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (lambda: LengthOptions(lengths=[256, 0]), "lengths must be >= 1, got 0"),
    ],
)
def test_a_declared_range_names_its_key_as_its_section_does(build, message) -> None:
    with pytest.raises(RecurformerError, match=f"^{re.escape(message)}$"):
        build()


def test_a_byte_tokenizer_reads_no_vocab_size_and_numpy_numbers_are_numbers() -> None:
    """``data.vocab_size`` is checked only for a BPE tokenizer; numpy scalars pass a range as the
    Python numbers they equal."""
    assert DataConfig(tokenizer="byte", vocab_size=100).vocab_size == 100
    assert TrainConfig(steps=np.int64(5), lr=np.float32(0.5)).steps == 5
    assert make_options(GenerateOptions, {"top_k": np.int64(5), "top_p": np.float64(0.9)}).top_k == 5
