"""The package as a user meets it: version and ``python -m``, bundled configs by name, the Python
API against the CLI, Hub-layout save/load (offline), the run header and logger sinks, the plots'
labels (read back from the figure objects), ``info``'s state size, lower-case prompts, ``synth``
progress, and the README's example."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import types
from importlib import resources
from pathlib import Path

import pytest
import tomllib
import torch
import yaml

import recurformer
from recurformer import RecurformerError, build_model
from recurformer.cli import main as cli_main
from recurformer.config import bundled_configs, load_yaml
from recurformer.data import Tokenizer
from recurformer.train import load_run_config

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the a cat dog ran sat on mat big small red blue happy sad tree house went saw".split()
MODEL = {"name": "memory_attention", "dim": 32, "n_layers": 2, "n_heads": 2, "chunk_size": 8}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + "." for _ in range(300)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("<|endoftext|>".join(docs))
    return path


def tiny_config(corpus: Path, tmp: Path, tokenizer: str = "byte") -> dict:
    return {
        "model": dict(MODEL),
        "data": {
            "dataset": None,
            "text_files": [str(corpus)],
            "tokenizer": tokenizer,
            "vocab_size": 300,
            "dir": str(tmp / "prepared"),
        },
        "train": {
            "out_dir": str(tmp / "run"),
            "batch_size": 3,
            "seq_len": 32,
            "steps": 4,
            "warmup": 2,
            "precision": "fp32",
            "eval_every": 2,
            "eval_batches": 2,
            "save_every": 2,
            "log_every": 1,
            "loggers": [],
        },
    }


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory) -> recurformer.Run:
    tmp = tmp_path_factory.mktemp("api")
    return recurformer.train(tiny_config(corpus, tmp), progress=False)


# -- version, python -m ---------------------------------------------------------------------------


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"recurformer {recurformer.__version__}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]  # one source: recurformer.__version__
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "recurformer.__version__"}


def test_api_functions_keep_the_names_of_their_modules() -> None:
    """``recurformer.train``/``evaluate``/``probe`` are the API functions, also after their modules
    are imported, and ``from recurformer.train import Trainer`` still reads the module (in a fresh
    interpreter, so that no earlier import hides an order problem)."""
    code = (
        "import recurformer, recurformer.api as api\n"
        "from recurformer.train import Trainer\nfrom recurformer.evaluate import evaluate_lengths\n"
        "from recurformer.probe import probe_model\nimport recurformer.cli\n"
        "assert (recurformer.train, recurformer.evaluate, recurformer.probe) == (api.train, api.evaluate, api.probe)\n"
        "assert Trainer.__module__ == 'recurformer.train'\nprint('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_python_dash_m() -> None:
    out = subprocess.run([sys.executable, "-m", "recurformer", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == f"recurformer {recurformer.__version__}"
    out = subprocess.run([sys.executable, "-m", "recurformer", "train"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.startswith("recurformer: error: give --config")


# -- bundled configs ------------------------------------------------------------------------------


def test_configs_are_package_data_and_load_by_name(tmp_path, monkeypatch) -> None:
    names = bundled_configs()
    assert {"tinystories-cpu", "memory-attention-paper", "repro/base"} <= set(names)
    # every bundled YAML is matched by the package-data globs, so the wheel ships it
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["recurformer"]
    root = Path(str(resources.files("recurformer"))) / "configs"
    for name in names:
        assert any((root / f"{name}.yaml").relative_to(root.parent).match(g) for g in globs), name
    monkeypatch.chdir(tmp_path)  # no configs/ here: the name is found inside the package
    cfg = load_run_config("tinystories-cpu", ["train.steps=7"])
    assert cfg.model["name"] == "memory_attention" and cfg.train.steps == 7 and cfg.data.dataset == "tinystories-sample"
    assert load_yaml("repro/base.yaml") == load_yaml(root / "repro" / "base.yaml")
    (tmp_path / "tinystories-cpu").mkdir()  # a directory of that name is not a config file: the bundled one is used
    assert load_yaml("tinystories-cpu")["model"]["name"] == "memory_attention"
    with pytest.raises(RecurformerError, match=r"config file not found: nope \(bundled configs: .*tinystories-cpu"):
        load_yaml("nope")


@pytest.mark.slow
def test_configs_load_by_name_from_a_built_wheel(tmp_path) -> None:
    """Build the wheel (pip, as a user would) and import the package from it, not from the source
    tree: the bundled configs travel inside it and load by name from any directory."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "recurformer", src / "recurformer", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("recurformer-*.whl")
    code = (
        "import recurformer; from recurformer.config import load_yaml; from recurformer.train import load_run_config; "
        "print(recurformer.__file__); print(load_run_config('tinystories-cpu').model['name'], load_yaml('memory-attention-paper')['model']['name'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(wheel)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(wheel / "recurformer" / "__init__.py"), "memory_attention memory_attention"]


def test_configs_path_in_a_clone_is_the_same_files() -> None:
    assert (ROOT / "configs").resolve() == (ROOT / "recurformer" / "configs").resolve()


# -- Python API against the CLI -------------------------------------------------------------------


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
    a = recurformer.train(cfg, progress=False, train={"steps": 2}, **{"model.dim": 16})
    assert a.metrics["step"] == 2 and a.model.config.dim == 16
    b = recurformer.train(resume=a.dir, progress=False, **{"train.steps": 4})
    assert b.metrics["step"] == 4 and b.model.config.dim == 16 and b.dir == a.dir
    with pytest.raises(RecurformerError, match="unknown config key 'train.stepz'"):
        recurformer.train(cfg, progress=False, train={"stepz": 2})


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


# -- Hub layout -----------------------------------------------------------------------------------


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


# -- logging --------------------------------------------------------------------------------------


def test_run_header(corpus, tmp_path, capsys) -> None:
    cfg = tiny_config(corpus, tmp_path)
    cfg["train"]["grad_accum"] = 2
    recurformer.train(cfg, progress=True)
    out = capsys.readouterr().out
    head = out[: out.index("step 2: val loss")]
    assert "model: memory_attention, " in head and " parameters (" in head
    assert re.search(r"device: cpu x 1 rank\(s\), precision fp32, \d+ threads per rank", head)
    assert "tokens per step: 192 (2 x 3 streams x 32 tokens x 1 ranks), 4 steps = 768 tokens; state carry" in head
    assert f"data: {corpus} (byte, vocabulary 258) from {tmp_path / 'prepared'}" in head
    assert f"checkpoints: {tmp_path / 'run'}/step_XXXXXX every 2 steps (keeping the last 3)" in head
    assert f"metrics: {tmp_path / 'run' / 'metrics.jsonl'}" in head
    assert re.search(
        r"the matmul peak, [\d,]+ GFLOP/s (measured now and cached|cached) in \S+matmul_peak.json for ", head
    )


@pytest.mark.parametrize("has_bf16", [False, True])
def test_run_header_warns_of_emulated_bf16(corpus, tmp_path, capsys, monkeypatch, has_bf16) -> None:
    """bf16 asked for by name on a CPU without bf16 matmuls (emulated, ~30x slower than fp32 on an
    AVX2 core) is said in the header, with both peaks; where the CPU has it, or with auto, nothing."""
    import recurformer.device

    monkeypatch.setattr(recurformer.device, "cpu_has_bf16", lambda: has_bf16)
    cfg = tiny_config(corpus, tmp_path)
    cfg["train"].update(precision="bf16", steps=1)
    recurformer.train(cfg, progress=False)  # no header printed, the warning still is
    warned = [line for line in capsys.readouterr().err.splitlines() if "bf16 asked for" in line]
    if has_bf16:
        assert warned == []
    else:
        assert (
            len(warned) == 1
            and "this CPU has no avx512_bf16/AMX" in warned[0]
            and "precision auto picks fp32" in warned[0]
        )
        assert re.search(
            r"matmul peaks: bf16 [\d.,]+ GFLOP/s, the mfu reference; fp32 [\d.,]+ GFLOP/s measured now\)$", warned[0]
        )
    assert recurformer.device.slow_bf16_warning("auto", torch.device("cpu")) is None
    assert recurformer.device.slow_bf16_warning("fp32", torch.device("cpu")) is None


def test_tensorboard_scalars_match_metrics(corpus, tmp_path) -> None:
    pytest.importorskip("tensorboard")  # in the test extras
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(corpus, tmp_path)
    cfg["train"]["loggers"] = ["tensorboard"]
    run = recurformer.train(cfg, progress=False)
    acc = EventAccumulator(str(run.dir / "tensorboard"))
    acc.Reload()
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "val_loss"):
        want = [(r["step"], r[key]) for r in rows if key in r]
        assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars(key)] == want


