"""Synthetic diagnostics ("The Recurrent Transformer: Greater Effective Depth and Efficient
Decoding", §"Synthetic diagnostics"): train a small model of any registered architecture on one task
of ``recurformer.data.synthetic`` and report its test accuracy.

Protocol. For every learning rate of a small sweep, a fresh model (same seed) is trained with
AdamW (``optim.make_optimizer``; betas 0.9/0.98 as in that paper's appendix) and warmup + cosine
(``optim.lr_at``) for a budget of optimizer steps over a fixed training set; the learning rate
with the best accuracy on a validation split is selected, and its test accuracy is reported
(train, validation and test rows are disjoint). Evaluation reads every row through the streaming
contract, ``chunk`` tokens per call with the state carried, teacher-forced argmax at the scored
positions; so a passkey at L = 16384 costs bounded memory for a bounded-state model. Tasks with a
length (passkey filler, copy string, copy delay, MQAR distance) are also tested at every ``eval_lengths`` value,
including lengths never trained. Compression is read through MAD's AutoEncoder head
(``CompressionDecoder``): every token is decoded from the model's features at the last position.

Metrics. ``token_accuracy`` is *micro* (correct scored tokens / scored tokens);
``macro_accuracy`` is the per-class recall averaged over target classes present (what MAD's
torchmetrics ``MulticlassAccuracy`` reports by default); ``exact_match`` is the fraction of rows
whose scored tokens are all correct (the paper's "sequence-level accuracy"). The headline
``accuracy`` is micro token accuracy for MAD tasks and exact match for copy, delayed copy and
passkey.

Model. The paper's synthetic setting (one layer, width 128, MLP 512, 16 heads) unless overridden;
the field that bounds each model's direct reach (``ModelConfig.context_field``: window, chunk,
segment or block length; llama's ``window=None`` stays full attention, the Recurrent Transformer
has none) is set to ``context`` (32 by default), so a bounded model must use its state on tasks
longer than that.

Recipes for memory (``recurformer.curriculum``): ``schedule`` changes the task length or the
truncation by step (a curriculum), ``train_lengths`` draws each batch's length from a range
(mixed lengths; with a length schedule, from its low end up to the stage's length), ``state_init``
starts each training row from a noisy state or another row's final state, and ``truncation``
backpropagates through that many segments of ``context`` tokens before detaching
(``Learner.backward``). Any of the first two, or ``fresh_data``, draws the
training rows fresh for every batch (``FreshRows``), disjoint from every held-out row. Validation
and test rows are at the task's own length, or at the length a schedule ends at (a curriculum is
scored at the length it trains towards).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from .checkpoint import RNGState, checkpoints, load_checkpoint, load_model_weights, save_checkpoint
from .config import Checked, RecurformerError, from_dict, merge, option, parse_overrides
from .curriculum import Pace, Schedule, check_state_init_share, schedule_from
from .data.synthetic import TASKS, Task, TaskData, get_task, make_split, row_tokens
from .device import autocast_context, device_option, pick_device, slow_bf16_warning
from .models import build_model, lookup, model_names
from .modules import RMSNorm
from .nn import IGNORE_INDEX, ModelConfig, State, StreamingLM
from .optim import make_optimizer, optimizer_from_flat, optimizer_to_flat
from .progress import Progress as Bar  # (this module's own Progress saves a run)
from .statesize import measure
from .tbptt import Update, backprop, start_state

MODEL_DEFAULTS: dict[str, Any] = {"dim": 128, "n_layers": 1, "n_heads": 16, "ffn_hidden": 512}
ONE_LAYER_FIELDS: dict[str, Any] = {"recurrent_layers": (-1,)}  # block_recurrent's default (-3,) needs 3 layers


@dataclass
class SynthConfig(Checked):
    key_format = "synth key '{}'"
    steps: int = option(500, range=">= 1")  # optimizer steps per learning rate
    batch_size: int = option(32, range=">= 1")
    n_train: int | None = option(None, range=">= 1")  # training examples (None: the task's MAD baseline size)
    n_val: int = option(256, range=">= 1")  # validation examples (learning-rate selection)
    n_test: int = option(1280, range=">= 1")  # test examples (MAD: 1,280)
    lrs: list[float] = option([5e-4, 1e-3, 3e-3], range="> 0")
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.98
    warmup: float = option(0.1, range="[0, 1)", note="a fraction of the steps")
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # the largest gradient norm (0: no clipping)
    precision: Literal["auto", "fp32", "bf16"] = "fp32"
    context: int = option(32, range=">= 1")  # window / chunk / segment / block length of every model that has one
    chunk: int = option(256, range=">= 1")  # tokens per model call at evaluation
    eval_batch_size: int = option(64, range=">= 1")
    eval_lengths: list[int] = option([], range=">= 0")  # lengths to test (passkey filler, copy string, copy delay)
    n_length_test: int = option(256, range=">= 1")  # test rows per length of ``eval_lengths``
    # the most memory one length's test may hold (rows, predictions, the model's state)
    eval_memory_gb: float = option(4.0, range="> 0")
    seed: int = 0
    # recipes for memory (recurformer.curriculum): with any of the first three, training rows are drawn
    # fresh for every batch (disjoint from every test row) instead of from a fixed set of n_train rows
    train_lengths: list[int] = field(default_factory=list)  # [lo, hi]: each batch's length (mixed_range)
    schedule: dict[str, Any] = field(default_factory=dict)  # the task length / truncation by step
    fresh_data: bool = False  # fresh rows for every batch at the task's own length
    # segments of ``context`` tokens backpropagated before the state is detached
    truncation: int = option(0, range=">= 0", note="0: the whole row")
    state_init: Literal["zero", "noise", "passing"] = "zero"  # each training row's initial state
    state_noise: float = option(1.0, range=">= 0")  # sigma of state_init=noise
    state_init_share: float = 1.0  # the fraction of rows given the noisy / passed state (others: the initial state)
    # validation accuracy every N steps, kept per lr in the sweep ("curve")
    eval_every: int = option(0, range=">= 0", note="0: only at the end")
    init_from: str | None = None  # a model saved by synth --save to start from (post-training), same model config
    # with --save DIR: progress every N steps in DIR/progress (synth --resume DIR); one lr
    save_every: int = option(0, range=">= 0", note="0: no progress saved")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lrs:
            raise RecurformerError("synth key 'lrs' is empty: give one or more learning rates (e.g. [1e-3])")
        if self.save_every and len(self.lrs) != 1:
            raise RecurformerError(
                f"synth key 'save_every' saves one run's progress; give one learning rate (lrs: {self.lrs})"
            )
        if self.train_lengths and (
            len(self.train_lengths) != 2 or not 0 <= self.train_lengths[0] <= self.train_lengths[1]
        ):
            raise RecurformerError(
                f"synth key 'train_lengths' must be [lo, hi] with 0 <= lo <= hi, got {self.train_lengths}"
            )
        check_state_init_share(self.state_init_share, self.state_init, "synth.state_init")

    def curriculum(self) -> Schedule:
        return schedule_from(self.schedule, "synth.schedule")

    def fresh(self) -> bool:
        """Whether training rows are drawn for every batch (a recipe that changes the length does so)."""
        return self.fresh_data or bool(self.train_lengths) or bool(self.schedule)


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


@dataclass
class SynthResult:
    task: str
    model: str
    metric: str  # "token" (micro token accuracy) or "sequence" (exact match)
    accuracy: float  # the headline test metric at the selected lr
    lr: float
    test: Scores
    val_accuracy: float
    sweep: list[dict[str, Any]]  # per lr: final train loss, val accuracy (and the curve with eval_every)
    by_length: dict[int, float]  # headline test accuracy per length of ``eval_lengths``
    task_params: dict[str, Any]
    model_config: dict[str, Any]
    num_params: int
    bounded_state: bool
    seconds: float


def split_overrides(items: list[str] | None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``--set`` items -> (model, task, synth) values: ``task.K=V`` and ``synth.K=V`` address the
    task and the protocol; ``model.K=V`` and bare ``K=V`` the model config."""
    over = parse_overrides(items)
    task, synth = over.pop("task", {}), over.pop("synth", {})
    model = merge(over.pop("model", {}), over)
    for name, d in (("task", task), ("synth", synth), ("model", model)):
        if not isinstance(d, dict):
            raise RecurformerError(f"--set {name}=... must name a key, e.g. {name}.seed=1")
    return model, task, synth


