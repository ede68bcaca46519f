"""What does the state carry? Two counterfactual probes read through the streaming contract.

**repeat** (copy). A document is ``s1, gap, marker, s2`` with ``s2 = s1``: the ``tinystories-repeat``
val split as it is (no gap), text files of such documents (scripts/make_copy_task.py: a story's
first sentence, the rest of the story as the gap), or, for any other text, passages of ``n`` tokens
cut from it (no gap). For the copy offset k (the k-th token of s2):

- copy_gain(k) = loss(s1[k]) − loss(s2[k]): how much better the copy is predicted than the
  original, both in the true document. Filed under distance k: the last k tokens before s1[k]
  and before s2[k] are the same, the tokens k back differ.
- swap_Δ(k) = loss(s2[k] | s1 replaced by another passage of the same length) − loss(s2[k] | s1):
  how much the prediction depends on what s1 said. Filed under k + |gap| + |marker|, the distance
  back to the nearest swapped token.

Distances count tokens back from the token a prediction is made from, so a model whose receptive
field is R tokens (see ``receptive_field``) has copy_gain and swap_Δ exactly 0 at every distance > R.

**swap** (any corpus). For a block of S target positions starting at t0 and a distance d, the
history older than d tokens before t0 (positions < t0 − d) is replaced by other text of the same
length; swap_Δ = loss(altered history) − loss(true history). A target at t0 + i then has its nearest
replaced token d + i tokens back (counted from the token it is predicted from).

Every document is read after a warm prefix of stream text of random length, so chunk, segment
and block phases vary. Values are averaged per document within log-spaced distance bins, and
each bin reports the mean over documents with a 95% percentile-bootstrap interval that resamples
documents (not tokens)."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import metrics, train_json
from .config import Checked, RecurformerError, make_options, opt, option
from .data.prepare import EOT, REPEAT_PROMPT, load_documents
from .data.tokenizer import Tokenizer
from .device import device_option
from .nn import StreamingLM
from .report import claim_outputs, pyplot, save_figure, write_report

TASKS = ("repeat", "swap")
MARKER_TEXT = f"\n{REPEAT_PROMPT}\n"
METRICS = {"repeat": ("swap_delta", "copy_gain"), "swap": ("swap_delta",)}
# what a good result looks like, one line per metric (tables and plots)
READING = {
    "copy_gain": "nats; above 0: the copy is predicted better than the original, so the model used what it read "
    "that far back (0 beyond its receptive field R); higher and farther is a longer memory",
    "swap_delta": "nats; above 0: swapping the history that far back made the prediction worse, so the model used "
    "it (0 beyond its receptive field R); higher and farther is a longer memory",
}


# ----------------------------------------------------------------------------------------------
# receptive fields


@dataclass
class ProbeOptions(Checked):
    """The copy (``repeat``) or ``swap`` probe: which documents, which distances, how they are read
    (``recurformer.probe`` and ``recurformer probe``)."""

    task: str = option(
        "repeat",
        "repeat (copy: s1, marker, s2 = s1) or swap (replace the history older than d)",
        metavar="{" + ",".join(TASKS) + "}",
    )  # checked in __post_init__: one line
    dataset: str | None = option(
        None,
        "a bundled dataset's val split (default: tinystories-repeat for repeat, the checkpoint's own for swap)",
        group="source",
    )
    text: list[str] | None = option(
        None, "UTF-8 text files, encoded with the checkpoint's tokenizer", nargs="+", metavar="FILE", group="source"
    )
    docs: int = option(500, "documents (the bootstrap resamples these)", range=">= 1")
    passage: int = option(128, "repeat on a corpus other than tinystories-repeat: passage length n", range=">= 1")
    distances: list[int] = option([1, 4, 16, 64, 256, 1024], "swap: replace the history older than each of these")
    span: int = option(32, "swap: target tokens scored after the history", range=">= 1")
    warm: tuple[int, int] = option(
        (32, 288),
        "fewest and most tokens of stream text read before each document (a random prefix length between them "
        "varies the chunk phases)",
        range=">= 0",
        cli=False,  # the command line's --warm-min and --warm-max
    )
    chunk: int = option(256, "tokens per model call (the state carries the rest)", range=">= 1")
    batch_size: int = option(16, "documents read side by side", range=">= 1")
    precision: str = option("fp32", "bf16: CPU/CUDA autocast", choices=["fp32", "bf16"])
    seed: int = option(0, "which documents and warm-up prefixes, and the bootstrap")

    def __post_init__(self) -> None:
        """The options checked where they are built, for ``recurformer.probe`` and
        ``probe_checkpoints`` alike (one-line errors naming them, ``config.opt``)."""
        if self.task not in TASKS:
            raise RecurformerError(f"unknown probe task '{self.task}'; valid tasks: {', '.join(TASKS)}")
        super().__post_init__()  # each range (Checked)
        if self.warm[0] > self.warm[1]:
            raise RecurformerError(f"{opt('warm')} must be (min, max) with min <= max, got {tuple(self.warm)}")


@dataclass
class ProbeCommandOptions(ProbeOptions):
    """``recurformer probe`` (``probe_checkpoints``): ``ProbeOptions`` for each checkpoint, and
    where the results go."""

    checkpoint: list[str] = option(
        None, "run or checkpoint directories or Hub repo ids (one line each in the plot)", cli=False
    )  # the command line's, beside --merge
    device: str = device_option()
    out: str | None = option(
        None,
        "output JSON, a PNG plot beside it (default: probe.json in the first checkpoint's run directory; with "
        "--merge, probe-merged.json beside the first merged file)",
        flag="--json",
        metavar="FILE",
    )


def receptive_field(model: StreamingLM) -> int | None:
    """The largest distance back (in tokens before the current one) that can change a logit, or
    None when it is unbounded (a recurrent state, or a full KV cache): ``max_context() - 1``,
    composed from each layer's reach (sliding window W over L layers: L·(W − 1); Transformer-XL
    from its segment/memory rule)."""
    context = model.max_context()
    return None if context is None else context - 1


# ----------------------------------------------------------------------------------------------
# samples: rows of tokens that a model reads, and the comparisons between their losses


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


def repeat_samples_from_stream(
    stream: np.ndarray, marker: np.ndarray, n_docs: int, passage: int, warm: tuple[int, int], rng: np.random.Generator
) -> list[Sample]:
    """Copy documents ``prefix, s1, marker, s1`` with s1 a ``passage``-token piece of ``stream``,
    and the swapped passage a piece from elsewhere in the stream."""
    if passage < 1:
        raise RecurformerError(f"--passage must be >= 1, got {passage}")
    need = warm[1] + 2 * passage + 1
    if len(stream) < 4 * need:
        raise RecurformerError(
            f"the text has {len(stream):,} tokens, too short for {passage}-token passages after a prefix of up to {warm[1]} "
            f"(need at least {4 * need:,}); give more text or a smaller --passage / --warm-max"
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
    if span < 1:
        raise RecurformerError(f"--span must be >= 1, got {span}")
    dmax = max(distances)
    length = dmax + warm[1] + span
    if len(stream) < 4 * length:
        raise RecurformerError(
            f"the text has {len(stream):,} tokens, too short for histories of {dmax} + a prefix of up to {warm[1]} tokens "
            f"(need at least {4 * length:,}); give more text or smaller --distances / --warm-max"
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


def make_samples(
    tok: Tokenizer,
    task: str,
    dataset: str | None,
    text: Sequence[str] | None,
    vocab_size: int,
    *,
    docs: int,
    passage: int,
    distances: Sequence[int],
    span: int,
    warm: tuple[int, int],
    seed: int,
) -> list[Sample]:
    """The documents of a ``task`` probe (``repeat`` or ``swap``), checked against the model's
    vocabulary; the same ``seed`` gives the same documents for every checkpoint."""
    if task not in TASKS:
        raise RecurformerError(f"unknown probe task '{task}'; valid tasks: {', '.join(TASKS)}")
    rng = np.random.default_rng(seed)
    if task == "repeat":
        samples = repeat_samples(tok, dataset, text, docs, passage, warm, rng)
    else:
        samples = swap_samples(text_stream(tok, dataset, text), docs, list(distances), span, warm, rng)
    top = max(int(r.max()) for s in samples for r in s.rows)
    if top >= vocab_size:
        raise RecurformerError(f"probe text has token id {top} >= the model's vocabulary ({vocab_size})")
    return samples


def samples_for(o: ProbeOptions, tok: Tokenizer, dataset: str | None, vocab_size: int) -> list[Sample]:
    """``make_samples`` with the documents, distances and seed of the options ``o``
    (``recurformer probe`` and ``recurformer.probe`` alike); ``dataset``: the one resolved from
    ``o.dataset`` and its defaults."""
    return make_samples(
        tok,
        o.task,
        dataset,
        [str(f) for f in o.text] if o.text else None,
        vocab_size,
        docs=o.docs,
        passage=o.passage,
        distances=list(o.distances),
        span=o.span,
        warm=tuple(o.warm),  # type: ignore[arg-type]
        seed=o.seed,
    )


# ----------------------------------------------------------------------------------------------
# reading rows through the streaming contract


@torch.no_grad()
def row_losses(
    model: StreamingLM,
    rows: Sequence[np.ndarray],
    chunk: int = ProbeOptions.chunk,
    batch_size: int = ProbeOptions.batch_size,
    precision: str = ProbeOptions.precision,
    progress: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """Per-position losses of each row: ``out[r][p]`` = cross-entropy of token p given tokens < p
    (``out[r][0]`` is NaN). Rows of any lengths are batched with padding at their end (which no
    earlier position can see) and read ``chunk`` tokens per call, carrying the state; ``progress(n)``
    is called after each batch, n its rows' tokens."""
    if chunk < 1:
        raise RecurformerError(f"--chunk must be >= 1, got {chunk}")
    device = model.tok_emb.weight.device
    order = np.argsort([len(r) for r in rows], kind="stable")
    out: list[np.ndarray] = [np.empty(0)] * len(rows)
    for start in range(0, len(rows), batch_size):
        idx = order[start : start + batch_size]
        T = max(len(rows[i]) for i in idx)
        x = torch.zeros(len(idx), T, dtype=torch.long)
        for b, i in enumerate(idx):
            x[b, : len(rows[i])] = torch.from_numpy(rows[i])
        x = x.to(device)
        losses = torch.full((len(idx), T), float("nan"), dtype=torch.float64)
        for a, o in zip(range(0, T - 1, chunk), model.read(x[:, : T - 1], chunk, precision=precision)):
            e = min(a + chunk, T - 1)
            ce = F.cross_entropy(o.logits.flatten(0, 1), x[:, a + 1 : e + 1].flatten(), reduction="none")
            losses[:, a + 1 : e + 1] = ce.view(len(idx), -1).double().cpu()
        for b, i in enumerate(idx):
            out[i] = losses[b, : len(rows[i])].numpy()
        if progress is not None:
            progress(sum(len(rows[i]) for i in idx))
    return out


