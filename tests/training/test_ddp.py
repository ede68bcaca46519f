"""torchrun + DDP on CPU (gloo, 2 processes): identical parameters on every rank, 2 ranks x B
equals 1 rank x 2B on the same streams, per-rank carried state, exact resume."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recurformer import RecurformerError
from recurformer.data import prepare
from recurformer.training.config import load_run_config
from recurformer.training.trainer import Trainer

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ddp")
    rng = random.Random(1)
    words = "a b c the dog cat sat ran on in big red".split()
    (d / "c.txt").write_text("<|endoftext|>".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(200)))
    prepare(d / "prep", text_files=[str(d / "c.txt")], tokenizer="byte")
    return d / "prep"


MA = ["model.name=memory_attention", "model.chunk_size=8"]


def overrides(data: Path, out: Path, batch: int, model: list[str] = MA) -> list[str]:
    return [
        *model,
        "model.dim=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "data.dataset=null",
        f"data.dir={data}",
        "data.tokenizer=byte",
        f"train.out_dir={out}",
        f"train.batch_size={batch}",
        "train.seq_len=16",
        "train.grad_accum=2",
        "train.precision=fp32",
        "train.warmup=1",
        "train.eval_every=1000",
        "train.save_every=1000",
    ]


def launch(
    n: int, out: Path, steps: int, data: Path, batch: int, resume: Path | None = None, model: list[str] = MA
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={n}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(HERE / "ddp_worker.py"),
        str(out),
        str(steps),
        str(resume or "-"),
        *overrides(data, out / "run", batch, model),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    run = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(n)]


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_double_batch(data_dir, tmp_path) -> None:
    two = launch(2, tmp_path / "two", 3, data_dir, batch=2)
    one = launch(1, tmp_path / "one", 3, data_dir, batch=4)[0]
    for k in two[0]["params"]:  # every rank holds the same parameters, bit for bit
        assert torch.equal(two[0]["params"][k], two[1]["params"][k]), k
        torch.testing.assert_close(two[0]["params"][k], one["params"][k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    # each rank carries its own state: rank r continues streams 2r, 2r+1 of the single-rank run
    for key, full in one["state"].items():
        if full.dim() == 0 or key == "fresh":
            continue
        torch.testing.assert_close(two[0]["state"][key], full[:2], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(two[1]["state"][key], full[2:], rtol=1e-4, atol=1e-5)
    mem = "layers.0.memory"
    assert not torch.allclose(two[0]["state"][mem], two[1]["state"][mem])


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [
        [
            "model.name=block_recurrent",
            "model.block_size=8",
            "model.recurrent_layers=[-1]",
        ],  # learned initial state vectors
        [*MA, "model.init_memory=learned"],
    ],
    ids=["block_recurrent", "memory_attention-learned-init"],
)
def test_learned_initial_states_train_under_ddp(data_dir, tmp_path, model) -> None:
    """A learned initial state enters only the calls that reset a row; DDP needs every parameter in
    every step's graph, or the third step fails waiting for a gradient that never comes."""
    two = launch(2, tmp_path / "two", 3, data_dir, batch=2, model=model)
    for k in two[0]["params"]:
        assert torch.equal(two[0]["params"][k], two[1]["params"][k]), k


@pytest.mark.slow
def test_two_rank_resume_is_exact(data_dir, tmp_path) -> None:
    full = launch(2, tmp_path / "full", 4, data_dir, batch=2)
    launch(2, tmp_path / "half", 2, data_dir, batch=2)
    resumed = launch(2, tmp_path / "half", 4, data_dir, batch=2, resume=tmp_path / "half" / "run")
    for r in range(2):
        for k in full[r]["params"]:
            assert torch.equal(full[r]["params"][k], resumed[r]["params"][k]), k
        for k in full[r]["state"]:
            assert torch.equal(full[r]["state"][k], resumed[r]["state"][k]), k
        assert full[r]["losses"][2:] == resumed[r]["losses"]
    # a 2-rank checkpoint cannot be resumed on 1 rank
    cfg = load_run_config(None, overrides(data_dir, tmp_path / "half" / "run", 2) + ["train.steps=5"])
    with pytest.raises(RecurformerError, match="written by 2 ranks"):
        Trainer(cfg, resume=str(tmp_path / "half" / "run"), show_progress=False)
