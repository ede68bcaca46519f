"""Every test starts from the same seeds; ``offline`` keeps the tests of the optional integrations
(transformers, lm-eval, datasets) off the network: no Hub access (``HF_HUB_OFFLINE``,
``HF_DATASETS_OFFLINE``), ``HF_HOME`` in a temporary directory, and any socket connection fails."""

import random
import socket
import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def offline(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    if "huggingface_hub" in sys.modules:  # read at import: set the flag where it is kept
        monkeypatch.setattr(sys.modules["huggingface_hub"].constants, "HF_HUB_OFFLINE", True)

    def refuse(self, address, *args):  # type: ignore[no-untyped-def]
        raise AssertionError(f"a test tried to open a network connection to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield tmp_path
