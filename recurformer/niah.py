"""Needle in a haystack (passkey in text): can the model retrieve a fact planted deep in a long
context? (Kamradt's "needle in a haystack" test; the passkey form of Mohtashami and Jaggi,
"Landmark Attention: Random-Access Infinite Context Length for Transformers", Section 4.2.)

For a context length L and a depth d%, a prompt of exactly L tokens is

    BOS, haystack text ..., NEEDLE at d% of the haystack, ... haystack text, QUESTION

with NEEDLE = "The secret passkey is K. Remember it. K is the passkey." (K a random 5-digit
number per trial) and QUESTION = "What is the secret passkey? The secret passkey is"; the
answer is " K". The haystack is the bundled Project Gutenberg books (val split) or any text,
cut at a random offset per trial. Two scores per (depth, length) cell, averaged over trials:

- ``logprob``: log p(answer | prompt), summed over the answer's tokens (nats);
- ``exact``: 1 if greedy decoding after the prompt gives exactly the answer's tokens (all of
  them the argmax under teacher forcing), else 0.

The prompt is read ``chunk`` tokens per call with the state carried, so lengths beyond the
training context cost no more memory for a bounded-state model. ``score_fn`` takes any model:
a ``StreamingLM`` or a ``transformers`` causal LM (``recurformer.hf.RecurformerForCausalLM``
is read through its state cache; any other is given the whole sequence at once)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .config import Checked, RecurformerError, make_options, option
from .data.tokenizer import Tokenizer
from .device import cpu_threads, device_option
from .nn import StreamingLM
from .report import claim_outputs, pyplot, save_figure, write_json, write_report

NEEDLE = " The secret passkey is {key}. Remember it. {key} is the passkey. "
QUESTION = " What is the secret passkey? The secret passkey is"


@dataclass
class Cell:
    length: int
    depth: float  # percent of the haystack before the needle
    logprob: float  # mean over trials of log p(answer | prompt), nats
    exact: float  # fraction of trials retrieved exactly (greedy)
    trials: int


def haystack_tokens(tokenizer: Tokenizer, text: Sequence[str | Path] | None = None) -> list[int]:
    """The haystack as tokens: the bundled books' val split, or the given text files."""
    from .data.prepare import bundled_corpus, read_text_file

    docs = [read_text_file(f) for f in text] if text else bundled_corpus("books_val")
    return [t for d in docs for t in tokenizer.encode(d + "\n\n")]


def make_prompt(
    hay: list[int], tokenizer: Tokenizer, length: int, depth: float, rng: random.Random
) -> tuple[list[int], list[int]]:
    """(prompt of exactly ``length`` tokens, answer tokens) for one trial."""
    key = str(rng.randint(10000, 99999))
    needle, question = tokenizer.encode(NEEDLE.format(key=key)), tokenizer.encode(QUESTION)
    answer = tokenizer.encode(" " + key)
    body = length - 1 - len(needle) - len(question)
    if body < 1:
        raise RecurformerError(
            f"length {length} leaves no room for the haystack (the needle and question take "
            f"{len(needle) + len(question) + 1} tokens)"
        )
    if len(hay) < body:
        raise RecurformerError(
            f"the haystack has {len(hay):,} tokens, fewer than the {body:,} that length {length:,} needs; "
            "give a longer text or shorter lengths"
        )
    start = rng.randint(0, len(hay) - body)
    text = hay[start : start + body]
    at = round(depth / 100 * body)
    return [tokenizer.bos_id, *text[:at], *needle, *text[at:], *question], answer


