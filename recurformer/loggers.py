"""Training logs: the run header, and metric sinks beside ``metrics.jsonl`` (always written).

``train.loggers`` lists the sinks: ``tensorboard`` (the default; skipped with a note in the
header when TensorBoard is not installed) and ``wandb`` (Weights & Biases; an error when the
``wandb`` package is missing; ``WANDB_MODE=offline`` logs without a network, ``WANDB_PROJECT``
names the project, default ``recurformer``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch

LOGGERS = ("tensorboard", "wandb")


class Sink(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line in ``run_dir/metrics.jsonl`` (appended, so resumes continue it)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"

    def log(self, record: dict[str, Any], step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars in ``run_dir/tensorboard`` (``tensorboard --logdir runs``)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any], step: int) -> None:
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run named after the run directory, with the run config."""

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "recurformer"), name=run_dir.name, config=config, dir=str(run_dir)
        )

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()


def make_sinks(names: list[str], run_dir: Path, config: dict[str, Any]) -> tuple[list[Sink], list[str]]:
    """The sinks for ``train.loggers`` (``metrics.jsonl`` first), and notes for the run header."""
    from .config import RecurformerError

    for name in names:  # every check before the first sink opens
        if name not in LOGGERS:
            raise RecurformerError(f"unknown logger '{name}' in train.loggers; valid: {', '.join(LOGGERS)}")
        if name == "wandb":
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise RecurformerError(
                    "train.loggers asks for wandb, but it is not installed (pip install wandb)"
                ) from None
    sinks: list[Sink] = [JsonlSink(run_dir)]
    notes = [f"metrics: {run_dir / 'metrics.jsonl'}"]
    for name in names:
        if name == "tensorboard":
            try:
                sinks.append(TensorBoardSink(run_dir))
                notes.append(f"tensorboard: {run_dir / 'tensorboard'}")
            except ImportError:
                notes.append("tensorboard: not installed (pip install tensorboard), skipped")
        else:
            sink = WandbSink(run_dir, config)
            sinks.append(sink)
            notes.append(f"wandb: project {sink.run.project}, mode {os.environ.get('WANDB_MODE', 'online')}")
    return sinks, notes


def run_header(trainer: Any, notes: list[str]) -> list[str]:
    """What a run is about to do, in a few lines: device, precision, threads, parameters, tokens
    per step, data, where checkpoints and logs go."""
    from .device import resolve_precision, slow_bf16_warning
    from .flops import matmul_peak

    t = trainer.cfg.train
    precision = t.precision
    if precision == "auto":
        precision = f"auto -> {'bf16 autocast' if resolve_precision('auto', trainer.device) == 'bf16' else 'fp32'}"
    device = str(trainer.device)
    if trainer.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(trainer.device)})"
    n = trainer.model.num_params()
    per_step = t.grad_accum * t.batch_size * t.seq_len * trainer.world
    data = trainer.cfg.data
    source = data.dataset or ", ".join(data.text_files) or trainer.meta.get("source", "prepared data")  # data.dir alone
    lines = [
        f"model: {trainer.cfg.model['name']}, {n:,} parameters ({n / 1e6:.2f}M)",
        f"device: {device} x {trainer.world} rank(s), precision {precision}, {torch.get_num_threads()} threads per rank",
        f"tokens per step: {per_step:,} ({t.grad_accum} x {t.batch_size} streams x {t.seq_len} tokens x {trainer.world} ranks), "
        f"{t.steps:,} steps = {per_step * t.steps:,} tokens; state {t.state}, data {t.data_order}",
        f"data: {source} ({trainer.meta.get('tokenizer', data.tokenizer)}, vocabulary {trainer.meta['vocab_size']:,}) "
        f"from {trainer.data_dir}, "
        f"{trainer.meta['train_tokens']:,} train tokens",
        f"checkpoints: {trainer.out_dir}/step_XXXXXX every {t.save_every} steps (keeping the last {t.keep_last})",
        f"speed: {trainer.flops_per_token / 1e6:,.1f} MFLOP per training token (counted, flops.py); mfu = mean tokens/s x "
        f"FLOP per token / the matmul peak, {trainer.peak_flops / 1e9:,.0f} GFLOP/s {trainer.peak_source}",
        *notes,
    ]
    warning = slow_bf16_warning(t.precision, trainer.device)
    if warning:
        fp32 = matmul_peak(torch.float32, str(trainer.device), seconds=0.2)
        lines.append(
            f"{warning} (matmul peaks: bf16 {trainer.peak_flops / 1e9:,.1f} GFLOP/s, the mfu reference; fp32 "
            f"{fp32 / 1e9:,.1f} GFLOP/s measured now)"
        )
    return lines
