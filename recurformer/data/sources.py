"""Documents from the files users have, streamed one at a time (a file larger than memory is
read piece by piece; only one document must fit):

- plain text (UTF-8): documents separated by ``<|endoftext|>`` (a file without one is one document);
- JSONL (``.jsonl`` / ``.json``): one JSON object per line, the text under ``text_field``;
- Parquet (``.parquet``, needs ``pyarrow``): the string column ``text_field``, read in row batches;
- a directory written by ``datasets``' ``save_to_disk`` (needs ``datasets``): the column
  ``text_field`` of the dataset, or of every split of a ``DatasetDict`` in order.

Every problem (a missing field, a line that is not JSON, a file that is not UTF-8) is one line
naming the file and the key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from recurformer.config import RecurformerError

EOT = "<|endoftext|>"
BLOCK = 1 << 20  # characters read from a text file at a time
ROWS = 1024  # rows read from a Parquet file or a datasets directory at a time


def kind_of(path: str | Path) -> str:
    """``text``, ``jsonl``, ``parquet`` or ``datasets`` (a directory)."""
    p = Path(path)
    if p.is_dir():
        return "datasets"
    name = p.name.lower()
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file or directory, stripped, empty ones skipped."""
    p = Path(path)
    if not p.exists():
        raise RecurformerError(f"text file {p} does not exist")
    reader = {"text": _text, "jsonl": _jsonl, "parquet": _parquet, "datasets": _datasets}[kind_of(p)]
    for doc in reader(p, text_field):
        doc = doc.strip()
        if doc:
            yield doc


def _text(p: Path, text_field: str) -> Iterator[str]:
    """Split on ``<|endoftext|>`` as the file streams by (BOM dropped, CRLF -> LF)."""
    rest = ""
    try:
        with p.open("r", encoding="utf-8-sig", newline="") as f:
            while block := f.read(BLOCK):
                if block.endswith("\r"):  # keep a CRLF pair in one block
                    block += f.read(1)
                *docs, rest = (rest + block.replace("\r\n", "\n")).split(EOT)
                yield from docs
    except UnicodeDecodeError as e:
        raise RecurformerError(f"text file {p} is not UTF-8 ({e.reason})") from None
    except OSError as e:
        raise RecurformerError(f"cannot read text file {p}: {e.strerror or e}") from None
    yield rest


def _jsonl(p: Path, text_field: str) -> Iterator[str]:
    try:
        with p.open("r", encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RecurformerError(f"{p} line {n} is not JSON ({e.msg})") from None
                if not isinstance(row, dict) or text_field not in row:
                    fields = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                    raise RecurformerError(
                        f"{p} line {n} has no field '{text_field}' (it has: {fields}); set --text-field"
                    )
                if not isinstance(row[text_field], str):
                    raise RecurformerError(
                        f"{p} line {n}: field '{text_field}' is a {type(row[text_field]).__name__}, not text"
                    )
                yield row[text_field]
    except UnicodeDecodeError as e:
        raise RecurformerError(f"{p} is not UTF-8 ({e.reason})") from None


def _column(p: Path, names: list[str], text_field: str, what: str) -> None:
    if text_field not in names:
        raise RecurformerError(
            f"{what} {p} has no column '{text_field}' (columns: {', '.join(names)}); set --text-field"
        )


def _parquet(p: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecurformerError(f"reading {p} needs pyarrow: pip install 'recurformer[hub]'") from None
    try:
        f = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises its own ArrowInvalid on a file that is not Parquet
        raise RecurformerError(f"cannot read Parquet file {p}: {str(e).splitlines()[0]}") from None
    _column(p, f.schema_arrow.names, text_field, "Parquet file")
    for batch in f.iter_batches(batch_size=ROWS, columns=[text_field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def _datasets(p: Path, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise RecurformerError(
            f"reading the datasets directory {p} needs `datasets`: pip install 'recurformer[hub]'"
        ) from None
    try:
        ds = datasets.load_from_disk(str(p))
    except FileNotFoundError:
        raise RecurformerError(f"{p} is a directory but no dataset saved with save_to_disk") from None
    parts = list(ds.values()) if isinstance(ds, datasets.DatasetDict) else [ds]
    for part in parts:
        _column(p, list(part.column_names), text_field, "dataset")
        for batch in part.select_columns([text_field]).iter(batch_size=ROWS):
            yield from (t for t in batch[text_field] if t is not None)
