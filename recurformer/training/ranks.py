"""The processes of a run under ``torchrun``: each rank's device and process group
(``join_processes``), and the collectives of a run (``gather``: every rank's part of a checkpoint; ``mean_over_ranks``)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..device import pick_device


def join_processes(device_name: str) -> tuple[torch.device, int, int]:
    """This process's device, rank and world size; under ``torchrun`` (WORLD_SIZE > 1), its own
    GPU (LOCAL_RANK) and the process group joined (NCCL on CUDA, Gloo on the CPU)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(device_name)
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device, rank, world


def gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` in rank order (a collective: every rank calls it)."""
    if world == 1:
        return [obj]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, obj)
    return everyone


def mean_over_ranks(x: float, world: int, device: torch.device) -> float:
    """The mean of ``x`` over the ranks, so that every rank logs (and stops on) the same number."""
    if world == 1:
        return x
    v = torch.tensor([x], device=device)
    dist.all_reduce(v)
    return float(v) / world
