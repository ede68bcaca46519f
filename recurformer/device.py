"""Devices: one place that picks the device and decides what runs fast on it.

Every command takes ``--device`` (``train.device`` in a run config): ``auto`` is CUDA when a GPU is
present, else the CPU. On CUDA: bf16 autocast where the GPU supports it (attention then runs in
bf16 through SDPA's flash / memory-efficient kernels), TF32 matmuls for fp32 work, fused AdamW
(``optim.make_optimizer``, on the CPU too), pinned host memory with non-blocking copies for batches, and the
allocator's peak (``torch.cuda.max_memory_allocated``) as the memory figure. Timings synchronise
first, as CUDA kernels run asynchronously.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from . import openmp
from .config import RecurformerError, option


def pick_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; any other name as torch spells it, with a
    one-line error for a device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise RecurformerError(f"unknown device '{name}'; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RecurformerError(
                f"device '{name}' asked for, but this machine has no CUDA GPU (torch {torch.__version__}); use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RecurformerError(
                f"device '{name}' asked for, but this machine has {torch.cuda.device_count()} CUDA GPU(s)"
            )
    elif dev.type != "cpu":
        raise RecurformerError(f"device type '{dev.type}' is not supported; use auto, cpu, cuda or cuda:N")
    return dev


@contextlib.contextmanager
def fast_matmuls(device: torch.device) -> Iterator[None]:
    """TF32 for fp32 matmuls and convolutions on CUDA while the block runs (about 1e-3 relative
    error, as in most GPU training; ``RECURFORMER_NO_TF32=1`` keeps full fp32), the process's own
    settings restored after it: a training run inside a program leaves that program's fp32 as it found it."""
    if device.type != "cuda" or os.environ.get("RECURFORMER_NO_TF32"):
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` has bf16 matmuls in hardware: a CUDA GPU with bf16, a CPU with avx512_bf16/AMX."""
    return torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_bf16()


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` where it pays (``bf16_supported``), else ``fp32``."""
    if precision != "auto":
        return precision
    return "bf16" if bf16_supported(device) else "fp32"


def slow_bf16_warning(precision: str, device: torch.device) -> str | None:
    """One line when bf16 is asked for by name on a device without bf16 matmuls, else None. A CPU
    without avx512_bf16/AMX emulates them: on one AVX2 core a 1024^3 bf16 matmul ran at 0.7 GFLOP/s
    against 23.7 in fp32, so a run asked for in bf16 there is ~30x slower without saying why."""
    if precision != "bf16" or bf16_supported(device):
        return None
    what = "this GPU has no bf16" if device.type == "cuda" else "this CPU has no avx512_bf16/AMX"
    return (
        f"warning: precision bf16 asked for, but {what}: bf16 matmuls are emulated, many times slower "
        "than fp32; precision auto picks fp32 here"
    )


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``bf16`` (``auto`` resolved as above), nothing for ``fp32``."""
    if resolve_precision(precision, device) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """A host batch onto ``device``: pinned and copied without blocking on CUDA (the copy overlaps
    the work already queued), unchanged on the CPU."""
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued device work (CUDA kernels run asynchronously), so timings are real."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Restart the peak counter: CUDA's allocator statistics, or on the CPU the process's peak
    resident set (Linux: VmHWM, via /proc/self/clear_refs; elsewhere it cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory in MB since ``reset_peak_memory``: tensors allocated on a CUDA device, or the
    process's resident set on the CPU (RSS: weights, activations and the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_kind(device: torch.device) -> str:
    """What ``peak_memory_mb`` measures on ``device``, for tables and logs."""
    return "CUDA allocated" if device.type == "cuda" else "RSS"


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is a failed allocation: torch's ``OutOfMemoryError`` (CUDA and other
    accelerators) or the ``RuntimeError`` of the CPU allocator ("can't allocate memory")."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)


