"""The gated delta rule on flash-linear-attention's Triton kernel (``fla-core[cuda]``, its
``chunk_gated_delta_rule``): the fast form on CUDA, called with ``delta_rule_chunked``'s arguments
and returning what it returns (our layout in and out), so a layer switches forms without any change
to its parameters or its state. Our chunked form stays the reference and the CPU path;
tests/ops/test_delta_rule.py checks this mapping against fla's own pure-PyTorch
``naive_chunk_gated_delta_rule`` on the CPU."""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal

import torch
from torch import Tensor

from ...config import RecurformerError, opt

FLA_CHUNKS = (16, 32, 64)  # the chunk sizes fla's kernel accepts
INSTALL = "pip install 'fla-core[cuda]'"


@functools.cache
def fla_kernel() -> Callable[..., Any] | None:
    """fla's ``chunk_gated_delta_rule``, or None where ``fla`` (or the Triton it needs) does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def use_fla(impl: Literal["auto", "fla"], device: torch.device, chunk: int) -> bool:
    """Whether a layer whose ``model.impl`` is ``impl`` runs fla's kernel on ``device``: ``auto`` on
    CUDA where fla imports and the chunk is one it accepts; ``fla`` always, with one line naming
    the fix where fla does not import or the tensors are not on CUDA (before any work is done)."""
    if impl == "auto":
        return device.type == "cuda" and chunk in FLA_CHUNKS and fla_kernel() is not None
    if device.type != "cuda":
        raise RecurformerError(
            f"{opt('model.impl', 'fla')} runs flash-linear-attention's Triton kernel on CUDA only, but this "
            f"model runs on {device.type}: use {opt('model.impl', 'auto')} (fla on CUDA, ours elsewhere)"
        )
    if fla_kernel() is None:
        raise RecurformerError(
            f"{opt('model.impl', 'fla')} needs flash-linear-attention, which does not import here: "
            f"{INSTALL}, or use {opt('model.impl', 'auto')}"
        )
    return True


def delta_rule_fla(
    q: Tensor, k: Tensor, v: Tensor, b: Tensor, g: Tensor, S: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """``delta_rule_chunked`` (same arguments, same results) by fla's ``chunk_gated_delta_rule``:
    q, k [B, H, T, d_k] normalised, v [B, H, T, d_v], write strengths b and log-decays g [B, H, T]
    (our floors already applied), the state S [B, H, d_v, d_k] -> o [B, H, T, d_v] in v's dtype and
    the final state in S's dtype. fla takes heads third ([B, T, H, ...]) and the state as keys x
    values; ``scale=1`` (our q is normalised, not scaled) and fla's own normalisation off (ours is
    done). The kernel's backward gives the initial state its gradient: truncated backprop through
    a carried state works as with ours."""
    kernel = fla_kernel()
    assert kernel is not None, "use_fla decides first"
    o, S_T = kernel(
        *(t.transpose(1, 2) for t in (q, k, v, g, b)),
        scale=1.0,
        initial_state=S.transpose(-1, -2),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        chunk_size=chunk,
    )
    return o.transpose(1, 2).to(v.dtype), S_T.transpose(-1, -2).to(S.dtype)
