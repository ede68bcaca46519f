"""Writing files so that a reader never sees half of one: every write goes to a temporary sibling
that is renamed into place (``os.replace`` is atomic), and a directory is filled under a temporary
name and swapped in whole. ``check_writable`` refuses, with one line and before any long work, a
destination that cannot be written."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

from .config import RecurformerError


def atomic_write(path: str | Path, write: Callable[[Path], object], what: str = "") -> None:
    """``write(tmp)`` to a temporary sibling, then rename it onto ``path``: a reader never sees a
    half-written file, and a failure leaves no temporary file and raises one line
    (``cannot write <what> <path>: <reason>``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise RecurformerError(f"cannot write {what + ' ' if what else ''}{path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str, what: str = "") -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text), what)


@contextlib.contextmanager
def atomic_dir(final: Path, tmp: Path, aside: Path) -> Iterator[Path]:
    """Fill the empty directory ``tmp`` inside the block, then move it onto ``final``: an existing
    ``final`` is renamed to ``aside`` first and deleted after. If the block fails, ``tmp`` is
    deleted and ``final`` is left as it was. OSError passes through (callers name what failed)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_files(source: Path, target: Path) -> list[str]:
    """Rename every file of the staging directory ``source`` into ``target`` (one atomic rename
    each, after all of them were written); returns their names."""
    names = [f.name for f in source.iterdir()]
    for name in names:
        os.replace(source / name, target / name)
    return names


def check_writable(path: str | Path, what: str, is_dir: bool = False) -> None:
    """Fail with one line, before any long work, when ``path`` (a directory, or a file to be
    written) cannot be created or replaced: its nearest existing ancestor must be a writable directory."""
    path = Path(path)
    if path.exists() and path.is_dir() != is_dir:
        raise RecurformerError(f"cannot write {what} {path}: it is {'not ' if is_dir else ''}a directory")
    base = path if is_dir and path.exists() else path.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise RecurformerError(f"cannot write {what} {path}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise RecurformerError(f"cannot write {what} {path}: {base} is not writable")
