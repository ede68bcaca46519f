"""Stopping a run cleanly: the first SIGINT/SIGTERM finishes the step and saves
(``TrainingInterrupted`` says how to continue), a second stops at once (``StopNow``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped training (after writing a checkpoint, when there was a step to save);
    ``str``: the message with the Python call that resumes, ``said(cli=True)``: with the command."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, run_dir: Path) -> None:
        self.signum, self.step, self.checkpoint, self.run_dir = signum, step, checkpoint, run_dir
        super().__init__(self.said(cli=False))

    def said(self, cli: bool) -> str:
        name = signal.Signals(self.signum).name
        if self.checkpoint is None:
            return f"stopped by {name} before training step {self.step + 1}; nothing new to save"
        how = (
            f"recurformer train --resume {self.run_dir}" if cli else f"recurformer.train(resume={str(self.run_dir)!r})"
        )
        return f"stopped by {name} after step {self.step}; saved {self.checkpoint}; continue with: {how}"


class StopNow(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: stop at once (``signum``: the signal, for the exit code)."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum


class StopSignals:
    """SIGINT/SIGTERM handler that records the first signal (training stops after the current
    step and saves) and raises ``StopNow`` at a second one (stop at once: the newest checkpoint
    on disk is complete either way)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise StopNow(signum)
        self.signum = signum

    def agreed(self, world: int, device: torch.device) -> int | None:
        """The signal that asked to stop, agreed by every rank (any rank's signal stops all)."""
        if world > 1:
            v = torch.tensor([self.signum or 0], device=device)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            return int(v) or None
        return self.signum

    @contextlib.contextmanager
    def installed(self) -> Any:
        """Handle SIGINT and SIGTERM inside the block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
