"""The package as a user installs it: the version and ``python -m``, the bundled configs by name (from a
clone and from a built wheel), the study configs by name from a clone only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest
import tomllib

import recurformer
from recurformer import RecurformerError
from recurformer.cli import main as cli_main
from recurformer.config import bundled_configs, load_yaml, study_configs
from recurformer.training.config import load_run_config

ROOT = Path(__file__).resolve().parent.parent


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"recurformer {recurformer.__version__}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]  # one source: recurformer.__version__
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "recurformer.__version__"}


def test_api_functions_keep_the_names_of_their_modules() -> None:
    """``recurformer.train``/``evaluate``/``probe`` are the API functions, also after the modules
    are imported (``recurformer.training``, ``recurformer.evaluate``), and ``from
    recurformer.evaluate.lengths import evaluate_lengths`` still reads the module (in a fresh interpreter,
    so that no earlier import hides an order problem)."""
    code = (
        "import recurformer, recurformer.api as api\n"
        "from recurformer.training.trainer import Trainer\nfrom recurformer.evaluate.lengths import evaluate_lengths\n"
        "from recurformer.probe.measure import probe_model\nimport recurformer.cli\n"
        "assert (recurformer.train, recurformer.evaluate, recurformer.probe) == (api.train, api.evaluate, api.probe)\n"
        "assert Trainer.__module__ == 'recurformer.training.trainer'\nprint('ok')\n"
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


def test_study_configs_load_by_name_from_a_clone_and_are_not_package_data(tmp_path, monkeypatch) -> None:
    """The one-study configs live in experiments/memory/configs/, outside the package, and in a
    clone load by name from any directory, as the results pages' commands give them."""
    studies = study_configs()
    home = ROOT / "experiments" / "memory" / "configs"
    assert {"memory/passkey-gated-deltanet-closed", "memory/mqar-selfpaced-mixed", "memory/mqar-fixed"} <= set(studies)
    assert sorted(studies.values()) == sorted(home.glob("*.yaml")) and not set(studies) & set(bundled_configs())
    monkeypatch.chdir(tmp_path)  # not the clone's root: the name is found beside the package
    assert load_yaml("memory/passkey-rmt-mixed") == load_yaml(home / "passkey-rmt-mixed.yaml")
    assert load_yaml("memory/mqar-fixed.yaml") == load_yaml(home / "mqar-fixed.yaml")
    with pytest.raises(
        RecurformerError, match=r"did you mean 'memory/passkey-rmt-mixed'.*bundled configs: .*repro/base"
    ):
        load_yaml("memory/passkey-rmt-mix")


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
    shipped = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("recurformer/configs/")]
    general = ["memory-attention-paper", "repro/base", "tinystories-cpu", "tinystories-rmt"]
    assert sorted(shipped) == [f"recurformer/configs/{n}.yaml" for n in general]  # no study's configs
    code = (
        "import recurformer; from recurformer.config import load_yaml; from recurformer.training.config import load_run_config; "
        "print(recurformer.__file__); print(load_run_config('tinystories-cpu').model['name'], load_yaml('memory-attention-paper')['model']['name'])\n"
        "from recurformer.config import study_configs; print(study_configs())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(wheel)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        str(wheel / "recurformer" / "__init__.py"),
        "memory_attention memory_attention",
        "{}",
    ]


def test_configs_path_in_a_clone_is_the_same_files() -> None:
    assert (ROOT / "configs").resolve() == (ROOT / "recurformer" / "configs").resolve()
