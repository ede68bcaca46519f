"""The one training loop. A job (``Job``) takes optimizer steps; the loop runs them to the end,
and between steps logs, evaluates and checkpoints at the cadence of ``Cadence``, and stops
cleanly on a signal: the step finishes, a checkpoint is written, the job says how to go on.
``recurformer train`` (``trainer.Trainer``) and ``recurformer synth`` (``recurformer.synth.job``)
are its two jobs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

from ..progress import Progress


@dataclass(frozen=True)
class Cadence:
    """After which steps the loop logs, evaluates and saves (every ``*_every`` steps; 0: never).
    After the last step it also logs, evaluates when ``eval_last`` (train: the final model's
    validation loss) and saves when ``save_last`` (train: the final checkpoint; synth saves the
    model itself then, so its progress is not saved at the last step)."""

    steps: int
    log_every: int = 0
    eval_every: int = 0
    save_every: int = 0
    eval_last: bool = True
    save_last: bool = True

    def log(self, step: int) -> bool:
        return self.log_every > 0 and (step % self.log_every == 0 or step == self.steps)

    def evaluate(self, step: int) -> bool:
        return self.eval_every > 0 and (step % self.eval_every == 0 or (self.eval_last and step == self.steps))

    def save(self, step: int) -> bool:
        if step == self.steps:
            return self.save_last
        return self.save_every > 0 and step % self.save_every == 0


class Job(Protocol):
    """What the loop runs: ``step`` (the optimizer steps taken), ``take_step()`` (one more; returns
    its loss, read or not), ``log``/``validate``/``checkpoint`` (the loss of the step just taken
    given)."""

    step: int

    def take_step(self) -> Any: ...

    def log(self, loss: Any) -> None: ...

    def validate(self) -> None: ...

    def checkpoint(self, loss: Any) -> None: ...


def run_loop(
    job: Job,
    cadence: Cadence,
    bar: Progress,
    stop: Callable[[], Exception | None] = lambda: None,
    paused: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Steps of ``job`` to ``cadence.steps``, each counted on ``bar``; after each, what ``cadence``
    says is due. ``stop``: asked after every step but the last whether a signal asked to stop, and if so
    for the exception that says so, raised once a checkpoint is written; ``paused``: a block whose time
    is not training time (evaluation, checkpoints, for the throughput meter)."""
    while job.step < cadence.steps:
        loss = job.take_step()
        bar.update(1)
        step = job.step
        if cadence.log(step):
            job.log(loss)
        with paused():
            if cadence.evaluate(step):
                job.validate()
            stopped = stop() if step < cadence.steps else None  # a finished run just finishes
            if cadence.save(step) or stopped:
                job.checkpoint(loss)
            if stopped:
                raise stopped
