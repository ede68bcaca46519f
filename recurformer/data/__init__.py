"""Data layer: bundled corpora, tokenizers, dataset preparation and stateful batch streams; the
``data`` section of a run config (``DataConfig``), whose fields are ``recurformer prepare``'s options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from recurformer.config import RecurformerError, check_fields, option
from recurformer.data.prepare import DATASETS, bundled_corpus, load_prepared, prepare
from recurformer.data.streams import Batch, ContiguousStreams, ShuffledWindows, eval_windows
from recurformer.data.tokenizer import Tokenizer

DEFAULT_DATASET = "tinystories-sample"


@dataclass
class DataConfig:
    """At most one of ``dataset`` (a bundled dataset name) and ``text_files`` is in force; with
    neither, ``dataset`` is the bundled TinyStories sample, unless ``dir`` names prepared data.
    ``text_field`` is the field / column of JSONL, Parquet and ``datasets`` inputs that holds the
    text (``prepare --text-field``)."""

    dataset: str | None = option(
        None, f"a bundled dataset: {', '.join(DATASETS)} (tinystories: from the Hub)", metavar="NAME"
    )
    text_files: list[str] = option(
        [],
        "your own corpus instead of a dataset: text files, JSONL, Parquet or datasets directories "
        "(save_to_disk), streamed",
        flag="--text",
        nargs="+",
        metavar="FILE",
    )
    text_field: str = option("text", "the field / column holding the text in JSONL, Parquet and datasets inputs")
    tokenizer: Literal["bpe", "byte"] = option("bpe", "byte-level BPE (learned on the train split) or raw bytes")
    vocab_size: int = option(4096, "BPE vocabulary size, special tokens included", range="[258, 1048576]")
    dir: str | None = option(
        None, "the prepared data directory (default: prepared/<dataset>-<tokenizer><vocab>)", flag="--out"
    )

    def __post_init__(self) -> None:
        if self.dataset and self.text_files:
            raise RecurformerError(
                f"config sets both data.dataset ({self.dataset}) and data.text_files ({', '.join(self.text_files)}); keep one"
            )
        if not self.dataset and not self.text_files and not self.dir:
            self.dataset = DEFAULT_DATASET
        if self.tokenizer == "bpe":  # (a byte tokenizer's vocabulary is its own: vocab_size is not read)
            check_fields(self, "config key 'data.{}'")

    def source_key(self) -> str | None:
        """A hash of what the prepared data is made of (dataset name or text file contents and
        field, tokenizer kind, vocabulary size), as ``prepare`` records it in meta.json; None when
        only ``dir`` is given."""
        from recurformer.data.prepare import source_key

        if not self.dataset and not self.text_files:
            return None
        return source_key(
            self.dataset, self.text_files or None, self.tokenizer, self.vocab_size, text_field=self.text_field
        )

    def prepare(self, out_dir: Path) -> dict:
        """Prepare this source (``data.prepare``) into ``out_dir``; returns the meta dict."""
        from recurformer.data.prepare import prepare

        return prepare(
            out_dir,
            dataset=self.dataset,
            text_files=self.text_files or None,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            text_field=self.text_field,
        )

    def resolved_dir(self) -> Path:
        """``data.dir``, or ``prepared/<dataset>-<tokenizer><vocab>`` for a bundled dataset and
        ``prepared/text-<content hash>-<tokenizer><vocab>`` for text files."""
        if self.dir:
            return Path(self.dir)
        name = (
            self.dataset or f"text-{(self.source_key() or '')[:12]}"
        )  # text_files: __post_init__ leaves no third case
        return Path("prepared") / f"{name}-{self.tokenizer}{self.vocab_size if self.tokenizer == 'bpe' else ''}"


__all__ = [
    "DATASETS",
    "DEFAULT_DATASET",
    "DataConfig",
    "Batch",
    "ContiguousStreams",
    "ShuffledWindows",
    "Tokenizer",
    "bundled_corpus",
    "eval_windows",
    "load_prepared",
    "prepare",
]
