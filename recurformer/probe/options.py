"""The probe's tasks, the metrics each one measures, and its options (``ProbeOptions``): which
documents, which distances, how they are read."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Checked, RecurformerError, opt, option

TASKS = ("repeat", "swap")
METRICS = {"repeat": ("swap_delta", "copy_gain"), "swap": ("swap_delta",)}


@dataclass
class ProbeOptions(Checked):
    """The copy (``repeat``) or ``swap`` probe: which documents, which distances, how they are read
    (``recurformer.probe`` and ``recurformer probe``)."""

    task: str = option(
        "repeat",
        "repeat (copy: s1, marker, s2 = s1) or swap (replace the history older than d)",
        metavar="{" + ",".join(TASKS) + "}",
    )  # checked in __post_init__: one line
    dataset: str | None = option(
        None,
        "a bundled dataset's val split (default: tinystories-repeat for repeat, the checkpoint's own for swap)",
        group="source",
    )
    text: list[str] | None = option(
        None, "UTF-8 text files, encoded with the checkpoint's tokenizer", nargs="+", metavar="FILE", group="source"
    )
    docs: int = option(500, "documents (the bootstrap resamples these)", range=">= 1")
    passage: int = option(128, "repeat on a corpus other than tinystories-repeat: passage length n", range=">= 1")
    distances: list[int] = option([1, 4, 16, 64, 256, 1024], "swap: replace the history older than each of these")
    span: int = option(32, "swap: target tokens scored after the history", range=">= 1")
    warm: tuple[int, int] = option(
        (32, 288),
        "fewest and most tokens of stream text read before each document (a random prefix length between them "
        "varies the chunk phases)",
        range=">= 0",
        cli=False,  # the command line's --warm-min and --warm-max
    )
    chunk: int = option(256, "tokens per model call (the state carries the rest)", range=">= 1")
    batch_size: int = option(16, "documents read side by side", range=">= 1")
    precision: str = option("fp32", "bf16: CPU/CUDA autocast", choices=["fp32", "bf16"])
    seed: int = option(0, "which documents and warm-up prefixes, and the bootstrap")

    def __post_init__(self) -> None:
        """The options checked where they are built, for ``recurformer.probe`` and
        ``probe_checkpoints`` alike (one-line errors naming them, ``config.opt``)."""
        if self.task not in TASKS:
            raise RecurformerError(f"unknown probe task '{self.task}'; valid tasks: {', '.join(TASKS)}")
        super().__post_init__()  # each range (Checked)
        if self.warm[0] > self.warm[1]:
            raise RecurformerError(f"{opt('warm')} must be (min, max) with min <= max, got {tuple(self.warm)}")
