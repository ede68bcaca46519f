"""Every test starts from the same seeds, in an empty working directory of its own (its ``tmp_path``:
nothing a user keeps where pytest starts, such as the README's ``runs/`` and ``data/``, changes a
result, and no test writes there); ``offline`` keeps the tests of the optional integrations
(transformers, lm-eval, datasets) off the network: no Hub access (``HF_HUB_OFFLINE``,
``HF_DATASETS_OFFLINE``), ``HF_HOME`` in a temporary directory, and any socket connection fails."""

import os
import random
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: see recurformer/__init__.py

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import tiny_config, write_corpus  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory) -> None:
    """The cached matmul peak (flops.reference_peak) of a test session stays out of the user's cache."""
    os.environ["RECURFORMER_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True, scope="session")
def _session_cwd(tmp_path_factory) -> Iterator[None]:
    """Session- and module-scoped fixtures, set up before any test's own directory, run in an empty
    directory too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("cwd"))
        yield


@pytest.fixture(autouse=True)
def _own_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in its ``tmp_path``: relative paths (the default ``runs/...``) land there."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def offline(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    # the libraries read these at import: where one is imported already, set them where they are kept
    if (hub := sys.modules.get("huggingface_hub.constants")) is not None:
        for key, value in (("HF_HUB_OFFLINE", True), ("HF_HOME", str(home)), ("HF_HUB_CACHE", str(home / "hub"))):
            monkeypatch.setattr(hub, key, value)
    if (ds := sys.modules.get("datasets.config")) is not None:
        for key, value in (
            ("HF_DATASETS_OFFLINE", True),
            ("HF_HUB_OFFLINE", True),
            ("HF_CACHE_HOME", str(home)),
            ("HF_DATASETS_CACHE", home / "datasets"),
        ):
            monkeypatch.setattr(ds, key, value)

    def refuse(self, address, *args):  # type: ignore[no-untyped-def]
        raise AssertionError(f"a test tried to open a network connection to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield tmp_path


# a tiny trained run on a random-word corpus: any test module may take them (or define its own ``corpus``)
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):  # type: ignore[no-untyped-def]
    import recurformer  # here, not at collection: some tests watch what importing recurformer does

    tmp = tmp_path_factory.mktemp("api")
    return recurformer.train(tiny_config(corpus, tmp), progress=False)
