"""Sliding-window attention baseline (Beltagy et al. 2020, "Longformer", §3.1; Mistral): Llama
with a required ``window`` W: a query sees the last W tokens, itself included. The layer state is
the last W - 1 keys/values, so memory is bounded at any length."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RecurformerError, option
from ..nn import Block, ModelConfig
from ..registry import register, register_layer
from ..stack import Layer
from .llama import Attention, Llama, LlamaConfig


@dataclass
class SlidingWindowConfig(LlamaConfig):
    window: int | None = option(256, range=">= 1")  # (declared anew, so with its range again)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is None:
            raise RecurformerError("sliding_window needs an integer 'window'")


@register_layer("window", ModelConfig)
def window_layer(cfg: ModelConfig, index: int) -> Layer:
    if cfg.window is None:
        raise RecurformerError(f"layer {index} is a 'window' layer: set config key 'window'")
    return Block(cfg, Attention(cfg, cfg.window))


class SlidingWindow(Llama):
    kind = "window"


register(
    "sliding_window",
    SlidingWindowConfig,
    SlidingWindow,
    "Llama-style decoder with sliding-window attention (bounded KV cache state)",
)
