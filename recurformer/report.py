"""One report writer for the commands that measure a model (``recurformer eval``, ``probe``,
``niah``): the table through the command's log, the results as JSON and the figure as a PNG
beside it (the same name, ``.png``), each file written whole or not at all (``files.atomic_write``),
then one line saying where both are. Figures are drawn on matplotlib's file backend (Agg), chosen
here once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from .config import option
from .files import atomic_write, atomic_write_text, check_writable

DPI = 120


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files (the Agg backend: no window, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def json_option(help: str) -> Any:
    """A measuring command's ``out`` option (``config.option``): ``--json FILE``, the results' JSON
    (the figure beside it); ``help`` says what is written and where by default."""
    return option(None, help, flag="--json", metavar="FILE")


def claim_outputs(out: Path, what: str, figure: str = "plot") -> None:
    """Refuse (one line) before any work when the JSON ``out`` (``what``) or its PNG (``figure``)
    cannot be written, rather than after it."""
    check_writable(out, what)
    check_writable(out.with_suffix(".png"), figure)


def write_json(path: Path, doc: Any, end: str = "\n") -> None:
    """``doc`` as indented JSON at ``path``, followed by ``end``."""
    atomic_write_text(path, json.dumps(doc, indent=2) + end)


def save_figure(fig: Any, path: Path) -> None:
    """The matplotlib figure ``fig`` as a PNG at ``path``, then closed."""
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    finally:
        pyplot().close(fig)


def write_report(
    out: Path,
    table: Sequence[str],
    doc: Any,
    figure: Callable[[], Any],
    log: Callable[[str], object],
    end: str = "\n",
) -> None:
    """A command's results: each line of ``table`` to ``log``, ``doc`` as JSON at ``out``
    (``write_json``), the figure that ``figure()`` draws as a PNG beside it, and a line naming both."""
    for line in table:
        log(line)
    write_json(out, doc, end)
    png = out.with_suffix(".png")
    save_figure(figure(), png)
    log(f"wrote {out} and {png}")
