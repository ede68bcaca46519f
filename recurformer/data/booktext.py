"""Book text for the long-context tasks (``needles``, ``babi``): one byte-level BPE over the bundled
books, the token streams a row's filler is cut from, and the layout of such a row.

Two texts from disjoint books (``corpora/README.md``): ``train`` is the first ``TRAIN_CHARS``
characters of ``books_train`` (47 books), ``test`` is all of ``books_val`` (4 others, about 410,000
tokens at vocabulary 1024). ``make_split``'s ``split`` picks which one a row's filler comes from.
A test row longer than ``books_val`` (rows of up to 1M tokens and more) takes its filler from
``books_val`` followed by ``LONG_TEST_CHARS`` characters of the ``books_train`` books that begin
after the train slice (books it never reads: about 2.0M tokens in all); rows that fit in
``books_val`` are drawn from it alone, as they always were.
The BPE is trained on the train slice only (a slice, so that training the tokenizer and encoding
both texts take a few seconds, not the ~30 s of all 37 MB); each is built once per process and
vocabulary (``functools.lru_cache``). The tasks' default vocabulary is 1024: a tiny synth model's
embedding and LM head stay small, and so do the logits of a row read at 1M tokens; the books hold
few digits, so every digit is one token at 1024 as at 4096, and a value costs the same tokens.

A row is ``filler[:p1], insert1, filler[p1:p2], insert2, ..., question, answer`` of exactly
``length + 1`` tokens before the shift: the inserts (needles, facts) keep their order at sorted
positions drawn uniformly from the filler's token boundaries, the filler is a window of the text at
a uniform offset (or repeated noise sentences from their start), and the answer's tokens are scored.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..config import opt
from .prepare import bundled_corpus
from .rows import Arrays, need, shift
from .tokenizer import Tokenizer

CORPORA = {"train": "books_train", "test": "books_val"}
TRAIN_CHARS = 2_000_000
LONG_TEST_CHARS = 4_200_000  # unread training books after books_val, for test rows longer than it


class Parts(NamedTuple):
    """One row's pieces as token lists: the inserts (in order), the question, the answer (scored),
    and for each insert how many of its last tokens are scored too (an answer inside the story)."""

    inserts: list[list[int]]
    question: list[int]
    answer: list[int]
    scored_tails: list[int] | None = None


def check_split(split: str) -> None:
    """A one-line error for a ``split`` that names no text."""
    need(split in CORPORA, f"unknown text split {split!r}: the splits are {', '.join(map(repr, CORPORA))}")


@lru_cache(maxsize=None)
def text(split: str, long: bool = False) -> str:
    """The books a ``split`` ("train" or "test") draws its filler from, as one string; ``long``
    (test only): ``books_val`` and then the first ``LONG_TEST_CHARS`` characters of the training
    books that begin after the train slice."""
    check_split(split)
    joined = "\n\n".join(bundled_corpus(CORPORA[split]))
    if split == "train":
        return joined[:TRAIN_CHARS]
    if not long:
        return joined
    unread, start = [], 0
    for book in bundled_corpus(CORPORA["train"]):
        if start >= TRAIN_CHARS:  # the train slice ends before this book begins
            unread.append(book)
        start += len(book) + 2
    return "\n\n".join([joined, *unread])[: len(joined) + 2 + LONG_TEST_CHARS]


@lru_cache(maxsize=4)
def tokenizer(vocab_size: int) -> Tokenizer:
    """The byte-level BPE of ``vocab_size`` tokens trained on the train text."""
    need(
        258 <= vocab_size <= 65536,
        f"{opt('task.vocab_size', vocab_size)} is not a BPE vocabulary size: give one in [258, 65536], e.g. "
        f"{opt('task.vocab_size', 1024)}",
    )
    return Tokenizer.train_bpe([text("train")], vocab_size)


@lru_cache(maxsize=8)
def stream(split: str, vocab_size: int, long: bool = False) -> np.ndarray:
    """The tokens of ``text(split, long)`` (int64, read-only: shared by every caller)."""
    out = np.asarray(tokenizer(vocab_size).encode(text(split, long)), dtype=np.int64)
    out.flags.writeable = False
    return out


def filler_stream(split: str, vocab_size: int, length: int) -> np.ndarray:
    """The tokens a row of ``length`` tokens cuts its filler from: the ``split`` text, or for a
    test row longer than it the long test text (``text(split, long=True)``)."""
    short = stream(split, vocab_size)
    return stream(split, vocab_size, long=True) if split == "test" and length + 1 > len(short) else short


@lru_cache(maxsize=4096)
def encode(vocab_size: int, s: str) -> tuple[int, ...]:
    """``s`` in the tokens of ``tokenizer(vocab_size)``, cached (a task's sentences repeat)."""
    return tuple(tokenizer(vocab_size).encode(s))


def check_fits(task: str, length: int, vocab_size: int, split: str, inserts: int, rest: int, noise: bool) -> None:
    """One-line errors, before any row is built, when a row of ``length`` tokens cannot hold the
    task: ``inserts`` (the most tokens its needles or facts can take) outnumber the filler that
    ``rest`` (the most its question and answer can take) leaves, or the ``split`` text is shorter
    than a row (book filler; ``noise`` repeats). Bounds, not one row's draw: a length that passes
    passes for every seed."""
    check_split(split)
    fill = length + 1 - inserts - rest
    need(
        fill >= inserts,
        f"task {task}: its needles or facts take up to {inserts} tokens, more than the filler ({max(fill, 0)} "
        f"tokens) of a row of {length} tokens: set {opt('task.length', 2 * inserts + rest - 1)} or more",
    )
    if not noise:
        have = len(filler_stream(split, vocab_size, length))
        books = CORPORA[split] + (" and the unread training books" if have > len(stream(split, vocab_size)) else "")
        need(
            length + 1 <= have,
            f"task {task} at {opt('task.length', length)} needs more filler than the {split} text has "
            f"({books}: {have:,} tokens at vocabulary {vocab_size}): set {opt('task.length', have - 1)} or less",
        )


def layout(
    rng: np.random.Generator, length: int, vocab_size: int, split: str, parts: list[Parts], noise: str | None = None
) -> Arrays:
    """The rows of ``parts`` (one per row; ``check_fits`` first), each ``length`` input tokens:
    filler from the ``split`` text (or ``noise`` repeated from its start), with the inserts in
    order at sorted uniform positions, then the question and the answer (scored; so are the last
    ``scored_tails`` tokens of each insert)."""
    source = (
        np.resize(np.asarray(encode(vocab_size, noise)), length + 1)
        if noise
        else filler_stream(split, vocab_size, length)
    )
    seq = np.empty((len(parts), length + 1), dtype=np.int64)
    scored = np.zeros_like(seq, dtype=bool)
    for i, (inserts, question, answer, tails) in enumerate(parts):
        fill = length + 1 - sum(len(x) for x in inserts) - len(question) - len(answer)
        start = 0 if noise else int(rng.integers(0, len(source) - fill + 1))
        filler = source[start : start + fill]
        cuts = np.sort(rng.integers(0, fill + 1, size=len(inserts)))
        pieces: list[np.ndarray | list[int]] = []
        end = 0  # where the row's last piece ends
        for a, b, x, tail in zip([0, *cuts[:-1]], cuts, inserts, tails or [0] * len(inserts)):
            pieces += [filler[a:b], x]
            end += b - a + len(x)
            scored[i, end - tail : end] = True
        seq[i] = np.concatenate([*pieces, filler[cuts[-1] if len(cuts) else 0 :], question, answer])
        scored[i, length + 1 - len(answer) :] = True
    return shift(seq, scored)