# ----------------------------------------------------------------------------------------------
# statistics


def distance_bins(max_distance: int) -> list[tuple[int, int]]:
    """Log-spaced bins [0, 1), [1, 2), [2, 4), [4, 8), ... covering 0..max_distance."""
    bins, lo = [(0, 1)], 1
    while lo <= max_distance:
        bins.append((lo, 2 * lo))
        lo *= 2
    return bins


def bootstrap_mean(
    values: np.ndarray, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """Mean of per-document values with a percentile-bootstrap interval that resamples documents."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(n_boot, values.size))].mean(axis=1)
    alpha = (1 - level) / 2
    return float(values.mean()), float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


@dataclass
class BinStat:
    lo: int  # distances in [lo, hi)
    hi: int
    mean: float  # mean over documents of the per-document mean in this bin
    ci_lo: float
    ci_hi: float
    docs: int  # documents with at least one token in the bin
    tokens: int


def aggregate(
    samples: Sequence[Sample], losses: Sequence[Sequence[np.ndarray]], metric: str, seed: int = 0
) -> list[BinStat]:
    """Per-document bin means of ``metric``, then mean and bootstrap interval over documents."""
    per_doc: list[tuple[np.ndarray, np.ndarray]] = []
    dmax = 0
    for s, ls in zip(samples, losses):
        vals, dist = [], []
        for c in s.comparisons:
            if c.metric == metric:
                vals.append(ls[c.row_a][c.pos_a] - ls[c.row_b][c.pos_b])
                dist.append(c.distance)
        if vals:
            v, d = np.concatenate(vals), np.concatenate(dist)
            per_doc.append((v, d))
            dmax = max(dmax, int(d.max()))
    out = []
    for lo, hi in distance_bins(dmax):
        doc_means, tokens = [], 0
        for v, d in per_doc:
            m = (d >= lo) & (d < hi)
            if m.any():
                doc_means.append(float(v[m].mean()))
                tokens += int(m.sum())
        if doc_means:
            mean, a, b = bootstrap_mean(np.asarray(doc_means), seed=seed)
            out.append(BinStat(lo, hi, mean, a, b, len(doc_means), tokens))
    return out


# ----------------------------------------------------------------------------------------------
# one checkpoint, end to end


@dataclass
class ProbeResult:
    label: str
    checkpoint: str
    model: str
    receptive_field: int | None
    step: int | None
    tokens_seen: int | None
    val_loss: float | None  # the run's last validation loss up to this checkpoint (metrics.jsonl)
    train_tok_per_s: float | None  # median training tokens/s up to this checkpoint (metrics.jsonl)
    metrics: dict[str, list[BinStat]]

    def __str__(self) -> str:
        """``print(result)``: the tables of ``markdown_tables``, one per metric, each with how to read it."""
        return markdown_tables([self])

    def _repr_markdown_(self) -> str:  # a notebook shows the tables, not the dataclass fields
        return str(self)


def run_facts(ckpt_dir: Path) -> dict[str, Any]:
    """Step and tokens of a checkpoint, and its run's validation loss and training speed so far."""
    facts: dict[str, Any] = {"step": None, "tokens_seen": None, "val_loss": None, "train_tok_per_s": None}
    state = train_json(ckpt_dir)
    if state is None:  # a pretrained directory: no run
        return facts
    facts["step"], facts["tokens_seen"] = state.get("step"), state.get("tokens_seen")
    rows = metrics(ckpt_dir.parent, facts["step"])
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    speeds = [r["tok_per_s"] for r in rows if "tok_per_s" in r]
    facts["val_loss"] = vals[-1] if vals else None
    facts["train_tok_per_s"] = float(np.median(speeds)) if speeds else None
    return facts


def probe_model(
    model: StreamingLM,
    samples: Sequence[Sample],
    metrics: Sequence[str],
    chunk: int = ProbeOptions.chunk,
    batch_size: int = ProbeOptions.batch_size,
    precision: str = ProbeOptions.precision,
    seed: int = ProbeOptions.seed,
    progress: Callable[[int], None] | None = None,
) -> dict[str, list[BinStat]]:
    """Read every row of every sample and aggregate each metric by distance bin."""
    model.eval()
    flat = [r for s in samples for r in s.rows]
    losses = row_losses(model, flat, chunk, batch_size, precision, progress)
    per_sample, i = [], 0
    for s in samples:
        per_sample.append(losses[i : i + len(s.rows)])
        i += len(s.rows)
    return {m: aggregate(samples, per_sample, m, seed) for m in metrics}


# ----------------------------------------------------------------------------------------------
# reports


def probe_checkpoints(
    checkpoints: Sequence[str],
    out: str | Path | None = None,
    *,
    meta: dict[str, Any] | None = None,
    log: Callable[[str], object] = print,
    **options: Any,
) -> list[ProbeResult]:
    """``recurformer probe``: the copy or swap probe of each checkpoint (``options``: the fields of
    ``ProbeOptions``, ``device``) on the same documents
    (``dataset`` defaults to ``tinystories-repeat`` for ``repeat``, else the checkpoint's own);
    logs the tables, writes ``out`` (JSON with ``meta``; default ``probe.json`` in the first
    checkpoint's run directory) and its PNG plot; progress on stderr (``progress.Progress``): a bar on a
    terminal, lines with the time left in a log."""
    from .device import pick_device, slow_bf16_warning
    from .hub import default_output, eval_labels, load, locate
    from .progress import Progress

    o = make_options(ProbeCommandOptions, {"checkpoint": list(checkpoints), "out": out, **options})
    task, dataset, text, precision, chunk, batch_size, seed = (
        o.task,
        o.dataset,
        o.text,
        o.precision,
        o.chunk,
        o.batch_size,
        o.seed,
    )
    path_out = default_output(out, checkpoints[0], "probe.json")
    claim_outputs(path_out, f"{opt('out')} file")  # before the work, not after it
    dev = pick_device(o.device)
    if warning := slow_bf16_warning(precision, dev):
        print(warning, file=sys.stderr)
    dataset = dataset if (dataset or text) else ("tinystories-repeat" if task == "repeat" else None)
    results = []
    dirs = [locate(p) for p in checkpoints]
    for path, d, label in zip(checkpoints, dirs, eval_labels(checkpoints, dirs)):
        loaded = load(d, dev)
        model, name, tok, config = loaded.model, loaded.name, loaded.tokenizer, loaded.config
        if tok is None:
            raise RecurformerError(f"checkpoint {path} has no tokenizer.json, so it cannot read text")
        if dataset is None and not text:
            dataset = config.get("data", {}).get("dataset")
            if not dataset:
                raise RecurformerError(
                    f"checkpoint {path} does not name a bundled dataset; give {opt('dataset')} or {opt('text')}"
                )
        samples = samples_for(o, tok, dataset, model.config.vocab_size)
        R = receptive_field(model)
        log(
            f"probing {label} ({name}, receptive field {'unbounded' if R is None else R}) on {len(samples)} documents, task {task}"
        )
        progress = Progress(sum(len(r) for s in samples for r in s.rows), label, "token")
        try:
            metrics = probe_model(model, samples, METRICS[task], chunk, batch_size, precision, seed, progress.update)
        finally:
            progress.close()
        facts = run_facts(loaded.path)
        results.append(ProbeResult(label, str(loaded.path), name, R, metrics=metrics, **facts))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    meta = (meta or {}) | {"dataset_used": dataset, "text_sha256": text_sha256(text)}
    drawn = partial(figure, results, f"{task} probe")
    write_report(path_out, ["", markdown_tables(results)], to_json(results, meta), drawn, log)
    return results


def merge_probes(
    files: Sequence[str | Path], out: str | Path | None = None, log: Callable[[str], object] = print
) -> list[ProbeResult]:
    """``recurformer probe --merge``: one table, JSON and plot (``out``, default
    ``probe-merged.json`` beside the first file) from earlier probe results run with the same
    documents and settings."""
    path_out = Path(out) if out else Path(files[0]).with_name("probe-merged.json")
    claim_outputs(path_out, "output file")
    results, meta = merge([Path(f) for f in files])
    drawn = partial(figure, results, f"{meta['task']} probe")
    write_report(path_out, [markdown_tables(results)], to_json(results, meta), drawn, log)
    return results


def _cell(b: BinStat) -> str:
    return f"{b.mean:+.3f} [{b.ci_lo:+.3f}, {b.ci_hi:+.3f}]"


def markdown_tables(results: Sequence[ProbeResult]) -> str:
    """One table per metric: a row per checkpoint, a column per distance bin."""
    out = []
    for metric in dict.fromkeys(m for r in results for m in r.metrics):
        bins = sorted({(b.lo, b.hi) for r in results for b in r.metrics.get(metric, [])})
        head = (
            "| checkpoint | R | val loss | train tok/s | "
            + " | ".join(f"{lo}–{hi - 1}" if hi - lo > 1 else f"{lo}" for lo, hi in bins)
            + " |"
        )
        lines = [
            f"**{metric}** by distance (tokens back), mean over documents [95% bootstrap interval]",
            f"({READING[metric]})" if metric in READING else "",
            "",
            head,
            "|---|---|---|---|" + "---|" * len(bins),
        ]
        for r in results:
            by = {(b.lo, b.hi): b for b in r.metrics.get(metric, [])}
            R = "∞" if r.receptive_field is None else str(r.receptive_field)
            val = f"{r.val_loss:.3f}" if r.val_loss is not None else "–"
            tps = f"{r.train_tok_per_s:,.0f}" if r.train_tok_per_s is not None else "–"
            lines.append(
                f"| {r.label} | {R} | {val} | {tps} | "
                + " | ".join(_cell(by[k]) if k in by else "" for k in bins)
                + " |"
            )
        out.append("\n".join(lines))
    return "\n\n".join(out)


def to_json(results: Sequence[ProbeResult], meta: dict[str, Any]) -> dict[str, Any]:
    return {"meta": meta, "results": [asdict(r) for r in results]}


# the settings two probe runs must share for their rows to be compared in one table
SAME_SETTINGS = (
    "task",
    "dataset_used",
    "text",
    "docs",
    "passage",
    "distances",
    "span",
    "warm_min",
    "warm_max",
    "chunk",
    "seed",
    "precision",
)


def merge(files: Sequence[Path]) -> tuple[list[ProbeResult], dict[str, Any]]:
    """The rows of several probe JSON files (``to_json``) as one result, when every file was run
    with the same documents and settings (``SAME_SETTINGS``): a run per checkpoint, at different
    times or on different machines, reads as one table and plot."""
    results: list[ProbeResult] = []
    first: tuple[Path, dict[str, Any]] | None = None
    digest: str | None = None
    for f in files:
        try:
            data = json.loads(Path(f).read_text())
            meta, rows = data["meta"], data["results"]
        except FileNotFoundError:
            raise RecurformerError(f"probe result not found: {f}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RecurformerError(f"{f} is not a probe result file ({type(e).__name__}: {e})") from None
        if first is None:
            first = (Path(f), meta)
        for key in SAME_SETTINGS:
            if meta.get(key) != first[1].get(key):
                raise RecurformerError(
                    f"cannot merge {first[0]} and {f}: they were run with different {key} ({first[1].get(key)!r} vs {meta.get(key)!r})"
                )
        if meta.get("text_sha256"):  # files of older runs lack it
            if digest not in (None, meta["text_sha256"]):
                raise RecurformerError(
                    f"cannot merge {first[0]} and {f}: their --text files have the same names but other contents"
                )
            digest = meta["text_sha256"]
        for r in rows:
            stats = {m: [BinStat(**b) for b in bs] for m, bs in r.pop("metrics").items()}
            results.append(ProbeResult(**r, metrics=stats))
    assert first is not None
    return results, {k: first[1].get(k) for k in SAME_SETTINGS} | {
        "text_sha256": digest,
        "merged_from": [str(f) for f in files],
    }


def text_sha256(files: Sequence[str] | None) -> str | None:
    """One hash of the probed text files' contents, in order (None for a bundled dataset): two
    probe files are merged only when they read the same documents, not just files of one name."""
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def plot(results: Sequence[ProbeResult], path: Path, title: str) -> None:
    """``figure`` saved as a PNG at ``path``."""
    save_figure(figure(results, title), path)


def figure(results: Sequence[ProbeResult], title: str):  # type: ignore[no-untyped-def]
    """One panel per metric: value vs distance (log), one line per checkpoint with its interval
    shaded and each bounded model's receptive field R marked by a dotted line (the legend says R,
    or that it is unbounded); a bin at distance 0 is drawn at 1/2 and its tick labelled 0."""
    plt = pyplot()
    metrics = list(dict.fromkeys(m for r in results for m in r.metrics))
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.4 * len(metrics), 4.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        xs: list[float] = []
        for i, r in enumerate(results):
            bs = r.metrics.get(metric, [])
            if not bs:
                continue
            color, style = f"C{i % 10}", ("-", "--", "-.")[i // 10 % 3]  # beyond 10 arms: a new line style
            x = [max(b.lo, 0.5) * (np.sqrt(2) if b.hi - b.lo > 1 else 1) for b in bs]  # bin centre (geometric)
            xs += x
            reach = "R unbounded" if r.receptive_field is None else f"R = {r.receptive_field:,}"
            ax.plot(x, [b.mean for b in bs], marker="o", ms=3, color=color, ls=style, label=f"{r.label} ({reach})")
            ax.fill_between(x, [b.ci_lo for b in bs], [b.ci_hi for b in bs], color=color, alpha=0.2, lw=0)
            if r.receptive_field is not None:
                ax.axvline(r.receptive_field, color=color, ls=":", lw=1.2)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xscale("log", base=2)
        if xs:
            top = int(np.log2(max(xs))) + 1
            ticks = [2.0**k for k in range(0, top + 1, 1 if top <= 8 else 2)]
            ticks = ([0.5] if min(xs) < 1 else []) + ticks
            ax.set_xticks(ticks, ["0" if t < 1 else f"{int(t):,}" for t in ticks])
        bounded = any(r.receptive_field is not None for r in results)
        ax.set_xlabel("distance back (tokens)" + ("; dotted: receptive field R" if bounded else ""))
        ax.set_ylabel(f"{metric} (nats)")
        ax.set_title(
            f"{title}: {metric}" + ("\nabove 0: the model used tokens that far back" if metric in READING else "")
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
