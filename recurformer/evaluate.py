"""Length-extrapolation evaluation (Liang, "Block-wise Recurrent Transformer",
§5.1): for each length L the model reads windows of L tokens chunk by chunk through the streaming
contract (so memory stays bounded for recurrent models at any L) and the loss / accuracy is taken
on the last ``last`` tokens of each window only.

The scored set is deterministic and shared by every model and length: the windows end at fixed
positions, ``last`` tokens apart, so their scored blocks tile the evaluation text after the first
``context`` tokens (the whole validation split by default; ``windows=K`` keeps K of them, evenly
spaced; ``recurformer eval`` and ``api.evaluate`` keep ``DEFAULT_WINDOWS`` unless asked for all).
Lengths therefore differ only in how much history the model read, and two checkpoints
evaluated on the same text score the same tokens. The 95% interval is a percentile bootstrap over
documents (the text's BOS-separated documents; over the windows instead when no BOS is known or
the scored tokens lie in fewer than ``MIN_DOCUMENTS`` documents, as in one long book) with a fixed
bootstrap seed: the mean loss is the total loss over the total token count of the resampled
units; a paired difference resamples the same units for both models."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .capture import Backend, DecodeGraphs
from .config import Checked, RecurformerError, make_options, opt, option, say
from .data.tokenizer import Tokenizer
from .device import cpu_threads, device_option, out_of_memory, peak_memory_mb, reset_peak_memory, synchronize
from .generate import Step
from .nn import NonFiniteLogits, StreamingLM
from .report import claim_outputs, pyplot, save_figure, write_json, write_report

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0
MIN_DOCUMENTS = 20  # fewer documents: the bootstrap resamples windows
LOSS_READING = (
    "(cross-entropy in nats per token, lower is better, exp(loss) the perplexity; a model that uses "
    "its history keeps or lowers its loss as the length grows)"
)
# windows per length unless every one is asked for: the default run's val split holds 743, and reading
# them all at 256..4096 (5.9M tokens) took longer than the run's training; 100 take about a tenth
DEFAULT_WINDOWS = 100


@dataclass
class LengthResult:
    length: int
    loss: float  # mean cross-entropy over the last `last` tokens of every window
    loss_low: float  # 95% bootstrap interval of `loss` over documents
    loss_high: float
    accuracy: float  # argmax accuracy on the same tokens
    scored_tokens: int
    windows: int
    units: int  # how many bootstrap units (documents, or windows) the scored tokens fall in
    unit: str  # "documents" or "windows"
    tokens_per_s: float  # tokens read (windows x (warm + L)) per second
    peak_memory_mb: (
        float  # peak memory while evaluating this length (device.peak_memory_mb: RSS on CPU, allocated on CUDA)
    )
    doc_loss: np.ndarray = field(
        repr=False, compare=False, default_factory=lambda: np.zeros(0)
    )  # summed loss per document
    doc_tokens: np.ndarray = field(
        repr=False, compare=False, default_factory=lambda: np.zeros(0)
    )  # scored tokens per document

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k not in ("doc_loss", "doc_tokens")}


@dataclass
class PairedDifference:
    length: int
    diff: float  # loss(model) - loss(reference) on the same tokens
    low: float  # 95% bootstrap interval, the same documents resampled for both
    high: float


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
    from .data import load_prepared
    from .data.prepare import load_documents, read_text_file

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
    text after the first ``context`` tokens; ``windows`` keeps that many of them, evenly spaced."""
    if n_tokens < context + 1:
        raise RecurformerError(f"{n_tokens} evaluation tokens are too few for windows of {context} tokens (+1)")
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


