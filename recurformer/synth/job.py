"""One learning rate's training of a synth run, as a job of the one training loop
(``recurformer.training.loop``): the task's rows are its data (a fixed training set in a seeded
epoch order, or ``FreshRows`` drawn for every step), its validation accuracy its evaluation, and
its progress (``synth.save_every``) is saved and restored through the training parts
(``recurformer.training.parts``): the weights, AdamW's moments, the generators, the rows' order
and cursor, the state passed between batches, and the learning curve so far."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from ..checkpoint import RNGState, checkpoints, load_checkpoint
from ..config import RecurformerError
from ..curriculum import Pace
from ..data.synthetic import TaskData, get_task, make_split
from ..device import autocast_context
from ..nn import State
from ..optim import make_optimizer
from ..progress import Progress
from ..tbptt import Update, start_state
from ..training.loop import Cadence, run_loop
from ..training.parts import ModelWeights, OptimizerState, Stateful, restore_parts, save_parts, state_dicts
from .config import SynthConfig, mixed_range, scheduled_length, stage_base, with_setting
from .learner import Learner, evaluate

PROGRESS = "progress"  # the subdirectory of the --save directory that holds a run's progress (synth.save_every)


class FreshRows:
    """Training batches drawn fresh for every step (``SynthConfig.fresh``): batch k at the task
    length the schedule sets at step k, or drawn uniformly from ``train_lengths`` [lo, hi]; with
    both, from lo up to the stage's length (at most hi; a stage shorter than lo trains at its own
    length), so mixed lengths can follow a curriculum; or at one of ``train_settings`` (task
    parameters, e.g. Zoology's (seq_len, num_pairs) mixture) drawn uniformly, so the rows of a batch
    share a shape (Zoology shuffles its settings within a batch; we mix them across batches). Rows
    from the seed ``(seed, k)``, none equal to a row of ``exclude`` (the validation and test rows):
    a function of the step alone, so a resumed run draws the batches an uninterrupted one does."""

    def __init__(self, task: str, params: dict[str, Any], cfg: SynthConfig, exclude: set[bytes]) -> None:
        self.task, self.t, self.params, self.cfg, self.exclude = task, get_task(task), params, cfg, exclude
        self.base_length = stage_base(self.t, params, cfg).get("length", 0)

    def length(self, step: int, pace: Pace | None = None) -> int | None:
        """The task length of batch ``step`` (None: the task's own parameters); ``pace``: where a
        self-paced schedule's stages start."""
        cfg = self.cfg
        stage = scheduled_length(self.t, self.params, cfg, step, pace)
        if cfg.train_lengths:
            lo, hi = mixed_range(cfg.train_lengths, stage)
            return int(np.random.default_rng([cfg.seed, step, 7]).integers(lo, hi + 1))
        return stage

    def setting(self, step: int) -> dict[str, Any] | None:
        """The ``train_settings`` entry batch ``step`` trains at (None: no settings)."""
        settings = self.cfg.train_settings
        if not settings:
            return None
        return settings[int(np.random.default_rng([self.cfg.seed, step, 11]).integers(len(settings)))]

    def batch(self, step: int, pace: Pace | None = None) -> TaskData:
        L = self.length(step, pace)
        params = self.params if L is None else self.t.at_length(self.params, L)
        if (setting := self.setting(step)) is not None:
            params = with_setting(self.t, params, setting, "train_settings")
        return make_split(
            self.task, self.cfg.batch_size, 10**9 + self.cfg.seed * 10**6 + step, params, exclude=self.exclude
        )


def load_progress(save_dir: str | Path) -> dict[str, Any]:
    """The newest progress checkpoint of a run saved with ``--save save_dir`` and ``synth.save_every``."""
    where = Path(save_dir) / PROGRESS
    if not Path(save_dir).exists():
        raise RecurformerError(
            f"{save_dir} does not exist: give --resume the directory a synth run was saved to "
            "(--save DIR with synth.save_every > 0)"
        )
    if checkpoints(Path(save_dir)):  # step_* directories of its own: a run of `recurformer train`
        raise RecurformerError(
            f"{save_dir} is a train run, not a synth run: resume it with `recurformer train --resume {save_dir}`"
        )
    if not checkpoints(where):
        raise RecurformerError(
            f"{save_dir} holds no synth run in progress (no checkpoint in {where}): "
            f"resume a run started with --save {save_dir} and synth.save_every > 0"
        )
    ck = load_checkpoint(where, with_train_state=True)
    if not all(isinstance(ck["config"].get(k), dict) for k in ("model", "task", "synth")):
        raise RecurformerError(f"{ck['dir']} is not a synth run's progress (its config.json has no model/task/synth)")
    return ck


@dataclass
class SavedProgress:
    """Where and how often a run's progress is saved (``synth.save_every``): every ``every`` steps
    one checkpoint in ``directory`` (``checkpoint.save_checkpoint``: written whole or not at all,
    the older one removed after), with ``run`` (the task, model and synth sections) from which
    ``synth --resume`` builds the same run again; ``resumed``: the checkpoint to continue from
    (``load_progress``), whose remaining steps then equal an uninterrupted run's."""

    directory: Path
    every: int
    run: dict[str, Any]
    resumed: dict[str, Any] | None = None


class TaskRows:
    """The training rows of a step: a fixed set in a seeded epoch order (``order``, ``pos``; a
    new order at each epoch's end) or ``FreshRows`` drawn for the step. A part of the saved
    progress: the generator, the order and the cursor."""

    def __init__(self, data: TaskData | FreshRows, cfg: SynthConfig) -> None:
        self.data, self.batch_size = data, cfg.batch_size
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.n = len(data.inputs) if isinstance(data, TaskData) else 0
        self.order = torch.randperm(self.n, generator=self.gen)
        self.pos = 0

    def batch(self, step: int, pace: Pace) -> tuple[Tensor, Tensor]:
        if isinstance(self.data, FreshRows):
            b = self.data.batch(step, pace)
            return b.inputs, b.targets
        if self.pos + self.batch_size > self.n:
            self.order, self.pos = torch.randperm(self.n, generator=self.gen), 0
        idx = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.data.inputs[idx], self.data.targets[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state(), "order": self.order, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.gen.set_state(sd["gen"])
        self.order, self.pos = sd["order"], sd["pos"]


class SynthTraining:
    """AdamW with warmup + cosine over ``cfg.steps`` steps of ``TaskRows``. With ``truncation``,
    ``state_init`` other than zero, or a schedule, each batch goes through ``Learner.backward``
    (the state a row ends with passed to the next batch: ``passed``). Keeps the mean training loss
    over the last 10% of the steps (``tail``), the learning curve (``curve``: with
    ``cfg.eval_every`` and ``val``, every that many steps the validation accuracy and the mean
    training loss since the last point, also printed to stderr: recall tasks learn in a sudden
    jump after a plateau) and the schedule's ``Pace`` (where each stage started; a self-paced
    stage is announced on stderr when it starts early)."""

    def __init__(
        self,
        learner: Learner,
        data: TaskData | FreshRows,
        cfg: SynthConfig,
        lr: float,
        val: TaskData | None,
        saving: SavedProgress | None,
    ) -> None:
        self.learner, self.cfg, self.lr, self.val, self.saving = learner, cfg, lr, val, saving
        self.device = learner.model.tok_emb.weight.device
        self.opt = make_optimizer(learner, lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
        min_lr, warmup = lr * cfg.min_lr_ratio, int(cfg.warmup * cfg.steps)
        self.update = Update(learner, self.opt, lr, min_lr, warmup, cfg.steps, cfg.grad_clip)
        self.rows = TaskRows(data, cfg)
        self.sched = cfg.curriculum()
        self.base = {"truncation": cfg.truncation, "length": data.base_length if isinstance(data, FreshRows) else 0}
        no_state = self.sched.values("truncation", self.base) == [0] and cfg.state_init == "zero"
        self.plain = learner.decoder is not None or no_state  # whole rows, no state passed
        self.pace = self.sched.pace(self.base)
        self.passed: State | None = None
        self.step = 0
        self.tail: list[float] = []
        self.since: list[float] = []
        self.curve: list[dict[str, float]] = []
        if saving is not None and saving.resumed is not None:
            restore_parts(self.parts(str(saving.resumed["dir"])), saving.resumed)

    def parts(self, where: str = "") -> dict[str, Stateful]:
        """The named parts of the progress; ``train`` (this job) holds the step and the curve."""
        return {
            "train": self,
            "model": ModelWeights(self.learner, where),
            "optimizer": OptimizerState(self.opt),
            "rng": RNGState(),
            "rows": self.rows,
            "state": PassedState(self),
        }

    def state_dict(self) -> dict[str, Any]:
        loop = {"tail": self.tail, "since": self.since, "curve": self.curve, "pace": dataclasses.asdict(self.pace)}
        return {"step": self.step, **loop}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.tail, self.since, self.curve = int(sd["step"]), sd["tail"], sd["since"], sd["curve"]
        self.pace = Pace(**sd["pace"]) if "pace" in sd else self.pace

    def say(self, msg: str) -> None:
        tqdm.write(f"lr {self.lr:g} step {self.step}/{self.cfg.steps}: {msg}", file=sys.stderr)

    def take_step(self) -> float:
        cfg, step = self.cfg, self.step
        x, y = (t.to(self.device) for t in self.rows.batch(step, self.pace))
        self.update.begin(step)
        with autocast_context(cfg.precision, self.device):
            if self.plain:
                loss_t = self.learner.loss(x, y)
                loss_t.backward()
                loss = float(loss_t.detach())
            else:
                truncation = self.sched.at(step, self.base, self.pace)["truncation"]
                rows = torch.ones(x.shape[0], dtype=torch.bool)
                seed = cfg.seed * 1_000_003 + step
                state = start_state(
                    self.learner.model,
                    cfg.state_init,
                    rows,
                    self.passed,
                    x.shape[0],
                    self.device,
                    seed,
                    cfg.state_noise,
                    cfg.state_init_share,
                )
                boundary = self.learner.model.reset_boundary
                loss, self.passed = self.learner.backward(x, y, state, truncation * cfg.context, boundary)
        self.update.finish()
        self.step += 1
        if (advanced := self.sched.observe(self.pace, step, loss)) is not None:
            values = ", ".join(f"{k} {v}" for k, v in self.sched.at(step + 1, self.base, self.pace).items())
            self.say(
                f"stage {advanced} ({values}) starts, the training loss of the last "
                f"{self.sched.advance_window} steps below {self.sched.advance_below:g}"
            )
        if step >= cfg.steps - max(1, cfg.steps // 10):
            self.tail.append(loss)
        if cfg.eval_every and self.val is not None:
            self.since.append(loss)
        return loss

    def log(self, loss: float) -> None:
        """(the steps are counted on the bar; the loss is kept in ``tail`` and ``since``)"""

    def validate(self) -> None:
        assert self.val is not None
        acc = evaluate(self.learner, self.val, self.cfg.chunk, self.cfg.eval_batch_size).headline(self.learner.metric)
        self.curve.append({"step": self.step, "train_loss": sum(self.since) / len(self.since), "val_accuracy": acc})
        self.say(f"train loss {self.curve[-1]['train_loss']:.4f}, val accuracy {acc:.3f}")
        self.since = []
        self.learner.train()

    def checkpoint(self, loss: float) -> None:
        assert self.saving is not None
        save_parts(self.saving.directory, self.step, state_dicts(self.parts()), self.saving.run, None, keep_last=1)


class PassedState:
    """The state passed from one batch to the next (``state_init=passing``) as ``passed.<field>``
    tensors; none before the first such step."""

    def __init__(self, job: SynthTraining) -> None:
        self.job = job

    def state_dict(self) -> dict[str, Any]:
        passed = self.job.passed
        return {f"passed.{k}": v for k, v in passed.to("cpu").to_flat().items()} if passed is not None else {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        flat = {k.removeprefix("passed."): v for k, v in sd.items() if k.startswith("passed.")}
        model = self.job.learner.model
        self.job.passed = model.state_from_flat(flat).to(self.job.device) if flat else None


def train_model(
    learner: Learner,
    data: TaskData | FreshRows,
    cfg: SynthConfig,
    lr: float,
    progress: bool = False,
    val: TaskData | None = None,
    saving: SavedProgress | None = None,
) -> tuple[float, list[dict[str, float]], Pace]:
    """``SynthTraining`` run to ``cfg.steps`` by the one loop: returns the mean training loss over
    the last 10% of the steps, the learning curve (empty without ``cfg.eval_every`` and ``val``)
    and the schedule's ``Pace``. ``progress``: the steps on stderr (``progress.Progress``: a bar on
    a terminal, lines with the time left in a log); ``saving``: the run's progress saved every so
    many steps (and restored first, when it resumes one); never at the last step, after which the
    model itself is saved."""
    job = SynthTraining(learner, data, cfg, lr, val, saving)
    learner.train()
    cadence = Cadence(
        cfg.steps,
        eval_every=cfg.eval_every if val is not None else 0,
        save_every=saving.every if saving is not None else 0,
        eval_last=False,
        save_last=False,
    )
    bar = Progress(cfg.steps, f"lr {lr:g}", "step", initial=job.step, show=progress)
    try:
        run_loop(job, cadence, bar)
    finally:
        bar.close()
    return sum(job.tail) / len(job.tail), job.curve, job.pace
