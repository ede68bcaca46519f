"""FLOPs per token and the machine's matmul peak, for tokens/s reported as a fraction of a peak
measured on the same machine in the same run (issue 18: these machines differ by ~40%, so only
ratios mean anything).

FLOPs are counted, not derived by hand: one no-grad forward of the real model over ``T`` tokens
runs under ``torch.utils.flop_counter.FlopCounterMode`` (every matmul, attention included, 2 FLOPs
per multiply-add). Attention through SDPA counts only the (query, key) pairs its mask lets through
(a causal mask: about half), on CPU and CUDA alike. A training step is counted as 3 forwards
(backward = 2 x forward, the usual convention, e.g. PaLM's MFU): for Memory Attention in the
seeds' configuration this gives ~73 MFLOP/token against 6N = 67 M.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .device import synchronize

aten = torch.ops.aten


def _sdpa_flops(q: Any, k: Any, v: Any, mask: Any, is_causal: bool) -> int:
    """2 FLOPs x (q.k over d, p.v over d_v) x the (query, key) pairs the mask shows, per batch and head."""
    B, H, Lq, d = q.shape
    Lk, dv = k.shape[-2], v.shape[-1]
    if mask is not None:  # boolean, or additive (SDPA turns a boolean mask into one: -inf = hidden)
        visible = mask if mask.dtype == torch.bool else mask != float("-inf")
        pairs = int(torch.broadcast_to(visible, (B, H, Lq, Lk)).sum())
    elif is_causal:  # query i sees keys 0..i + (Lk - Lq), as SDPA aligns them
        pairs = B * H * sum(max(0, min(Lk, Lk - Lq + i + 1)) for i in range(Lq))
    else:
        pairs = B * H * Lq * Lk
    return 2 * pairs * (d + dv)


def _raw(f: Any) -> Any:
    f._get_raw = True  # the counter passes these tensors, not their shapes: the mask is read
    return f


# each SDPA kernel's arguments, as its aten schema orders them
@_raw
def _flash_cpu(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask: Any = None, **kw: Any) -> int:
    return _sdpa_flops(q, k, v, attn_mask, is_causal)


@_raw
def _flash_cuda(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, *args: Any, **kw: Any) -> int:
    return _sdpa_flops(q, k, v, None, is_causal)


@_raw
def _with_bias(q: Any, k: Any, v: Any, attn_bias: Any, compute_log_sumexp: bool, dropout_p: float = 0.0, is_causal: bool = False, *args: Any, **kw: Any) -> int:
    return _sdpa_flops(q, k, v, attn_bias, is_causal)


SDPA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu,
    aten._scaled_dot_product_flash_attention: _flash_cuda,
    aten._scaled_dot_product_efficient_attention: _with_bias,
    aten._scaled_dot_product_cudnn_attention: _with_bias,
}


def forward_flops_per_token(model: torch.nn.Module, T: int, device: torch.device | str = "cpu") -> float:
    """FLOPs of one forward over ``T`` tokens (batch 1, a fresh state), divided by T.

    SDPA kernels are counted by the pairs their mask lets through (``_sdpa_flops``), so the number
    does not depend on which kernel the device picks."""
    x = torch.zeros(1, T, dtype=torch.long, device=device)
    counter = FlopCounterMode(display=False, custom_mapping=SDPA_FLOPS)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), counter:
            model(x)
    finally:
        model.train(was_training)
    return counter.get_total_flops() / T


def train_flops_per_token(model: torch.nn.Module, T: int, device: torch.device | str = "cpu") -> float:
    """Forward + backward = 3 forwards per token."""
    return 3 * forward_flops_per_token(model, T, device)


@functools.lru_cache(maxsize=None)
def matmul_peak(dtype: torch.dtype, device: str = "cpu", n: int | None = None, seconds: float = 0.5) -> float:
    """Best FLOP/s of an n x n @ n x n matmul in ``dtype`` on ``device`` over ~``seconds``
    (n = 1024 on CPU, 8192 on CUDA): the peak the fractions are taken of, with the threads the
    process has. Measured once per process and precision; the global RNG is not touched."""
    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 1024)
    g = torch.Generator().manual_seed(0)
    a = torch.rand(n, n, generator=g).to(dev, dtype)
    b = torch.rand(n, n, generator=g).to(dev, dtype)
    a @ b  # warm-up
    synchronize(dev)
    best, t_end = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        a @ b
        synchronize(dev)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return 2 * n**3 / best
