"""Length extrapolation, measured: windows of each length read chunk by chunk through the streaming
contract, the loss and accuracy of their last ``last`` tokens, with a bootstrap interval over the
documents those tokens lie in (see the package's docstring); the options that say how
(``LengthOptions``) and the evaluation text of a checkpoint (``eval_tokens``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..capture import Backend, DecodeGraphs
from ..config import Checked, RecurformerError, opt, option, say
from ..data.tokenizer import Tokenizer
from ..device import out_of_memory, peak_memory_mb, reset_peak_memory, synchronize
from ..generate import Step
from ..intervals import bootstrap_weights, ratio_interval
from ..nn import NonFiniteLogits, StreamingLM
from .results import LengthResult

MIN_DOCUMENTS = 20  # fewer documents: the bootstrap resamples windows
# windows per length unless every one is asked for: the default run's val split holds 743, and reading
# them all at 256..4096 (5.9M tokens) took longer than the run's training; 100 take about a tenth
DEFAULT_WINDOWS = 100


@torch.no_grad()
def score_rows(
    model: StreamingLM,
    windows: torch.Tensor,
    last: int,
    chunk: int,
    batch_size: int,
    progress: Callable[[int], object] | None = None,
    step: Step | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """windows: [K, N + 1], read ``chunk`` tokens per call (through ``step`` when given, as
    ``StreamingLM.read``). Returns the cross-entropy and the argmax hits of the last ``last``
    targets of each window, both [K, last] (float64); ``progress(n)`` is called after each batch
    of n windows."""
    device = model.tok_emb.weight.device
    losses, hits = [], []
    for rows in windows.split(batch_size):
        rows = rows.to(device)
        x, y = rows[:, :-1], rows[:, 1:]
        T = x.shape[1]
        first_scored = T - last
        row_loss, row_hits = [], []
        for a, out in zip(range(0, T, chunk), model.read(x, chunk, step=step)):
            b = min(a + chunk, T)
            lo = max(a, first_scored)
            if lo < b:
                logits = out.logits[:, lo - a :]
                tgt = y[:, lo:b]
                row_loss.append(F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none").double().cpu())
                row_hits.append((logits.argmax(-1) == tgt).double().cpu())
        losses.append(torch.cat(row_loss, 1))
        hits.append(torch.cat(row_hits, 1))
        if progress is not None:
            progress(rows.shape[0])
    return torch.cat(losses), torch.cat(hits)


def score_windows(
    model: StreamingLM, windows: torch.Tensor, last: int, chunk: int, batch_size: int = 8
) -> tuple[float, float, int]:
    """(summed loss, summed correct, scored tokens) over the last ``last`` targets of each window."""
    loss, hits = score_rows(model, windows, last, chunk, batch_size)
    return float(loss.sum()), float(hits.sum()), loss.numel()


def eval_tokens(
    tok: Tokenizer | None,
    config: dict,
    *,
    data: str | None = None,
    dataset: str | None = None,
    text: list[str] | None = None,
    cache: dict | None = None,
) -> np.ndarray:
    """The evaluation token stream for one checkpoint: its own prepared val split (or the
    prepared directory ``data``) by default, or the val split of a bundled ``dataset`` / the
    ``text`` files encoded with the checkpoint's tokenizer ``tok`` (BOS before each document).
    ``cache`` reuses an encoding across checkpoints that share a tokenizer."""
    from ..data import load_prepared
    from ..data.prepare import load_documents, read_text_file

    cache = {} if cache is None else cache
    if dataset or text:
        if tok is None:
            raise RecurformerError("this checkpoint has no tokenizer.json; evaluate it with --data DIR")
        key = (dataset, tuple(text or ()), id(tok))
        if key not in cache:
            if dataset:
                docs = load_documents(dataset, None, 0.05)[1]
            else:
                docs = [read_text_file(f) for f in text or []]
                empty = [f for f, d in zip(text or [], docs) if not d.strip()]
                if empty:
                    raise RecurformerError(
                        f"{empty[0]} holds no text; give {opt('text')} a file with text to evaluate on"
                    )
            ids: list[int] = []
            for d in docs:
                ids += [tok.bos_id, *tok.encode(d)]
            cache[key] = np.asarray(ids, dtype=np.int64)
        return cache[key]
    data_dir = data or config.get("data", {}).get("dir")
    if not data_dir:
        raise RecurformerError("the checkpoint does not name its data; give --data DIR, --dataset NAME or --text FILE")
    _, _, val, data_tok = load_prepared(data_dir)
    probe = (
        "the quick brown fox, 1984."  # lower case: an exported tokenizer may lower-case its input (hub.save_pretrained)
    )
    if tok is not None and data_tok.encode(probe) != tok.encode(probe):
        raise RecurformerError(
            f"{data_dir} was tokenized with another tokenizer than the checkpoint's; use --dataset or --text"
        )
    return val


def window_ends(n_tokens: int, context: int, last: int, windows: int | None = None) -> np.ndarray:
    """Where the evaluation windows end (exclusive indices into the token stream): every
    ``last``-th position from ``context + 1`` on, so the scored blocks of ``last`` targets tile the
    text after the first ``context`` tokens; ``windows`` keeps that many of them, evenly spaced.
    ``context`` as ``LengthOptions.context_for`` gives it, checked there to leave a window."""
    ends = np.arange(context + 1, n_tokens + 1, last)
    if windows is not None and windows < len(ends):
        ends = ends[np.unique(np.linspace(0, len(ends) - 1, windows).round().astype(np.int64))]
    return ends


def document_ids(tokens: np.ndarray, bos: int | None) -> np.ndarray:
    """For every position of ``tokens``, the index of the document it belongs to (documents
    start at a BOS token); all zeros when ``bos`` is None."""
    if bos is None:
        return np.zeros(len(tokens), dtype=np.int64)
    return np.cumsum(np.asarray(tokens) == bos)


@dataclass
class LengthOptions(Checked):
    """How ``evaluate_lengths`` reads: the lengths, the scored tokens, the windows and the calls
    (``recurformer.evaluate`` and ``recurformer eval``)."""

    lengths: list[int] = option([256, 512, 1024, 2048, 4096], "comma-separated window lengths L", range=">= 1")
    last: int = option(256, "score only the last N tokens of each window", range=">= 1")
    windows: int | None = option(
        DEFAULT_WINDOWS,
        "windows per length, evenly spaced over the evaluation text (a quick, deterministic look)",
        range=">= 1",
        group="windows",
    )
    chunk: int = option(256, "tokens per model call (the state carries the rest)", range=">= 1")
    batch_size: int = option(8, "windows read side by side", range=">= 1")
    warm_state: int = option(0, "read N tokens before each window, unscored", range=">= 0", metavar="N")
    context: int | None = option(
        None,
        "windows end where this many tokens fit before them (default: warm-up + the longest length); give the "
        "same value to compare runs with different lengths on the same tokens",
        range=">= 1",
    )
    cuda_graphs: bool = option(
        False, "read each aligned chunk through a captured CUDA graph (a CUDA GPU; other calls run eagerly)"
    )

    def __post_init__(self) -> None:
        """The options checked where they are built, for every caller (one-line errors naming them,
        ``config.opt``): each range, and how the lengths, ``last`` and ``context`` fit together."""
        super().__post_init__()  # each range (Checked)
        if not self.lengths:
            raise RecurformerError(f"{opt('lengths')} is empty")
        for L in self.lengths:
            if L < self.last:
                raise RecurformerError(f"{opt('lengths')}: {L} is shorter than {opt('last')} {self.last}")
        span = self.warm_state + max(self.lengths)
        if self.context is not None and self.context < span:
            raise RecurformerError(
                f"{opt('context')} {self.context} is shorter than warm-up + the longest length ({span})"
            )

    def context_for(self, n_tokens: int) -> int:
        """The context the windows end after (``context``, or warm-up + the longest length), checked
        to leave a window in ``n_tokens`` evaluation tokens (one line naming what fits)."""
        context = self.warm_state + max(self.lengths) if self.context is None else self.context
        if n_tokens < context + 1:
            raise RecurformerError(
                f"{n_tokens} evaluation tokens are too few for windows of {context} tokens (+1): {_fit(self, n_tokens)}"
            )
        return context


def _fit(o: LengthOptions, n_tokens: int) -> str:
    """What to give for windows that ``n_tokens`` tokens hold: the lengths that fit and the longest."""
    if o.context is not None:
        return f"lower {opt('context')} to at most {n_tokens - 1}, or give a longer text"
    longest = n_tokens - 1 - o.warm_state
    if longest >= o.last:
        lengths = sorted({L for L in o.lengths if L <= longest} | {longest})
        return f"use {opt('lengths', lengths)} (the longest that fits is {longest})"
    if longest >= 1:
        return f"use {opt('lengths', [longest])} and {opt('last', longest)} (the longest that fits is {longest})"
    return "give a longer text"


def evaluate_lengths(
    model: StreamingLM,
    tokens: np.ndarray,
    lengths: list[int],
    last: int = LengthOptions.last,
    windows: int | None = None,
    chunk: int = LengthOptions.chunk,
    warm: int = LengthOptions.warm_state,
    batch_size: int = LengthOptions.batch_size,
    context: int | None = None,
    bos: int | None = None,
    progress: Callable[[int], object] | None = None,
    done: Callable[[LengthResult], object] | None = None,
    graphs: Backend | None = None,
    note: Callable[[str], object] = say,
) -> list[LengthResult]:
    """Loss on the last ``last`` tokens of windows of each length in ``lengths``, after reading
    ``warm`` unscored tokens first. ``context`` (default: warm + the longest length) fixes where
    the windows end (``window_ends``); ``bos`` marks the documents the bootstrap resamples (None:
    each window is a unit); ``progress(n)`` is called after each batch of n windows read, ``done(result)`` after each length.
    ``graphs``: every aligned call read through captured forward steps of that backend
    (``capture.DecodeGraphs``; "cuda": CUDA graphs), the others eagerly, said in one line to ``note``.
    ``read_lengths`` with these options as one ``LengthOptions``."""
    o = LengthOptions(lengths, last, windows, chunk, batch_size, warm, context)
    return read_lengths(model, tokens, o, bos, progress, done, graphs, note)


def read_lengths(
    model: StreamingLM,
    tokens: np.ndarray,
    o: LengthOptions,
    bos: int | None = None,
    progress: Callable[[int], object] | None = None,
    done: Callable[[LengthResult], object] | None = None,
    graphs: Backend | None = None,
    note: Callable[[str], object] = say,
) -> list[LengthResult]:
    """``evaluate_lengths`` with its options ``o`` (checked where they were built), read as they come."""
    if int(tokens.max()) >= model.config.vocab_size:
        raise RecurformerError(
            f"evaluation data has token id {int(tokens.max())} >= the model's vocabulary {model.config.vocab_size}"
        )
    context = o.context_for(len(tokens))
    last, warm = o.last, o.warm_state
    step = DecodeGraphs(model, graphs).or_eager(note, True, "reading") if graphs else None
    ends = window_ends(len(tokens), context, last, o.windows)
    targets = ends[:, None] - last + np.arange(last)  # stream positions of the scored tokens
    by_window = np.repeat(np.arange(len(ends)), last)
    kind, unit = "windows", by_window
    if bos is not None:
        _, by_doc = np.unique(document_ids(tokens, bos)[targets], return_inverse=True)
        if by_doc.max() + 1 >= MIN_DOCUMENTS:
            kind, unit = "documents", by_doc.reshape(-1)
    n_units = int(unit.max()) + 1
    weights = bootstrap_weights(n_units)
    doc_tokens = np.bincount(unit, minlength=n_units).astype(np.float64)
    device = model.tok_emb.weight.device
    model.eval()
    out = []
    for L in o.lengths:
        n = warm + L + 1
        w = torch.from_numpy(np.stack([np.asarray(tokens[e - n : e], dtype=np.int64) for e in ends]))
        reset_peak_memory(device)
        t0 = time.perf_counter()
        try:
            loss, hits = score_rows(model, w, last, o.chunk, o.batch_size, progress, step)
        except NonFiniteLogits as e:
            raise NonFiniteLogits(f"non-finite logits (NaN/inf) at length {L}") from e
        synchronize(device)
        dt = time.perf_counter() - t0
        doc_loss = np.bincount(unit, weights=loss.numpy().reshape(-1), minlength=n_units)
        low, high = ratio_interval(doc_loss, doc_tokens, weights)
        out.append(
            LengthResult(
                L,
                float(loss.mean()),
                low,
                high,
                float(hits.mean()),
                loss.numel(),
                len(ends),
                n_units,
                kind,
                len(ends) * (n - 1) / dt,
                peak_memory_mb(device),
                doc_loss,
                doc_tokens,
            )
        )
        if done is not None:
            done(out[-1])
    return out


def eval_sizes(label: str, model: StreamingLM, o: LengthOptions) -> tuple[str, str]:
    """What an evaluation holds in memory (the model, windows side by side, tokens per call, the
    longest window) and what to lower, for ``device.out_of_memory``."""
    from ..registry import model_name

    doing = (
        f"evaluating {label} ({model_name(model.config)}, {model.num_params():,} parameters): batch_size "
        f"{o.batch_size} windows side by side, chunk {o.chunk} tokens per call, lengths up to {max(o.lengths)}"
    )
    return doing, f"lower {opt('batch_size')} or {opt('chunk')} (a state that grows with the text: {opt('lengths')})"


def evaluate_options(
    label: str,
    model: StreamingLM,
    tokens: np.ndarray,
    o: LengthOptions,
    bos: int | None,
    graphs: Backend | None,
    progress: Callable[[int], object] | None = None,
    done: Callable[[LengthResult], object] | None = None,
    note: Callable[[str], object] = say,
) -> list[LengthResult]:
    """``read_lengths`` with the options ``o`` (``recurformer eval`` and ``recurformer.evaluate``
    alike, so a new field reaches both) and the capture decided for them (``device.graphs_or_eager``),
    an out-of-memory error naming ``label`` and what to lower (``eval_sizes``)."""
    with out_of_memory(*eval_sizes(label, model, o)):
        return read_lengths(model, tokens, o, bos, progress, done, graphs, note)
