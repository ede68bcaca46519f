"""What an evaluation measured and how it reads: each length's loss with its interval
(``LengthResult``), the paired difference of two models on the same tokens, the markdown table,
the JSON and the figure of ``recurformer eval``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import RecurformerError
from ..intervals import bootstrap_weights, ratio_interval
from ..report import pyplot, save_figure, write_json

LOSS_READING = (
    "(cross-entropy in nats per token, lower is better, exp(loss) the perplexity; a model that uses "
    "its history keeps or lowers its loss as the length grows)"
)


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
