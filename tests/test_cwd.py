"""The suite's results do not depend on the directory pytest starts in: a user who ran the README's
commands there (``runs/tinystories-cpu-block_recurrent`` and the other run folders, prepared data)
gets the same passes as in a clean directory (issue 63: conftest's ``_own_cwd``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from recurformer.models import model_names

# tests that train or check a run folder named by a bundled config, or write in the working directory
TOUCHING_RUN_FOLDERS = [
    "tests/test_first_day.py::test_a_block_longer_than_the_segment_names_the_key",  # the reported one
    "tests/test_first_day.py::test_readme_own_data_commands_run",  # runs/mine, runs/notes, runs/notes-rmt
    "tests/test_first_day.py::test_train_reads_a_jsonl_text_field_as_prepare_does",  # prepared/text-...
    "tests/test_options.py::test_python_train_bad_lr_is_a_recurformer_error",  # runs/tinystories-cpu
]


def readme_leftovers(where: Path) -> None:
    """What the README's commands leave in ``where``: a run folder (a run stopped before its first
    checkpoint) for every bundled config's ``out_dir`` and every model's, and data directories."""
    runs = ["tinystories-cpu", "tinystories-rmt", "memory-attention-paper", "mine", "notes", "notes-rmt", "api-tour"]
    runs += [f"tinystories-cpu-{name}" for name in model_names()]
    for name in runs:
        (where / "runs" / name).mkdir(parents=True)
        (where / "runs" / name / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    for data in ("prepared/tinystories-sample-bpe4096", "prepared/notes", "data"):
        (where / data).mkdir(parents=True)
        (where / data / "meta.json").write_text("{}\n")


@pytest.fixture(scope="module")
def module_cwd() -> Path:
    """The working directory a module-scoped fixture is set up in (before any test's own)."""
    return Path.cwd()


def test_each_test_runs_in_its_own_tmp_path(tmp_path: Path) -> None:
    assert Path.cwd() == tmp_path


def test_a_module_fixture_runs_in_a_directory_of_the_session(module_cwd, tmp_path_factory) -> None:
    assert module_cwd.parent == tmp_path_factory.getbasetemp()


@pytest.mark.slow
def test_a_users_run_folders_change_no_result(tmp_path: Path) -> None:
    """The reported test and others that touch run folders, run by pytest started in a directory
    holding every README leftover: they pass, and the leftovers are left as they were."""
    user = tmp_path / "user"
    readme_leftovers(user)
    before = {p: p.read_bytes() if p.is_file() else None for p in user.rglob("*")}
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ids = [str(ROOT / t) for t in TOUCHING_RUN_FOLDERS]
    # its own --basetemp: pytest's default one is shared with (and pruned under) this session
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "basetemp"), *ids]
    done = subprocess.run(argv, cwd=user, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"{len(ids)} passed" in done.stdout, done.stdout[-3000:]
    assert {p: p.read_bytes() if p.is_file() else None for p in user.rglob("*")} == before  # left as it was
