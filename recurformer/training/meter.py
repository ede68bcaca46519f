"""What a run measures and writes as it trains: tokens/s and the model FLOPs utilisation
(``Throughput``), the losses not yet read from the device (``UnreadLosses``), and the metric
sinks (``RunLog``)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..config import RecurformerError, say
from ..device import resolve_precision
from ..flops import reference_peak, train_flops_per_token
from ..nn import StreamingLM


class Throughput:
    """Training tokens/s and the model FLOPs utilisation, mfu = mean tokens/s x FLOP per token /
    (the machine's matmul peak x ranks) (PaLM, Chowdhery et al., "PaLM: Scaling Language Modeling
    with Pathways", appendix B); the peak measured once and cached (``flops.reference_peak``),
    measured again once where an mfu comes out above 1 (``fraction``), ``note`` saying so.
    Only training time counts: ``paused()`` holds the clock (evaluation, checkpoints)."""

    def __init__(
        self,
        model: StreamingLM,
        seq_len: int,
        device: torch.device,
        precision: str,
        world: int,
        note: Callable[[str], object] = say,
    ) -> None:
        self.flops_per_token = train_flops_per_token(model, seq_len, device)
        self.dtype = torch.bfloat16 if resolve_precision(precision, device) == "bf16" else torch.float32
        self.device, self.note, self.remeasured = device, note, False
        self.peak_flops, self.peak_source = reference_peak(self.dtype, device)
        self.world = world
        self.t0, self.tokens0 = time.perf_counter(), 0
        self.run_time, self.run_tokens = 0.0, 0  # this process's training time and tokens, so far

    def start(self, tokens: int) -> None:
        self.t0, self.tokens0 = time.perf_counter(), tokens

    def fraction(self, tokens_per_s: float) -> float:
        """``tokens_per_s`` as a fraction of the peak (mfu). Above 1 the peak is stale (cached
        while the machine was busy): it is measured again, once, and the higher one kept, so the
        fraction is taken of the best peak seen (one still above 1 is reported as it is, the
        peak's source naming the re-measurement)."""
        f = tokens_per_s * self.flops_per_token / (self.peak_flops * self.world)
        if f > 1 and not self.remeasured:
            self.remeasured, stale = True, self.peak_flops
            self.peak_flops, where = reference_peak(self.dtype, self.device, remeasure=True)
            self.peak_source = f"{where} (re-measured: mfu {f:.2f} against the earlier {stale / 1e9:,.1f} GFLOP/s)"
            self.note(f"mfu: {self.peak_source}: now {self.peak_flops / 1e9:,.1f} GFLOP/s")
            f = tokens_per_s * self.flops_per_token / (self.peak_flops * self.world)
        return f

    def lap(self, tokens: int) -> tuple[float, float, float]:
        """(tokens/s since the last lap, mean tokens/s of the run, mfu) at ``tokens`` seen; a
        re-measured peak (``fraction``) takes none of the run's training time."""
        dt = time.perf_counter() - self.t0
        tps = (tokens - self.tokens0) / max(dt, 1e-9)
        self.run_time, self.run_tokens = self.run_time + dt, self.run_tokens + tokens - self.tokens0
        mean = self.run_tokens / max(self.run_time, 1e-9)
        mfu = self.fraction(mean)
        self.start(tokens)
        return tps, mean, mfu

    @contextlib.contextmanager
    def paused(self) -> Any:
        paused = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - paused


class Notes:
    """Lines on stderr, each once per run, from one process (``show``: rank 0)."""

    def __init__(self, show: bool) -> None:
        self.show, self.said = show, set[str]()

    def __call__(self, msg: str) -> None:
        if self.show and msg not in self.said:
            self.said.add(msg)
            tqdm.write(msg, file=sys.stderr)


class UnreadLosses:
    """The training losses not yet read from the device, summed on it (a nan or inf in any of them
    shows in the sum): the loop reads once per log interval and before a checkpoint (``read``), so
    the steps between queue their work without waiting for the device."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.first = 0  # the step of the first loss in ``total``

    def add(self, loss: torch.Tensor, step: int) -> None:
        if self.total is None:
            self.total, self.first = loss, step
        else:
            self.total = self.total + loss

    def read(self, loss: torch.Tensor, step: int, world: int, out_dir: Path) -> float:
        """``loss`` as a float: the one host read (a wait for the device) per log interval. Raises if
        any step since the last read had a loss that is not finite; with several ranks, the mean over
        ranks, so every rank logs (and stops on) the same number."""
        v = torch.stack([loss, self.total if self.total is not None else loss])
        if world > 1:
            dist.all_reduce(v)
            v = v / world
        mean, seen = v.tolist()
        first, self.total = self.first, None
        if not math.isfinite(seen):
            where = f"at step {step}" if first == step else f"at one of steps {first}..{step}"
            raise RecurformerError(
                f"loss became {seen} {where}; stopped (the last good checkpoint in {out_dir} is kept)"
            )
        return mean


class RunLog:
    """The run's metric sinks (``loggers.make_sinks``; rank 0 only, none elsewhere): ``log``
    writes a record to each, a failed write is one line naming the run directory."""

    def __init__(self, sinks: list[Any], out_dir: Path) -> None:
        self.sinks, self.out_dir = sinks, out_dir

    def log(self, record: dict[str, Any]) -> None:
        try:
            for sink in self.sinks:
                sink.log(record, record["step"])
        except OSError as e:
            raise RecurformerError(f"cannot write the run's logs in {self.out_dir}: {e.strerror or e}") from None

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
