"""The run header and the logger sinks (TensorBoard, wandb, offline), and ``synth``'s progress."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_config

import recurformer
from recurformer.cli import main as cli_main


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
    from recurformer.synth.config import SynthConfig
    from recurformer.synth.run import run_synth

    cfg = SynthConfig(steps=3, batch_size=8, n_train=16, n_val=8, n_test=8, lrs=[1e-3])
    run_synth("in_context_recall", "llama", {"dim": 16, "n_heads": 2}, {"seq_len": 16}, cfg, progress=True)
    assert re.search(r"^  lr 0\.001: 3/3 steps, ", capsys.readouterr().err, re.M)  # not a terminal: a line
    run_synth("in_context_recall", "llama", {"dim": 16, "n_heads": 2}, {"seq_len": 16}, cfg)
    assert capsys.readouterr().err == ""
