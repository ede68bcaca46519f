"""The probe's documents: rows of tokens that a model reads (the true history, and the same with a
passage or the older history swapped for other text) and the comparisons between their losses
(see the package's docstring), from a bundled dataset or text files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import RecurformerError
from ..data.prepare import EOT, REPEAT_PROMPT, load_documents
from ..data.tokenizer import Tokenizer
from .options import ProbeOptions

MARKER_TEXT = f"\n{REPEAT_PROMPT}\n"


@dataclass
class Comparison:
    """metric value = loss[row_a][pos_a] − loss[row_b][pos_b] at each entry, filed under ``distance``."""

    metric: str
    row_a: int
    pos_a: np.ndarray
    row_b: int
    pos_b: np.ndarray
    distance: np.ndarray


@dataclass
class Sample:
    """One document: ``rows`` of equal length (row 0 holds the true history) and what to compare."""

    rows: list[np.ndarray]
    comparisons: list[Comparison] = field(default_factory=list)


def _encode(tok: Tokenizer, docs: Sequence[str], append_eos: bool) -> list[np.ndarray]:
    tail = [tok.eos_id] if append_eos else []
    return [np.asarray([tok.bos_id, *ids, *tail], dtype=np.int64) for ids in tok.encode_batch(list(docs))]


def _prefix(stream: np.ndarray, end: int, length: int) -> np.ndarray:
    """The ``length`` stream tokens before position ``end`` (wrapping around the stream's start)."""
    idx = (np.arange(end - length, end)) % len(stream)
    return stream[idx]


def _repeat_sample(
    prefix: np.ndarray,
    head: np.ndarray,
    s1: np.ndarray,
    gap: np.ndarray,
    marker: np.ndarray,
    s2: np.ndarray,
    tail: np.ndarray,
    alt: np.ndarray,
) -> Sample:
    """Rows [prefix, head, s1, gap, marker, s2, tail] and the same with s1 replaced by ``alt``.
    copy_gain(k) is filed under k (the contexts of s1[k] and s2[k] agree on their last k tokens);
    swap_Δ(k) under k + |gap| + |marker|, the distance back to the nearest swapped token."""
    n = len(s1)
    true = np.concatenate([prefix, head, s1, gap, marker, s2, tail])
    swapped = np.concatenate([prefix, head, alt, gap, marker, s2, tail])
    a = len(prefix) + len(head)  # position of s1[0]
    b = a + n + len(gap) + len(marker)  # position of s2[0]
    k = np.arange(n)
    return Sample(
        rows=[true, swapped],
        comparisons=[
            Comparison("copy_gain", 0, a + k, 0, b + k, k),
            Comparison("swap_delta", 1, b + k, 0, b + k, k + len(gap) + len(marker)),
        ],
    )


def split_copy_document(doc: np.ndarray, marker: np.ndarray, tail: int) -> tuple[np.ndarray, ...] | None:
    """[BOS] s1 gap marker s2 [EOS]: s2 follows the last marker and s1 = s2 opens the document.
    Returns (head, s1, gap, marker, s2, tail) or None when the tokens do not have that form."""
    m = len(marker)
    body = doc[1 : len(doc) - tail]
    if len(body) < m:
        return None
    hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(body, m) == marker).all(axis=1))
    if not len(hits):
        return None
    last = int(hits[-1])
    s2 = body[last + m :]
    n = len(s2)
    if n == 0 or last < n or not np.array_equal(body[:n], s2):
        return None
    return doc[:1], body[:n], body[n:last], marker, s2, doc[len(doc) - tail :]


def repeat_samples(
    tok: Tokenizer,
    dataset: str | None,
    text: Sequence[str] | None,
    n_docs: int,
    passage: int,
    warm: tuple[int, int],
    rng: np.random.Generator,
) -> list[Sample]:
    """Copy documents. Documents that hold the marker (``tinystories-repeat``: BOS, story,
    marker, story, EOS, as trained on; or text files of ``s1 gap marker s1`` documents, e.g.
    scripts/make_copy_task.py) are split at their last marker; any other text gives
    ``passage``-token pieces of it."""
    marker = np.asarray(tok.encode(MARKER_TEXT), dtype=np.int64)
    if dataset == "tinystories-repeat":
        stories = load_documents("tinystories-sample", None, 0.05)[1]
        texts, eos = [f"{s}{MARKER_TEXT}{s}" for s in stories], True
    else:
        texts, eos = documents(dataset, text), False
        if not any(MARKER_TEXT in t for t in texts):
            return repeat_samples_from_stream(
                np.concatenate(_encode(tok, texts, eos)), marker, n_docs, passage, warm, rng
            )
    docs = _encode(tok, texts, eos)
    parts = [split_copy_document(d, marker, int(eos)) for d in docs]
    usable = [i for i, x in enumerate(parts) if x is not None]
    if len(usable) < n_docs:
        raise RecurformerError(
            f"the text has {len(usable)} copy documents (s1, marker, s1), fewer than --docs {n_docs}; give more or ask for fewer"
        )
    stream = np.concatenate(docs)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    samples = []
    for i in np.sort(rng.choice(usable, size=n_docs, replace=False)):
        head, s1, gap, mk, s2, tail = parts[i]
        # the swapped passage: the copied passages of the next documents, cut to len(s1)
        pool: list[np.ndarray] = []
        j = (usable.index(i) + 1) % len(usable)
        while sum(len(q) for q in pool) < len(s1):
            pool.append(parts[usable[j]][1])  # type: ignore[index]
            j = (j + 1) % len(usable)
        alt = np.concatenate(pool)[: len(s1)]
        p = int(rng.integers(warm[0], warm[1] + 1))
        samples.append(_repeat_sample(_prefix(stream, int(starts[i]), p), head, s1, gap, mk, s2, tail, alt))
    return samples