UNITS = {"bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@contextlib.contextmanager
def out_of_memory(doing: str, advice: str) -> Iterator[None]:
    """Running out of memory inside the block becomes one line: what was being done at which sizes
    (``doing``), the allocation that failed (as torch reports it), and what to do (``advice``). The error
    is raised outside the handler, so that it holds no traceback, and no tensor, of the failed work."""
    message = None
    try:
        yield
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        m = re.search(r"allocate ([\d.]+) ?(bytes|[KMGT]iB)", str(e), re.IGNORECASE)
        failed = f" (an allocation of {float(m[1]) * UNITS[m[2].lower()] / 2**30:.2f} GiB failed)" if m else ""
        message = f"out of memory {doing}{failed}; {advice}"
    if message is not None:
        raise RecurformerError(message)


def idle_cpus(interval: float = 0.25) -> int | None:
    """How many of the CPUs this process may run on stayed idle over the next ``interval`` seconds:
    a CPU counts as idle when more than half of its time (Linux ``/proc/stat``: idle + iowait
    over all ticks) went unused. None where ``/proc/stat`` cannot be read."""

    def sample() -> dict[str, tuple[int, int]]:
        ticks = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name.startswith("cpu") and name[3:].isdigit():
                    v = [int(x) for x in values[:8]]  # user nice system idle iowait irq softirq steal
                    ticks[name] = (v[3] + v[4], sum(v))
        return ticks

    try:
        before = sample()
        time.sleep(interval)
        after = sample()
    except (OSError, ValueError, IndexError):
        return None
    mine = {f"cpu{i}" for i in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else set(after)
    idle = 0
    for cpu in mine & before.keys() & after.keys():
        total = after[cpu][1] - before[cpu][1]
        idle += total > 0 and after[cpu][0] - before[cpu][0] > total / 2
    return idle


@contextlib.contextmanager
def cpu_threads() -> Iterator[int]:
    """torch's intra-op threads for one call of the Python API (usable as a decorator): unchanged,
    unless OpenMP spins (``openmp.SPINNING``: torch was imported before recurformer with no wait
    policy set, so the runtime cannot be made passive any more) and fewer CPUs are idle
    (``idle_cpus``) than torch has threads; then as many threads as idle CPUs, at least 1, so no
    thread of a parallel region spins on a core another process needs while a sibling waits for
    it. The count is restored afterwards; yields the count used. One thread never enters an
    OpenMP parallel region, so it cannot stall this way. (A thread more than CPUs makes
    libgomp spin only briefly as well, but it depends on libgomp's internals and was not measured
    cleanly enough here to rely on.)"""
    n = torch.get_num_threads()
    idle = idle_cpus() if openmp.SPINNING and n > 1 else None
    use = n if idle is None else max(1, min(n, idle))
    if use < n:
        warnings.warn(
            f"torch was imported before recurformer, so OpenMP's idle threads spin (no OMP_WAIT_POLICY when torch "
            f"loaded); {idle} of this process's CPUs are idle, so this call runs on {use} torch thread(s), not {n}. "
            "Import recurformer before torch (or export OMP_WAIT_POLICY=PASSIVE) to keep every thread",
            stacklevel=4,  # the caller of the decorated function
        )
        torch.set_num_threads(use)
    try:
        yield use
    finally:
        if use < n:
            torch.set_num_threads(n)


def device_option() -> Any:
    """A command's ``device`` option (``config.option``)."""
    return option("auto", "auto (CUDA when present), cpu, cuda or cuda:N")


def graphs_or_eager(
    asked: bool,
    device: torch.device,
    option: str,
    running: str,
    processes: int | None = None,
    fix: str = "",
) -> Literal["cuda"] | None:
    """How a command runs its model's calls: through captured CUDA graphs ("cuda", the capture
    backend) where ``option`` asks for them, else eagerly (None). Graphs need a CUDA GPU (one
    process on one, where ``processes`` is given); off it, one line naming ``option``, where the
    work runs (``running`` + " on <device>": "this evaluation runs", "this model is") and ``fix``."""
    if not asked:
        return None
    if device.type != "cuda" or (processes or 1) > 1:
        need = "a CUDA GPU" if processes is None else "one process on a CUDA GPU"
        where = f"on {processes} processes" if device.type == "cuda" else f"on {device}"
        raise RecurformerError(f"{option} needs {need}; {running} {where}{fix}")
    return "cuda"
