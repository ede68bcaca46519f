"""The run config of ``recurformer train``: its model, data and train sections (``RunConfig``),
how a config file, a model's ``per_model`` entry and overrides merge (``merge_config``), and the
model a config builds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .. import checkpoint as ckpt
from ..config import Checked, RecurformerError, from_dict, load_yaml, merge, opt, option, parse_overrides, suggest
from ..curriculum import Schedule, check_state_init_share, schedule_from
from ..data import DataConfig
from ..models import build_model, make_config, model_names
from ..nn import StreamingLM, check_compile
from ..registry import config_keys

SCHEDULED = ("seq_len", "truncation")  # the train keys a schedule may change


@dataclass
class TrainConfig(Checked):
    key_format = "config key 'train.{}'"
    out_dir: str = "runs/default"
    batch_size: int = option(8, range=">= 1")  # streams per rank
    seq_len: int = option(256, range=">= 1")  # tokens per segment (the TBPTT window)
    steps: int = option(1000, range=">= 1")  # optimizer steps
    grad_accum: int = option(1, range=">= 1")  # segments per optimizer step (consecutive segments of the same streams)
    truncation: int = option(1, range=">= 1")  # segments backpropagated through before the state is detached
    state: Literal["carry", "reset"] = "carry"
    state_init: Literal["zero", "noise", "passing"] = "zero"  # where a row starts a document (curriculum.initial_state)
    state_noise: float = option(1.0, range=">= 0")  # sigma of state_init=noise
    state_init_share: float = 1.0  # the fraction of starting rows given the noisy / passed state
    schedule: dict[str, Any] = field(default_factory=dict)  # seq_len / truncation by step (curriculum.Schedule)
    data_order: Literal["contiguous", "shuffled"] = "contiguous"
    lr: float = option(1e-3, range="> 0")
    min_lr: float = option(1e-4, range=">= 0")
    warmup: int = option(100, range=">= 0")
    weight_decay: float = option(0.1, range=">= 0")
    beta1: float = option(0.9, range="[0, 1)")
    beta2: float = option(0.95, range="[0, 1)")
    grad_clip: float = option(1.0, range=">= 0")
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    compile: bool = False
    cuda_graphs: bool = False  # the model's training call captured once per shape and replayed (capture.StepGraphs)
    eval_every: int = option(200, range=">= 1")
    eval_batches: int = option(10, range=">= 1")
    log_every: int = option(10, range=">= 1")
    save_every: int = option(500, range=">= 1")
    keep_last: int = option(3, range=">= 0")
    seed: int = 0
    device: str = "auto"
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])  # + metrics.jsonl; see loggers.py

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.grad_accum % self.truncation:
            raise RecurformerError(
                f"train.grad_accum ({self.grad_accum}) must be a multiple of train.truncation ({self.truncation})"
            )
        sched = self.curriculum()
        sched.check("train.schedule", SCHEDULED, self.base_values())
        for v in sched.values("truncation", self.base_values()):
            if v > self.grad_accum or self.grad_accum % v:
                raise RecurformerError(
                    f"config key 'train.schedule' sets truncation {v}: more segments than the {self.grad_accum} a step reads "
                    f"(train.grad_accum), or not a divisor of it"
                )
        if self.compile:
            check_compile()
        check_state_init_share(self.state_init_share, self.state_init, "train.state_init")
        if self.state_init == "passing" and self.batch_size < 2:
            raise RecurformerError(
                "config key 'train.state_init' = passing needs train.batch_size >= 2 (a row takes another stream's state)"
            )

    def base_values(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in SCHEDULED}

    def curriculum(self) -> Schedule:
        return schedule_from(self.schedule, "train.schedule")


@dataclass
class RunConfig:
    model: dict[str, Any] = field(default_factory=lambda: {"name": "memory_attention"})
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def merge_config(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``merge`` for run configs, where naming a data source in ``over`` replaces the other
    source of ``base``: ``data.text_files`` drops the base's ``data.dataset`` and vice versa, and
    ``data.dir`` alone drops both (train on the prepared data there). The model in force picks its
    keys (``for_model``)."""
    data_over = over.get("data")
    if isinstance(data_over, dict) and isinstance(base.get("data"), dict):
        data = dict(base["data"])
        only_dir = data_over.get("dir") and not {"dataset", "text_files"} & set(data_over)
        if (data_over.get("text_files") or only_dir) and "dataset" not in data_over:
            data.pop("dataset", None)
        if (data_over.get("dataset") or only_dir) and "text_files" not in data_over:
            data.pop("text_files", None)
        base = {**base, "data": data}
    base, over = for_model(base, over)
    return merge(base, over)


