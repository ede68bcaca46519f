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
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .capture import Backend, CaptureFailed, failed, record
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


@dataclass
class CapturedUpdate(Update):
    """``Update``'s ``finish`` as one captured call (``capture.record``; ``train.cuda_graphs``):
    clipping the gradient norm, AdamW's step and zeroing the gradients, with no host read. The
    learning rate is a 0-dim tensor on the parameters' device that ``begin`` sets in place (float32
    on CUDA, which its fused kernel reads; float64 elsewhere, as a Python float is), AdamW is
    ``capturable`` (its step counts on the device) and fused, as ``optim.make_optimizer`` makes it;
    the gradients are buffers zeroed in place (a parameter without a gradient keeps none, as with
    ``Update``). The first ``eager_steps`` steps run eagerly (real steps: AdamW makes its state in
    the first); a capture that fails, or a parameter that gets its first gradient after it, says
    so in one line to ``note``, and the steps run eagerly from there (the weights and the
    optimizer's state as if the capture had not been tried)."""

    backend: Backend = "eager"
    note: Callable[[str], object] = print
    eager_steps: int = 2
    done: int = field(default=0, init=False)  # the steps taken
    replay: Callable[[], None] | None = field(default=None, init=False)
    plain: bool = field(default=False, init=False)  # eager for the rest of the run
    captured: list[torch.nn.Parameter] = field(default_factory=list, init=False)  # those with a gradient
    grads: list[Tensor] = field(default_factory=list, init=False)  # their gradient buffers
    others: list[torch.nn.Parameter] = field(default_factory=list, init=False)  # those without

    def __post_init__(self) -> None:
        dev = next(self.module.parameters()).device
        self.lr_tensor = torch.tensor(self.lr, dtype=torch.float32 if dev.type == "cuda" else torch.float64, device=dev)
        if not all(g.get("fused") for g in self.opt.param_groups):
            self.note("train.cuda_graphs: the optimizer is not fused, so it cannot be captured; it steps eagerly")
            self.plain = True

    def begin(self, step: int) -> float:
        if self.plain:
            return super().begin(step)
        lr = self.lr_at(step)
        self.lr_tensor.fill_(lr)
        for g in self.opt.param_groups:  # again after a checkpoint's groups are loaded
            g["lr"], g["capturable"] = self.lr_tensor, True
        return lr

    def step(self) -> list[Tensor]:
        """Clip, update, zero the gradients in place: what is captured."""
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        return []

    def finish(self) -> None:
        if self.plain:
            return super().finish()
        self.done += 1
        if self.replay is None and self.done <= self.eager_steps:
            self.step()
            return
        try:
            if self.replay is None:
                self.replay = self.capture()
            self.hold()
        except CaptureFailed as e:
            self.note(f"train.cuda_graphs: {e}; the optimizer steps eagerly")
            self.plain, self.replay = True, None
            self.step()
            return
        self.replay()

    def hold(self) -> None:
        """The captured gradient buffers in place: a gradient that autograd made anew copied in."""
        for p, g in zip(self.captured, self.grads):
            if p.grad is None:
                g.zero_()
            elif p.grad is not g:
                g.copy_(p.grad)
            p.grad = g
        if any(p.grad is not None for p in self.others):
            raise CaptureFailed("a parameter got its first gradient after the optimizer step was captured")

    def capture(self) -> Callable[[], None]:
        """The step recorded, the weights, gradients and optimizer state put back as they were
        (recording runs it)."""
        self.captured = [p for p in self.module.parameters() if p.grad is not None]
        self.others = [p for p in self.module.parameters() if p.grad is None]
        self.grads = [p.grad for p in self.captured if p.grad is not None]
        state = [t for p in self.captured for t in self.opt.state[p].values() if isinstance(t, Tensor)]
        mutable = [*(p.data for p in self.captured), *self.grads, *state]
        kept = [t.clone() for t in mutable]
        try:
            return record(lambda: self.step(), [], self.backend, 1)[1]  # make_fx: a function, not a method
        except RuntimeError as e:
            raise failed(f"capturing the {self.backend} optimizer step", e) from None
        finally:
            with torch.no_grad():
                torch._foreach_copy_(mutable, kept)


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
