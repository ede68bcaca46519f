"""RULER's needles in a haystack (Hsieh et al., "RULER: What's the Real Context Size of Your
Long-Context Language Models?", 2024, §3.1), as synth tasks over the bundled books
(``booktext``: the project's byte-level BPE; training rows cut from training books, held-out rows
from other books, chosen by ``make_split``'s ``split``).

A needle is "One of the special magic numbers for {key} is: {value}." (a key from ``KEYS``, an
adjective-noun pair as RULER's random words are; a value of 7 digits, or a UUID); the row ends
with the query "What is the special magic number for {key} mentioned in the provided text? The
special magic number for {key} mentioned in the provided text is" and the value, whose tokens are
scored (exact match of the whole value). The needle sits at a uniform token position of the filler.

- ``s_niah_1``: a number in noise sentences ("The grass is green. ..." repeated);
- ``s_niah_2``: a number in book text;
- ``s_niah_3``: a UUID in book text ("special magic uuid");
- ``mk_niah``: ``num_needles`` numbers with distinct keys in book text, one queried, the others
  distractors (RULER's MK-NIAH-1).

``length`` is the row's input tokens (the filler is what the needles, query and value leave).
"""

from __future__ import annotations

import uuid
from functools import lru_cache
from typing import Callable

import numpy as np

from ..config import opt
from .booktext import Parts, check_fits, encode, layout
from .rows import Arrays, need

NOISE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " One of the special magic {kind}s for {key} is:{value}."  # value: " 1234567"
QUERY = (
    " What is the special magic {kind} for {key} mentioned in the provided text?"
    " The special magic {kind} for {key} mentioned in the provided text is"
)
_ADJECTIVES = "ancient bitter brave calm crimson eager fancy gentle hollow icy jolly lucky mellow noble quiet rapid"
_NOUNS = (
    "anchor badger candle dragon falcon garden harbor island jacket kettle lantern meadow orchard pepper river saddle"
)
KEYS = [f"{a}-{b}" for a in _ADJECTIVES.split() for b in _NOUNS.split()]  # 256 keys


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _uuid(rng: np.random.Generator) -> str:
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


VALUE_CHARS: dict[Callable[[np.random.Generator], str], int] = {_number: 7, _uuid: 36}


@lru_cache(maxsize=16)
def _longest(vocab_size: int, kind: str) -> tuple[int, int]:
    """The most tokens a needle's words and a query take over every key (the value apart: the
    tokenizer's pre-tokenizer splits " {value}" off the words around it)."""
    head, tail = NEEDLE.split("{value}")
    needle = max(len(encode(vocab_size, head.format(kind=kind, key=k))) for k in KEYS) + len(encode(vocab_size, tail))
    return needle, max(len(encode(vocab_size, QUERY.format(kind=kind, key=k))) for k in KEYS)


def _niah(
    rng: np.random.Generator,
    n: int,
    task: str,
    vocab_size: int,
    length: int,
    split: str,
    num_needles: int = 1,
    value: Callable[[np.random.Generator], str] = _number,
    kind: str = "number",
    noise: str | None = None,
) -> Arrays:
    """``n`` rows of ``num_needles`` needles with distinct keys, the first of them queried."""
    need(
        1 <= num_needles <= len(KEYS),
        f"task {task} draws each needle's key from {len(KEYS)} keys, got {opt('task.num_needles', num_needles)}: "
        f"set {opt('task.num_needles', min(max(num_needles, 1), len(KEYS)))}",
    )
    words, query = _longest(vocab_size, kind)
    value_tokens = 1 + VALUE_CHARS[value]  # at most one token a byte, the space included
    inserts = num_needles * (words + value_tokens)
    check_fits(task, length, vocab_size, split, inserts, query + value_tokens, noise is not None)
    parts: list[Parts] = []
    for _ in range(n):
        keys = [KEYS[k] for k in rng.choice(len(KEYS), size=num_needles, replace=False)]
        values = [value(rng) for _ in keys]
        needles = [
            list(encode(vocab_size, NEEDLE.format(kind=kind, key=k, value=" " + v))) for k, v in zip(keys, values)
        ]
        order = rng.permutation(num_needles)  # the queried needle at a random rank among the others
        question = list(encode(vocab_size, QUERY.format(kind=kind, key=keys[0])))
        parts.append(Parts([needles[j] for j in order], question, list(encode(vocab_size, " " + values[0]))))
    return layout(rng, length, vocab_size, split, parts, noise)


def s_niah_1(
    rng: np.random.Generator, n: int, vocab_size: int = 1024, length: int = 256, *, split: str = "train"
) -> Arrays:
    """RULER S-NIAH-1: a 7-digit number in repeated noise sentences (the same for every split)."""
    return _niah(rng, n, "s_niah_1", vocab_size, length, split, noise=NOISE)


def s_niah_2(
    rng: np.random.Generator, n: int, vocab_size: int = 1024, length: int = 256, *, split: str = "train"
) -> Arrays:
    """RULER S-NIAH-2: a 7-digit number in book text."""
    return _niah(rng, n, "s_niah_2", vocab_size, length, split)


def s_niah_3(
    rng: np.random.Generator, n: int, vocab_size: int = 1024, length: int = 256, *, split: str = "train"
) -> Arrays:
    """RULER S-NIAH-3: a UUID in book text."""
    return _niah(rng, n, "s_niah_3", vocab_size, length, split, value=_uuid, kind="uuid")


def mk_niah(
    rng: np.random.Generator,
    n: int,
    vocab_size: int = 1024,
    length: int = 512,
    num_needles: int = 4,
    *,
    split: str = "train",
) -> Arrays:
    """RULER MK-NIAH-1: ``num_needles`` 7-digit numbers with distinct keys in book text, one queried."""
    return _niah(rng, n, "mk_niah", vocab_size, length, split, num_needles=num_needles)


NEEDLES = {f.__name__: f for f in (s_niah_1, s_niah_2, s_niah_3, mk_niah)}
