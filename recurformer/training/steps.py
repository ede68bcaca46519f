"""One optimizer step of stateful segment training (Liang, "Block-wise Recurrent Transformer",
§4), i.e. truncated BPTT with the model state carried across steps.

Each optimizer step reads ``grad_accum`` consecutive segments of ``seq_len`` tokens from B
streams (row b of segment k+1 continues row b of segment k: *data continuity*). The state
returned by segment k is the initial state of segment k+1 (*state persistence*); it is detached
every ``truncation`` segments, where the summed loss of those segments is backpropagated. A row
whose stream wraps to its start has its state reset. The four ablation modes of its Table 2 are
``state: carry|reset`` x ``data_order: contiguous|shuffled``. ``schedule`` changes ``seq_len``
and ``truncation`` by step (a curriculum, self-paced or not: ``Pacing``), and ``state_init`` says
what a row that starts a document reads first: the initial state, a noisy one, or another
stream's (``curriculum.initial_state``).

Every rank owns its own streams and carried state, which are never broadcast or averaged;
gradients are all-reduced once per optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import numpy as np
import torch

from ..capture import Backend, CaptureFailed, StepGraphs
from ..curriculum import Pace
from ..device import autocast_context, to_device
from ..nn import State
from ..optim import make_optimizer
from ..tbptt import CapturedUpdate, Update, backprop, start_state
from .config import RunConfig, TrainConfig, build_from_run_config
from .data import RunData, check_model, train_streams, val_streams
from .meter import Notes, Throughput, UnreadLosses
from .ranks import gather, mean_over_ranks


class SegmentSteps:
    """The model, its optimizer, the data streams and the carried state of one rank, and the
    optimizer step over them (``train_step``); ``evaluate``: the validation loss. ``step`` and
    ``tokens_seen`` count what was trained; ``meter`` times it. The model is built from
    ``train.seed``; ``out_dir``: where a non-finite loss says the last good checkpoint is."""

    def __init__(
        self, cfg: RunConfig, data: RunData, device: torch.device, rank: int, world: int, out_dir: Any
    ) -> None:
        t = cfg.train
        self.cfg, self.data, self.device, self.rank, self.world, self.out_dir = cfg, data, device, rank, world, out_dir
        self._note = Notes(rank == 0)  # a line on stderr, once per run
        torch.manual_seed(t.seed)
        self.model = build_from_run_config(cfg, data.meta["vocab_size"]).to(device)
        check_model(self.model, cfg, data.meta["vocab_size"])
        self.model.check_tokens = False  # every token id of the data is < its vocabulary: no per-step check
        self.opt = make_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))
        self.update = Update(self.model, self.opt, t.lr, t.min_lr, t.warmup, t.steps, t.grad_clip)
        self.meter = Throughput(self.model, t.seq_len, device, t.precision, world, lambda m: self._note(m))
        self.flops_per_token = self.meter.flops_per_token
        if t.compile:
            self.model.compile_layers()
        self.ddp: torch.nn.Module = self.model
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # the carried state is not a module buffer, and buffers are not broadcast either
            self.ddp = DDP(self.model, broadcast_buffers=False)
        self.graphs: StepGraphs | None = None  # the training calls as captured steps (capture_steps)
        self.streams: Any = self._make_streams(t.seq_len, t.seed)
        self.state: State | None = None
        self.unread = UnreadLosses()  # train_step's losses not yet read (read_loss)
        self.pacing = Pacing(t)
        self.step = 0
        self.tokens_seen = 0

    def capture_steps(self, backend: Backend) -> None:
        """Train through captured steps (``capture.StepGraphs``; ``train.cuda_graphs``: the cuda
        backend) and a captured optimizer step (``tbptt.CapturedUpdate``: clipping, AdamW and
        zeroing the gradients, after the accumulation); the model's calls stay eager where a
        carried state would need a graph per step (layers that read absolute positions), in one line."""
        t = self.cfg.train
        u = self.update
        self.update = CapturedUpdate(
            u.module, u.opt, u.lr, u.min_lr, u.warmup, u.steps, u.grad_clip, backend, self._note
        )
        graphs = StepGraphs(self.model, t.grad_accum, backend)
        if t.state == "carry" and not graphs.shift:
            self._note(
                f"train.cuda_graphs: {self.cfg.model['name']} reads absolute positions, so a carried state would "
                "need a graph per step; training runs eager (train.state=reset captures once)"
            )
            return
        self.graphs = graphs

    def _make_streams(self, seq_len: int, seed: int) -> Any:
        t, boundary = self.cfg.train, self.model.reset_boundary
        return train_streams(self.data, t.data_order, t.batch_size, seq_len, seed, self.rank, self.world, boundary)

    def _apply_schedule(self) -> int:
        """Enter the schedule's stage for the step about to be taken; returns its truncation.
        A new segment length gets new streams that go on about where the old ones were (the
        same token offset before any wrap; shuffled windows get a new seed) and a fresh state."""
        stage = self.pacing.at(self.step)
        old = self.streams
        if stage["seq_len"] != old.seq_len:
            self.streams = self._make_streams(stage["seq_len"], self.cfg.train.seed + self.step)
            self.streams.step = old.step * old.seq_len // stage["seq_len"]
            self.state = None
        return stage["truncation"]

    def _segment(
        self, batch: Any, state: State | None, index: int = 0, evaluating: bool = False
    ) -> tuple[torch.Tensor, State]:
        """Loss and state after segment ``index`` of the step, read from ``_read_from``; the
        forward under autocast; ``evaluating``: the model itself (no DDP), from the zero state."""
        state = self._read_from(batch, state, index, evaluating)
        x, y = to_device(batch.x, self.device), to_device(batch.y, self.device)
        if evaluating:  # the model itself (no DDP), one call, its logits checked finite
            out = next(self.model.read(x, x.shape[1], state, y, self.cfg.train.precision))
        else:
            with autocast_context(self.cfg.train.precision, self.device):
                out = self.ddp(x, state=state, targets=y)
        assert out.loss is not None  # targets were given
        return out.loss, out.state

    def _read_from(self, batch: Any, state: State | None, index: int = 0, evaluating: bool = False) -> State:
        """The state segment ``index`` of the step reads from: a fresh state in ``reset`` mode or
        at the start, rows whose stream wrapped reset (in training, from ``train.state_init``)."""
        t = self.cfg.train
        if (
            t.state_init != "zero" and not evaluating
        ):  # rows that start a document take a noisy or another stream's state
            rows = torch.ones(t.batch_size, dtype=torch.bool) if t.state == "reset" else batch.wrapped
            seed = ((t.seed * 1_000_003 + self.step) * 4099 + index) * 1031 + self.rank
            return start_state(
                self.model,
                t.state_init,
                rows,
                state,
                t.batch_size,
                self.device,
                seed,
                t.state_noise,
                t.state_init_share,
            )
        if t.state == "reset" or state is None:
            return self.model.init_state(t.batch_size, self.device)
        if bool(batch.wrapped.any()):  # host data: no wait for the device
            return state.reset(batch.wrapped)  # a host mask, so the state knows on the host that a row is fresh
        return state

    def _replay(self, batch: Any, index: int) -> torch.Tensor:
        """Segment ``index`` of a step of one-segment windows through the captured step
        (``self.graphs``): the same loss, gradients (of loss / grad_accum, accumulated) and
        detached state as ``backprop`` over ``_segment``, which it falls back to, with one line,
        for a call that cannot be captured or a capture that fails (then for the rest of the run)."""
        t = self.cfg.train
        state = self._read_from(batch, self.state, index)
        x, y = to_device(batch.x, self.device), to_device(batch.y, self.device)
        if self.graphs is not None and self.graphs.aligned(x, state):
            try:
                with autocast_context(t.precision, self.device):
                    loss, self.state = self.graphs(x, y, state)
                return loss
            except CaptureFailed as e:
                self._note(f"train.cuda_graphs: {e}; training goes on eager")
                self.graphs = None
        elif self.graphs is not None:
            self._note(
                f"train.cuda_graphs: a call of {x.shape[1]} tokens at position {state.pos} is not aligned; it runs eager"
            )

        def forward(i: int, state: State | None) -> tuple[torch.Tensor, State]:
            with autocast_context(t.precision, self.device):
                out = self.model(x, state=state, targets=y)
            return out.loss, out.state

        losses, self.state = backprop(forward, [1], state, t.grad_accum)
        return losses[0]

    def train_step(self, read: bool = True) -> Any:
        """One optimizer step over ``grad_accum`` consecutive segments; returns the mean loss: as a
        float, read and checked to be finite (``read``), or as the 0-dim tensor on the device,
        unread, so the step queues its work without waiting for the device (the loop reads the
        loss once per log interval and before a checkpoint: ``read_loss``)."""
        t = self.cfg.train
        self.update.begin(self.step)
        truncation = self._apply_schedule()
        seq_len = self.streams.seq_len

        def sync_last(window: int) -> Any:  # DDP all-reduces the gradients in the step's last window only
            last = window == t.grad_accum // truncation - 1
            return self.ddp.no_sync() if (self.world > 1 and not last) else contextlib.nullcontext()  # type: ignore[operator]

        if self.graphs is not None and truncation > 1:
            self._note(
                f"train.cuda_graphs: truncation {truncation} backpropagates through several calls; those steps run eager"
            )
        if self.graphs is not None and truncation == 1:
            losses = [self._replay(self.streams.next_batch(), i) for i in range(t.grad_accum)]
        else:
            losses, self.state = backprop(
                lambda i, state: self._segment(self.streams.next_batch(), state, i),
                [truncation] * (t.grad_accum // truncation),
                self.state,
                t.grad_accum,
                sync_last,
            )
        self.update.finish()
        total: Any = sum(losses)
        self.step += 1
        self.tokens_seen += t.grad_accum * t.batch_size * seq_len * self.world
        mean = (total / t.grad_accum).float()
        self.unread.add(mean, self.step)
        if self.pacing.self_paced and (line := self.pacing.observe(self.step - 1, self._mean(mean))):
            self._note(line)
        return self.read_loss(mean) if read else mean

    def _mean(self, x: Any) -> float:
        return mean_over_ranks(float(x), self.world, self.device)

    def read_loss(self, loss: torch.Tensor) -> float:
        """The step's loss as a float (``UnreadLosses.read``)."""
        return self.unread.read(loss, self.step, self.world, self.out_dir)

    def _val_streams(self) -> Any:
        t = self.cfg.train
        return val_streams(self.data, t.batch_size, t.seq_len, self.rank, self.world, self.model.reset_boundary)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` consecutive validation segments of B fresh streams,
        carrying the state between them in ``carry`` mode."""
        t = self.cfg.train
        self.model.eval()
        streams = self._val_streams()
        state, losses = None, []
        for _ in range(t.eval_batches):
            loss, state = self._segment(streams.next_batch(), state, evaluating=True)
            losses.append(float(loss))
        self.model.train()
        return self._mean(float(np.mean(losses)))


class Pacing:
    """Where the stages of ``train.schedule`` start: at their steps, or for a self-paced schedule
    (``advance_below``) as soon as the training loss of the stage before falls below it
    (``curriculum.Schedule.observe``; the loss then read every step, a wait for the device). A part
    of the checkpoint (``pace``) when self-paced."""

    def __init__(self, t: TrainConfig) -> None:
        self.schedule, self.base = t.curriculum(), t.base_values()
        self.pace = self.schedule.pace(self.base)
        self.self_paced = bool(self.schedule.advance_below)

    def at(self, step: int) -> dict[str, int]:
        """seq_len and truncation in force at ``step`` (0-based: the step about to be taken)."""
        return self.schedule.at(step, self.base, self.pace)

    def observe(self, step: int, loss: float) -> str | None:
        """Step ``step``'s loss (0-based) recorded; the line that says a stage starts early, if one does."""
        if (stage := self.schedule.observe(self.pace, step, loss)) is None:
            return None
        values = ", ".join(f"{k} {v}" for k, v in self.at(step + 1).items())
        return (
            f"step {step + 1}: stage {stage} ({values}) starts, the training loss of the last "
            f"{self.schedule.advance_window} steps below {self.schedule.advance_below:g}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"pace": dataclasses.asdict(self.pace)} if self.self_paced else {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "pace" in sd:
            self.pace = Pace(**sd["pace"])


class StreamCursors:
    """Every rank's data cursor, a list under ``streams`` (rank r resumes from entry r); a cursor
    saved in another stage of the ``seq_len`` schedule gets streams of its segment length."""

    def __init__(self, trainer: SegmentSteps) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"streams": gather(self.trainer.streams.state_dict(), self.trainer.world)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        tr = self.trainer
        saved = sd["streams"][tr.rank]
        if saved.get("seq_len") != tr.streams.seq_len:
            tr.streams = tr._make_streams(saved["seq_len"], saved.get("seed", tr.cfg.train.seed))
        tr.streams.load_state_dict(saved)


class CarriedState:
    """Every rank's carried state as ``rank<r>.state.<field>`` tensors (``State.to_flat``); none
    before the first step. Loading checks it against the model and batch size exactly."""

    def __init__(self, trainer: SegmentSteps) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        tr = self.trainer
        local = tr.state.to("cpu").to_flat() if tr.state is not None else None
        everyone = gather(local, tr.world)
        sd: dict[str, Any] = {
            f"rank{r}.state.{k}": v for r, flat in enumerate(everyone) if flat for k, v in flat.items()
        }
        sd["state_class"] = type(tr.model.init_state(1, "cpu")).__name__
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        tr, prefix = self.trainer, f"rank{self.trainer.rank}.state."
        flat = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        if flat:
            state = tr.model.state_from_flat(flat).to(tr.device)
            tr.state = tr.model.check_state(state, tr.cfg.train.batch_size)


# ----------------------------------------------------------------------------------------------
# the run directory
