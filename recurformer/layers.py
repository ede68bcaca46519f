"""The shared building blocks (``modules``) and the pre-norm ``Block`` (``nn``) under their
former names; new code imports them from where they live."""

from .modules import MLP, RMSNorm, alibi_slopes, apply_rope, attend, merge_heads, pieces, rope_cos_sin, split_heads
from .nn import Block

__all__ = [
    "MLP",
    "Block",
    "RMSNorm",
    "alibi_slopes",
    "apply_rope",
    "attend",
    "merge_heads",
    "pieces",
    "rope_cos_sin",
    "split_heads",
]
