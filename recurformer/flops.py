"""FLOPs per token and the machine's matmul peak, for tokens/s reported as a fraction of a peak
measured on the same machine (machines of one type differ by ~40%, so only ratios mean anything).

The peak a training run divides by (``reference_peak``) is measured once per machine, torch
version, dtype and thread count, over a few seconds, and cached in the user's cache directory
(``$RECURFORMER_CACHE/matmul_peak.json``, by default ``~/.cache/recurformer``, under
``$XDG_CACHE_HOME`` when set): two runs on one machine divide by the same number, so their
fractions compare. Delete the file to re-measure; a run whose fraction comes out above 1 (the peak
cached while the machine was busy) measures it again and keeps the higher one.

FLOPs are counted, not derived by hand: one no-grad forward of the real model over ``T`` tokens
runs under ``torch.utils.flop_counter.FlopCounterMode`` (every matmul, attention included, 2 FLOPs
per multiply-add). Attention through SDPA counts only the (query, key) pairs its mask lets through
(a causal mask: about half), whatever kernel the device would pick (on CPU an additive mask runs
as dense bmm, which would count every masked pair); attention written as plain matmuls is counted
as those matmuls. A training step is counted as 3 forwards
(backward = 2 x forward, the usual convention, e.g. PaLM's MFU): for Memory Attention in the
paper's TinyStories configuration (dim 288, 6 layers) this gives ~73 MFLOP/token against 6N = 67 M.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from .device import synchronize
from .modules import biased_attend


def _sdpa_flops(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> int:
    """2 FLOPs x (q.k over d, p.v over d_v) x the (query, key) pairs the mask shows, per batch and head."""
    B, H, Lq, d = q.shape
    Lk, dv = k.shape[-2], v.shape[-1]
    if mask is not None:  # boolean, or additive (-inf = hidden)
        visible = mask if mask.dtype == torch.bool else mask != float("-inf")
        pairs = int(torch.broadcast_to(visible, (B, H, Lq, Lk)).sum())
    elif is_causal:  # SDPA's causal mask is aligned top-left: query i sees keys 0..i
        pairs = B * H * sum(min(Lk, i + 1) for i in range(Lq))
    else:
        pairs = B * H * Lq * Lk
    return 2 * pairs * (d + dv)


class _CountAttention(TorchFunctionMode):
    """Counts every ``F.scaled_dot_product_attention`` (and ``modules.biased_attend``) call by the pairs its mask shows and returns
    zeros of its output's shape instead of running it, so the FLOP counter never sees a kernel: on
    CPU an additive mask goes to the math path, whose dense bmm would count every masked pair. The
    FLOPs of a forward depend on shapes only, so the zeros change no count downstream."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is biased_attend:  # any batch dims; pairs the bias shows, per batch entry
            q, k, v, bias = args
            shown = torch.broadcast_to(bias != float("-inf"), (*q.shape[:-1], k.shape[-2]))
            self.flops += 2 * int(shown.sum()) * (q.shape[-1] + v.shape[-1])
            return q.new_zeros(*q.shape[:-1], v.shape[-1])
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        self.flops += _sdpa_flops(q, k, v, mask, causal)
        return q.new_zeros(*q.shape[:-1], v.shape[-1])


def forward_flops_per_token(model: torch.nn.Module, T: int, device: torch.device | str = "cpu") -> float:
    """FLOPs of one forward over ``T`` tokens (batch 1, a fresh state), divided by T.

    SDPA calls are counted by the pairs their mask lets through (``_CountAttention``), so the number
    does not depend on which kernel the device would pick."""
    x = torch.zeros(1, T, dtype=torch.long, device=device)
    counter, attention = FlopCounterMode(display=False), _CountAttention()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), counter, attention:
            model(x)
    finally:
        model.train(was_training)
    return (counter.get_total_flops() + attention.flops) / T


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


PEAK_SECONDS = 3.0  # the cached reference: best of ~3 s of repetitions


def machine_name(device: torch.device | str = "cpu") -> str:
    """The CPU model (``/proc/cpuinfo``) or the GPU name, for keying the cached peak."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_meta() -> dict[str, object]:
    """Where a CPU measurement ran, for its JSON: the time (UTC), torch, threads, CPU model, cores."""
    return dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpu=machine_name(),
        cores=os.cpu_count(),
    )


def peak_cache_file() -> Path:
    root = (
        os.environ.get("RECURFORMER_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "recurformer"
    )
    return Path(root) / "matmul_peak.json"


def reference_peak(
    dtype: torch.dtype, device: torch.device | str = "cpu", remeasure: bool = False
) -> tuple[float, str]:
    """(FLOP/s, where it comes from): the matmul peak for this machine, torch version, dtype and
    thread count, read from the cache or measured now (``PEAK_SECONDS``) and cached. ``remeasure``:
    measured now even when cached (a cached peak below what a run reached was measured under
    load), the higher of the two kept."""
    dev = torch.device(device)
    key = f"{machine_name(dev)} | torch {torch.__version__} | {str(dtype).removeprefix('torch.')}"
    key += f" | {torch.get_num_threads()} threads" if dev.type == "cpu" else ""
    path = peak_cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cached = float(cache[key]) if isinstance(cache.get(key), (int, float)) else None
    if cached is not None and not remeasure:
        return cached, f"cached in {path} for {key}"
    peak = max(matmul_peak.__wrapped__(dtype, str(dev), seconds=PEAK_SECONDS), cached or 0.0)
    cache = {**(cache if isinstance(cache, dict) else {}), key: peak}
    try:  # atomic, so two runs starting together never leave half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
        where = f"measured now and cached in {path} for {key}"
    except OSError:
        where = f"measured now for {key} (cache {path} not writable)"
    return peak, where
