"""The probe measured: each model's receptive field, the per-position losses of every row read
through the streaming contract, and the comparisons between them binned by distance, with a
bootstrap interval over documents."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..intervals import bootstrap_mean
from ..nn import StreamingLM
from .options import ProbeOptions
from .results import BinStat
from .samples import Sample


def receptive_field(model: StreamingLM) -> int | None:
    """The largest distance back (in tokens before the current one) that can change a logit, or
    None when it is unbounded (a recurrent state, or a full KV cache): ``max_context() - 1``,
    composed from each layer's reach (sliding window W over L layers: L·(W − 1); Transformer-XL
    from its segment/memory rule)."""
    context = model.max_context()
    return None if context is None else context - 1


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


def distance_bins(max_distance: int) -> list[tuple[int, int]]:
    """Log-spaced bins [0, 1), [1, 2), [2, 4), [4, 8), ... covering 0..max_distance."""
    bins, lo = [(0, 1)], 1
    while lo <= max_distance:
        bins.append((lo, 2 * lo))
        lo *= 2
    return bins


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
