"""The model under test and the task's read-out (``Learner``: its LM head, or MAD's AutoEncoder
decoder for compression), trained within a row by truncated BPTT, and scored (``evaluate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.synthetic import Task, TaskData
from ..modules import RMSNorm
from ..nn import IGNORE_INDEX, State, StreamingLM
from ..tbptt import backprop


@dataclass
class Scores:
    token_accuracy: float  # micro
    macro_accuracy: float
    exact_match: float
    scored_tokens: int
    rows: int
    by_order: list[float] = field(default_factory=list)  # micro accuracy of each row's j-th scored token

    def headline(self, metric: str) -> float:
        return self.token_accuracy if metric == "token" else self.exact_match


class CompressionDecoder(nn.Module):
    """MAD's AutoEncoder decoder for the compression task (Poli et al. 2024): the model's
    features e at the last position plus a sin-cos position embedding p_i for each position i go
    through (RMSNorm -> Linear -> GELU) twice and RMSNorm -> Linear to the vocabulary:
    logits_i = U(MLP(e + p_i)). The decoder sees nothing but e, so e must hold the whole row."""

    def __init__(self, dim: int, vocab_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            RMSNorm(dim, eps),
            nn.Linear(dim, dim),
            nn.GELU(),
            RMSNorm(dim, eps),
            nn.Linear(dim, dim),
            nn.GELU(),
            RMSNorm(dim, eps),
        )
        self.unembed = nn.Linear(dim, vocab_size)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.02)
                nn.init.zeros_(m.bias)

    @staticmethod
    def positions(length: int, dim: int, device: torch.device) -> Tensor:
        """[length, dim] sin-cos embedding: sin(i w_k) | cos(i w_k), w_k = 10000^(-k / (dim/2))."""
        w = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=device) / (dim // 2))
        a = torch.arange(length, device=device)[:, None] * w
        return torch.cat([a.sin(), a.cos()], dim=-1)

    def forward(self, e: Tensor, length: int) -> Tensor:
        """e [B, D] -> logits [B, length, V]."""
        x = e[:, None, :] + self.positions(length, e.shape[-1], e.device).to(e.dtype)
        return self.unembed(self.mlp(x))


class Learner(nn.Module):
    """The model under test and the task's read-out: its own LM head (next-token targets), or
    a ``CompressionDecoder`` over its features at the last position (``Task.head == "autoencoder"``)."""

    def __init__(self, model: StreamingLM, task: Task) -> None:
        super().__init__()
        self.model, self.metric = model, task.metric
        self.decoder = (
            CompressionDecoder(model.config.dim, model.config.vocab_size, model.config.norm_eps)
            if task.head == "autoencoder"
            else None
        )

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        if self.decoder is None:
            out = self.model(x, targets=y)
            assert out.loss is not None
            return out.loss
        h, _ = self.model.features(x)
        logits = self.decoder(h[:, -1], x.shape[1])
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)

    def backward(self, x: Tensor, y: Tensor, state: State | None, piece: int, boundary: int) -> tuple[float, State]:
        """Backpropagate the mean loss over the scored tokens of ``x`` read from ``state``,
        detaching the state every ``piece`` tokens (0: never): truncated BPTT within a row.
        Returns the loss and the state after the row's last whole multiple of ``boundary``
        tokens, detached (what ``state_init=passing`` gives another row); a row shorter than
        ``boundary`` (a mixed length below the chunk) passes on the state it was read from."""
        assert self.decoder is None, "the autoencoder head reads whole rows"
        T = x.shape[1]
        n = (y != IGNORE_INDEX).sum().clamp(min=1)
        whole = (T // boundary) * boundary
        cuts = sorted({0, T, whole, *range(piece or T, T, piece or T)})
        ends = [i + 1 for i, b in enumerate(cuts[1:]) if piece and b % piece == 0 or b == T]  # after these calls
        kept = None
        if whole == 0:
            kept = (state if state is not None else self.model.init_state(x.shape[0], x.device)).detach()

        def call(i: int, state: State | None) -> tuple[Tensor, State]:
            nonlocal kept
            a, b = cuts[i], cuts[i + 1]
            out = self.model(x[:, a:b], state=state)
            loss = (
                F.cross_entropy(
                    out.logits.float().flatten(0, 1), y[:, a:b].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
                )
                / n
            )
            if b == whole:
                kept = out.state.detach()
            return loss, out.state

        losses, _ = backprop(call, [b - a for a, b in zip([0, *ends[:-1]], ends)], state)
        assert kept is not None
        return sum(float(v) for v in losses), kept

    @torch.no_grad()
    def predict(self, x: Tensor, chunk: int, progress: Callable[[int], object] | None = None) -> Tensor:
        """Argmax predictions [B, T], reading ``x`` ``chunk`` tokens per call with the state carried;
        ``progress(n)`` after each call, n the tokens it read."""
        starts = range(0, x.shape[1], chunk)
        if self.decoder is None:
            parts = []
            for a, out in zip(starts, self.model.read(x, chunk)):
                parts.append(out.logits.argmax(-1))
                if progress is not None:
                    progress(x[:, a : a + chunk].numel())
            return torch.cat(parts, dim=1)
        state, last = None, None
        for a in starts:  # the hidden states, which the autoencoder head reads
            h, state = self.model.features(x[:, a : a + chunk], state)
            last = h[:, -1]
            if progress is not None:
                progress(x[:, a : a + chunk].numel())
        return self.decoder(last, x.shape[1]).argmax(-1)


@torch.no_grad()
def evaluate(
    learner: Learner, data: TaskData, chunk: int, batch_size: int, progress: Callable[[int], object] | None = None
) -> Scores:
    """Teacher-forced argmax at the scored positions, reading each row ``chunk`` tokens per call;
    also by order (MQAR's j-th query: a model that only rules out the values already answered is
    right on the last query and near chance on the first). ``progress(n)`` after each call, n the
    tokens it read."""
    learner.eval()
    device = learner.model.tok_emb.weight.device
    preds = torch.cat(
        [
            learner.predict(data.inputs[lo : lo + batch_size].to(device), chunk, progress).cpu()
            for lo in range(0, len(data.inputs), batch_size)
        ]
    )
    scored = data.targets != IGNORE_INDEX
    correct = (preds == data.targets) & scored
    tgt = data.targets[scored]
    hit = correct[scored].float()
    classes = tgt.unique()
    per_class = torch.stack([hit[tgt == c].mean() for c in classes])
    rows = scored.any(1)
    exact = (correct.sum(1) == scored.sum(1))[rows]
    order = scored.cumsum(1) - 1  # j at a row's j-th scored position
    by_order = [float(correct[scored & (order == j)].float().mean()) for j in range(int(scored.sum(1).max()))]
    return Scores(
        float(hit.mean()),
        float(per_class.mean()),
        float(exact.float().mean()),
        int(scored.sum()),
        int(rows.sum()),
        by_order,
    )
