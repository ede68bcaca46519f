"""Length-extrapolation evaluation (Liang, "Block-wise Recurrent Transformer", §5.1): for each
length L, K windows of L tokens; the model reads each window chunk by chunk through the streaming
contract (so memory stays bounded for recurrent models at any L) and the loss / accuracy is taken on
the last ``last`` tokens only. The windows of every length end at the same K positions (as in the
authors' evaluation), so all lengths score the same tokens and differ only in how much history the
model read. Windows start from the initial state, or after reading a warm-up prefix."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .config import RecurformerError
from .device import peak_memory_mb, reset_peak_memory, synchronize
from .files import atomic_write
from .nn import StreamingLM


@dataclass
class LengthResult:
    length: int
    loss: float  # mean cross-entropy over the last `last` tokens of every window
    accuracy: float  # argmax accuracy on the same tokens
    scored_tokens: int
    windows: int
    tokens_per_s: float  # tokens read (windows x (warm + L)) per second
    peak_memory_mb: float  # peak memory while evaluating this length (device.peak_memory_mb: RSS on CPU, allocated on CUDA)


@torch.no_grad()
def score_windows(model: StreamingLM, windows: torch.Tensor, last: int, chunk: int, batch_size: int = 8) -> tuple[float, float, int]:
    """windows: [K, N + 1], read ``chunk`` tokens per call. Returns (summed loss, summed correct,
    scored tokens) over the last ``last`` targets of each window."""
    total_loss, correct, count = 0.0, 0.0, 0
    device = model.tok_emb.weight.device
    for rows in windows.split(batch_size):
        rows = rows.to(device)
        x, y = rows[:, :-1], rows[:, 1:]
        T = x.shape[1]
        first_scored = T - last
        state = None
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            out = model(x[:, a:b], state=state)
            state = out.state
            lo = max(a, first_scored)
            if lo < b:
                logits = out.logits[:, lo - a :]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                tgt = y[:, lo:b]
                total_loss += float(F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum"))
                correct += float((logits.argmax(-1) == tgt).sum())
                count += tgt.numel()
    return total_loss, correct, count


def eval_tokens(tok, config: dict, *, data: str | None = None, dataset: str | None = None,  # type: ignore[no-untyped-def]
                text: list[str] | None = None, cache: dict | None = None) -> np.ndarray:
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
            docs = load_documents(dataset, None, 0.05)[1] if dataset else [read_text_file(f) for f in text or []]
            ids: list[int] = []
            for d in docs:
                ids += [tok.bos_id, *tok.encode(d)]
            cache[key] = np.asarray(ids, dtype=np.int64)
        return cache[key]
    data_dir = data or config.get("data", {}).get("dir")
    if not data_dir:
        raise RecurformerError("the checkpoint does not name its data; give --data DIR, --dataset NAME or --text FILE")
    _, _, val, data_tok = load_prepared(data_dir)
    if tok is not None and data_tok.encode("The quick brown fox, 1984.") != tok.encode("The quick brown fox, 1984."):
        raise RecurformerError(f"{data_dir} was tokenized with another tokenizer than the checkpoint's; use --dataset or --text")
    return val


def evaluate_lengths(
    model: StreamingLM,
    tokens: np.ndarray,
    lengths: list[int],
    last: int = 256,
    windows: int = 16,
    chunk: int = 256,
    warm: int = 0,
    batch_size: int = 8,
    seed: int = 0,
    context: int | None = None,
) -> list[LengthResult]:
    """``context`` (default: warm + the longest length) fixes where the windows end; runs that
    use the same context and seed score the same tokens, whatever their lengths or warm-up."""
    from .data import eval_windows

    if int(tokens.max()) >= model.config.vocab_size:
        raise RecurformerError(f"evaluation data has token id {int(tokens.max())} >= the model's vocabulary {model.config.vocab_size}")
    model.eval()
    out = []
    for L in lengths:
        if L < last:
            raise RecurformerError(f"length {L} is shorter than --last {last}")
        # windows end at the same positions for every L: each length scores the same targets
        w = eval_windows(tokens, warm + L, windows, seed=seed, context=context or warm + max(lengths))
        device = model.tok_emb.weight.device
        reset_peak_memory(device)
        t0 = time.perf_counter()
        loss, corr, n = score_windows(model, w, last, chunk, batch_size)
        synchronize(device)
        dt = time.perf_counter() - t0
        out.append(LengthResult(L, loss / n, corr / n, n, windows, windows * (warm + L) / dt, peak_memory_mb(device)))
    return out


def markdown_table(results: dict[str, list[LengthResult]]) -> str:
    lengths = sorted({r.length for rs in results.values() for r in rs})
    head = "| model | " + " | ".join(str(L) for L in lengths) + " |"
    sep = "|---|" + "---|" * len(lengths)
    rows = []
    for label, rs in results.items():
        by = {r.length: r for r in rs}
        rows.append(f"| {label} | " + " | ".join(f"{by[L].loss:.3f}" if L in by else "" for L in lengths) + " |")
    return "\n".join([head, sep, *rows])


def figure(results: dict[str, list[LengthResult]], title: str, last: int, trained: dict[str, int | None] | None = None):  # type: ignore[no-untyped-def]
    """Loss against length, one line per model; the y label names ``last``, the x label each
    model's training length (``trained``: label -> train.seq_len, None where unknown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, rs in results.items():
        ax.plot([r.length for r in rs], [r.loss for r in rs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    known = {k: v for k, v in (trained or {}).items() if v is not None}
    if known and len(set(known.values())) == 1 and len(known) == len(results):
        ax.set_xlabel(f"sequence length L (trained at {next(iter(known.values()))})")
    elif known:
        ax.set_xlabel("sequence length L (trained at: " + ", ".join(f"{k} {v}" for k, v in known.items()) + ")")
    else:
        ax.set_xlabel("sequence length L")
    ax.set_ylabel(f"loss on the last {last} tokens")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(results: dict[str, list[LengthResult]], path: Path, title: str, last: int, trained: dict[str, int | None] | None = None) -> None:
    """``figure`` saved as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(results, title, last, trained)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))
    finally:
        plt.close(fig)


def save_json(results: dict[str, list[LengthResult]], path: Path, meta: dict) -> None:
    text = json.dumps({"meta": meta, "results": {k: [asdict(r) for r in v] for k, v in results.items()}}, indent=2)
    atomic_write(path, lambda tmp: tmp.write_text(text))
