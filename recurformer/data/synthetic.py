"""Synthetic diagnostic tasks ("The Recurrent Transformer: Greater Effective Depth and Efficient
Decoding", "Synthetic diagnostics": MAD + the copy task; Brenndoerfer, "Recurrent Memory: Extending
Transformer Context with Segment-Level State Caching": the copying task with a delay; a passkey task for lengths beyond any window; multi-query
associative recall with the pairs a controlled distance back, after Arora et al., "Zoology").

Every task is a generator ``fn(rng, n, **params) -> (inputs, targets)`` of int64 arrays [n, T]
in next-token form: the model reads ``inputs`` and is scored at position t on ``targets[t]``;
``targets`` is ``IGNORE_INDEX`` (-100) wherever the task does not score. ``vocab_size`` is always
the whole vocabulary the model needs (special tokens included). ``make_split`` draws a seeded,
de-duplicated set of rows; splits built with disjoint ``exclude`` sets share no input row.

Deviations from MAD (athms/mad-lab), on purpose:
- training uses the same masked targets as the test (MAD trains the recall tasks on every
  next token, including unpredictable keys and first-seen values);
- fuzzy recall uses random motif sizes in training and test alike (MAD: test keys are max size);
- compression is scored through MAD's AutoEncoder head (``Task.head == "autoencoder"``): the
  model reads the row and a separate decoder reconstructs every token from the model's features
  at the *last* position only (``recurformer.synth.learner.CompressionDecoder``); the LM head is unused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..config import RecurformerError, coerce, suggest
from ..state import IGNORE_INDEX
from .babi import BABI
from .needles import NEEDLES
from .rows import Arrays, TaskData
from .rows import need as _need
from .rows import shift as _shift
from .zoology import mqar_zoology

# ----------------------------------------------------------------------------------------------
# MAD tasks


def in_context_recall(rng: np.random.Generator, n: int, vocab_size: int = 16, seq_len: int = 128) -> Arrays:
    """MAD in-context recall (multi-query). Baseline: vocab 16, length 128, 12,800 training
    examples (1,280 test).

    Keys are tokens [0, V/2), values [V/2, V). Each row draws a random key -> value map, then
    ``seq_len/2`` (key, value) pairs with random keys; the last pair re-asks a key shown earlier.
    inputs = pairs[:-1] (length seq_len - 1); a position is scored when the next token is the
    value of a key that already appeared earlier in the row (its answer is in context)."""
    _need(vocab_size >= 4 and vocab_size % 2 == 0, f"in_context_recall needs an even vocab_size >= 4, got {vocab_size}")
    _need(seq_len >= 6 and seq_len % 2 == 0, f"in_context_recall needs an even seq_len >= 6, got {seq_len}")
    nk, P = vocab_size // 2, seq_len // 2
    mapping = rng.integers(nk, vocab_size, size=(n, nk))
    keys = rng.integers(0, nk, size=(n, P))
    keys[:, -1] = keys[np.arange(n), rng.integers(0, P - 1, size=n)]
    seq = np.empty((n, seq_len), dtype=np.int64)
    seq[:, 0::2] = keys
    seq[:, 1::2] = np.take_along_axis(mapping, keys, axis=1)
    scored = np.zeros_like(seq, dtype=bool)
    for i in range(n):
        seen: set[int] = set()
        for p, k in enumerate(keys[i]):
            scored[i, 2 * p + 1] = int(k) in seen
            seen.add(int(k))
    return _shift(seq, scored)


def noisy_in_context_recall(
    rng: np.random.Generator,
    n: int,
    vocab_size: int = 32,
    seq_len: int = 128,
    noise_vocab: int = 16,
    frac_noise: float = 0.2,
) -> Arrays:
    """MAD noisy in-context recall. Baseline: vocab 32 (16 of them noise), length 128,
    frac_noise 0.2, 12,800 training examples.

    As ``in_context_recall`` with keys [0, K/2) and values [K/2, K), K = V - noise_vocab; each
    pair slot except the last (the probe, a real pair re-asking an earlier real key) and the first
    (so a real key exists) becomes two random noise tokens [K, V) with probability frac_noise.
    Scored: values of real keys already seen earlier; noise is never scored."""
    K = vocab_size - noise_vocab
    _need(
        K >= 4 and K % 2 == 0 and noise_vocab >= 1,
        f"noisy_in_context_recall needs vocab_size - noise_vocab even and >= 4, got {K}",
    )
    _need(seq_len >= 6 and seq_len % 2 == 0, f"noisy_in_context_recall needs an even seq_len >= 6, got {seq_len}")
    _need(0 <= frac_noise < 1, f"frac_noise must be in [0, 1), got {frac_noise}")
    nk, P = K // 2, seq_len // 2
    seq = np.empty((n, seq_len), dtype=np.int64)
    scored = np.zeros_like(seq, dtype=bool)
    for i in range(n):
        mapping = rng.integers(nk, K, size=nk)
        noise = rng.random(P) < frac_noise
        noise[0] = noise[-1] = False
        keys = rng.integers(0, nk, size=P)
        real = np.flatnonzero(~noise[:-1])
        keys[-1] = keys[rng.choice(real)]
        seen: set[int] = set()
        for p in range(P):
            if noise[p]:
                seq[i, 2 * p : 2 * p + 2] = rng.integers(K, vocab_size, size=2)
                continue
            seq[i, 2 * p], seq[i, 2 * p + 1] = keys[p], mapping[keys[p]]
            scored[i, 2 * p + 1] = int(keys[p]) in seen
            seen.add(int(keys[p]))
    return _shift(seq, scored)


def fuzzy_in_context_recall(
    rng: np.random.Generator, n: int, vocab_size: int = 16, seq_len: int = 128, max_motif: int = 3
) -> Arrays:
    """MAD fuzzy in-context recall. Baseline: vocab 16, length 128, motifs of at most 3 tokens,
    12,800 training examples.

    Pad = V - 1; key tokens [0, (V-1)/2), value tokens [(V-1)/2, V-1). Keys and values are motifs
    of 1..max_motif distinct tokens. Each row is a list of (key motif, value motif) pairs: each
    pair either introduces a new key with a random value motif (always for the first, otherwise
    with probability 1/2) or repeats an earlier pair; the last pair always repeats one. The row is
    left-padded with pad to seq_len + 1 tokens and shifted (inputs length seq_len). Scored: the
    value tokens of repeated pairs."""
    nk = (vocab_size - 1) // 2
    _need(
        max_motif >= 1 and nk >= max_motif + 1,
        f"fuzzy_in_context_recall needs (vocab_size-1)/2 > max_motif, got vocab {vocab_size}",
    )
    _need(seq_len >= 4 * max_motif + 1, f"fuzzy_in_context_recall needs seq_len >= {4 * max_motif + 1}, got {seq_len}")
    pad, budget = vocab_size - 1, seq_len + 1
    seq = np.full((n, budget), pad, dtype=np.int64)
    scored = np.zeros_like(seq, dtype=bool)
    for i in range(n):
        pairs: dict[tuple[int, ...], tuple[int, ...]] = {}
        row: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
        used = 0
        while True:
            final = used + 4 * max_motif > budget
            if pairs and (final or rng.random() < 0.5):
                key = list(pairs)[rng.integers(len(pairs))]
                row.append((key, pairs[key], True))
            else:
                key = tuple(int(t) for t in rng.choice(nk, size=rng.integers(1, max_motif + 1), replace=False))
                if key in pairs:
                    continue
                pairs[key] = tuple(
                    int(t)
                    for t in rng.choice(np.arange(nk, 2 * nk), size=rng.integers(1, max_motif + 1), replace=False)
                )
                row.append((key, pairs[key], False))
            used += len(row[-1][0]) + len(row[-1][1])
            if final:
                break
        p = budget - used
        for key, val, repeat in row:
            seq[i, p : p + len(key)] = key
            p += len(key)
            seq[i, p : p + len(val)] = val
            scored[i, p : p + len(val)] = repeat
            p += len(val)
    return _shift(seq, scored)


def selective_copying(
    rng: np.random.Generator, n: int, vocab_size: int = 16, seq_len: int = 256, num_tokens: int = 16
) -> Arrays:
    """MAD selective copying. Baseline: vocab 16, length 256, 16 tokens to copy, 12,800
    training examples.

    Content tokens [0, V-2), blank V-2, copy V-1. inputs (length seq_len): ``num_tokens`` content
    tokens scattered in order among seq_len - 2*num_tokens - 1 blanks, then the copy token, then
    num_tokens blanks. targets are *not shifted* (as in MAD): -100 except the last num_tokens
    positions, which hold the content tokens in order (the first is predicted while reading the
    first blank after the copy token)."""
    _need(vocab_size >= 3, f"selective_copying needs vocab_size >= 3, got {vocab_size}")
    _need(
        num_tokens >= 1 and seq_len >= 2 * num_tokens + 1,
        f"selective_copying needs seq_len >= 2 * num_tokens + 1, got {seq_len}",
    )
    blank, copy, N = vocab_size - 2, vocab_size - 1, num_tokens
    head = seq_len - N - 1
    inputs = np.full((n, seq_len), blank, dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    tokens = rng.integers(0, vocab_size - 2, size=(n, N))
    for i in range(n):
        pos = np.sort(rng.choice(head, size=N, replace=False))
        inputs[i, pos] = tokens[i]
    inputs[:, head] = copy
    targets[:, seq_len - N :] = tokens
    return inputs, targets


def memorization(
    rng: np.random.Generator, n: int, vocab_size: int = 256, seq_len: int = 32, map_seed: int = 0
) -> Arrays:
    """MAD memorization. Baseline: vocab 256, length 32, 256 training examples.

    A fixed key -> value map drawn from ``map_seed`` (the same for every split, so the test asks
    training facts in new rows, as in MAD): keys [0, (V-1)/2), values [(V-1)/2, V-1), insert token
    V-1. inputs: seq_len/2 (key, insert) pairs with distinct random keys; targets: the key's value
    at each insert position, -100 at keys."""
    nk = (vocab_size - 1) // 2
    _need(
        nk >= 1 and seq_len % 2 == 0 and seq_len >= 2,
        f"memorization needs vocab_size >= 3 and an even seq_len, got {vocab_size}, {seq_len}",
    )
    _need(seq_len // 2 <= nk, f"memorization needs seq_len/2 <= {nk} distinct keys, got seq_len {seq_len}")
    values = np.random.default_rng(map_seed).integers(nk, 2 * nk, size=nk)
    keys = np.stack([rng.choice(nk, size=seq_len // 2, replace=False) for _ in range(n)])
    inputs = np.full((n, seq_len), vocab_size - 1, dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    inputs[:, 0::2] = keys
    targets[:, 1::2] = values[keys]
    return inputs, targets


def compression(rng: np.random.Generator, n: int, vocab_size: int = 16, seq_len: int = 32) -> Arrays:
    """MAD compression. Baseline: vocab 16, length 32, 12,800 training examples.

    inputs: seq_len - 1 random tokens from [0, V-1), then the compression token V-1. targets =
    inputs, every position scored. Not next-token prediction: the task is read with the
    AutoEncoder head, which must rebuild all seq_len tokens from the model's features at the last
    position (the compression token), so those features are the only bottleneck."""
    _need(
        vocab_size >= 3 and seq_len >= 2,
        f"compression needs vocab_size >= 3 and seq_len >= 2, got {vocab_size}, {seq_len}",
    )
    inputs = np.concatenate(
        [rng.integers(0, vocab_size - 1, size=(n, seq_len - 1)), np.full((n, 1), vocab_size - 1)], axis=1
    )
    return inputs, inputs.copy()


# ----------------------------------------------------------------------------------------------
# copy tasks and passkey


def copy(rng: np.random.Generator, n: int, vocab_size: int = 30, min_len: int = 5, max_len: int = 20) -> Arrays:
    """Jelassi et al. copy task (the copy diagnostic of "The Recurrent Transformer: Greater Effective
    Depth and Efficient Decoding"). Defaults: 26 letters + 4 specials, training strings of 5..20
    letters (the authors' code; it evaluates 10..19).

    Letters [0, V-4), then ``$`` = V-4 (BOS), ``|`` = V-3 (separator), ``.`` = V-2 (EOS),
    ``*`` = V-1 (pad). A row is ``$ s | s .`` with |s| uniform in [min_len, max_len], right-padded
    with ``*`` to 2*max_len + 3 and shifted (inputs length 2*max_len + 2). Scored: the copy and the
    final ``.`` (predicted from ``|`` through the last copied letter). One example per row (the
    authors pack several per training row)."""
    A = vocab_size - 4
    _need(A >= 2, f"copy needs vocab_size >= 6 (letters + 4 specials), got {vocab_size}")
    _need(1 <= min_len <= max_len, f"copy needs 1 <= min_len <= max_len, got {min_len}, {max_len}")
    bos, sep, eos, pad = A, A + 1, A + 2, A + 3
    seq = np.full((n, 2 * max_len + 3), pad, dtype=np.int64)
    scored = np.zeros_like(seq, dtype=bool)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    for i, ell in enumerate(lengths):
        s = rng.integers(0, A, size=ell)
        seq[i, : 2 * ell + 3] = np.concatenate([[bos], s, [sep], s, [eos]])
        scored[i, ell + 2 : 2 * ell + 3] = True
    return _shift(seq, scored)


def delayed_copy(
    rng: np.random.Generator, n: int, vocab_size: int = 10, copy_len: int = 10, delay: int = 100
) -> Arrays:
    """The copying task with a delay of Brenndoerfer, "Recurrent Memory: Extending Transformer
    Context with Segment-Level State Caching" ("Evaluation: Comparing Context Approaches"):
    blank = 0, content tokens [1, V-1), signal V-1; defaults vocab 10, 10 tokens (its delays:
    50, 100, 200, 400).

    inputs (length 2*copy_len + delay): the copy_len content tokens, ``delay`` blanks, the signal,
    copy_len - 1 blanks. targets: the content tokens in order at the signal and the blanks after
    it, -100 elsewhere. (That listing scores only tokens 1..copy_len-1, one position late;
    here the signal position predicts the first token, so every token is asked.)"""
    _need(vocab_size >= 3, f"delayed_copy needs vocab_size >= 3, got {vocab_size}")
    _need(copy_len >= 1 and delay >= 0, f"delayed_copy needs copy_len >= 1 and delay >= 0, got {copy_len}, {delay}")
    c = copy_len
    tokens = rng.integers(1, vocab_size - 1, size=(n, c))
    inputs = np.zeros((n, 2 * c + delay), dtype=np.int64)
    targets = np.full_like(inputs, IGNORE_INDEX)
    inputs[:, :c] = tokens
    inputs[:, c + delay] = vocab_size - 1
    targets[:, c + delay :] = tokens
    return inputs, targets


def passkey(
    rng: np.random.Generator,
    n: int,
    vocab_size: int = 32,
    length: int = 256,
    key_len: int = 4,
    key_vocab: int = 16,
    key_span: float = 0.0,
) -> Arrays:
    """Passkey retrieval: a key of ``key_len`` tokens from [0, key_vocab) inside ``length`` random
    filler tokens from [key_vocab, V-1), the query marker V-1, then the key again (teacher-forced).
    inputs = (filler[:p], key, filler[p:], query, key)[:-1], length 2*key_len + length; scored: the
    key_len positions from the query marker on, which predict the key tokens in order.

    ``p``, the filler tokens before the key, is drawn per row uniformly from
    [0, floor(key_span * length)]: 0 puts the key first in every row; 0.5 anywhere in the first half
    of the filler, so the model must write the key when it sees it, not at the row's start (as
    "BABILong", Kuratov et al. 2024, §2, hides its facts at random positions). The nearest copy of
    key token j is at least ``length - floor(key_span * length) + key_len + 1`` positions before the
    position that must predict it, so a model that sees only a window of at most
    ``length - floor(key_span * length) + 1`` tokens cannot beat chance."""
    _need(key_len >= 1 and length >= 0, f"passkey needs key_len >= 1 and length >= 0, got {key_len}, {length}")
    _need(
        2 <= key_vocab <= vocab_size - 2,
        f"passkey needs 2 <= key_vocab <= vocab_size - 2, got {key_vocab}, {vocab_size}",
    )
    _need(0.0 <= key_span <= 1.0, f"passkey needs 0 <= key_span <= 1 (a fraction of the filler), got {key_span}")
    m = key_len
    key = rng.integers(0, key_vocab, size=(n, m))
    body = np.concatenate([key, rng.integers(key_vocab, vocab_size - 1, size=(n, length))], axis=1)
    p = rng.integers(0, int(key_span * length) + 1, size=(n, 1))  # filler tokens before the key, per row
    col = np.arange(m + length)[None, :]  # row r reads body's columns m..m+p-1, then 0..m-1, then m+p..
    body = np.take_along_axis(body, np.where(col < p, col + m, np.where(col < p + m, col - p, col)), axis=1)
    seq = np.concatenate([body, np.full((n, 1), vocab_size - 1), key], axis=1)
    scored = np.zeros_like(seq, dtype=bool)
    scored[:, -m:] = True
    return _shift(seq, scored)


def mqar(
    rng: np.random.Generator,
    n: int,
    vocab_size: int = 64,
    key_vocab: int = 24,
    value_vocab: int = 24,
    num_pairs: int = 8,
    num_queries: int = 8,
    distance: int = 0,
    seq_len: int = 0,
) -> Arrays:
    """Multi-query associative recall (Arora et al., "Zoology: Measuring and Improving Recall in
    Efficient Language Models", 2023, §3 and appendix on MQAR), with the pairs a controlled
    distance back.

    Keys [0, key_vocab), values [key_vocab, key_vocab + value_vocab), filler the remaining tokens
    (at least one). A row: filler, ``num_pairs`` (key, value) pairs with distinct random keys and
    values drawn independently (so no value can be inferred from the others), ``distance`` filler
    tokens, then ``num_queries`` of those keys (distinct, random order), each followed by its value
    (teacher-forced). inputs = row[:-1], of length ``seq_len`` (0: the shortest row,
    2 * num_pairs + distance + 2 * num_queries - 1; longer rows get more filler in front).
    Scored: each query key's position, which predicts the key's value.

    The last pair token is ``distance + 1 + 2j`` positions before the position that answers query
    j, so a model that reads at most ``distance + 1`` tokens (itself included) sees no pair from
    any query and cannot beat chance, 1 / value_vocab."""
    _need(
        key_vocab >= 1 and value_vocab >= 2,
        f"mqar needs key_vocab >= 1 and value_vocab >= 2, got {key_vocab}, {value_vocab}",
    )
    _need(
        vocab_size > key_vocab + value_vocab,
        f"mqar needs vocab_size > key_vocab + value_vocab (filler), got {vocab_size}",
    )
    _need(1 <= num_pairs <= key_vocab, f"mqar needs 1 <= num_pairs <= key_vocab ({key_vocab}), got {num_pairs}")
    _need(1 <= num_queries <= num_pairs, f"mqar needs 1 <= num_queries <= num_pairs ({num_pairs}), got {num_queries}")
    _need(distance >= 0, f"task parameter 'distance' must be >= 0, got {distance}")
    P, Q = num_pairs, num_queries
    shortest = 2 * P + distance + 2 * Q - 1
    _need(
        seq_len == 0 or seq_len >= shortest,
        f"task parameter 'distance' = {distance} does not fit in seq_len {seq_len}: {P} pairs, the distance and {Q} queries need {shortest}",
    )
    S = max(seq_len, shortest) + 1  # tokens of the row before the shift
    filler = key_vocab + value_vocab
    seq = rng.integers(filler, vocab_size, size=(n, S))
    keys = np.argsort(rng.random((n, key_vocab)), axis=1)[:, :P]  # distinct keys per row
    values = rng.integers(key_vocab, filler, size=(n, P))
    a = S - 2 * Q - distance - 2 * P  # where the pairs begin
    seq[:, a : a + 2 * P : 2], seq[:, a + 1 : a + 2 * P : 2] = keys, values
    asked = np.argsort(rng.random((n, P)), axis=1)[:, :Q]  # which pairs are queried, in order
    rows = np.arange(n)[:, None]
    q0 = S - 2 * Q
    seq[:, q0::2], seq[:, q0 + 1 :: 2] = keys[rows, asked], values[rows, asked]
    scored = np.zeros_like(seq, dtype=bool)
    scored[:, q0 + 1 :: 2] = True
    return _shift(seq, scored)


# ----------------------------------------------------------------------------------------------
# registry and splits


@dataclass(frozen=True)
class Task:
    name: str
    fn: Callable[..., Arrays]
    metric: str  # "token": token accuracy (MAD); "sequence": exact match of every scored token per row
    train_size: int  # the baseline number of training examples
    head: str = "lm"  # "lm": next-token targets; "autoencoder": decode every target from the last position
    length_key: tuple[str, ...] = ()  # the parameter(s) a length sweep sets (passkey filler, copy string, delay)
    texts: bool = False  # the filler is book text: ``make_split``'s ``split`` picks training or test books

    @property
    def defaults(self) -> dict[str, Any]:
        params = list(inspect.signature(self.fn).parameters.items())[2:]
        return {k: p.default for k, p in params if p.kind is not p.KEYWORD_ONLY}  # (``split`` is no parameter)

    def at_length(self, params: dict[str, Any], length: int) -> dict[str, Any]:
        """``params`` with the task's length set to ``length`` (every row exactly that long)."""
        _need(bool(self.length_key), f"task {self.name} has no length to sweep")
        return {**params, **{k: length for k in self.length_key}}

    def params(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The task's defaults updated with ``overrides`` (checked and coerced to the default's type)."""
        out = self.defaults
        for k, v in (overrides or {}).items():
            if k not in out:
                raise RecurformerError(f"unknown parameter '{k}' of task {self.name}{suggest(k, list(out))}")
            out[k] = coerce(v, type(out[k]), f"task parameter '{k}'")
        return out


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("in_context_recall", in_context_recall, "token", 12800),
        Task("noisy_in_context_recall", noisy_in_context_recall, "token", 12800),
        Task("fuzzy_in_context_recall", fuzzy_in_context_recall, "token", 12800),
        Task("selective_copying", selective_copying, "token", 12800),
        Task("compression", compression, "token", 12800, head="autoencoder"),
        Task("memorization", memorization, "token", 256),
        Task("copy", copy, "sequence", 16000, length_key=("min_len", "max_len")),
        Task("delayed_copy", delayed_copy, "sequence", 12800, length_key=("delay",)),
        Task("passkey", passkey, "sequence", 12800, length_key=("length",)),
        Task("mqar", mqar, "token", 12800, length_key=("distance",)),
        Task("mqar_zoology", mqar_zoology, "token", 100_000, length_key=("seq_len",)),  # Zoology: 100,000
        *(Task(k, f, "sequence", 12800, length_key=("length",), texts=True) for k, f in {**NEEDLES, **BABI}.items()),
    ]
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise RecurformerError(f"unknown task '{name}'{suggest(name, list(TASKS)).replace('keys', 'tasks')}")
    return TASKS[name]


def make_split(
    task: str,
    n: int,
    seed: int,
    params: dict[str, Any] | None = None,
    exclude: set[bytes] | None = None,
    split: str = "train",
) -> TaskData:
    """``n`` distinct rows of ``task`` drawn from ``seed`` (the same seed gives the same rows), none
    of whose inputs is in ``exclude``; a task in book text cuts its filler from the ``split``
    ("train" or "test") books (``booktext``). Raises if the task cannot supply that many distinct rows."""
    t = get_task(task)
    kw = {**t.params(params), **({"split": split} if t.texts else {})}
    if n < 1:
        raise RecurformerError(f"a split needs at least 1 example, got {n}")
    exclude = exclude or set()
    seen: set[bytes] = set()
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for attempt in range(20):
        x, y = t.fn(np.random.default_rng([seed, attempt]), n - len(xs), **kw)
        for xi, yi in zip(x, y):
            k = xi.tobytes()
            if k not in exclude and k not in seen:
                seen.add(k)
                xs.append(xi)
                ys.append(yi)
        if len(xs) == n:
            return TaskData(torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys)))
    raise RecurformerError(f"task {task} with {kw} has too few distinct rows for {n} examples (got {len(xs)})")


def vocab_size(task: str, params: dict[str, Any] | None = None) -> int:
    return int(get_task(task).params(params)["vocab_size"])


# the input tokens of one row of a task with a length, from its parameters (the layouts of the
# generators above): a row at a long length is counted, never built
ROW_TOKENS: dict[str, Callable[[dict[str, Any]], int]] = {
    "copy": lambda p: 2 * p["max_len"] + 2,
    "delayed_copy": lambda p: 2 * p["copy_len"] + p["delay"],
    "passkey": lambda p: 2 * p["key_len"] + p["length"],
    "mqar": lambda p: max(p["seq_len"], 2 * p["num_pairs"] + p["distance"] + 2 * p["num_queries"] - 1),
    "mqar_zoology": lambda p: p["seq_len"],
    **dict.fromkeys([*NEEDLES, *BABI], lambda p: p["length"]),
}


def row_tokens(task: str, params: dict[str, Any] | None = None) -> int:
    """The input tokens of one row of ``task`` with ``params``: counted for a task with a length
    (``ROW_TOKENS``; a memory check must not build the row it refuses), else read off one row built."""
    kw = get_task(task).params(params)
    if task in ROW_TOKENS:
        return ROW_TOKENS[task](kw)
    return int(make_split(task, 1, 0, kw).inputs.shape[1])