def test_missing_tensorboard_is_noted_and_missing_wandb_is_an_error(corpus, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # "not installed"
    cfg = tiny_config(corpus, tmp_path)
    argv = ["train", "--config", _yaml(cfg, tmp_path), "--set", f"train.out_dir={tmp_path / 'nolog'}"]
    assert cli_main(argv + ["--set", "train.loggers=[tensorboard,wandb]"]) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after the data preparation's progress bars
    assert last_line == "recurformer: error: train.loggers asks for wandb, but it is not installed (pip install wandb)"
    assert not (tmp_path / "nolog" / "tensorboard").exists()  # no sink opened before the error
    assert cli_main(argv + ["--set", "train.loggers=[mlflow]"]) == 2
    assert "unknown logger 'mlflow'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg["train"]["loggers"] = ["tensorboard"]
    recurformer.train(cfg, progress=True, train={"steps": 1})
    assert "tensorboard: not installed (pip install tensorboard), skipped" in capsys.readouterr().out


def _yaml(cfg: dict, tmp: Path) -> str:
    import yaml

    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_wandb_logger_with_a_fake_module(corpus, tmp_path, monkeypatch) -> None:
    calls: dict = {"log": []}

    class FakeRun:
        project = "recurformer"

        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finished"] = True

    def init(project, name, config, dir):
        calls.update(project=project, name=name, config=config, dir=dir)
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = tiny_config(corpus, tmp_path)
    cfg["train"]["loggers"] = ["wandb"]
    run = recurformer.train(cfg, progress=False)
    assert calls["name"] == "run" and calls["dir"] == str(run.dir) and calls["config"]["model"]["chunk_size"] == 8
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert calls["log"] == [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in rows]
    assert calls["finished"]


def test_wandb_offline(corpus, tmp_path, monkeypatch) -> None:
    """The real package in offline mode (runs where ``wandb`` is installed; it is not a dependency)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_config(corpus, tmp_path)
    cfg["train"]["loggers"] = ["wandb"]
    run = recurformer.train(cfg, progress=False)
    (offline,) = (run.dir / "wandb").glob("offline-run-*")
    assert any(offline.glob("*.wandb"))


def test_synth_shows_progress(capsys) -> None:
    from recurformer.synth import SynthConfig, run_synth

    cfg = SynthConfig(steps=3, batch_size=8, n_train=16, n_val=8, n_test=8, lrs=[1e-3])
    run_synth("in_context_recall", "llama", {"dim": 16, "n_heads": 2}, {"seq_len": 16}, cfg, progress=True)
    assert re.search(r"lr 0\.001: .*/3 \[", capsys.readouterr().err)  # a bar over the 3 steps of lr 1e-3
    run_synth("in_context_recall", "llama", {"dim": 16, "n_heads": 2}, {"seq_len": 16}, cfg)
    assert capsys.readouterr().err == ""


# -- plots ----------------------------------------------------------------------------------------


def _results(*lengths: int):
    from recurformer.evaluate import LengthResult

    return [
        LengthResult(L, 3.0 - 0.1 * i, 2.9 - 0.1 * i, 3.1 - 0.1 * i, 0.3, 100, 4, 4, "windows", 1000.0, 10.0)
        for i, L in enumerate(lengths)
    ]


def test_eval_plot_labels_follow_last_and_training_lengths() -> None:
    import matplotlib.pyplot as plt

    from recurformer.evaluate import figure

    fig = figure({"a": _results(128, 512), "b": _results(128, 512)}, "t", last=128, trained={"a": 256, "b": 1024})
    ax = fig.axes[0]
    assert ax.get_ylabel() == "loss on the last 128 tokens (95% interval)"
    assert ax.get_xlabel() == "sequence length L (trained at: a 256, b 1024)"
    plt.close(fig)
    fig = figure({"a": _results(256)}, "t", last=64, trained={"a": 512})
    assert (
        fig.axes[0].get_xlabel() == "sequence length L (trained at 512)"
        and fig.axes[0].get_ylabel() == "loss on the last 64 tokens (95% interval)"
    )
    plt.close(fig)
    fig = figure({"a": _results(256)}, "t", last=64)
    assert fig.axes[0].get_xlabel() == "sequence length L"
    plt.close(fig)


def test_generation_plot_starts_memory_at_zero_and_has_a_title() -> None:
    import matplotlib.pyplot as plt

    from benchmarks.generation import figure

    marks = [{"tokens": n, "mem_mb": 400 + n / 100, "tok_per_s": 500.0} for n in (1024, 8192)]
    fig = figure({"llama": {"marks": marks}, "memory_attention": {"marks": marks}})
    memory, speed = fig.axes
    assert memory.get_ylim()[0] == 0 and speed.get_ylim()[0] == 0 and memory.get_ylabel().startswith("memory (MB)")
    assert fig._suptitle is not None and fig._suptitle.get_text().startswith("Streaming generation")
    plt.close(fig)


def test_synthetic_grid_has_one_legend_titled_panels_and_visible_markers() -> None:
    import matplotlib.pyplot as plt

    from benchmarks.synthetic import figure

    results = [
        {"task": t, "model": m, "accuracy": 0.5, "by_length": {"16": 1.0, "64": 1.0} if t == "passkey" else {}}
        for t in ("passkey", "in_context_recall")
        for m in ("llama", "memory_attention", "transformer_xl")
    ]
    fig = figure(results)
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["llama", "memory_attention", "transformer_xl"]
    assert all(ax.get_title() for ax in fig.axes) and len(fig.axes) == 2
    lines = fig.axes[1].get_lines()
    assert len({ln.get_marker() for ln in lines}) == 3  # equal values still show three distinct hollow markers
    assert all(ln.get_markerfacecolor() == "none" and ln.get_markersize() >= 6 for ln in lines)
    plt.close(fig)


def test_step_profile_reads_matmul_dims_from_recorded_shapes() -> None:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.step_profile import MATMULS, matmul_dims

    lin = torch.nn.Linear(5, 7)
    a, b = torch.randn(3, 4, 6), torch.randn(3, 6, 2)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        lin(torch.randn(11, 5))  # addmm: bias, x, W^T
        lin.weight.t() @ torch.randn(7, 9)  # mm
        torch.bmm(a, b)
    dims = {
        ev.key: matmul_dims(ev.key, ev.input_shapes)
        for ev in prof.key_averages(group_by_input_shape=True)
        if ev.key in MATMULS
    }
    assert dims == {"aten::addmm": (1, 11, 5, 7), "aten::mm": (1, 5, 7, 9), "aten::bmm": (3, 4, 6, 2)}


# -- info, lower-case prompts, README ------------------------------------------------------------


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


def ckpt_steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in run.glob("step_*"))


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
        recurformer.generate.generate_text(run.dir, "the", max_new_tokens=2, save_state=tmp_path / "file" / "s")
