"""How far a long command got, shown the same way by every command that can run for minutes
(``train``, ``synth`` training and ``--evaluate``, ``eval``, ``probe``, ``niah``, ``prepare``): on stderr, so
that stdout keeps a command's results (tables, JSON) as scripts parse them."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


class Progress:
    """How far a long loop got, on stderr (stdout keeps a command's results): a tqdm bar on a
    terminal; elsewhere (a log file, a pipe, nohup, a scheduler) a plain line at most every
    ``every`` seconds and at the end, with the units done of ``total``, the time so far and the
    time left at the rate so far. ``total`` None: a count alone, without an end line (a phase whose
    size is not known before it ends); ``initial``: units done before (a resumed run), not counted
    in the rate; ``show`` False: nothing at all. Call ``update(n)`` after n more units (or read
    through ``track``), ``close()`` at the end."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        *,
        initial: int = 0,
        every: float = 20.0,
        show: bool = True,
    ) -> None:
        from tqdm import tqdm

        self.total, self.desc, self.unit, self.every, self.show = total, desc, unit, every, show
        self.bar = (
            tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=False, dynamic_ncols=True)
            if show and sys.stderr.isatty()
            else None
        )
        self.done = self.initial = initial
        self.start = self.shown = time.monotonic()
        self.note = ""  # the latest figures of the loop (``set_postfix``), shown after the count

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        finished = self.total is not None and self.done >= self.total
        if not self.show or (now - self.shown < self.every and not finished):
            return
        self.shown = now
        sys.stdout.flush()  # the results so far first, where both streams go to one log
        print(self.line(now - self.start), file=sys.stderr, flush=True)

    def set_postfix(self, **figures: str) -> None:
        """The loop's latest figures (``loss="3.120"``): beside the bar on a terminal, at the end of
        the next line in a log."""
        if self.bar is not None:
            self.bar.set_postfix(**figures)
        self.note = ", ".join(f"{k} {v}" for k, v in figures.items())

    def line(self, spent: float) -> str:
        """The log line after ``spent`` seconds: done (of total), the time so far and the time left."""
        count = f"{self.done:,}" if self.total is None else f"{self.done:,}/{self.total:,}"
        text = f"  {self.desc}: {count} {self.unit}s, {spent / 60:.1f} min"
        if self.total is not None and self.initial < self.done < self.total:
            text += f", about {spent / (self.done - self.initial) * (self.total - self.done) / 60:.1f} min left"
        return f"{text}; {self.note}" if self.note else text

    def track(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, each one unit done once the loop has used it; closed at the end."""
        try:
            for item in items:
                yield item
                self.update(1)
        finally:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