def model_values(name: str, values: dict[str, Any], vocab: int, context: int) -> dict[str, Any]:
    """The model config for a task: synthetic defaults, context length on every field that has
    it, the user's values, and the task's vocabulary."""
    if "vocab_size" in values and int(values["vocab_size"]) != vocab:
        raise RecurformerError(f"the task fixes vocab_size = {vocab}; set it with task.vocab_size instead")
    cls = lookup(name)[0]
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    out = dict(MODEL_DEFAULTS)
    if cls.context_field is not None and fields[cls.context_field] is not None:  # None: unlimited (llama's window)
        out[cls.context_field] = context
    out.update({k: v for k, v in ONE_LAYER_FIELDS.items() if k in fields})
    out.update(values)
    out["vocab_size"] = vocab
    return out


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


class FreshRows:
    """Training batches drawn fresh for every step (``SynthConfig.fresh``): batch k at the task
    length the schedule sets at step k, or drawn uniformly from ``train_lengths`` [lo, hi]; with
    both, from lo up to the stage's length (at most hi; a stage shorter than lo trains at its own
    length), so mixed lengths can follow a curriculum. Rows from the seed ``(seed, k)``, none equal
    to a row of ``exclude`` (the validation and test rows)."""

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

    def batch(self, step: int, pace: Pace | None = None) -> TaskData:
        L = self.length(step, pace)
        params = self.params if L is None else self.t.at_length(self.params, L)
        return make_split(
            self.task, self.cfg.batch_size, 10**9 + self.cfg.seed * 10**6 + step, params, exclude=self.exclude
        )


