"""Data layer: bundled corpora, tokenizers, dataset preparation and stateful batch streams."""

from recurformer.data.prepare import DATASETS, bundled_corpus, load_prepared, prepare
from recurformer.data.streams import Batch, ContiguousStreams, ShuffledWindows, eval_windows
from recurformer.data.tokenizer import Tokenizer

__all__ = [
    "DATASETS",
    "Batch",
    "ContiguousStreams",
    "ShuffledWindows",
    "Tokenizer",
    "bundled_corpus",
    "eval_windows",
    "load_prepared",
    "prepare",
]
