"""The settings of a synth run (``SynthConfig``), the model config a task gets, and the recipe's
stages: the task length a schedule sets at a step, the rows a run is scored on, and the one-line
checks of a recipe against its task before any work."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import Checked, RecurformerError, from_dict, merge, option, parse_overrides
from ..curriculum import Pace, Schedule, check_state_init_share, schedule_from
from ..data.synthetic import Task, make_split
from ..models import lookup

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
    # task-parameter settings, e.g. {seq_len: 64, num_pairs: 4}: each batch draws one (FreshRows)
    train_settings: list[dict[str, Any]] = field(default_factory=list)
    # task-parameter settings tested after training, n_length_test rows each (the result's by_setting)
    eval_settings: list[dict[str, Any]] = field(default_factory=list)
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
        for key in ("train_settings", "eval_settings"):
            for s in getattr(self, key):
                if not isinstance(s, dict) or not s:
                    raise RecurformerError(
                        f"synth key '{key}' holds task-parameter settings, got {s!r}: give mappings, "
                        "e.g. [{seq_len: 64, num_pairs: 4}]"
                    )
        if self.train_settings and self.train_lengths:
            raise RecurformerError(
                "synth keys 'train_settings' and 'train_lengths' both choose each batch's task parameters: "
                "give one (a setting may set the length)"
            )
        check_state_init_share(self.state_init_share, self.state_init, "synth.state_init")

    def curriculum(self) -> Schedule:
        return schedule_from(self.schedule, "synth.schedule")

    def fresh(self) -> bool:
        """Whether training rows are drawn for every batch (a recipe that changes the length does so)."""
        return self.fresh_data or bool(self.train_lengths) or bool(self.train_settings) or bool(self.schedule)


def setting_name(setting: dict[str, Any]) -> str:
    """A setting of ``train_settings`` / ``eval_settings`` as the result names it: ``seq_len=64,num_pairs=4``."""
    return ",".join(f"{k}={v}" for k, v in setting.items())


def with_setting(t: Task, params: dict[str, Any], setting: dict[str, Any], key: str) -> dict[str, Any]:
    """``params`` updated with one setting of ``synth.<key>``, each of its keys checked as a
    parameter of the task (one line naming the setting otherwise)."""
    try:
        checked = t.params(setting)
    except RecurformerError as e:
        raise RecurformerError(f"synth key '{key}', setting {setting_name(setting)}: {e.args[0]}") from None
    return {**params, **{k: checked[k] for k in setting}}


def synth_config(values: dict[str, Any]) -> SynthConfig:
    return from_dict(SynthConfig, values, where="synth")


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


def check_recipe(t: Task, params: dict[str, Any], cfg: SynthConfig) -> None:
    """One-line errors, before any work, for a recipe that does not fit the task: a schedule that
    is not monotone or names a key the task lacks, mixed lengths for a task without a length,
    truncation through a decoder head, more segments of ``context`` tokens than a row has, or a
    setting of ``train_settings`` / ``eval_settings`` whose keys are not the task's parameters
    (or, for training, whose rows do not build)."""
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
    if cfg.train_settings and sched.sets("length"):
        raise RecurformerError(
            "synth key 'train_settings' sets each batch's task parameters, synth.schedule its length: give one"
        )
    for s in cfg.eval_settings:
        with_setting(t, params, s, "eval_settings")  # the keys now; the rows are built before training
    if cfg.train_settings:  # every setting's rows build, and the shortest is the shortest training row
        shortest = min(
            make_split(t.name, 1, 0, with_setting(t, params, s, "train_settings")).inputs.shape[1]
            for s in cfg.train_settings
        )
    elif t.length_key:
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