def for_model(base: dict[str, Any], over: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(base, over) for the model that ``model.name`` names after merging them. A config's
    ``per_model`` section holds, per registered model name, the sections to merge under ``over``
    when that model is trained (``per_model: {llama: {train: {state: reset}}}``); when ``over``
    switches ``model.name``, the base's model keys that the new model lacks are left out (they
    were settings of the base's model)."""
    base, over = dict(base), dict(over)
    entries = [part.pop("per_model", None) or {} for part in (base, over)]
    if not all(isinstance(e, dict) and all(isinstance(v, dict) for v in e.values()) for e in entries):
        raise RecurformerError("config key 'per_model' must map model names to config sections")
    per = merge(*entries)
    for n in per:
        if n not in model_names():
            hint = suggest(n, model_names()).replace("keys", "models")
            raise RecurformerError(f"per_model names an unknown model '{n}'{hint}")
    model: dict[str, Any] = base["model"] if isinstance(base.get("model"), dict) else {}
    over_model: dict[str, Any] = over["model"] if isinstance(over.get("model"), dict) else {}
    name: Any = over_model.get("name", model.get("name"))
    if model.get("name") not in (None, name) and name in model_names():  # over switches the model
        keys = config_keys(name)
        base["model"] = {k: v for k, v in model.items() if k == "name" or k in keys}
    return merge(base, per.get(name, {}) if isinstance(name, str) else {}), over


def load_run_config(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    raw = load_yaml(path) if path else {}
    return run_config_from_dict(merge_config(raw, parse_overrides(overrides)))


def run_config_from_dict(raw: dict[str, Any]) -> RunConfig:
    cfg = from_dict(RunConfig, raw)
    if "name" not in cfg.model:
        raise RecurformerError("config key 'model.name' is required (e.g. memory_attention)")
    make_config(cfg.model["name"], {k: v for k, v in cfg.model.items() if k != "name"}, ("name",))  # validate now
    if cfg.train.schedule:  # every stage's segment length fits the model's chunk, before any work starts
        with torch.device("meta"):
            boundary = build_from_run_config(cfg, 2).reset_boundary
        for L in cfg.train.curriculum().values("seq_len", cfg.train.base_values()):
            if L % boundary:
                raise RecurformerError(
                    f"config key 'train.schedule' sets seq_len {L}, not a multiple of the model's chunk/segment/block length ({boundary})"
                )
    return cfg


def build_from_run_config(cfg: RunConfig, vocab_size: int | None = None) -> StreamingLM:
    values = {k: v for k, v in cfg.model.items() if k != "name"}
    if vocab_size is not None:
        values.setdefault("vocab_size", vocab_size)
    return build_model(cfg.model["name"], values)


# ----------------------------------------------------------------------------------------------
# the training state as named parts (as torchtitan's checkpointer holds its Stateful objects): each
# part has ``state_dict()``/``load_state_dict()``, so saving and restoring are one loop over the


def resolve_run_config(
    config: str | Path | dict[str, Any] | None, over: dict[str, Any], resume: str | None
) -> RunConfig:
    """The config of a run: ``config`` (a YAML path, a bundled config name or a dict) or, to resume
    without one, the run's own config; merged with ``over``. A resumed run writes into its own
    directory unless ``over`` sets ``train.out_dir``."""
    if isinstance(config, dict):
        raw = config
    elif config is not None:
        raw = load_yaml(config)
    else:
        raw = ckpt.load_config(resume) if resume is not None else {}
    cfg = run_config_from_dict(merge_config(raw, over))
    if resume is not None and "out_dir" not in over.get("train", {}):
        cfg.train.out_dir = str(ckpt.resolve(resume).parent)
    return cfg


def training_sizes(cfg: RunConfig) -> tuple[str, str]:
    """What a training step holds in memory (model, streams x segment length) and what to lower,
    for ``out_of_memory``."""
    t, m = cfg.train, cfg.model
    size = ", ".join(f"{k} {m[k]}" for k in ("dim", "n_layers") if k in m)
    per_step = f"train.batch_size {t.batch_size} x train.seq_len {t.seq_len}" + (
        f" x train.truncation {t.truncation}" if t.truncation > 1 else ""
    )
    doing = f"training {m['name']}{f' ({size})' if size else ''} at {per_step} tokens per backward pass"
    lower = (
        f"lower train.batch_size ({opt('train.batch_size', max(1, t.batch_size // 2))}; "
        f"{opt('train.grad_accum', 2 * t.grad_accum)} keeps the tokens per step) or "
        f"train.seq_len, or the model's size"
    )
    return doing, lower