def mixed_range(train_lengths: list[int], stage: int | None) -> tuple[int, int]:
    """The range [lo, hi] a batch's length is drawn from: ``train_lengths``, its top capped by the
    length a schedule's stage sets (``stage``; None: no length schedule) and its bottom by that top."""
    lo, hi = train_lengths
    if stage is not None:
        hi = min(hi, stage)
        lo = min(lo, hi)
    return lo, hi


def scheduled_length(
    t: Task, params: dict[str, Any], cfg: SynthConfig, step: int, pace: Pace | None = None
) -> int | None:
    """The task length ``cfg.schedule`` sets at ``step`` (None: the schedule sets no length)."""
    if not cfg.curriculum().sets("length"):
        return None
    return cfg.curriculum().at(step, stage_base(t, params, cfg), pace)["length"]


def trained_params(t: Task, params: dict[str, Any], cfg: SynthConfig) -> dict[str, Any]:
    """The task parameters of the validation and test rows: ``params``, at the length the last
    step trains at where a schedule changes the length (a curriculum is scored where it ends; a
    self-paced one at its last stage, where it ends at the latest)."""
    sched = cfg.curriculum()
    if sched.advance_below and sched.sets("length"):
        return t.at_length(params, sched.stage_list(stage_base(t, params, cfg))[-1]["length"])
    L = scheduled_length(t, params, cfg, cfg.steps - 1)
    return params if L is None else t.at_length(params, L)


def stage_base(t: Task, params: dict[str, Any], cfg: SynthConfig) -> dict[str, int]:
    """The values a synth schedule starts from: the task length (where the task has one) and truncation."""
    base = {"truncation": cfg.truncation}
    if t.length_key:
        base["length"] = int(params[t.length_key[0]])
    return base


PROGRESS = "progress"  # the subdirectory of the --save directory that holds a run's progress (synth.save_every)


@dataclass
class Progress:
    """A run's progress, saved every ``every`` steps in ``directory`` (``synth.save_every``): one
    checkpoint (``checkpoint.save_checkpoint``: written whole or not at all, the older one removed
    after) of the weights, AdamW's moments, the data order and cursor, the generators, the state
    passed between batches and the learning curve so far, with ``run`` (the task, model and synth
    sections) from which ``synth --resume`` builds the same run again; ``resumed``: the checkpoint
    to continue from (``load_progress``), whose remaining steps then equal an uninterrupted run's."""

    directory: Path
    every: int
    run: dict[str, Any]
    resumed: dict[str, Any] | None = None

    def save(
        self,
        step: int,
        learner: Learner,
        opt: torch.optim.Optimizer,
        gen: torch.Generator,
        order: Tensor,
        loop: dict[str, Any],
        passed: State | None,
    ) -> None:
        tensors, meta = optimizer_to_flat(opt)
        rng = RNGState().state_dict()
        tensors |= {"gen": gen.get_state(), "order": order} | {k: v for k, v in rng.items() if k != "rng"}
        if passed is not None:
            tensors |= {f"passed.{k}": v for k, v in passed.to("cpu").to_flat().items()}
        train = {"step": step, "optimizer": meta, "rng": rng["rng"], **loop}
        save_checkpoint(self.directory, step, learner.state_dict(), self.run, None, tensors, train, keep_last=1)

    def restore(
        self, learner: Learner, opt: torch.optim.Optimizer, gen: torch.Generator
    ) -> tuple[int, Tensor, dict[str, Any], State | None]:
        """Loads the saved step into ``learner``, ``opt``, ``gen`` and the global generators; returns
        the step to continue from, the data order, the loop's other values and the passed state."""
        ck = self.resumed
        assert ck is not None
        load_model_weights(learner, ck["model"], str(ck["dir"]))
        tensors, train = ck["train_tensors"], ck["train_json"]
        optimizer_from_flat(opt, tensors, train["optimizer"])
        gen.set_state(tensors["gen"])
        RNGState().load_state_dict(tensors | train)
        flat = {k.removeprefix("passed."): v for k, v in tensors.items() if k.startswith("passed.")}
        device = learner.model.tok_emb.weight.device
        passed = learner.model.state_from_flat(flat).to(device) if flat else None
        loop = {k: train[k] for k in ("pos", "tail", "since", "curve", "pace") if k in train}
        return int(train["step"]), tensors["order"], loop, passed


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


