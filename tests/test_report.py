"""The report writer the measuring commands share (report.py): the table through the log, the
JSON and the PNG beside it, then one line naming both; matplotlib's file backend is chosen in
that one module."""

from __future__ import annotations

import json
import re
from pathlib import Path

from recurformer.report import pyplot, write_report

PACKAGE = Path(__file__).resolve().parents[1] / "recurformer"


def test_write_report_logs_the_table_then_writes_json_and_png(tmp_path) -> None:
    figures = []

    def drawn():  # type: ignore[no-untyped-def]
        fig, ax = pyplot().subplots()
        ax.plot([1, 2], [3, 4])
        figures.append(fig.number)
        return fig

    lines: list[str] = []
    out = tmp_path / "sub" / "r.json"
    write_report(out, ["", "| a |"], {"k": [1]}, drawn, lines.append, end="")
    assert lines == ["", "| a |", f"wrote {out} and {out.with_suffix('.png')}"]
    assert out.read_text() == json.dumps({"k": [1]}, indent=2)  # ``end``: nothing after the JSON
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json", "r.png"]  # no temporary file left
    assert figures and figures[0] not in pyplot().get_fignums()  # the figure was closed


def test_the_file_backend_is_chosen_in_one_place() -> None:
    users = sorted(p.name for p in PACKAGE.rglob("*.py") if re.search(r"matplotlib\.use\(", p.read_text()))
    assert users == ["report.py"]
