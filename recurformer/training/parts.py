"""The training state as named parts (as torchtitan's checkpointer holds its Stateful objects):
each part has ``state_dict()``/``load_state_dict()``, so saving and restoring are one loop over
the parts (``save_parts``, ``restore_parts``). A part's tensors go to train_state.safetensors and
its other values to train_state.json (model weights: model.safetensors), under keys of its own; no
two parts share a key, so each part reads its own back from the two files merged."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from .. import checkpoint as ckpt
from ..optim import optimizer_from_flat, optimizer_to_flat


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


class ModelWeights:
    """The weights (format-1 names are upgraded on load, a misfit is a one-line error)."""

    def __init__(self, model: nn.Module, where: str) -> None:
        self.model, self.where = model, where

    def state_dict(self) -> dict[str, Any]:
        return dict(self.model.state_dict())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ckpt.load_model_weights(self.model, sd, self.where)


class OptimizerState:
    """AdamW's moments as ``opt.<param>.<name>`` tensors, its param groups under ``optimizer``."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def state_dict(self) -> dict[str, Any]:
        tensors, meta = optimizer_to_flat(self.opt)
        return {**tensors, "optimizer": meta}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        optimizer_from_flat(self.opt, sd, sd["optimizer"])


def state_dicts(parts: dict[str, Stateful]) -> dict[str, dict[str, Any]]:
    """Every part's state (a collective where a part gathers from every rank: every rank calls it)."""
    return {name: part.state_dict() for name, part in parts.items()}


def save_parts(
    directory: Path,
    step: int,
    sd: dict[str, dict[str, Any]],
    config: dict[str, Any],
    tokenizer_json: str | None,
    keep_last: int,
) -> Path:
    """One checkpoint of ``sd`` (``state_dicts``) at ``step`` in ``directory``
    (``checkpoint.save_checkpoint``: written whole or not at all), the ``model`` part's weights
    apart, the other parts' tensors and values merged; ``keep_last`` checkpoints kept (0: all)."""
    sd = dict(sd)
    weights = sd.pop("model")
    train = {k: v for part in sd.values() for k, v in part.items()}
    return ckpt.save_checkpoint(
        directory,
        step,
        weights,
        config,
        tokenizer_json,
        {k: v for k, v in train.items() if isinstance(v, torch.Tensor)},
        {k: v for k, v in train.items() if not isinstance(v, torch.Tensor)},
        keep_last=keep_last,
    )


def restore_parts(parts: dict[str, Stateful], resumed: dict[str, Any]) -> None:
    """Every part loaded from a checkpoint read by ``checkpoint.load_checkpoint(with_train_state=True)``."""
    train = {**resumed["train_tensors"], **resumed["train_json"]}
    for name, part in parts.items():
        part.load_state_dict(resumed["model"] if name == "model" else train)