def logits_fn(model: Any, chunk: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """(tokens [B, T], first) -> logits [B, T - first, V] of ``model`` at positions >= first,
    read ``chunk`` tokens per call through the state (a ``StreamingLM``, or recurformer's
    transformers class through its cache; earlier logits are dropped as they come); any other
    ``transformers`` model reads the whole sequence in one call."""
    if isinstance(model, StreamingLM):

        def read(x: torch.Tensor, first: int) -> torch.Tensor:
            parts = zip(range(0, x.shape[1], chunk), model.read(x, chunk))
            return torch.cat([out.logits[:, max(first - a, 0) :] for a, out in parts if a + chunk > first], 1)

        return read
    if hasattr(model, "empty_cache"):  # recurformer's transformers class: read through its state cache

        def run(x: torch.Tensor, first: int) -> torch.Tensor:
            parts, cache = [], model.empty_cache()
            for a in range(0, x.shape[1], chunk):
                logits = model(x[:, a : a + chunk], past_key_values=cache, use_cache=True).logits
                if a + chunk > first:
                    parts.append(logits[:, max(first - a, 0) :].float())
            return torch.cat(parts, 1)

        return run
    return lambda x, first: model(input_ids=x).logits[:, first:].float()


@dataclass
class NiahOptions(Checked):
    """``recurformer niah`` (``niah_checkpoint``): the grid of depths x lengths and how it is read."""

    checkpoint: str = option(None, "a run, checkpoint or pretrained directory, or a Hub repo id", required=True)
    lengths: list[int] = option([256, 512, 1024, 2048], "context lengths in tokens", range=">= 1")
    depths: list[float] = option([0, 25, 50, 75, 100], "needle depths in percent of the haystack")
    trials: int = option(4, "prompts per cell (random passkeys and haystack offsets)", range=">= 1")
    chunk: int = option(256, "tokens per model call (the state carries the rest)", range=">= 1")
    text: list[str] | None = option(
        None, "haystack text files (default: the bundled books, val split)", nargs="+", metavar="FILE"
    )
    via: str = option(
        "recurformer",
        "transformers: load and run the model through AutoModelForCausalLM (needs recurformer[hf])",
        choices=["recurformer", "transformers"],
    )
    seed: int = option(0, "passkeys and haystack offsets")
    device: str = device_option()
    out: str | None = option(
        None,
        "output JSON, the heatmap PNG beside it (default: niah.json in the checkpoint's run directory)",
        flag="--json",
    )


@torch.no_grad()
def niah(
    model: Any,
    tokenizer: Tokenizer,
    lengths: Sequence[int] = (256, 512, 1024),
    depths: Sequence[float] = (0, 25, 50, 75, 100),
    trials: int = NiahOptions.trials,
    chunk: int = NiahOptions.chunk,
    text: Sequence[str | Path] | None = None,
    seed: int = NiahOptions.seed,
    progress: Callable[[int], object] | None = None,
) -> list[Cell]:
    """Every (depth, length) cell: ``trials`` prompts (one batch), scored at the answer;
    ``progress(n)`` is called after each cell, n its prompts' tokens (trials x length)."""
    for d in depths:
        if not 0 <= d <= 100:
            raise RecurformerError(f"depth {d} is not a percentage in [0, 100]")
    if trials < 1 or chunk < 1:
        raise RecurformerError(f"trials and chunk must be positive, got {trials} and {chunk}")
    hay = haystack_tokens(tokenizer, text)
    device = next(model.parameters()).device
    run = logits_fn(model, chunk)
    model.eval()
    cells = []
    for L in lengths:
        for d in depths:
            rng = random.Random(f"{seed}-{L}-{float(d)}")
            rows = [make_prompt(hay, tokenizer, L, d, rng) for _ in range(trials)]
            n = max(len(a) for _, a in rows)
            x = torch.tensor([p + a + [tokenizer.eos_id] * (n - len(a)) for p, a in rows], device=device)
            logp = run(x[:, :-1], L - 1).log_softmax(-1)  # the predictions of the answer's tokens
            tgt = x[:, L:]
            mask = torch.tensor([[i < len(a) for i in range(n)] for _, a in rows], device=device)
            lp = logp.gather(-1, tgt[..., None]).squeeze(-1)
            ll = torch.where(mask, lp, torch.zeros_like(lp)).sum(1)
            exact = ((logp.argmax(-1) == tgt) | ~mask).all(1).float()
            cells.append(Cell(L, float(d), float(ll.mean()), float(exact.mean()), trials))
            if progress is not None:
                progress(trials * L)
    return cells


def table(cells: Sequence[Cell]) -> str:
    """Markdown: one row per depth, one column per length, exact match (mean log p), under a line
    saying how to read it."""
    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    at = {(c.depth, c.length): c for c in cells}
    lines = [
        "exact match: share of trials whose passkey came out whole (1.00 best); in parentheses the mean log p "
        "of the answer (0 best)",
        "",
        "| depth \\ length | " + " | ".join(f"{L:,}" for L in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for d in depths:
        lines.append(
            f"| {d:g}% | " + " | ".join(f"{at[d, L].exact:.2f} ({at[d, L].logprob:.2f})" for L in lengths) + " |"
        )
    return "\n".join(lines)


def figure(cells: Sequence[Cell], title: str) -> Any:
    """The depth x length heatmap of exact match (the standard NIAH figure), each cell labelled
    with its exact-match rate and mean answer log-probability, a line below saying how to read it."""
    plt = pyplot()
    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    at = {(c.depth, c.length): c for c in cells}
    grid = [[at[d, L].exact for L in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 2.5, 0.55 * len(depths) + 1.8))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i, d in enumerate(depths):
        for j, L in enumerate(lengths):
            ax.text(j, i, f"{at[d, L].exact:.2f}\n{at[d, L].logprob:.1f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [f"{L:,}" for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{title}\npasskey retrieval: exact match (log p of the answer)", fontsize=10)
    fig.colorbar(im, ax=ax, label="exact match")
    fig.text(0.01, 0.01, "1.00: every passkey found; green along a row: retrieval holds at that depth", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def plot(cells: Sequence[Cell], path: Path, title: str) -> None:
    """``figure`` saved as a PNG at ``path``."""
    save_figure(figure(cells, title), path)


def to_json(cells: Sequence[Cell], meta: dict[str, Any]) -> dict[str, Any]:
    return {"meta": meta, "cells": [asdict(c) for c in cells]}


def save(cells: Sequence[Cell], path: Path, meta: dict[str, Any]) -> None:
    """JSON of every cell, and the heatmap PNG beside it."""
    write_json(path, to_json(cells, meta))
    plot(cells, path.with_suffix(".png"), meta.get("label", "model"))


__all__ = ["Cell", "NEEDLE", "QUESTION", "figure", "make_prompt", "niah", "plot", "save", "table"]


@cpu_threads()
def niah_checkpoint(
    checkpoint: str | Path,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] | None = None,
    out: str | Path | None = None,
    *,
    log: Callable[[str], object] = print,
    **options: Any,
) -> list[Cell]:
    """``recurformer niah``: needle in a haystack over ``depths`` x ``lengths`` (default:
    ``NiahOptions``'s; ``options``: its other fields) for a checkpoint, read by recurformer or
    (``via="transformers"``) through ``AutoModelForCausalLM``; logs the table and writes ``out``
    (JSON; default ``niah.json`` in the checkpoint's run directory) and its heatmap PNG; progress on
    stderr (``progress.Progress``): a bar on a terminal, lines with the time left in a log."""
    from .data.tokenizer import Tokenizer
    from .device import pick_device
    from .hub import default_output, load, locate
    from .progress import Progress

    given: dict[str, Any] = {"checkpoint": str(checkpoint), "out": out}
    given |= {k: list(v) for k, v in (("lengths", lengths), ("depths", depths)) if v is not None}
    o = make_options(NiahOptions, given | options)
    lengths, depths, trials, chunk, text, via, seed = o.lengths, o.depths, o.trials, o.chunk, o.text, o.via, o.seed
    path_out = default_output(out, checkpoint, "niah.json")
    claim_outputs(path_out, "output JSON", "heatmap")
    dev = pick_device(o.device)
    model: Any
    if via == "transformers":
        from .hf import RecurformerForCausalLM

        d = locate(checkpoint)  # the tokenizer only: transformers loads the model
        tok = Tokenizer.load(d) if (d / "tokenizer.json").is_file() else None
        model = RecurformerForCausalLM.from_pretrained(checkpoint).to(dev)
    else:
        loaded = load(checkpoint, dev)
        model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise RecurformerError(f"{checkpoint} has no tokenizer.json: the haystack is text")
    progress = Progress(len(depths) * trials * sum(lengths), "niah", "token")
    try:
        cells = niah(model, tok, lengths, depths, trials, chunk, text, seed, progress.update)
    finally:
        progress.close()
    label = Path(checkpoint).name
    meta = {
        "checkpoint": str(checkpoint),
        "via": via,
        "trials": trials,
        "chunk": chunk,
        "seed": seed,
        "haystack": text or "bundled books (val)",
        "label": label,
    }
    drawn = partial(figure, cells, label)
    write_report(path_out, [table(cells)], to_json(cells, meta), drawn, log)
    return cells