def train_model(
    learner: Learner,
    data: TaskData | FreshRows,
    cfg: SynthConfig,
    lr: float,
    progress: bool = False,
    val: TaskData | None = None,
    saving: Progress | None = None,
) -> tuple[float, list[dict[str, float]], Pace]:
    """AdamW with warmup + cosine over ``cfg.steps`` steps of random batches (epoch order, seeded),
    or of fresh batches (``FreshRows``). With ``truncation``, ``state_init`` other than zero, or a
    schedule, each batch goes through ``Learner.backward``. Returns the mean training loss over the
    last 10% of the steps, the learning curve: with ``cfg.eval_every`` and ``val``, every that
    many steps the validation accuracy and the mean training loss since the last point (recall
    tasks learn in a sudden jump after a plateau; each point also printed to stderr), else empty,
    and the schedule's ``Pace`` (where each stage started; a self-paced stage is announced on
    stderr when it starts early); ``progress``: the steps on stderr (``progress.Progress``: a bar on
    a terminal, lines with the time left in a log); ``saving``: the run's progress saved
    every so many steps (and restored first, when it resumes one)."""
    min_lr, warmup = lr * cfg.min_lr_ratio, int(cfg.warmup * cfg.steps)
    device = learner.model.tok_emb.weight.device
    opt = make_optimizer(learner, lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    update = Update(learner, opt, lr, min_lr, warmup, cfg.steps, cfg.grad_clip)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = len(data.inputs) if isinstance(data, TaskData) else 0
    order = torch.randperm(n, generator=gen)
    pos, tail, since, curve = 0, [], [], []
    sched = cfg.curriculum()
    base = {"truncation": cfg.truncation, "length": data.base_length if isinstance(data, FreshRows) else 0}
    plain = learner.decoder is not None or (sched.values("truncation", base) == [0] and cfg.state_init == "zero")
    pace = sched.pace(base)
    passed: State | None = None
    start = 0
    if saving is not None and saving.resumed is not None:
        start, order, loop, passed = saving.restore(learner, opt, gen)
        pos, tail, since, curve = loop["pos"], loop["tail"], loop["since"], loop["curve"]
        pace = Pace(**loop["pace"]) if "pace" in loop else pace
    learner.train()
    bar = Bar(cfg.steps, f"lr {lr:g}", "step", initial=start, show=progress)
    for step in bar.track(range(start, cfg.steps)):
        if isinstance(data, TaskData):
            if pos + cfg.batch_size > n:
                order, pos = torch.randperm(n, generator=gen), 0
            idx = order[pos : pos + cfg.batch_size]
            pos += cfg.batch_size
            x, y = data.inputs[idx].to(device), data.targets[idx].to(device)
        else:
            b = data.batch(step, pace)
            x, y = b.inputs.to(device), b.targets.to(device)
        update.begin(step)
        with autocast_context(cfg.precision, device):
            if plain:
                loss_t = learner.loss(x, y)
                loss_t.backward()
                loss = float(loss_t.detach())
            else:
                truncation = sched.at(step, base, pace)["truncation"]
                rows = torch.ones(x.shape[0], dtype=torch.bool)
                state = start_state(
                    learner.model,
                    cfg.state_init,
                    rows,
                    passed,
                    x.shape[0],
                    device,
                    cfg.seed * 1_000_003 + step,
                    cfg.state_noise,
                    cfg.state_init_share,
                )
                loss, passed = learner.backward(x, y, state, truncation * cfg.context, learner.model.reset_boundary)
        update.finish()
        if (advanced := sched.observe(pace, step, loss)) is not None:
            values = ", ".join(f"{k} {v}" for k, v in sched.at(step + 1, base, pace).items())
            tqdm.write(
                f"lr {lr:g} step {step + 1}/{cfg.steps}: stage {advanced} ({values}) starts, the training loss of "
                f"the last {sched.advance_window} steps below {sched.advance_below:g}",
                file=sys.stderr,
            )
        if step >= cfg.steps - max(1, cfg.steps // 10):
            tail.append(loss)
        if cfg.eval_every and val is not None:
            since.append(loss)
            if (step + 1) % cfg.eval_every == 0:
                acc = evaluate(learner, val, cfg.chunk, cfg.eval_batch_size).headline(learner.metric)
                curve.append({"step": step + 1, "train_loss": sum(since) / len(since), "val_accuracy": acc})
                tqdm.write(
                    f"lr {lr:g} step {step + 1}/{cfg.steps}: train loss {curve[-1]['train_loss']:.4f}, "
                    f"val accuracy {acc:.3f}",
                    file=sys.stderr,
                )
                since = []
                learner.train()
        if saving is not None and (step + 1) % saving.every == 0 and step + 1 < cfg.steps:
            loop = {"pos": pos, "tail": tail, "since": since, "curve": curve, "pace": dataclasses.asdict(pace)}
            saving.save(step + 1, learner, opt, gen, order, loop, passed)
    return sum(tail) / len(tail), curve, pace


def saved_weights(
    path: str, model_name: str, config: ModelConfig, log: Callable[[str], None] = lambda s: None
) -> dict[str, Tensor]:
    """The weights of a model saved by ``synth --save`` for ``synth.init_from``: one line, before
    any work, if it is missing or holds another model or another config than this run builds
    (a key the saved config lacks, being older, counts as its default; the config's
    ``retrain_keys`` may differ: a line says so)."""
    ck = load_checkpoint(path)
    saved = dict(ck["config"].get("model") or {})
    name = saved.pop("name", None)
    if name != model_name:
        raise RecurformerError(f"synth.init_from {path} holds a '{name}' model, this run trains '{model_name}'")
    for f in dataclasses.fields(config):
        k, v = f.name, getattr(config, f.name)
        if k not in saved and f.default is not dataclasses.MISSING:
            saved[k] = f.default
        if k in saved and saved[k] != v and not (isinstance(v, (list, tuple)) and list(saved[k] or []) == list(v)):
            if k in config.retrain_keys:
                log(f"synth.init_from {path} was saved with model {k} = {saved[k]!r}; this run trains on with {v!r}")
                continue
            raise RecurformerError(f"synth.init_from {path} has model {k} = {saved[k]!r}, this run builds {v!r}")
    return ck["model"]


def check_recipe(t: Task, params: dict[str, Any], cfg: SynthConfig) -> None:
    """One-line errors, before any work, for a recipe that does not fit the task: a schedule that
    is not monotone or names a key the task lacks, mixed lengths for a task without a length,
    truncation through a decoder head, or more segments of ``context`` tokens than a row has."""
    base = stage_base(t, params, cfg)
    sched = cfg.curriculum()
    sched.check("synth.schedule", tuple(base), base)
    if cfg.train_lengths and not t.length_key:
        raise RecurformerError(f"synth key 'train_lengths' needs a task with a length; task {t.name} has none")
    truncations = sched.values("truncation", base)
    if t.head != "lm" and (truncations != [0] or cfg.state_init != "zero"):
        raise RecurformerError(
            f"task {t.name} is read by a decoder from the whole row: synth.truncation and synth.state_init do not apply"
        )
    if cfg.state_init == "passing" and cfg.batch_size < 2:
        raise RecurformerError(
            "synth key 'state_init' = passing needs batch_size >= 2 (a row takes another row's state)"
        )
    if t.length_key:
        lengths = sched.values("length", base)
        if cfg.train_lengths:  # the shortest length each stage draws (FreshRows.length)
            stages: list[int | None] = list(lengths) if sched.sets("length") else [None]
            lengths = [mixed_range(cfg.train_lengths, s)[0] for s in stages]
        shortest = min(make_split(t.name, 1, 0, t.at_length(params, L)).inputs.shape[1] for L in lengths)
    else:
        shortest = make_split(t.name, 1, 0, params).inputs.shape[1]
    for v in truncations:
        if v * cfg.context > shortest:
            raise RecurformerError(
                f"synth key 'truncation' = {v}: more segments of {cfg.context} tokens (synth.context) than the shortest training row ({shortest} tokens) has"
            )


def check_eval_budget(
    t: Task,
    params: dict[str, Any],
    cfg: SynthConfig,
    model: StreamingLM,
    lengths: list[int],
    n_rows: int | None = None,
) -> None:
    """One line, before any work, when testing at one of ``lengths`` would hold more than
    ``cfg.eval_memory_gb``: the ``n_rows`` test rows (default ``cfg.n_length_test``) and their
    predictions (int64), and the model's state for ``cfg.eval_batch_size`` rows at the row's end
    (fp32; measured, ``statesize.measure``: constant for a bounded state, a KV cache grows with the
    row). Computed from sizes alone (``row_tokens``): no row is built, however long."""
    if not lengths:
        return
    n = cfg.n_length_test if n_rows is None else n_rows
    # what to lower: a training run's config keys, or synth --evaluate's own options (n_rows given)
    knobs = "synth.eval_lengths, synth.n_length_test" if n_rows is None else "--lengths, --n-test"
    knobs += " or synth.eval_batch_size"
    size = measure(model)
    for L in sorted(lengths, reverse=True):
        T = row_tokens(t.name, t.at_length(params, L))
        rows = 3 * 8 * n * T
        state = 4 * cfg.eval_batch_size * size.at(T)
        if (need := (rows + state) / 2**30) > cfg.eval_memory_gb:
            raise RecurformerError(
                f"testing {t.name} at length {L} ({T:,} tokens a row) needs about {need:.1f} GB "
                f"({rows / 2**30:.1f} for {n} rows, {state / 2**30:.1f} for the state of "
                f"{cfg.eval_batch_size} rows{'' if size.bounded else ', which grows with the row'}), more than "
                f"synth.eval_memory_gb = {cfg.eval_memory_gb:g}: lower {knobs}, or raise synth.eval_memory_gb"
            )


def run_synth(
    task: str,
    model_name: str,
    model_over: dict[str, Any] | None = None,
    task_over: dict[str, Any] | None = None,
    cfg: SynthConfig | None = None,
    log: Callable[[str], None] = lambda s: None,
    device: str = "auto",
    progress: bool = False,
    save: str | None = None,
    resume: dict[str, Any] | None = None,
) -> SynthResult:
    """Train ``model_name`` on ``task`` for every lr of ``cfg.lrs``; select by validation accuracy.
    ``progress``: each learning rate's training and the tests at ``eval_lengths`` on stderr
    (``progress.Progress``: a bar on a terminal, lines with the time left in a log); ``save``: a directory
    to save the selected model in (``StreamingLM.save_pretrained``), and with ``cfg.save_every``
    the run's progress in its ``progress`` subdirectory, removed once the model is saved;
    ``resume``: a progress checkpoint (``load_progress``) to continue from."""
    cfg = cfg or SynthConfig()
    saving = None
    if cfg.save_every:
        if not save:
            raise RecurformerError(
                "synth key 'save_every' keeps the run's progress in the --save directory: give --save DIR"
            )
        run = {
            "model": {"name": model_name, **(model_over or {})},
            "task": {"name": task, **(task_over or {})},
            "synth": dataclasses.asdict(cfg),
        }
        saving = Progress(Path(save) / PROGRESS, cfg.save_every, run, resume)
    elif resume is not None:
        raise RecurformerError("resume needs the run's synth.save_every (the progress it was saved with)")
    if save and resume is None and checkpoints(Path(save) / PROGRESS):
        raise RecurformerError(
            f"{save} holds a synth run in progress ({checkpoints(Path(save) / PROGRESS)[-1]}): continue it with "
            f"`recurformer synth --resume {save}`, or --save elsewhere"
        )
    dev = pick_device(device)
    if warning := slow_bf16_warning(cfg.precision, dev):
        log(warning)
    t = get_task(task)
    params = t.params(task_over)
    if cfg.n_train is not None and cfg.n_train < cfg.batch_size:
        raise RecurformerError(f"n_train ({cfg.n_train}) must be at least batch_size ({cfg.batch_size})")
    if cfg.eval_lengths and not t.length_key:
        raise RecurformerError(
            f"task {task} has no length to sweep; eval_lengths applies to {[n for n, x in TASKS.items() if x.length_key]}"
        )
    values = model_values(model_name, dict(model_over or {}), int(params["vocab_size"]), cfg.context)
    built = build_model(model_name, values)  # validate before generating data
    start = saved_weights(cfg.init_from, model_name, built.config, log) if cfg.init_from else None
    check_recipe(t, params, cfg)
    check_eval_budget(t, params, cfg, built, cfg.eval_lengths)
    t0 = time.perf_counter()
    train: TaskData | FreshRows
    if cfg.fresh():  # held-out rows first; training rows are drawn per batch, none equal to one of them
        held = trained_params(t, params, cfg)
        val = make_split(task, cfg.n_val, cfg.seed + 1, held)
        seen = val.row_keys()
        test = make_split(task, cfg.n_test, cfg.seed + 2, held, exclude=seen)
        seen |= test.row_keys()
        length_data = {L: length_split(t, params, L, cfg.n_length_test, cfg.seed, seen) for L in cfg.eval_lengths}
        for d in length_data.values():
            seen |= d.row_keys()
        train = FreshRows(task, params, cfg, seen)
        log(
            f"{task} {params}: fresh training rows for each of {cfg.steps} steps / {cfg.n_val} val / {cfg.n_test} test rows of {val.inputs.shape[1]} tokens"
        )
    else:
        train = make_split(task, cfg.n_train or t.train_size, cfg.seed, params)
        seen = train.row_keys()
        val = make_split(task, cfg.n_val, cfg.seed + 1, params, exclude=seen)
        seen |= val.row_keys()
        test = make_split(task, cfg.n_test, cfg.seed + 2, params, exclude=seen)
        seen |= test.row_keys()
        length_data = {L: length_split(t, params, L, cfg.n_length_test, cfg.seed, seen) for L in cfg.eval_lengths}
        log(
            f"{task} {params}: {len(train.inputs)} train / {cfg.n_val} val / {cfg.n_test} test rows of {train.inputs.shape[1]} tokens"
        )

    best: tuple[float, float, Learner] | None = None
    sweep = []
    for lr in cfg.lrs:
        torch.manual_seed(cfg.seed)
        learner = Learner(build_model(model_name, values), t)
        if start is not None:
            load_model_weights(learner.model, start, str(cfg.init_from))
        learner = learner.to(dev)
        loss, curve, pace = train_model(learner, train, cfg, lr, progress, val, saving)
        v = evaluate(learner, val, cfg.chunk, cfg.eval_batch_size).headline(t.metric)
        sweep.append(
            {
                "lr": lr,
                "train_loss": loss,
                "val_accuracy": v,
                **({"curve": curve} if curve else {}),
                **({"stage_starts": pace.starts} if cfg.curriculum().advance_below else {}),
            }
        )
        log(f"  {model_name} lr {lr:g}: train loss {loss:.4f}, val accuracy {v:.4f}")
        if best is None or v > best[0]:
            best = (v, lr, learner)
    assert best is not None
    val_acc, lr, learner = best
    scores = evaluate(learner, test, cfg.chunk, cfg.eval_batch_size)
    if save:
        learner.model.save_pretrained(save, config={"model": {"name": model_name}, "task": {"name": task, **params}})
        if saving is not None:  # the run is saved whole: its progress is spent
            shutil.rmtree(saving.directory, ignore_errors=True)
    by_length: dict[int, float] = {}
    bar = Bar(sum(d.inputs.numel() for d in length_data.values()), "test at eval_lengths", "token", show=progress)
    for L, data in length_data.items():
        by_length[L] = evaluate(learner, data, cfg.chunk, cfg.eval_batch_size, bar.update).headline(t.metric)
        log(f"  {task} at length {L}: test accuracy {by_length[L]:.4f}")
    bar.close()
    return SynthResult(
        task=task,
        model=model_name,
        metric=t.metric,
        accuracy=scores.headline(t.metric),
        lr=lr,
        test=scores,
        val_accuracy=val_acc,
        sweep=sweep,
        by_length=by_length,
        task_params=params,
        model_config=dataclasses.asdict(learner.model.config),
        num_params=learner.model.num_params(),
        bounded_state=learner.model.bounded_state,
        seconds=time.perf_counter() - t0,
    )


def length_split(
    t: Task, params: dict[str, Any], L: int, n: int, seed: int, exclude: set[bytes] | None = None
) -> TaskData:
    """The test rows of ``t`` at length ``L`` of a run with seed ``seed`` (``run_synth``'s
    ``eval_lengths``, and ``score_lengths`` after it)."""
    return make_split(t.name, n, seed + 3 + L, t.at_length(params, L), exclude=exclude)


def score_lengths(
    model: StreamingLM,
    task: str,
    params: dict[str, Any],
    lengths: list[int],
    n_rows: int,
    cfg: SynthConfig | None = None,
    progress: bool = False,
) -> dict[int, Scores]:
    """A trained model (e.g. one saved by ``run_synth(save=...)``) scored on ``n_rows`` rows of
    ``task`` at each of ``lengths``, drawn as ``run_synth`` draws its length tests
    (``length_split``), read ``cfg.chunk`` tokens per call: a length curve finer or longer than a
    run's ``eval_lengths``, without training again. ``progress``: the tokens read on stderr
    (``progress.Progress``: a bar on a terminal, lines with the time left in a log)."""
    cfg = cfg or SynthConfig()
    t = get_task(task)
    if t.head != "lm":
        raise RecurformerError(f"task {task} is read by a decoder that a saved model does not hold")
    if not t.length_key:
        raise RecurformerError(f"task {task} has no length to sweep")
    check_eval_budget(t, params, cfg, model, lengths, n_rows)
    learner = Learner(model, t)
    total = n_rows * sum(row_tokens(task, t.at_length(params, L)) for L in lengths)
    bar = Bar(total, "evaluate", "token", show=progress)
    scores = {
        L: evaluate(learner, length_split(t, params, L, n_rows, cfg.seed), cfg.chunk, cfg.eval_batch_size, bar.update)
        for L in lengths
    }
    bar.close()
    return scores


def synth_config(values: dict[str, Any]) -> SynthConfig:
    return from_dict(SynthConfig, values, where="synth")


def result_dict(r: SynthResult) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["by_length"] = {str(k): v for k, v in r.by_length.items()}
    return d


def summary(r: SynthResult) -> str:
    kind = "micro token accuracy" if r.metric == "token" else "exact match"
    s = r.test
    return (
        f"{r.task} / {r.model}: test {kind} {r.accuracy:.4f} (lr {r.lr:g}; token {s.token_accuracy:.4f}, "
        f"macro {s.macro_accuracy:.4f}, exact {s.exact_match:.4f} over {s.rows} rows)"
    )


__all__ = [
    "CompressionDecoder",
    "Learner",
    "SynthConfig",
    "SynthResult",
    "Scores",
    "evaluate",
    "run_synth",
    "split_overrides",
    "synth_config",
    "summary",
    "result_dict",
]

EVALUATE_ROWS = 128  # rows per length of ``synth --evaluate`` without --n-test


@dataclass
class SynthCommandOptions(Checked):
    """``recurformer synth`` (``synth_command``): a task and a model from the flags or ``config``
    files (``set`` overrides), or ``evaluate``: a saved model scored at ``lengths``."""

    task: str | None = option(
        None,
        "the diagnostic task (MAD tasks, copy, delayed copy, passkey); or task.name in a --config",
        choices=sorted(TASKS),
    )
    model: str | None = option(None, f"one of: {', '.join(model_names())}; or model.name in a --config")
    config: list[str] | None = option(
        None,
        "YAML with model/task/synth sections (repeatable; --set wins); a config that names its task and model "
        "(task.name, model.name) is a whole experiment: `recurformer synth --config FILE`",
        action="append",
        metavar="FILE",
    )
    set: list[str] = option([], "override a config value (repeatable)", action="append", metavar="KEY=VALUE")
    steps: int | None = option(None, f"optimizer steps per learning rate (default {SynthConfig.steps})")
    lrs: str | None = option(None, "comma-separated learning rates to sweep (default 5e-4,1e-3,3e-3)")
    n_train: int | None = option(None, "training examples (default: the task's MAD baseline)")
    n_test: int | None = option(None, f"test examples (default {SynthConfig.n_test})")
    device: str = device_option()
    json: str | None = option(None, "write the full result as JSON here")
    save: str | None = option(
        None, "save the selected model (pretrained layout) for `recurformer readout`", metavar="DIR"
    )
    evaluate: str | None = option(
        None,
        "instead of training, score a model saved by --save on its task at --lengths (--n-test rows each, default "
        f"{EVALUATE_ROWS})",
        metavar="DIR",
    )
    lengths: list[int] | None = option(
        None, "with --evaluate: comma-separated task lengths, e.g. 128,256,512", range=">= 1"
    )
    resume: str | None = option(
        None,
        "continue a run saved with --save DIR and synth.save_every from its last saved step (--json, --device apply)",
        metavar="DIR",
    )


def synth_command(args: SynthCommandOptions) -> None:
    """``recurformer synth``: train on a synthetic task (or, with ``evaluate``, score a saved
    model at more lengths; with ``resume``, continue a saved run), print the summary, write
    ``json`` when given."""
    from .config import load_yaml
    from .files import check_writable

    if args.json:
        check_writable(Path(args.json), "--json file")  # before training, not after it
    if args.evaluate:
        return synth_evaluate(args)
    if args.resume:
        return synth_resume(args)
    files: dict[str, dict] = {"model": {}, "task": {}, "synth": {}}
    for path in args.config or []:  # YAML files with model / task / synth sections, the later and --set winning
        raw = load_yaml(path)
        unknown = sorted(set(raw) - set(files))
        if unknown:
            raise RecurformerError(
                f"synth config {path} has section '{unknown[0]}'; valid sections: model, task, synth"
            )
        files = {k: merge(v, raw.get(k) or {}) for k, v in files.items()}
    model_over, task_over, synth_over = (merge(files[k], d) for k, d in zip(files, split_overrides(args.set)))
    task, model = task_over.pop("name", None), model_over.pop("name", None)
    task, model = args.task or task, args.model or model  # the command line wins over a config
    if task is None or model is None:
        missing = "--task" if task is None else "--model"
        raise RecurformerError(f"synth needs {missing} (or {missing[2:]}.name in a --config)")
    if task not in TASKS:
        raise RecurformerError(f"unknown synth task '{task}' (task.name); one of: {', '.join(sorted(TASKS))}")
    for key, value in (("steps", args.steps), ("lrs", args.lrs), ("n_train", args.n_train), ("n_test", args.n_test)):
        if value is not None:
            synth_over[key] = value
    if args.save:
        check_writable(Path(args.save), "--save directory", is_dir=True)
    train_and_report(args, task, model, model_over, task_over, synth_config(synth_over), args.save)


def train_and_report(
    args: SynthCommandOptions,
    task: str,
    model: str,
    model_over: dict[str, Any],
    task_over: dict[str, Any],
    cfg: SynthConfig,
    save: str | None,
    resume: dict[str, Any] | None = None,
) -> None:
    """``run_synth`` from the command line: its log and summary printed, ``args.json`` written."""
    import json

    from .files import atomic_write_text

    r = run_synth(
        task,
        model,
        model_over,
        task_over,
        cfg,
        log=print,
        device=args.device,
        progress=True,
        save=save,
        resume=resume,
    )
    print(summary(r))
    if args.json:
        atomic_write_text(args.json, json.dumps(result_dict(r), indent=2) + "\n")
        print(f"wrote {args.json}")


def synth_resume(args: SynthCommandOptions) -> None:
    """``synth --resume DIR``: a run saved with ``--save DIR`` and ``synth.save_every``, continued
    from its last saved step as it was configured (its ``--json`` and ``--device`` may be given)."""
    assert args.resume is not None
    given = [
        f"--{k.replace('_', '-')}"
        for k in ("task", "model", "config", "set", "steps", "lrs", "n_train", "n_test", "save", "lengths")
        if getattr(args, k)
    ]
    if given:
        raise RecurformerError(f"synth --resume continues the run as it was saved; {given[0]} does not apply")
    ck = load_progress(args.resume)
    run = ck["config"]
    model_over, task_over = dict(run["model"]), dict(run["task"])
    model, task = model_over.pop("name"), task_over.pop("name")
    cfg = synth_config(run["synth"])
    print(f"resuming {args.resume}: {model} on {task} from step {ck['train_json']['step']} of {cfg.steps}")
    train_and_report(args, task, model, model_over, task_over, cfg, args.resume, ck)


def synth_evaluate(args: SynthCommandOptions) -> None:
    """``synth --evaluate DIR --lengths ...``: a model saved by ``synth --save`` scored at more lengths."""
    import json

    from .files import atomic_write_text
    from .hub import load

    if not args.lengths:
        raise RecurformerError("synth --evaluate needs --lengths, e.g. --lengths 128,256,512")
    lengths = args.lengths
    model_over, task_over, synth_over = split_overrides(args.set)
    if model_over:
        raise RecurformerError(
            f"synth --evaluate reads the saved model as it is; --set {next(iter(model_over))}=... does not apply"
        )
    loaded = load(str(args.evaluate), pick_device(args.device))
    model, name, saved = loaded.model, loaded.name, loaded.config
    params = dict(saved.get("task") or {})
    task = params.pop("name", None)
    if task is None:
        raise RecurformerError(f"{args.evaluate} holds no synthetic task (task.name): not saved by synth --save")
    params.update(task_over)
    rows = args.n_test or EVALUATE_ROWS
    scores = score_lengths(model, task, params, lengths, rows, synth_config(synth_over), progress=True)
    print(f"{args.evaluate}: {name} on {task}, {rows} rows per length")
    print("| length | exact match | token accuracy |\n|---|---|---|")
    for L, sc in scores.items():
        print(f"| {L} | {sc.exact_match:.3f} | {sc.token_accuracy:.3f} |")
    if args.json:
        out = {
            "checkpoint": str(args.evaluate),
            "model": name,
            "task": task,
            "task_params": params,
            "rows": rows,
            "by_length": {str(L): dataclasses.asdict(sc) for L, sc in scores.items()},
        }
        atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
