"""One training loop for every registered model: stateful segment training (Liang, "Block-wise
Recurrent Transformer", §4), i.e. truncated BPTT with the model state carried across steps.

Each optimizer step reads ``grad_accum`` consecutive segments of ``seq_len`` tokens from B
streams (row b of segment k+1 continues row b of segment k: *data continuity*). The state
returned by segment k is the initial state of segment k+1 (*state persistence*); it is detached
every ``truncation`` segments, where the summed loss of those segments is backpropagated. A row
whose stream wraps to its start has its state reset. The four ablation modes of its Table 2 are
``state: carry|reset`` x ``data_order: contiguous|shuffled``. ``schedule`` changes ``seq_len``
and ``truncation`` by step (a curriculum; ``Trainer._apply_schedule``), and ``state_init`` says
what a row that starts a document reads first: the initial state, a noisy one, or another
stream's (``curriculum.initial_state``).

Runs on one process or under ``torchrun`` (DDP): every rank owns its own streams and carried
state, which are never broadcast or averaged; gradients are all-reduced once per optimizer step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from . import checkpoint as ckpt
from . import loggers
from .capture import Backend, CaptureFailed, StepGraphs
from .config import (
    Checked,
    RecurformerError,
    from_dict,
    load_yaml,
    merge,
    opt,
    option,
    parse_overrides,
    say,
    suggest,
)
from .curriculum import Schedule, check_state_init_share, schedule_from
from .data import DataConfig
from .device import (
    autocast_context,
    cpu_threads,
    fast_matmuls,
    graphs_or_eager,
    out_of_memory,
    pick_device,
    resolve_precision,
    to_device,
)
from .flops import reference_peak, train_flops_per_token
from .models import build_model, make_config, model_names
from .nn import State, StreamingLM, check_compile
from .optim import make_optimizer, optimizer_from_flat, optimizer_to_flat
from .progress import Progress
from .registry import config_keys
from .statesize import state_size_line
from .tbptt import Update, backprop, start_state

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
        if sched.advance_below:
            raise RecurformerError(
                "config key 'train.schedule.advance_below': a self-paced schedule is for synth runs; "
                "train's stages start at their steps"
            )
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

    def at(self, step: int) -> dict[str, int]:
        """seq_len and truncation in force at ``step`` (the schedule's stage, or the base values)."""
        return self.curriculum().at(step, self.base_values())


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


@dataclass
class InfoOptions:
    """``recurformer info`` (``model_info``): the model to describe, by name or by a run config."""

    model: str | None = option(None, f"one of: {', '.join(model_names())}")
    config: str | None = option(None, "a YAML config file (its model section is used)")


def model_info(o: InfoOptions, over: dict[str, Any]) -> list[str]:
    """The lines of ``recurformer info``: the configuration of the model that ``o`` names (with the
    config overrides ``over``), its parameter counts by group, and its state size (``statesize``)."""
    overridden, over = " with --set overrides" if over else "", dict(over)
    values = merge(over.pop("model", {}), over)  # "dim=288" and "model.dim=288" both accepted
    if o.model:
        values.setdefault("name", o.model)
    if o.config:  # the model a run of this config trains (its per_model entry included)
        values = dict(merge_config(load_yaml(o.config), {"model": values}).get("model", {}))
    name = values.pop("name", None)
    if not name:
        raise RecurformerError("give --model NAME (or a --config with model.name)")
    model = build_model(name, values)
    if o.config:
        lines = [f"model: {name}, the model section of {o.config}{overridden}"]
    else:
        lines = [
            f"model: {name}, its defaults (the size of its paper){overridden}"
            "; --config tinystories-cpu shows the model the bundled default run trains"
        ]
    lines += [f"  {k}: {v}" for k, v in vars(model.config).items()]
    n = model.num_params()
    lines.append(
        f"parameters: {n:,} ({n / 1e6:.2f}M; token embedding {model.tok_emb.weight.numel():,}, tied with the output head)"
    )
    lines += [f"  {group}: {count:,}" for group, count in model.param_groups().items()]
    return lines + model.info_lines() + [state_size_line(model)]  # measured (statesize.py)


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
# parts. A part's tensors go to train_state.safetensors and its other values to train_state.json
# (model weights: model.safetensors), under keys of its own; no two parts share a key, so each
# part reads its own back from the two files merged.


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


def gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` in rank order (a collective: every rank calls it)."""
    if world == 1:
        return [obj]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, obj)
    return everyone


class ModelWeights:
    """The weights (format-1 names are upgraded on load, a misfit is a one-line error)."""

    def __init__(self, model: StreamingLM, where: str) -> None:
        self.model, self.where = model, where

    def state_dict(self) -> dict[str, Any]:
        return dict(self.model.state_dict())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ckpt.load_model_weights(self.model, sd, self.where)


class OptimizerState:
    """AdamW's moments as ``opt.<param>.<name>`` tensors, its param groups under ``optimizer``."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def state_dict(self) -> dict[str, Any]:
        tensors, meta = optimizer_to_flat(self.opt)
        return {**tensors, "optimizer": meta}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        optimizer_from_flat(self.opt, sd, sd["optimizer"])


class StreamCursors:
    """Every rank's data cursor, a list under ``streams`` (rank r resumes from entry r); a cursor
    saved in another stage of the ``seq_len`` schedule gets streams of its segment length."""

    def __init__(self, trainer: Trainer) -> None:
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

    def __init__(self, trainer: Trainer) -> None:
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


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped training (after writing a checkpoint, when there was a step to save);
    ``str``: the message with the Python call that resumes, ``said(cli=True)``: with the command."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, run_dir: Path) -> None:
        self.signum, self.step, self.checkpoint, self.run_dir = signum, step, checkpoint, run_dir
        super().__init__(self.said(cli=False))

    def said(self, cli: bool) -> str:
        name = signal.Signals(self.signum).name
        if self.checkpoint is None:
            return f"stopped by {name} before training step {self.step + 1}; nothing new to save"
        how = (
            f"recurformer train --resume {self.run_dir}" if cli else f"recurformer.train(resume={str(self.run_dir)!r})"
        )
        return f"stopped by {name} after step {self.step}; saved {self.checkpoint}; continue with: {how}"


class StopNow(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: stop at once (``signum``: the signal, for the exit code)."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum


class StopSignals:
    """SIGINT/SIGTERM handler that records the first signal (training stops after the current
    step and saves) and raises ``StopNow`` at a second one (stop at once: the newest checkpoint
    on disk is complete either way)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise StopNow(signum)
        self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Any:
        """Handle SIGINT and SIGTERM inside the block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


# ----------------------------------------------------------------------------------------------
# the parts a trainer is built from: its process (device, rank), its data, the checks of its
# model against the run, its throughput meter and its logs


def join_processes(device_name: str) -> tuple[torch.device, int, int]:
    """This process's device, rank and world size; under ``torchrun`` (WORLD_SIZE > 1), its own
    GPU (LOCAL_RANK) and the process group joined (NCCL on CUDA, Gloo on the CPU)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(device_name)
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device, rank, world


@dataclass
class RunData:
    """The prepared data of a run: ``meta.json``, the memory-mapped train and validation tokens,
    the tokenizer (and its JSON, saved with every checkpoint)."""

    dir: Path
    meta: dict[str, Any]
    train_tokens: Any
    val_tokens: Any
    tokenizer: Any
    tokenizer_json: str

    @property
    def key(self) -> str | None:
        """What the data was made from (``DataConfig.source_key``), as ``prepare`` recorded it."""
        return self.meta.get("source_key")


def run_data(data: DataConfig, resumed: dict[str, Any] | None, rank: int, world: int) -> RunData:
    """The run's data, prepared on first use (rank 0; the other ranks wait), then memory-mapped.
    It must be what the run expects: for a resumed run, the data it started with (text files
    deleted after they were prepared into an explicit data.dir cannot be checked), else the
    configured source; a ``data.dir`` alone must hold prepared data."""
    from .data import load_prepared, prepare

    data_dir = data.resolved_dir()
    if resumed is not None:
        expected_key = resumed["train_json"].get("data_key")
    else:
        expected_key = data.source_key() if all(Path(f).is_file() for f in data.text_files) else None
    if (data_dir / "meta.json").is_file():
        found_key = json.loads((data_dir / "meta.json").read_text()).get("source_key")
        if expected_key and found_key and found_key != expected_key:
            what = (
                "the data this run started with" if resumed is not None else "the configured data source and tokenizer"
            )
            fix = (
                "point data.dir at the data this run started with"
                if resumed is not None
                else "to train on what it holds, leave out data.dataset and data.text_files (data.dir alone); "
                "to prepare the configured source, point data.dir at another directory"
            )
            raise RecurformerError(
                f"prepared data {data_dir} was made from other data than {what} (source key {found_key[:12]}, "
                f"expected {expected_key[:12]}); {fix}"
            )
    else:
        if not data.dataset and not data.text_files:
            raise RecurformerError(
                f"data.dir {data_dir} holds no prepared data (no meta.json): prepare it first "
                f"(recurformer prepare --text FILE --out {data_dir}), or name the source to prepare there "
                "(data.text_files or data.dataset)"
            )
        if rank == 0:
            prepare(
                data_dir,
                dataset=data.dataset,
                text_files=data.text_files or None,
                tokenizer=data.tokenizer,
                vocab_size=data.vocab_size,
                text_field=data.text_field,
            )
        if world > 1:
            dist.barrier()
    meta, train_tokens, val_tokens, tokenizer = load_prepared(data_dir)
    return RunData(data_dir, meta, train_tokens, val_tokens, tokenizer, (data_dir / "tokenizer.json").read_text())


def check_model(model: StreamingLM, cfg: RunConfig, vocab_size: int) -> None:
    """One line, before any step, where the model does not fit the run: a vocabulary smaller than
    the data's, a segment length that is not a multiple of its chunk, or a carried state that
    grows without bound."""
    t = cfg.train
    if model.config.vocab_size < vocab_size:
        raise RecurformerError(f"model.vocab_size {model.config.vocab_size} < the data's vocabulary {vocab_size}")
    if t.seq_len % model.reset_boundary:
        boundary, key = model.reset_boundary, model.config.context_field
        fix = (
            f"set model.{key} to a divisor of {t.seq_len} or "
            if getattr(model.config, key or "", None) == boundary
            else ""
        )
        raise RecurformerError(
            f"train.seq_len ({t.seq_len}) must be a multiple of the model's chunk/segment/block length ({boundary}): "
            f"{fix}train.seq_len to a multiple of {boundary}"
        )
    if t.state == "carry" and not model.bounded_state:
        raise RecurformerError(
            f"{cfg.model['name']} carries a KV cache that grows without bound; train it with train.state=reset"
        )


class Throughput:
    """Training tokens/s and the model FLOPs utilisation, mfu = mean tokens/s x FLOP per token /
    (the machine's matmul peak x ranks) (PaLM, Chowdhery et al., "PaLM: Scaling Language Modeling
    with Pathways", appendix B); the peak measured once and cached (``flops.reference_peak``),
    measured again once where an mfu comes out above 1 (``fraction``), ``note`` saying so.
    Only training time counts: ``paused()`` holds the clock (evaluation, checkpoints)."""

    def __init__(
        self,
        model: StreamingLM,
        seq_len: int,
        device: torch.device,
        precision: str,
        world: int,
        note: Callable[[str], object] = say,
    ) -> None:
        self.flops_per_token = train_flops_per_token(model, seq_len, device)
        self.dtype = torch.bfloat16 if resolve_precision(precision, device) == "bf16" else torch.float32
        self.device, self.note, self.remeasured = device, note, False
        self.peak_flops, self.peak_source = reference_peak(self.dtype, device)
        self.world = world
        self.t0, self.tokens0 = time.perf_counter(), 0
        self.run_time, self.run_tokens = 0.0, 0  # this process's training time and tokens, so far

    def start(self, tokens: int) -> None:
        self.t0, self.tokens0 = time.perf_counter(), tokens

    def fraction(self, tokens_per_s: float) -> float:
        """``tokens_per_s`` as a fraction of the peak (mfu). Above 1 the peak is stale (cached
        while the machine was busy): it is measured again, once, and the higher one kept, so the
        fraction is taken of the best peak seen (one still above 1 is reported as it is, the
        peak's source naming the re-measurement)."""
        f = tokens_per_s * self.flops_per_token / (self.peak_flops * self.world)
        if f > 1 and not self.remeasured:
            self.remeasured, stale = True, self.peak_flops
            self.peak_flops, where = reference_peak(self.dtype, self.device, remeasure=True)
            self.peak_source = f"{where} (re-measured: mfu {f:.2f} against the earlier {stale / 1e9:,.1f} GFLOP/s)"
            self.note(f"mfu: {self.peak_source}: now {self.peak_flops / 1e9:,.1f} GFLOP/s")
            f = tokens_per_s * self.flops_per_token / (self.peak_flops * self.world)
        return f

    def lap(self, tokens: int) -> tuple[float, float, float]:
        """(tokens/s since the last lap, mean tokens/s of the run, mfu) at ``tokens`` seen; a
        re-measured peak (``fraction``) takes none of the run's training time."""
        dt = time.perf_counter() - self.t0
        tps = (tokens - self.tokens0) / max(dt, 1e-9)
        self.run_time, self.run_tokens = self.run_time + dt, self.run_tokens + tokens - self.tokens0
        mean = self.run_tokens / max(self.run_time, 1e-9)
        mfu = self.fraction(mean)
        self.start(tokens)
        return tps, mean, mfu

    @contextlib.contextmanager
    def paused(self) -> Any:
        paused = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - paused


class RunLog:
    """The run's metric sinks (``loggers.make_sinks``; rank 0 only, none elsewhere): ``log``
    writes a record to each, a failed write is one line naming the run directory."""

    def __init__(self, sinks: list[Any], out_dir: Path) -> None:
        self.sinks, self.out_dir = sinks, out_dir

    def log(self, record: dict[str, Any]) -> None:
        try:
            for sink in self.sinks:
                sink.log(record, record["step"])
        except OSError as e:
            raise RecurformerError(f"cannot write the run's logs in {self.out_dir}: {e.strerror or e}") from None

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


# ----------------------------------------------------------------------------------------------


class Trainer:
    """Holds everything that a checkpoint must restore: model, optimizer, step, data streams,
    carried state, RNG. ``run()`` trains to ``train.steps``.

    ``train.out_dir`` is never silently reused: it must not hold another run, unless ``resume``
    continues that very run (from its newest checkpoint, or from an older one when ``overwrite``
    allows deleting the later ones) or ``overwrite`` allows replacing it. Messages name options
    with ``config.opt`` (``--resume`` on the command line, ``resume=`` in Python)."""

    def __init__(
        self,
        cfg: RunConfig,
        resume: str | None = None,
        show_progress: bool = True,
        overwrite: bool = False,
        stop: StopSignals | None = None,
    ) -> None:
        self.cfg, t = cfg, cfg.train
        self.device, self.rank, self.world = join_processes(t.device)
        graphs = graphs_or_eager(
            t.cuda_graphs,
            self.device,
            "train.cuda_graphs",
            "this run trains",
            self.world,
            f" (train without captured steps: {opt('train.cuda_graphs', False)})",
        )
        self.show_progress = show_progress and self.rank == 0
        self.out_dir = Path(t.out_dir)
        resumed = ckpt.load_checkpoint(resume, with_train_state=True, resuming=True) if resume else None
        if resumed is not None and (saved := resumed["config"].get("model", {}).get("name")) != cfg.model["name"]:
            raise RecurformerError(
                f"checkpoint {resumed['dir']} holds a '{saved}' model, the config asks for '{cfg.model['name']}'"
            )
        self.resumed_from: Path | None = resumed["dir"] if resumed is not None else None
        self.unreadable: list[str] = []  # the checkpoints after the resumed one that did not read, deleted
        if self.rank == 0:  # before the data is prepared: fail fast
            self.unreadable = ckpt.claim_run_dir(self.out_dir, resumed, overwrite, cfg.model["name"])
        self.data = run_data(cfg.data, resumed, self.rank, self.world)
        self.meta, self.val_tokens, self.tokenizer, self.data_dir = (
            self.data.meta,
            self.data.val_tokens,
            self.data.tokenizer,
            self.data.dir,
        )

        torch.manual_seed(t.seed)
        self.model = build_from_run_config(cfg, self.data.meta["vocab_size"]).to(self.device)
        check_model(self.model, cfg, self.data.meta["vocab_size"])
        self.model.check_tokens = False  # every token id of the data is < its vocabulary: no per-step check
        self.opt = make_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))
        self.update = Update(self.model, self.opt, t.lr, t.min_lr, t.warmup, t.steps, t.grad_clip)
        self.meter = Throughput(self.model, t.seq_len, self.device, t.precision, self.world, lambda m: self._note(m))
        self.flops_per_token = self.meter.flops_per_token
        if t.compile:
            self.model.compile_layers()
        self.ddp: torch.nn.Module = self.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # the carried state is not a module buffer, and buffers are not broadcast either
            self.ddp = DDP(self.model, broadcast_buffers=False)
        self.graphs: StepGraphs | None = None  # the training calls as captured steps (capture_steps)
        self._said: set[str] = set()  # the one-time notes already given (_note)
        if t.warmup > t.steps:  # the warmup is cut off before it reaches train.lr
            self._note(
                f"warning: train.warmup = {t.warmup} is more than train.steps = {t.steps}: the learning rate never "
                f"reaches train.lr = {t.lr:g} (it ends at {self.update.lr_at(t.steps - 1):.3g}); set train.warmup to "
                f"at most {t.steps}, e.g. {t.steps // 10}"
            )
        if graphs is not None:
            self.capture_steps(graphs)

        self.streams: Any = self._make_streams(t.seq_len, t.seed)
        self.state: State | None = None
        self._unread: torch.Tensor | None = None  # train_step's losses not yet read (read_loss)
        self._unread_from = 0
        self.step = 0
        self.tokens_seen = 0
        if resumed is not None:
            self._restore(resumed)
        self.stop = stop or StopSignals()  # installed by run(); by train_main from the start
        self.logs = RunLog([], self.out_dir)
        self.header: list[str] = []
        self.existing = ckpt.entries(self.out_dir)  # what the run directory held before this run
        if self.rank == 0:
            ckpt.open_run_dir(self.out_dir, resumed["dir"].parent if resumed is not None else None, self.step)
            sinks, notes = loggers.make_sinks(t.loggers, self.out_dir, self._config_dict())
            self.logs = RunLog(sinks, self.out_dir)
            self.header = loggers.run_header(self, notes)

    @property
    def peak_flops(self) -> float:
        """The matmul peak the mfu is taken of (``Throughput``: re-measured once where stale)."""
        return self.meter.peak_flops

    @property
    def peak_source(self) -> str:
        return self.meter.peak_source

    def capture_steps(self, backend: Backend) -> None:
        """Train through captured steps (``capture.StepGraphs``; ``train.cuda_graphs``: the cuda
        backend), the optimizer eager; unless a carried state would need a graph per step (layers
        that read absolute positions): then one line, and training stays eager."""
        t = self.cfg.train
        graphs = StepGraphs(self.model, t.grad_accum, backend)
        if t.state == "carry" and not graphs.shift:
            self._note(
                f"train.cuda_graphs: {self.cfg.model['name']} reads absolute positions, so a carried state would "
                "need a graph per step; training runs eager (train.state=reset captures once)"
            )
            return
        self.graphs = graphs

    def _make_streams(self, seq_len: int, seed: int) -> Any:
        from .data import ContiguousStreams, ShuffledWindows

        t = self.cfg.train
        if t.data_order == "contiguous":
            return ContiguousStreams(
                self.data.train_tokens,
                t.batch_size,
                seq_len,
                rank=self.rank,
                world_size=self.world,
                bos_id=self.data.meta["bos_id"],
                seq_multiple=self.model.reset_boundary,
                split="training",
            )
        return ShuffledWindows(
            self.data.train_tokens, t.batch_size, seq_len, rank=self.rank, world_size=self.world, seed=seed
        )

    def _apply_schedule(self) -> int:
        """Enter the schedule's stage for the step about to be taken; returns its truncation.
        A new segment length gets new streams that go on about where the old ones were (the
        same token offset before any wrap; shuffled windows get a new seed) and a fresh state."""
        stage = self.cfg.train.at(self.step)
        old = self.streams
        if stage["seq_len"] != old.seq_len:
            self.streams = self._make_streams(stage["seq_len"], self.cfg.train.seed + self.step)
            self.streams.step = old.step * old.seq_len // stage["seq_len"]
            self.state = None
        return stage["truncation"]

    # -- state of the run ------------------------------------------------------------------------
    def _config_dict(self) -> dict[str, Any]:
        d = asdict(self.cfg)
        d["model"] = {"name": self.cfg.model["name"], **asdict(self.model.config)}
        d["data"]["dir"] = str(self.data_dir)
        return d

    def parts(self) -> dict[str, Stateful]:
        """The named parts of the training state; ``train`` (this trainer) holds the counters."""
        return {
            "train": self,
            "model": ModelWeights(self.model, str(self.resumed_from)),
            "optimizer": OptimizerState(self.opt),
            "rng": ckpt.RNGState(),
            "streams": StreamCursors(self),
            "state": CarriedState(self),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.world, "data_key": self.data.key}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("world_size", 1) != self.world:
            raise RecurformerError(
                f"checkpoint was written by {sd.get('world_size')} ranks; resume it on the same number (got {self.world})"
            )
        self.step, self.tokens_seen = sd["step"], sd["tokens_seen"]

    def save(self) -> Path | None:
        """Every rank gives its parts (carried states and data cursors are gathered); rank 0
        writes one checkpoint."""
        sd = {name: part.state_dict() for name, part in self.parts().items()}
        if self.rank != 0:
            dist.barrier()  # wait until rank 0 has written the checkpoint
            return None
        weights = sd.pop("model")
        train = {k: v for part in sd.values() for k, v in part.items()}
        path = ckpt.save_checkpoint(
            self.out_dir,
            self.step,
            weights,
            self._config_dict(),
            self.data.tokenizer_json,
            {k: v for k, v in train.items() if isinstance(v, torch.Tensor)},
            {k: v for k, v in train.items() if not isinstance(v, torch.Tensor)},
            keep_last=self.cfg.train.keep_last,
        )
        if self.world > 1:
            dist.barrier()
        return path

    def _restore(self, resumed: dict[str, Any]) -> None:
        train = {**resumed["train_tensors"], **resumed["train_json"]}
        for name, part in self.parts().items():
            part.load_state_dict(resumed["model"] if name == "model" else train)

    # -- the loop ----------------------------------------------------------------------------------
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

    def _note(self, msg: str) -> None:
        """``msg`` on stderr (rank 0), once per run."""
        if self.rank == 0 and msg not in self._said:
            self._said.add(msg)
            tqdm.write(msg, file=sys.stderr)

    def _mean_over_ranks(self, x: float) -> float:
        """The mean of ``x`` over the ranks, so that every rank logs (and stops on) the same number."""
        if self.world == 1:
            return x
        v = torch.tensor([x], device=self.device)
        dist.all_reduce(v)
        return float(v) / self.world

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
        if self._unread is None:  # the sum of the unread steps' losses: a nan or inf in any of them shows in it
            self._unread, self._unread_from = mean, self.step
        else:
            self._unread = self._unread + mean
        return self.read_loss(mean) if read else mean

    def read_loss(self, loss: torch.Tensor) -> float:
        """The step's loss as a float: the one host read (a wait for the device) per log interval.
        Raises if any step since the last read had a loss that is not finite; with several ranks,
        the mean over ranks, so every rank logs (and stops on) the same number."""
        v = torch.stack([loss, self._unread if self._unread is not None else loss])
        if self.world > 1:
            dist.all_reduce(v)
            v = v / self.world
        mean, seen = v.tolist()
        first, self._unread = self._unread_from, None
        if not math.isfinite(seen):
            where = f"at step {self.step}" if first == self.step else f"at one of steps {first}..{self.step}"
            raise RecurformerError(
                f"loss became {seen} {where}; stopped (the last good checkpoint in {self.out_dir} is kept)"
            )
        return mean

    def _val_streams(self) -> Any:
        """B fresh streams over the validation split."""
        from .data import ContiguousStreams

        t = self.cfg.train
        return ContiguousStreams(
            self.val_tokens,
            t.batch_size,
            t.seq_len,
            rank=self.rank,
            world_size=self.world,
            seq_multiple=self.model.reset_boundary,
            split="validation",
        )

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
        return self._mean_over_ranks(float(np.mean(losses)))

    def close_loggers(self) -> None:
        self.logs.close()

    def _say(self, msg: str) -> None:
        if self.show_progress:
            tqdm.write(msg)

    def _stop_requested(self) -> int | None:
        """The signal that asked to stop, agreed by every rank (any rank's signal stops all)."""
        if self.world > 1:
            v = torch.tensor([self.stop.signum or 0], device=self.device)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            return int(v) or None
        return self.stop.signum

    def run(self) -> dict[str, Any]:
        """Train to ``train.steps``. On SIGINT/SIGTERM: finish the step, save, raise
        ``TrainingInterrupted``."""
        with self.stop.installed(), fast_matmuls(self.device):
            t = self.cfg.train
            if self.resumed_from is not None and self.step >= t.steps:
                self._say(
                    f"{self.resumed_from} is already at step {self.step} of train.steps={t.steps}: the run is finished "
                    f"(raise it with {opt('train.steps', 'N', True)} to train further)"
                )
                return {}
            self._val_streams()  # a validation split too short for the streams fails now, not at the first evaluation
            stop = self._stop_requested()
            if stop:  # a signal while the run was being set up
                raise TrainingInterrupted(stop, self.step, None, self.out_dir)
            if self.show_progress:
                print("\n".join(self.header), flush=True)
            else:  # without the header, still say why a run will be slow
                for line in self.header:
                    if line.startswith("warning:"):
                        print(line, file=sys.stderr, flush=True)
            if self.resumed_from is not None:
                gone = f" (deleted {', '.join(self.unreadable)} after it: unreadable)" if self.unreadable else ""
                self._say(
                    f"resuming from {self.resumed_from} at step {self.step} of {t.steps}, writing to {self.out_dir}{gone}"
                )
            self.model.train()
            bar = Progress(t.steps, "train", "step", initial=self.step, show=self.show_progress)
            try:
                return self._loop(bar)
            finally:
                bar.close()

    def _loop(self, bar: Progress) -> dict[str, Any]:
        t = self.cfg.train
        last: dict[str, Any] = {}
        self.meter.start(self.tokens_seen)
        while self.step < t.steps:
            loss_t = self.train_step(read=False)  # no wait for the device until the log interval
            bar.update(1)
            if self.step % t.log_every == 0 or self.step == t.steps:
                loss = self.read_loss(loss_t)  # waits for the queued steps, so the clock below counts them
                tps, mean_tps, mfu = self.meter.lap(self.tokens_seen)
                # tok_per_s: the last log interval's rate; mean_tok_per_s and mfu: the run so far
                last = {
                    "step": self.step,
                    "loss": loss,
                    "lr": self.update.lr_at(self.step - 1),
                    "tokens": self.tokens_seen,
                    "tok_per_s": tps,
                    "mean_tok_per_s": mean_tps,
                    "mfu": mfu,
                }
                bar.set_postfix(
                    loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", mean_tok_s=f"{mean_tps:,.0f}", mfu=f"{mfu:.0%}"
                )
                self.logs.log(last)
            with self.meter.paused():  # tokens/s counts training time only
                if self.step % t.eval_every == 0 or self.step == t.steps:
                    val = self.evaluate()
                    last = {**last, "step": self.step, "val_loss": val}
                    self.logs.log({"step": self.step, "val_loss": val, "tokens": self.tokens_seen})
                    self._say(f"step {self.step}: val loss {val:.4f}")
                stop = self._stop_requested() if self.step < t.steps else None  # a finished run just finishes
                if self.step % t.save_every == 0 or self.step == t.steps or stop:
                    if self._unread is not None:  # never save a model whose loss went non-finite
                        self.read_loss(loss_t)
                    path = self.save()
                    if path is not None:
                        self._say(f"saved {path}")
                if stop:
                    raise TrainingInterrupted(stop, self.step, self.out_dir / f"step_{self.step:06d}", self.out_dir)
        return last


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


def train_main(
    config: str | Path | dict[str, Any] | None,
    over: dict[str, Any],
    resume: str | None = None,
    overwrite: bool = False,
    show_progress: bool = True,
) -> tuple[Trainer, dict[str, Any]]:
    """Train (or ``resume``) a run to ``train.steps``; returns the trainer and its last metrics.
    SIGINT/SIGTERM are handled from the start: a signal while the run is set up stops it before
    its first step. A run that fails before its first checkpoint takes its own files with it
    (``checkpoint.discard_unsaved``), so a retry finds no run in the way; running out of memory is
    one line naming the sizes (``out_of_memory``). Errors name options with ``config.opt``."""
    cfg = resolve_run_config(config, over, resume)
    stop = StopSignals()
    with stop.installed(), out_of_memory(*training_sizes(cfg)):
        trainer = Trainer(cfg, resume=resume, show_progress=show_progress, overwrite=overwrite, stop=stop)
        finished = False
        try:
            last = trainer.run()
            finished = True
            return trainer, last
        finally:
            trainer.close_loggers()
            if not finished and trainer.rank == 0:
                ckpt.discard_unsaved(trainer.out_dir, trainer.existing)
            if trainer.world > 1 and dist.is_initialized():
                dist.destroy_process_group()


@dataclass
class TrainOptions:
    """``recurformer train`` (``train_command``): the config to train or the run to resume, and
    switches for config keys (``--set`` overrides any other)."""

    config: str | None = option(None, "YAML file with model/data/train sections (see configs/)")
    resume: str | None = option(
        None,
        "a run or checkpoint directory to continue exactly (written into that run directory unless "
        "--set train.out_dir=... is given)",
    )
    overwrite: bool = option(
        False,
        "replace the run in train.out_dir (or, with --resume of an older checkpoint, delete the run's later checkpoints)",
    )
    compile: bool = option(False, "torch.compile every layer (regional compilation; same as --set train.compile=true)")
    cuda_graphs: bool = option(
        False,
        "train through captured CUDA graphs, one per call shape, replayed every step (a CUDA GPU, one "
        "process; calls that cannot be captured run eagerly; same as --set train.cuda_graphs=true)",
    )
    device: str | None = option(
        None, "auto (CUDA when present; the default), cpu, cuda or cuda:N (same as --set train.device=...)"
    )
    text_field: str | None = option(
        None,
        "the field / column holding the text in JSONL, Parquet and datasets inputs of data.text_files, as for "
        f"prepare (same as --set data.text_field=...; default: {DataConfig.text_field})",
    )


def train_command(o: TrainOptions, sets: list[str]) -> dict[str, Any]:
    """``recurformer train``: ``train_main`` with the config overrides ``sets`` (``key=value``)
    and the switches of ``o`` after them; returns the last metrics."""
    if not o.config and not o.resume:
        raise RecurformerError("give --config FILE (see configs/) or --resume DIR")
    sets = (
        sets
        + (["train.compile=true"] if o.compile else [])
        + (["train.cuda_graphs=true"] if o.cuda_graphs else [])
        + ([f"train.device={o.device}"] if o.device else [])
        + ([f"data.text_field={o.text_field}"] if o.text_field else [])
    )
    with cpu_threads():
        _, last = train_main(o.config, parse_overrides(sets), o.resume, o.overwrite)
    return last


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
