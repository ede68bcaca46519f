"""``recurformer train`` (``train_command``) and its Python form (``train_main``): a run config
resolved, a ``Trainer`` built and run, a run that fails before its first checkpoint taking its
own files with it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .. import checkpoint as ckpt
from ..config import RecurformerError, option, parse_overrides
from ..data import DataConfig
from ..device import cpu_threads, out_of_memory
from .config import resolve_run_config, training_sizes
from .signals import StopSignals
from .trainer import Trainer


def train_main(
    config: str | Path | dict[str, Any] | None,
    over: dict[str, Any],
    resume: str | None = None,
    overwrite: bool = False,
    show_progress: bool = True,
) -> tuple[Trainer, dict[str, Any]]:
    """Train (or ``resume``) a run to ``train.steps``; returns the trainer and its last metrics.
    SIGINT/SIGTERM are handled from the start: a signal while the run is set up stops it before
    its first step. A run that fails before its first checkpoint takes its own files with it
    (``checkpoint.discard_unsaved``), so a retry finds no run in the way; running out of memory is
    one line naming the sizes (``out_of_memory``). Errors name options with ``config.opt``."""
    cfg = resolve_run_config(config, over, resume)
    stop = StopSignals()
    with stop.installed(), out_of_memory(*training_sizes(cfg)):
        trainer = Trainer(cfg, resume=resume, show_progress=show_progress, overwrite=overwrite, stop=stop)
        finished = False
        try:
            last = trainer.run()
            finished = True
            return trainer, last
        finally:
            trainer.close_loggers()
            if not finished and trainer.rank == 0:
                ckpt.discard_unsaved(trainer.out_dir, trainer.existing)
            if trainer.world > 1 and dist.is_initialized():
                dist.destroy_process_group()


@dataclass
class TrainOptions:
    """``recurformer train`` (``train_command``): the config to train or the run to resume, and
    switches for config keys (``--set`` overrides any other)."""

    config: str | None = option(None, "YAML file with model/data/train sections (see configs/)")
    resume: str | None = option(
        None,
        "a run or checkpoint directory to continue exactly (written into that run directory unless "
        "--set train.out_dir=... is given)",
    )
    overwrite: bool = option(
        False,
        "replace the run in train.out_dir (or, with --resume of an older checkpoint, delete the run's later checkpoints)",
    )
    compile: bool = option(False, "torch.compile every layer (regional compilation; same as --set train.compile=true)")
    cuda_graphs: bool = option(
        False,
        "train through captured CUDA graphs, one per call shape, replayed every step (a CUDA GPU, one "
        "process; calls that cannot be captured run eagerly; same as --set train.cuda_graphs=true)",
    )
    device: str | None = option(
        None, "auto (CUDA when present; the default), cpu, cuda or cuda:N (same as --set train.device=...)"
    )
    text_field: str | None = option(
        None,
        "the field / column holding the text in JSONL, Parquet and datasets inputs of data.text_files, as for "
        f"prepare (same as --set data.text_field=...; default: {DataConfig.text_field})",
    )


def train_command(o: TrainOptions, sets: list[str]) -> dict[str, Any]:
    """``recurformer train``: ``train_main`` with the config overrides ``sets`` (``key=value``)
    and the switches of ``o`` after them; returns the last metrics."""
    if not o.config and not o.resume:
        raise RecurformerError("give --config FILE (see configs/) or --resume DIR")
    sets = (
        sets
        + (["train.compile=true"] if o.compile else [])
        + (["train.cuda_graphs=true"] if o.cuda_graphs else [])
        + ([f"train.device={o.device}"] if o.device else [])
        + ([f"data.text_field={o.text_field}"] if o.text_field else [])
    )
    with cpu_threads():
        _, last = train_main(o.config, parse_overrides(sets), o.resume, o.overwrite)
    return last