def _elsewhere(stream: np.ndarray, at: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``length`` tokens of ``stream`` starting half to three quarters of the stream away from ``at``."""
    o = (at + len(stream) // 2 + int(rng.integers(0, len(stream) // 4))) % (len(stream) - length)
    return stream[o : o + length]


def _check_length(stream: np.ndarray, need: int, what: str, smaller: str) -> None:
    """One line where ``stream`` is shorter than 4 ``need`` tokens (room for the random offsets of
    pieces of ``need`` tokens): ``what`` it is too short for, and ``smaller``, the options to lower."""
    if len(stream) < 4 * need:
        raise RecurformerError(
            f"the text has {len(stream):,} tokens, too short for {what} (need at least {4 * need:,}); "
            f"give more text or {smaller}"
        )


def repeat_samples_from_stream(
    stream: np.ndarray, marker: np.ndarray, n_docs: int, passage: int, warm: tuple[int, int], rng: np.random.Generator
) -> list[Sample]:
    """Copy documents ``prefix, s1, marker, s1`` with s1 a ``passage``-token piece of ``stream``,
    and the swapped passage a piece from elsewhere in the stream."""
    need = warm[1] + 2 * passage + 1
    _check_length(
        stream, need, f"{passage}-token passages after a prefix of up to {warm[1]}", "a smaller --passage / --warm-max"
    )
    samples = []
    for _ in range(n_docs):
        at = int(rng.integers(warm[1], len(stream) - passage))
        s1 = stream[at : at + passage]
        alt = _elsewhere(stream, at, passage, rng)
        p = int(rng.integers(max(warm[0], 1), max(warm[1], 1) + 1))  # s1[0] needs a token to be predicted from
        empty = stream[:0]
        samples.append(_repeat_sample(_prefix(stream, at, p), empty, s1, empty, marker, s1, empty, alt))
    return samples


def swap_samples(
    stream: np.ndarray,
    n_docs: int,
    distances: Sequence[int],
    span: int,
    warm: tuple[int, int],
    rng: np.random.Generator,
) -> list[Sample]:
    """For each sample: a true history of ``max(distances)`` + a random warm prefix, ``span``
    targets after it, and one row per distance d whose history older than d is other text."""
    if not distances or min(distances) < 0:
        raise RecurformerError(f"--distances must be non-negative integers, got {list(distances)}")
    dmax = max(distances)
    length = dmax + warm[1] + span
    _check_length(
        stream, length, f"histories of {dmax} + a prefix of up to {warm[1]} tokens", "smaller --distances / --warm-max"
    )
    samples = []
    for _ in range(n_docs):
        hist = dmax + int(rng.integers(warm[0], warm[1] + 1))
        t0 = int(rng.integers(hist, len(stream) - span))
        true = stream[t0 - hist : t0 + span]
        other = _elsewhere(stream, t0, hist, rng)
        rows, comps = [true], []
        i = np.arange(span)
        for d in distances:
            row = true.copy()
            row[: hist - d] = other[: hist - d]
            rows.append(row)
            comps.append(Comparison("swap_delta", len(rows) - 1, hist + i, 0, hist + i, d + i))
        samples.append(Sample(rows, comps))
    return samples


def documents(dataset: str | None, text: Sequence[str] | None) -> list[str]:
    """The val documents of a bundled ``dataset``, or the documents of UTF-8 ``text`` files
    (separated by ``<|endoftext|>``)."""
    if not text:
        return load_documents(dataset, None, 0.05)[1]
    docs: list[str] = []
    for f in text:
        p = Path(f)
        if not p.is_file():
            raise RecurformerError(f"text file not found: {f}")
        try:
            docs += [d.strip() for d in p.read_text(encoding="utf-8").split(EOT) if d.strip()]
        except UnicodeDecodeError as e:
            raise RecurformerError(f"{f} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    return docs


def text_stream(tok: Tokenizer, dataset: str | None, text: Sequence[str] | None) -> np.ndarray:
    """The documents of ``documents(dataset, text)`` as one token stream, BOS before each (and
    EOS after each for ``tinystories-repeat``, as it was trained)."""
    return np.concatenate(_encode(tok, documents(dataset, text), append_eos=dataset == "tinystories-repeat"))


def samples_for(o: ProbeOptions, tok: Tokenizer, dataset: str | None, vocab_size: int) -> list[Sample]:
    """The documents of the probe of the options ``o`` (its ``task``, ``repeat`` or ``swap``; checked
    where they were built), checked against the model's vocabulary; the same ``seed`` gives the
    same documents for every checkpoint (``recurformer probe`` and ``recurformer.probe`` alike).
    ``dataset``: the one resolved from ``o.dataset`` and its defaults."""
    text = [str(f) for f in o.text] if o.text else None
    warm: tuple[int, int] = tuple(o.warm)  # type: ignore[assignment]
    rng = np.random.default_rng(o.seed)
    if o.task == "repeat":
        samples = repeat_samples(tok, dataset, text, o.docs, o.passage, warm, rng)
    else:
        samples = swap_samples(text_stream(tok, dataset, text), o.docs, list(o.distances), o.span, warm, rng)
    top = max(int(r.max()) for s in samples for r in s.rows)
    if top >= vocab_size:
        raise RecurformerError(f"probe text has token id {top} >= the model's vocabulary ({vocab_size})")
    return samples
