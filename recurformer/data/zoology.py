"""Multi-query associative recall as Zoology generates it (Arora et al., "Zoology: Measuring and
Improving Recall in Efficient Language Models", 2023, §3-4 and appendix; the protocol of "Simple
linear attention language models balance the recall-throughput tradeoff", Arora et al., 2024):
the ``mqar_zoology`` task, read from the definition of HazyResearch/zoology's
``zoology/data/multiquery_ar.py`` (``random_non_queries=True``, one pass over the pairs).

Unlike ``synthetic.mqar`` (pairs a controlled distance back, queries in one block, each followed
by its value), the queries are scattered over the rest of the row, nearer slots likelier, among
random tokens of the whole vocabulary, and the value never follows its query in the input.
"""

from __future__ import annotations

import numpy as np

from ..config import opt
from ..state import IGNORE_INDEX
from .rows import Arrays, need


def top(scores: np.ndarray, k: int) -> np.ndarray:
    """The column indices of the ``k`` largest ``scores`` of each row, largest first."""
    idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, idx, axis=1), axis=1)
    return np.take_along_axis(idx, order, axis=1)


def mqar_zoology(
    rng: np.random.Generator,
    n: int,
    vocab_size: int = 8192,
    seq_len: int = 256,
    num_pairs: int = 64,
    power_a: float = 0.01,
) -> Arrays:
    """Zoology's MQAR rows (the paper's §3 task; its protocol: vocabulary 8192, training at
    (seq_len, num_pairs) (64, 4) (128, 8) (256, 16) (256, 32) (256, 64), testing up to (1024, 256)).

    A row of ``seq_len`` input tokens (even) begins with ``num_pairs`` = P (key, value) pairs: P
    distinct keys from [1, V/2) (token 0 is never a key), P distinct values from [V/2, V). The rest
    holds (seq_len - 2P) / 2 slots of two tokens; P of them, drawn without replacement with slot i
    (i = 1, 2, ...) likelier in proportion to i^(power_a - 1) (near slots likelier: Zoology's power
    law of the gap between repeated bigrams), hold the keys as queries at the slot's first token,
    the j-th pair's key in the j-th slot drawn (as Zoology places them). Every other position is a
    random token of the whole vocabulary [0, V). The target at a query's position is its pair's
    value (the value does not follow the query in the input); nothing else is scored: token
    accuracy over the queries. The pairs and queries take 4P tokens, so 4P <= seq_len (Zoology's
    own assert); Zoology also asserts V > seq_len, which nothing here needs (a row longer than the
    vocabulary is still well defined), so it is not required."""
    P, V, T = num_pairs, vocab_size, seq_len
    keys_from = V // 2 - 1  # [1, V/2)
    need(power_a > 0, f"task mqar_zoology needs {opt('task.power_a', power_a)} > 0: set {opt('task.power_a', 0.01)}")
    need(
        T >= 4 and T % 2 == 0,
        f"task mqar_zoology needs an even {opt('task.seq_len', T)} >= 4 (pairs, then query slots of 2 tokens): "
        f"set {opt('task.seq_len', max(4, T + T % 2))}",
    )
    need(
        P >= 1 and 4 * P <= T,
        f"task mqar_zoology's {opt('task.num_pairs', P)} pairs and their queries need 4 x num_pairs tokens, "
        f"more than {opt('task.seq_len', T)} holds: set {opt('task.num_pairs', max(1, T // 4))} "
        f"or {opt('task.seq_len', 4 * max(P, 1))}",
    )
    need(
        P <= keys_from,
        f"task mqar_zoology draws {opt('task.num_pairs', P)} distinct keys from the {keys_from} tokens "
        f"[1, vocab_size/2) of {opt('task.vocab_size', V)}: set {opt('task.vocab_size', 2 * P + 2)} or more",
    )
    space = (T - 2 * P) // 2
    keys = 1 + top(rng.random((n, keys_from)), P)
    values = V // 2 + top(rng.random((n, V - V // 2)), P)
    log_weight = (power_a - 1) * np.log(np.arange(1, space + 1))
    slots = top(log_weight + rng.gumbel(size=(n, space)), P)  # Gumbel top-k: weighted draws without replacement
    inputs = rng.integers(0, V, size=(n, T))
    inputs[:, 0 : 2 * P : 2], inputs[:, 1 : 2 * P : 2] = keys, values
    at = 2 * P + 2 * slots
    rows = np.arange(n)[:, None]
    inputs[rows, at] = keys
    targets = np.full_like(inputs, IGNORE_INDEX)
    targets[rows, at] = values
    return inputs, targets