def bootstrap_weights(units: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """[samples, units]: how often each unit is drawn in each bootstrap resample (a fixed seed)."""
    return np.random.default_rng(seed).multinomial(units, np.full(units, 1.0 / units), size=samples).astype(np.float64)


def ratio_interval(sums: np.ndarray, counts: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """95% percentile interval of sum(w * sums) / sum(w * counts) over the resamples ``weights``."""
    means = (weights @ sums) / np.maximum(weights @ counts, 1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


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


@dataclass
class EvalOptions(LengthOptions):
    """``recurformer eval`` (``evaluate_checkpoints``): ``LengthOptions`` for each checkpoint, on
    its own val split or the text given, and where the results go."""

    checkpoint: list[str] = option(
        None, "run or checkpoint directories or Hub repo ids (one line each in the plot)", nargs="+", required=True
    )
    window: int | None = option(None, "evaluate a dense model with a sliding-window mask of this size", range=">= 1")
    data: str | None = option(None, "a prepared dataset directory (default: the checkpoint's own)", group="source")
    dataset: str | None = option(
        None, "a bundled dataset's val split, encoded with the checkpoint's tokenizer", group="source"
    )
    text: list[str] | None = option(
        None, "text files, encoded with the checkpoint's tokenizer", nargs="+", group="source"
    )
    device: str = device_option()
    out: str | None = option(
        None,
        "output JSON, a PNG plot beside it (default: eval.json in the first checkpoint's run directory; a Hub "
        "repo id's: the working directory)",
        flag="--json",
        metavar="FILE",
    )


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
    from .registry import model_name

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


@cpu_threads()
def evaluate_checkpoints(
    checkpoints: Sequence[str],
    lengths: Sequence[int] | None = None,
    out: str | Path | None = None,
    *,
    meta: dict[str, Any] | None = None,
    log: Callable[[str], object] = say,
    **options: Any,
) -> dict[str, list[LengthResult]]:
    """``recurformer eval``: length extrapolation of each checkpoint at ``lengths`` (default:
    ``EvalOptions``'s; ``options``: its other fields), on its own val split by
    default, or ``data``/``dataset``/``text``; ``windows`` evenly spaced windows per length, all of
    them with None), ``window`` W evaluating a dense model with a sliding window; logs a table,
    writes ``out`` (JSON with ``meta``; default ``eval.json`` in the first checkpoint's run
    directory) and its PNG plot. The JSON is rewritten (atomically) as each length finishes, with
    ``"complete": false`` until the end, ``cuda_graphs`` reads every aligned chunk through a CUDA
    graph (``evaluate_lengths``'s ``graphs``), so an interrupted eval keeps what it finished; progress
    shows on stderr (``progress.Progress``): a bar on a terminal, lines with the time left elsewhere.
    Every option is checked before any work."""
    from .device import graphs_or_eager, memory_kind, pick_device
    from .hub import default_output, eval_labels, load, locate
    from .progress import Progress

    given = {"checkpoint": list(checkpoints), "out": out} | ({"lengths": list(lengths)} if lengths is not None else {})
    o = make_options(EvalOptions, given | options)  # checked where built (LengthOptions.__post_init__)
    lengths, last, windows, warm_state = o.lengths, o.last, o.windows, o.warm_state  # the log's
    window, data, dataset, text = o.window, o.data, o.dataset, o.text
    dev = pick_device(o.device)
    graphs = graphs_or_eager(o.cuda_graphs, dev, opt("cuda_graphs"), "this evaluation runs")
    dirs = [locate(p) for p in checkpoints]  # a Hub id fetched once, before any work
    labels = eval_labels(checkpoints, dirs)
    path_out = default_output(out, checkpoints[0], "eval.json")
    claim_outputs(path_out, f"{opt('out')} file")  # before the work, not after it
    results: dict[str, list[LengthResult]] = {}
    cache: dict[Any, Any] = {}
    trained: dict[str, Any] = {}
    for path, d, label in zip(checkpoints, dirs, labels):
        loaded = load(d, dev)
        model, name, tok, config = loaded.model, loaded.name, loaded.tokenizer, loaded.config
        if window:
            if not hasattr(model, "set_window"):
                raise RecurformerError(f"{opt('window')} applies to dense attention models (llama), not {name}")
            model.set_window(window)
            label += f" (window {window})"
        tokens = eval_tokens(tok, config, data=data, dataset=dataset, text=text, cache=cache)
        span = o.context_for(len(tokens))
        every = len(window_ends(len(tokens), span, last))
        n = min(every, windows or every)
        every_one = opt("windows", "None", True)
        how = (
            "every window of the evaluation text" if n == every else f"evenly spaced, of {every:,}; {every_one} for all"
        )
        log(
            f"evaluating {label} ({name}) at lengths {lengths}: {n:,} windows ({how}), loss on the last {last} tokens of each, "
            f"{n * sum(warm_state + L for L in lengths):,} tokens to read"
        )

        def keep(r: LengthResult, label: str = label) -> None:
            """Each length as it finishes, into the JSON: an interrupted eval keeps what it finished."""
            results[label] = [*results.get(label, []), r]
            save_json(results, path_out, meta or {}, complete=False)
            log(
                f"  L={r.length:>6}: loss {r.loss:.4f} [{r.loss_low:.4f}, {r.loss_high:.4f}]  acc {r.accuracy:.3f}  "
                f"{r.windows} windows, bootstrap over {r.units} {r.unit}  {r.tokens_per_s:,.0f} tok/s  peak {memory_kind(dev)} {r.peak_memory_mb:,.0f} MB"
            )

        progress = Progress(n * len(lengths), label, "window")
        try:
            bos = tok.bos_id if tok is not None else None
            evaluate_options(label, model, tokens, o, bos, graphs, progress=progress.update, done=keep, note=log)
        except NonFiniteLogits as e:
            kept = f"{path_out} keeps the results before it" if results else "nothing written"
            raise RecurformerError(f"{path} gives {e} although its weights load; {kept}") from None
        except BaseException as e:  # Ctrl-C, a scheduler's SIGTERM, a failure
            if results and not isinstance(e, RecurformerError):
                log(f'stopped: {path_out} keeps the lengths finished so far ("complete": false)')
            raise
        finally:
            progress.close()
        trained[label] = config.get("train", {}).get("seq_len")
    title = f"loss on the last {last} tokens (nats/token, lower is better)"
    drawn = partial(figure, results, title, last, trained, warm_state)
    write_report(path_out, ["", markdown_table(results)], json_doc(results, meta or {}), drawn, log, end="")
    return results


def paired_differences(model: list[LengthResult], reference: list[LengthResult]) -> list[PairedDifference]:
    """loss(model) - loss(reference) at every length both measured, with a 95% bootstrap interval
    that resamples the same documents for both (they must have scored the same tokens)."""
    ref = {r.length: r for r in reference}
    out = []
    for r in model:
        b = ref.get(r.length)
        if b is None:
            continue
        if not np.array_equal(r.doc_tokens, b.doc_tokens):
            raise RecurformerError(
                f"paired difference at length {r.length}: the two results did not score the same tokens"
            )
        d = r.doc_loss - b.doc_loss
        low, high = ratio_interval(d, r.doc_tokens, bootstrap_weights(len(d)))
        out.append(PairedDifference(r.length, float(d.sum() / r.doc_tokens.sum()), low, high))
    return out


def comparable(results: dict[str, list[LengthResult]]) -> bool:
    """Whether every model scored the same tokens (same evaluation text and settings)."""
    firsts = [rs[0] for rs in results.values() if rs]
    return all(np.array_equal(f.doc_tokens, firsts[0].doc_tokens) for f in firsts)


def markdown_table(results: dict[str, list[LengthResult]]) -> str:
    """Mean loss [95% interval] per model and length; with several models scored on the same
    tokens, a second table of paired differences from the first model."""
    lengths = sorted({r.length for rs in results.values() for r in rs})
    head = "| model | " + " | ".join(str(L) for L in lengths) + " |"
    sep = "|---|" + "---|" * len(lengths)
    rows = []
    for label, rs in results.items():
        by = {r.length: r for r in rs}
        rows.append(
            f"| {label} | "
            + " | ".join(
                f"{by[L].loss:.3f} [{by[L].loss_low:.3f}, {by[L].loss_high:.3f}]" if L in by else "" for L in lengths
            )
            + " |"
        )
    units = sorted({r.unit for rs in results.values() for r in rs})
    table = [
        f"loss on the last tokens, mean [95% bootstrap interval over {' / '.join(units)}]",
        LOSS_READING,
        "",
        head,
        sep,
        *rows,
    ]
    labels = list(results)
    if len(labels) > 1 and comparable(results):
        ref = labels[0]
        table += [
            "",
            f"paired difference from {ref} (negative: lower loss than {ref}), mean [95% interval]",
            "",
            head,
            sep,
        ]
        for label in labels[1:]:
            diffs = {d.length: d for d in paired_differences(results[label], results[ref])}
            table.append(
                f"| {label} | "
                + " | ".join(
                    f"{diffs[L].diff:+.3f} [{diffs[L].low:+.3f}, {diffs[L].high:+.3f}]" if L in diffs else ""
                    for L in lengths
                )
                + " |"
            )
    return "\n".join(table)


MIN_Y_SPAN = 0.5  # nats: the loss axis spans at least this much, so a 0.03-nat gap looks like one


def figure(
    results: dict[str, list[LengthResult]],
    title: str,
    last: int,
    trained: dict[str, int | None] | None = None,
    warm: int | dict[str, int] = 0,
) -> Any:
    """Loss against length, one series of points with 95% error bars per model (no lines: only
    the lengths measured are drawn); a point with no history before its scored tokens (L = last,
    no warm-up) is drawn hollow and labelled cold start. ``warm``: the warm-up tokens of every
    model, or per model label (missing: 0). The y axis spans at least MIN_Y_SPAN."""
    plt = pyplot()
    warms = warm if isinstance(warm, dict) else dict.fromkeys(results, warm)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    n = len(results)
    for i, (label, rs) in enumerate(results.items()):
        shift = 2 ** (0.06 * (i - (n - 1) / 2))  # side by side, not on top of each other
        xs = np.array([r.length * shift for r in rs], dtype=float)
        ys = np.array([r.loss for r in rs])
        err = np.array([[r.loss - r.loss_low for r in rs], [r.loss_high - r.loss for r in rs]])
        cold = np.array([warms.get(label, 0) == 0 and r.length == last for r in rs])
        bars = ax.errorbar(xs[~cold], ys[~cold], yerr=err[:, ~cold], fmt="o", capsize=3, label=label)
        if cold.any():
            ax.errorbar(
                xs[cold], ys[cold], yerr=err[:, cold], fmt="o", mfc="white", capsize=3, color=bars[0].get_color()
            )
    if any(warms.get(label, 0) == 0 and r.length == last for label, rs in results.items() for r in rs):
        ax.annotate("hollow: cold start (no history)", xy=(0.02, 0.02), xycoords="axes fraction", fontsize=8)
    ax.set_xscale("log", base=2)
    lengths = sorted({r.length for rs in results.values() for r in rs})
    ax.set_xticks(lengths, [str(L) for L in lengths])
    lows = [r.loss_low for rs in results.values() for r in rs]
    highs = [r.loss_high for rs in results.values() for r in rs]
    if lows:
        mid, span = (min(lows) + max(highs)) / 2, max(max(highs) - min(lows), MIN_Y_SPAN) * 1.1
        ax.set_ylim(mid - span / 2, mid + span / 2)
    known = {k: v for k, v in (trained or {}).items() if v is not None}
    if known and len(set(known.values())) == 1 and len(known) == len(results):
        ax.set_xlabel(f"sequence length L (trained at {next(iter(known.values()))})")
    elif known:
        ax.set_xlabel("sequence length L (trained at: " + ", ".join(f"{k} {v}" for k, v in known.items()) + ")")
    else:
        ax.set_xlabel("sequence length L")
    ax.set_ylabel(f"loss on the last {last} tokens (95% interval)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(
    results: dict[str, list[LengthResult]],
    path: Path,
    title: str,
    last: int,
    trained: dict[str, int | None] | None = None,
    warm: int | dict[str, int] = 0,
) -> None:
    """``figure`` saved as a PNG at ``path``."""
    save_figure(figure(results, title, last, trained, warm), path)


def save_json(results: dict[str, list[LengthResult]], path: Path, meta: dict, complete: bool = True) -> None:
    """``json_doc`` written to ``path`` (atomically)."""
    write_json(path, json_doc(results, meta, complete), end="")


def json_doc(results: dict[str, list[LengthResult]], meta: dict, complete: bool = True) -> dict[str, Any]:
    """Results, and paired differences from the first model when every model scored the same tokens;
    ``complete`` false marks the lengths finished so far of an evaluation still running (or stopped)."""
    labels = list(results)
    paired = {}
    if len(labels) > 1 and comparable(results):
        paired = {lab: [vars(d) for d in paired_differences(results[lab], results[labels[0]])] for lab in labels[1:]}
    return {
        "meta": meta,
        "complete": complete,
        "results": {k: [r.to_dict() for r in v] for k, v in results.items()},
        "paired_differences": {"reference": labels[0], "models": paired} if paired else None,
    }
