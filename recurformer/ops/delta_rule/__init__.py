"""The gated delta rule (Gated DeltaNet's recurrence): ``chunk`` (the fast form, for training) beside
``naive`` (token by token, the reference and the decoding step)."""

from .chunk import chunk_step, delta_rule_chunked
from .naive import delta_rule_naive

__all__ = ["chunk_step", "delta_rule_chunked", "delta_rule_naive"]
