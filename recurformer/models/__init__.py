"""The architectures, one file each; importing a file registers its model (``registry.register``),
so a new architecture is one file plus one import line here. ``build_model`` is the one way to
build a model from a name and a dict of config values."""

from __future__ import annotations

from ..registry import LAYER_KINDS, REGISTRY, build_layer, build_model, lookup, make_config, model_name, model_names
from . import armt  # noqa: F401  ARMT: the RMT's segment memory for associative: true
from .block_recurrent import BlockRecurrent, BlockRecurrentConfig
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from .llama import Llama, LlamaConfig
from .memory_attention import MemoryAttention, MemoryAttentionConfig
from .recurrent_transformer import RecurrentTransformer, RecurrentTransformerConfig
from .rmt import RMT, RMTConfig
from .sliding_window import SlidingWindow, SlidingWindowConfig
from .transformer_xl import TransformerXL, TransformerXLConfig

__all__ = [
    "LAYER_KINDS",
    "REGISTRY",
    "build_layer",
    "build_model",
    "lookup",
    "make_config",
    "model_name",
    "model_names",
    "BlockRecurrent",
    "BlockRecurrentConfig",
    "GatedDeltaNet",
    "GatedDeltaNetConfig",
    "Llama",
    "LlamaConfig",
    "MemoryAttention",
    "MemoryAttentionConfig",
    "RecurrentTransformer",
    "RecurrentTransformerConfig",
    "RMT",
    "RMTConfig",
    "SlidingWindow",
    "SlidingWindowConfig",
    "TransformerXL",
    "TransformerXLConfig",
]
