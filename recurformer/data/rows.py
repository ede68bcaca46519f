"""The pieces every synthetic task generator shares (``synthetic``, ``needles``, ``babi``): the
``(inputs, targets)`` pair a generator returns, the shift to next-token form, the one-line check
of a task's parameters, and a split's rows as tensors (``TaskData``, made by ``make_split``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import RecurformerError
from ..state import IGNORE_INDEX

Arrays = tuple[np.ndarray, np.ndarray]


def shift(seq: np.ndarray, scored: np.ndarray) -> Arrays:
    """seq, scored: [n, T+1] -> inputs seq[:, :-1], targets seq[:, 1:] where scored, else -100."""
    return seq[:, :-1].copy(), np.where(scored[:, 1:], seq[:, 1:], IGNORE_INDEX)


def need(cond: bool, msg: str) -> None:
    """Raise ``msg`` as a one-line ``RecurformerError`` unless ``cond``."""
    if not cond:
        raise RecurformerError(msg)


@dataclass
class TaskData:
    inputs: torch.Tensor  # [N, T] int64
    targets: torch.Tensor  # [N, T] int64, IGNORE_INDEX where not scored

    def row_keys(self) -> set[bytes]:
        """One hashable key per row (its input tokens), for disjointness checks."""
        return {r.tobytes() for r in self.inputs.numpy()}
