"""What a probe measured and how it reads: the distance bins of each metric (``BinStat``), one
checkpoint's result (``ProbeResult``), the markdown tables, the JSON, the merge of several probe
files run alike, and the figure."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..config import RecurformerError
from ..report import pyplot, save_figure

# what a good result looks like, one line per metric (tables and plots)
READING = {
    "copy_gain": "nats; above 0: the copy is predicted better than the original, so the model used what it read "
    "that far back (0 beyond its receptive field R); higher and farther is a longer memory",
    "swap_delta": "nats; above 0: swapping the history that far back made the prediction worse, so the model used "
    "it (0 beyond its receptive field R); higher and farther is a longer memory",
}


@dataclass
class BinStat:
    lo: int  # distances in [lo, hi)
    hi: int
    mean: float  # mean over documents of the per-document mean in this bin
    ci_lo: float
    ci_hi: float
    docs: int  # documents with at least one token in the bin
    tokens: int


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
