"""Batch iterators over a 1-D token array (usually a ``np.memmap``) for stateful TBPTT.

``ContiguousStreams`` is the "data continuity" of Liang, "Block-wise Recurrent Transformer" (§4):
every row of a batch is its own stream that reads a fixed region of the corpus in order, so row b of
batch k+1 is the exact continuation of row b of batch k and a recurrent state carried per row stays
meaningful. Unlike the authors' loader (llama2Rnn) it tells the trainer when a row restarts
(``wrapped``) so the row's state can be reset, splits the streams across DDP ranks by construction,
and resumes exactly. ``ShuffledWindows`` is the ablation without continuity; ``eval_windows`` gives
fixed long windows.

Both iterators are counter-based: the state is just the number of batches drawn (the cursors and
random offsets are pure functions of it), so every rank can resume from any rank's state dict.
Batches are built by slicing the array with one fancy index; there are no per-token Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from recurformer.config import RecurformerError, opt


@dataclass
class Batch:
    """``x``/``y``: LongTensor[B, T] (``y`` = ``x`` shifted by one); ``wrapped``: BoolTensor[B]."""

    x: torch.Tensor
    y: torch.Tensor
    wrapped: torch.Tensor


def _check_common(tokens: np.ndarray, batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
    if tokens.ndim != 1:
        raise RecurformerError(f"token array must be 1-D, got shape {tuple(tokens.shape)}")
    if batch_size < 1 or seq_len < 1 or world_size < 1:
        raise RecurformerError(
            f"batch_size, seq_len, world_size must be >= 1, got {batch_size}, {seq_len}, {world_size}"
        )
    if not 0 <= rank < world_size:
        raise RecurformerError(f"rank must be in [0, {world_size}), got {rank}")


def _windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    """LongTensor[len(starts), length] with row i = tokens[starts[i] : starts[i] + length]."""
    idx = starts.astype(np.int64)[:, None] + np.arange(length, dtype=np.int64)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def _check_state(d: dict, expected: dict[str, int], kind: str) -> int:
    if d.get("kind") != kind:
        raise RecurformerError(f"data state dict is for {d.get('kind')!r}, not {kind!r}")
    for key, value in expected.items():
        if d.get(key) != value:
            raise RecurformerError(f"data state dict mismatch: {key}={d.get(key)!r} but this loader has {key}={value}")
    step = d.get("step")
    if not isinstance(step, int) or step < 0:
        raise RecurformerError(f"data state dict has a bad step {step!r}")
    return step


class _Loader:
    """What both iterators share: the checks of their arguments, the batch counter ``step`` that
    is their whole state, and the identity (``_identity``) a state dict must match to load."""

    kind: ClassVar[str]  # the state dict's "kind"

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
        _check_common(tokens, batch_size, seq_len, rank, world_size)
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.step = 0

    def _identity(self) -> dict[str, int]:
        return {
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, d: dict) -> None:
        self.step = _check_state(d, self._identity(), self.kind)


def _next_bos(tokens: np.ndarray, bos_id: int, start: int, limit: int, chunk: int = 1 << 20) -> int:
    """First position >= start (and < limit) holding BOS; ``start`` itself if there is none."""
    for lo in range(start, limit, chunk):
        hit = np.flatnonzero(np.asarray(tokens[lo : min(lo + chunk, limit)]) == bos_id)
        if hit.size:
            return lo + int(hit[0])
    return start


def _bounds(tokens: np.ndarray, n: int, bos_id: int | None) -> np.ndarray:
    """The n + 1 boundaries of n equal contiguous regions of ``tokens``; with ``bos_id``, each
    inner boundary moved forward to the next BOS token."""
    bounds = [s * (len(tokens) // n) for s in range(n)] + [len(tokens)]
    if bos_id is not None:
        bounds[1:-1] = [_next_bos(tokens, bos_id, b, bounds[i + 2]) for i, b in enumerate(bounds[1:-1])]
    return np.array(bounds, dtype=np.int64)


class ContiguousStreams(_Loader):
    """``batch_size * world_size`` streams over equal contiguous regions; rank r owns rows r*B..(r+1)*B-1.

    Each batch advances every stream by ``seq_len`` tokens (windows of T+1 overlap by one token).
    When fewer than T+1 tokens remain in a region, the stream restarts at its region start (the
    tail is skipped) and ``wrapped`` is True for that row in that batch. With ``bos_id`` given,
    each region start (except the first) is moved forward to the next BOS token, so every stream
    starts - and restarts - at a document boundary (regions are then only nearly equal).

    Too few tokens for the streams is one line naming ``train.batch_size`` and ``train.seq_len``
    with the largest values that fit (a segment length a multiple of ``seq_multiple``, the model's
    chunk); ``split`` names the tokens there (``"validation"``).
    """

    kind = "contiguous"

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        bos_id: int | None = None,
        seq_multiple: int = 1,
        split: str = "",
    ) -> None:
        super().__init__(tokens, batch_size, seq_len, rank, world_size)
        self.bos_id = bos_id
        bounds = _bounds(tokens, batch_size * world_size, bos_id)
        self.region_start = bounds[:-1]
        self.region_len = np.diff(bounds)
        if self.region_len.min() < seq_len + 1:
            raise RecurformerError(self._too_few(seq_multiple, split))
        # Windows per pass over a region: starts 0, T, 2T, ... while start + T + 1 <= region length.
        self.windows_per_pass: np.ndarray = (self.region_len - 1) // seq_len
        self.rows = slice(rank * batch_size, (rank + 1) * batch_size)

    def _too_few(self, multiple: int, split: str) -> str:
        """The message for regions shorter than a window: the largest batch size at this segment
        length and the longest segment length (a multiple of ``multiple``) at this batch size."""
        B, T, world, n_tokens = self.batch_size, self.seq_len, self.world_size, len(self.tokens)

        def longest(b: int) -> int:  # the longest segment length that b rows per rank fit
            return int((np.diff(_bounds(self.tokens, b * world, self.bos_id)).min() - 1) // multiple * multiple)

        fewer = next((b for b in range(B - 1, 0, -1) if longest(b) >= T), None)
        fixes = [f"{opt('train.batch_size', fewer)} (at seq_len {T})"] if fewer else []
        if longest(B) >= 1:
            fixes.append(f"{opt('train.seq_len', longest(B))} (at batch_size {B})")
        elif not fixes and longest(1) >= 1:
            fixes.append(f"{opt('train.batch_size', 1)} and {opt('train.seq_len', longest(1))}")
        fix = f"use {' or '.join(fixes)}" if fixes else "give more text"
        where = f" in the {split} split" if split else ""
        return (
            f"{n_tokens} tokens{where} are too few for {B * world} streams of seq_len {T} (each needs {T + 1}, "
            f"the shortest has {int(self.region_len.min())}): {fix}"
        )

    def cursors(self) -> np.ndarray:
        """Offset within its region where each of the ``batch_size * world_size`` streams reads next."""
        return (self.step % self.windows_per_pass) * self.seq_len

    def next_batch(self) -> Batch:
        wrapped = (self.step % self.windows_per_pass[self.rows] == 0) & (self.step > 0)
        starts = self.region_start[self.rows] + self.cursors()[self.rows]
        xy = _windows(self.tokens, starts, self.seq_len + 1)
        self.step += 1
        return Batch(xy[:, :-1], xy[:, 1:], torch.from_numpy(wrapped))

    def _identity(self) -> dict[str, int]:
        return {**super()._identity(), "bos_id": -1 if self.bos_id is None else self.bos_id}

    def state_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, **self._identity(), "cursors": self.cursors().tolist()}


class ShuffledWindows(_Loader):
    """Independent uniformly random windows of T+1 tokens per row: the paper's ablation without data
    continuity. ``wrapped`` is all False: whether the state is carried across these unrelated
    windows is the trainer's ``state: carry|reset`` switch ("Infinity Only Model" carries it).

    Batch k of rank r uses the generator seeded by ``(seed, rank, k)``, so resuming needs only k.
    """

    kind = "shuffled"

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(tokens, batch_size, seq_len, rank, world_size)
        if len(tokens) < seq_len + 1:
            raise RecurformerError(f"{len(tokens)} tokens are too few for windows of seq_len {seq_len} (+1)")
        self.seed = seed

    def next_batch(self) -> Batch:
        rng = np.random.default_rng([self.seed, self.rank, self.step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        xy = _windows(self.tokens, starts, self.seq_len + 1)
        self.step += 1
        return Batch(xy[:, :-1], xy[:, 1:], torch.zeros(self.batch_size, dtype=torch.bool))

    def _identity(self) -> dict[str, int]:
        return {**super()._identity(), "seed": self.seed}

    def state_dict(self) -> dict:
        return {
            "kind": self.kind,
            "step": self.step,
            **self._identity(),
            "rng": "numpy default_rng([seed, rank, step])",
        }


def eval_windows(tokens: np.ndarray, length: int, n: int, seed: int = 0, context: int | None = None) -> torch.Tensor:
    """LongTensor[n, length + 1]: windows at deterministic random positions (same seed -> same
    windows). The windows *end* at positions drawn so that ``context`` (>= length) tokens fit
    before them: calls with the same ``context`` and seed but different lengths give windows
    with the same last tokens, so a length sweep scores the same targets with more or less
    history."""
    context = length if context is None else context
    if context < length:
        raise RecurformerError(f"eval_windows: context {context} < length {length}")
    if tokens.ndim != 1 or len(tokens) < context + 1:
        raise RecurformerError(f"{len(tokens)} tokens are too few for evaluation windows of length {context} (+1)")
    if n < 1 or length < 1:
        raise RecurformerError(f"eval_windows needs n >= 1 and length >= 1, got n={n}, length={length}")
    ends = np.random.default_rng(seed).integers(context + 1, len(tokens) + 1, size=n)
    return _windows(tokens, ends - (length + 1), length + 1)
