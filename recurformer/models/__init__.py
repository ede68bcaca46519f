"""Model registry: name -> (config class, model class). ``build_model`` is the one way to build a
model from a name and a dict of config values. Every model class names its layer ``kind``, so a
config's ``layers`` list can stack layers of several kinds (``build_layer``); a new architecture is
added with one file and one line here."""

from __future__ import annotations

from typing import Any

from ..config import RecurformerError, _suggest, from_dict
from ..nn import Layer, ModelConfig, StreamingLM
from .block_recurrent import BlockRecurrent, BlockRecurrentConfig
from .llama import Llama, LlamaConfig
from .memory_attention import MemoryAttention, MemoryAttentionConfig
from .recurrent_transformer import RecurrentTransformer, RecurrentTransformerConfig
from .sliding_window import SlidingWindow, SlidingWindowConfig
from .transformer_xl import TransformerXL, TransformerXLConfig

REGISTRY: dict[str, tuple[type[ModelConfig], type[StreamingLM]]] = {
    "llama": (LlamaConfig, Llama),
    "sliding_window": (SlidingWindowConfig, SlidingWindow),
    "memory_attention": (MemoryAttentionConfig, MemoryAttention),
    "transformer_xl": (TransformerXLConfig, TransformerXL),
    "block_recurrent": (BlockRecurrentConfig, BlockRecurrent),
    "recurrent_transformer": (RecurrentTransformerConfig, RecurrentTransformer),
}
LAYER_KINDS: dict[str, type[StreamingLM]] = {model.kind: model for _, model in REGISTRY.values()}


def model_names() -> list[str]:
    return sorted(REGISTRY)


def lookup(name: str) -> tuple[type[ModelConfig], type[StreamingLM]]:
    if name not in REGISTRY:
        raise RecurformerError(f"unknown model '{name}'{_suggest(name, model_names()).replace('keys', 'models')}")
    return REGISTRY[name]


def build_layer(kind: str, cfg: ModelConfig, index: int) -> Layer:
    """Layer ``index`` of kind ``kind`` ('full', 'window', 'memory', 'xl', ...) for config ``cfg``."""
    if kind not in LAYER_KINDS:
        raise RecurformerError(f"unknown layer kind '{kind}' for layer {index}{_suggest(kind, sorted(LAYER_KINDS)).replace('keys', 'kinds')}")
    model = LAYER_KINDS[kind]
    if not isinstance(cfg, model.layer_config):
        raise RecurformerError(f"a '{kind}' layer needs the config of a {model.layer_config.__name__}, not {type(cfg).__name__}")
    return model.make_layer(cfg, index)


def make_config(name: str, values: dict[str, Any] | None = None) -> ModelConfig:
    cfg_cls, _ = lookup(name)
    return from_dict(cfg_cls, dict(values or {}), where="model")


def build_model(name: str | ModelConfig, values: dict[str, Any] | None = None) -> StreamingLM:
    """``build_model("memory_attention", {"dim": 128})`` or ``build_model(config_instance)``."""
    if isinstance(name, ModelConfig):
        cfg = name
        name = model_name(cfg)
    else:
        cfg = make_config(name, values)
    return lookup(name)[1](cfg)


def model_name(cfg: ModelConfig) -> str:
    for n, (c, _) in REGISTRY.items():
        if type(cfg) is c:
            return n
    raise RecurformerError(f"{type(cfg).__name__} is not a registered config")


__all__ = ["REGISTRY", "build_layer", "build_model", "make_config", "model_name", "model_names", "lookup"]
