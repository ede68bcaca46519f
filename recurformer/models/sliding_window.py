"""Sliding-window attention baseline (Beltagy et al. 2020; Mistral): the Llama block, trained and
evaluated with attention to the last ``window`` tokens only. The state is the last ``window - 1``
keys/values per layer, so memory is bounded at any length."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RecurformerError
from .llama import KVState, Llama, LlamaConfig


@dataclass
class SlidingWindowConfig(LlamaConfig):
    window: int | None = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is None:
            raise RecurformerError("sliding_window needs an integer 'window'")


@dataclass
class WindowState(KVState):
    """The KV cache holding at most ``window - 1`` keys/values per layer."""


class SlidingWindow(Llama):
    state_cls = WindowState

    def __init__(self, config: SlidingWindowConfig) -> None:
        super().__init__(config)
