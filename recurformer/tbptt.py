"""One optimizer step of truncated backpropagation through time (TBPTT), shared by the trainer
(``training.steps``) and the synthetic diagnostics (``synth.learner``).

A step reads segments s_1..s_n in order, the state carried from one to the next, and cuts them
into windows of consecutive segments. Each window's summed loss, divided by ``divisor`` D,

    L_w = (1/D) sum_{i in w} l_i(s_i, state_{i-1}),

is backpropagated when the window ends and the state is detached after it, so a gradient reaches
back to the first segment of its window and no further: stateful segment training with a
truncation of k segments (Liang et al., "Block-wise Recurrent Transformer", §4); one window of n
segments is plain backpropagation through the whole sequence. Around the windows: the step's
learning rate (linear warmup, then cosine; ``optim.lr_at``), the state a starting row reads
first (``curriculum.initial_state``), and after them clipping of the gradient norm and the
optimizer's update (``Update``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .curriculum import initial_state
from .nn import StreamingLM
from .optim import lr_at
from .state import State

Segment = Callable[[int, State | None], tuple[Tensor, State]]  # (index, state) -> (loss term, new state)


@dataclass
class Update:
    """The optimizer's part of a step over ``module``'s parameters: ``begin(step)`` sets the
    step's learning rate (warmup + cosine from ``lr`` to ``min_lr`` at ``steps``) in every
    parameter group; ``finish()`` clips the gradient norm to ``grad_clip`` (0: no clipping),
    updates, and frees the gradients."""

    module: torch.nn.Module
    opt: torch.optim.Optimizer
    lr: float
    min_lr: float
    warmup: int
    steps: int
    grad_clip: float

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.lr, self.min_lr, self.warmup, self.steps)

    def begin(self, step: int) -> float:
        lr = self.lr_at(step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        return lr

    def finish(self) -> None:
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def backprop(
    segment: Segment,
    windows: Sequence[int],
    state: State | None,
    divisor: int | None = None,
    context: Callable[[int], contextlib.AbstractContextManager] | None = None,
) -> tuple[list[Tensor], State]:
    """Read ``sum(windows)`` segments through ``segment``, carrying the state; after each window
    of ``windows[w]`` segments backpropagate its summed loss (divided by ``divisor``, if given)
    and detach the state. ``context(w)`` is entered around window w (e.g. DDP's ``no_sync``).
    Returns every window's summed loss (detached) and the detached state after the last one."""
    losses: list[Tensor] = []
    index = 0
    for w, k in enumerate(windows):
        with context(w) if context is not None else contextlib.nullcontext():
            pending: Tensor | None = None
            for _ in range(k):
                loss, state = segment(index, state)
                index += 1
                pending = loss if pending is None else pending + loss
            assert pending is not None and state is not None, "a window reads at least one segment"
            (pending if divisor is None else pending / divisor).backward()
            state = state.detach()
        losses.append(pending.detach())
    assert state is not None
    return losses, state


def start_state(
    model: StreamingLM,
    kind: str,
    rows: Tensor,
    state: State | None,
    batch_size: int,
    device: torch.device | str,
    seed: int,
    sigma: float,
    share: float,
) -> State:
    """``curriculum.initial_state`` for the rows marked in ``rows`` that start a document, its
    noise and choices drawn from a CPU generator seeded with ``seed`` (the same on every device)."""
    gen = torch.Generator().manual_seed(seed)
    return initial_state(model, kind, rows, state, batch_size, device, gen, sigma, share)
