"""``train.cuda_graphs``: the trainer's training calls through captured steps (``capture.StepGraphs``)
and its optimizer step captured (``tbptt.CapturedUpdate``).
Without a GPU the wiring runs with the ``eager`` and ``trace`` backends: over several steps with
gradient accumulation 2 and rows whose streams wrap (a reset), the trainer through captured steps
equals the plain trainer (losses, weights, the carried state); a call that cannot be captured or a
capture that fails is one line and the step runs eager; on the CPU the flag is a one-line error
before any work."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_config, write_corpus

from recurformer import RecurformerError
from recurformer.cli import main as cli_main
from recurformer.tbptt import CapturedUpdate
from recurformer.training.config import load_run_config
from recurformer.training.trainer import Trainer

WORDS = "the a cat dog ran sat on mat big small red blue".split()
STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """So small that each of 3 streams wraps within the test's steps (a reset of its row)."""
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))) + "." for _ in range(24)]
    path = d / "corpus.txt"
    path.write_text("<|endoftext|>".join(docs))
    return path


def trainer(corpus: Path, tmp: Path, model: str = "memory_attention", **train: object) -> Trainer:
    over = [
        f"model.name={model}",
        "model.dim=32",
        "model.n_layers=2",
        "model.n_heads=2",
        *(["model.chunk_size=8"] if model == "memory_attention" else []),
        "data.dataset=null",
        f"data.text_files=[{corpus}]",
        "data.tokenizer=byte",
        f"data.dir={tmp.parent / 'prepared'}",
        f"train.out_dir={tmp / 'run'}",
        "train.batch_size=3",
        "train.seq_len=32",
        f"train.steps={STEPS}",
        "train.warmup=2",
        "train.precision=fp32",
        "train.grad_accum=2",
        "train.loggers=[]",
        "train.device=cpu",
    ]
    over += [f"train.{k}={v}" for k, v in train.items()]
    return Trainer(load_run_config(None, over), show_progress=False)


def run(tr: Trainer) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every step's loss; the weights and the carried state after the last; every step's
    accumulated gradients, before clipping and the update (so a wrong scale shows)."""
    grads: dict[str, torch.Tensor] = {}
    finish, steps = tr.update.finish, iter(range(STEPS))

    def record() -> None:
        step = next(steps)
        grads.update({f"{step}.{n}": p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})
        finish()

    tr.update.finish = record  # type: ignore[method-assign]
    losses = [tr.train_step() for _ in range(STEPS)]
    assert tr.state is not None
    return losses, {k: v.clone() for k, v in tr.model.state_dict().items()}, tr.state.to_flat(), grads


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The plain trainer's run (``run``), which the captured ones are held to, once per module."""
    tr = trainer(corpus, tmp_path_factory.mktemp("plain") / "plain")
    wrapped = []
    read = tr.streams.next_batch
    tr.streams.next_batch = lambda: (b := read(), wrapped.append(bool(b.wrapped.any())))[0]  # type: ignore[method-assign]
    expect = run(tr)
    assert any(wrapped[1:]), "the corpus must be so small that a stream wraps (a reset)"
    return expect


@pytest.mark.parametrize("backend", ["eager", "trace"])
def test_captured_steps_equal_the_plain_trainer(corpus, tmp_path, plain, backend) -> None:
    expect = plain
    tr = trainer(corpus, tmp_path / backend)
    tr.capture_steps(backend)
    assert tr.graphs is not None
    got = run(tr)
    assert len(tr.graphs.graphs) >= 1  # the steps went through captured calls
    assert isinstance(tr.update, CapturedUpdate) and tr.update.replay is not None  # and the optimizer's step
    exact = backend == "eager"
    assert got[0] == expect[0] if exact else got[0] == pytest.approx(expect[0], rel=1e-5)
    assert_same(got[1], expect[1], exact)
    assert_same(got[2], expect[2], exact)
    assert_same(got[3], expect[3], exact)


def test_a_failed_capture_is_one_line_and_training_goes_on_eager(corpus, tmp_path, plain, capsys, monkeypatch) -> None:
    expect = plain
    tr = trainer(corpus, tmp_path / "fails")
    tr.capture_steps("eager")
    assert tr.graphs is not None

    def oom(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(tr.graphs, "capture", oom)
    capsys.readouterr()
    got = run(tr)
    assert tr.graphs is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA out of memory. Tried to allocate 2.00 GiB" in err[0] and "eager" in err[0], err
    assert got[0] == expect[0]
    assert_same(got[1], expect[1], exact=True)


def test_truncation_over_several_calls_runs_eager_with_one_line(corpus, tmp_path, capsys) -> None:
    expect = run(trainer(corpus, tmp_path / "plain", truncation=2))
    tr = trainer(corpus, tmp_path / "graphs", truncation=2)
    tr.capture_steps("eager")
    assert tr.graphs is not None
    capsys.readouterr()
    got = run(tr)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncation 2" in err[0] and "eager" in err[0], err
    assert not tr.graphs.graphs and got[0] == expect[0]


def test_cuda_graphs_on_the_cpu_is_one_line_before_any_work(corpus, tmp_path) -> None:
    with pytest.raises(RecurformerError) as e:
        trainer(corpus, tmp_path / "cpu", cuda_graphs="true")
    msg = str(e.value)
    assert "\n" not in msg and "train.cuda_graphs" in msg and "cpu" in msg, msg
    assert not (tmp_path / "cpu").exists() and not (tmp_path / "prepared").exists()


def test_a_carried_state_of_position_reading_layers_trains_eager_with_one_line(corpus, tmp_path, capsys) -> None:
    """RoPE over a carried cache (the sliding window) would need a graph per step: not captured."""
    tr = trainer(corpus, tmp_path / "window", model="sliding_window")
    capsys.readouterr()
    tr.capture_steps("eager")
    err = capsys.readouterr().err.strip().splitlines()
    assert tr.graphs is None and len(err) == 1 and "sliding_window reads absolute positions" in err[0], err


def test_train_cuda_graphs_flag_is_the_config_key(tmp_path, capsys) -> None:
    """``train --cuda-graphs`` (as ``eval`` and ``generate`` have it) sets train.cuda_graphs=true:
    on the CPU it gives the config key's one line, before any work."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(write_corpus(tmp_path / "corpus.txt"), tmp_path)))
    lines = []
    for switch in (["--cuda-graphs"], ["--set", "train.cuda_graphs=true"]):
        assert cli_main(["train", "--config", str(config), "--device", "cpu", *switch]) == 2
        lines.append(capsys.readouterr().err)
    assert lines[0] == lines[1] and lines[0].count("\n") == 1, lines
    assert lines[0] == (
        "recurformer: error: train.cuda_graphs needs one process on a CUDA GPU; this run trains on cpu "
        "(train without captured steps: --set train.cuda_graphs=False)\n"
    )
    assert not (tmp_path / "run").exists() and not (tmp_path / "prepared").exists()
