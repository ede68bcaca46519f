"""A synth run (``run_synth``): the rows drawn, a model trained for every learning rate of the
sweep (``job.train_model``), the one best on validation tested, at more lengths too; and a saved
model scored at more lengths (``score_lengths``)."""

from __future__ import annotations

import dataclasses
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from ..checkpoint import checkpoints, load_checkpoint, load_model_weights
from ..config import RecurformerError
from ..data.synthetic import TASKS, Task, TaskData, get_task, make_split, row_tokens
from ..device import pick_device, slow_bf16_warning
from ..models import build_model
from ..nn import ModelConfig, StreamingLM
from ..progress import Progress
from ..statesize import measure
from .config import SynthConfig, check_recipe, model_values, setting_name, trained_params, with_setting
from .job import PROGRESS, FreshRows, SavedProgress, train_model
from .learner import Learner, Scores, evaluate


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
    by_setting: dict[str, float]  # headline test accuracy per setting of ``eval_settings`` (``setting_name``)
    task_params: dict[str, Any]
    model_config: dict[str, Any]
    num_params: int
    bounded_state: bool
    seconds: float


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


def check_eval_budget(
    t: Task,
    params: dict[str, Any],
    cfg: SynthConfig,
    model: StreamingLM,
    lengths: list[int],
    n_rows: int | None = None,
    settings: list[dict[str, Any]] | None = None,
) -> None:
    """One line, before any work, when testing at one of ``lengths`` (or of ``settings``, a
    training run's ``eval_settings``) would hold more than ``cfg.eval_memory_gb``: the ``n_rows``
    test rows (default ``cfg.n_length_test``) and their predictions (int64), and the model's state
    for ``cfg.eval_batch_size`` rows at the row's end (fp32; measured, ``statesize.measure``:
    constant for a bounded state, a KV cache grows with the row). Computed from sizes alone
    (``row_tokens``): no row is built, however long."""
    tests = [(f"length {L}", t.at_length(params, L), "synth.eval_lengths") for L in sorted(lengths, reverse=True)]
    tests += [
        (setting_name(s), with_setting(t, params, s, "eval_settings"), "synth.eval_settings") for s in settings or []
    ]
    if not tests:
        return
    n = cfg.n_length_test if n_rows is None else n_rows
    size = measure(model)
    for where, p, key in tests:
        # what to lower: a training run's config keys, or synth --evaluate's own options (n_rows given)
        knobs = f"{key}, synth.n_length_test" if n_rows is None else "--lengths, --n-test"
        knobs += " or synth.eval_batch_size"
        T = row_tokens(t.name, p)
        rows = 3 * 8 * n * T
        state = 4 * cfg.eval_batch_size * size.at(T)
        if (need := (rows + state) / 2**30) > cfg.eval_memory_gb:
            raise RecurformerError(
                f"testing {t.name} at {where} ({T:,} tokens a row) needs about {need:.1f} GB "
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
        saving = SavedProgress(Path(save) / PROGRESS, cfg.save_every, run, resume)
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
    check_eval_budget(t, params, cfg, built, cfg.eval_lengths, settings=cfg.eval_settings)
    t0 = time.perf_counter()
    train: TaskData | FreshRows
    if cfg.fresh():  # held-out rows first; training rows are drawn per batch, none equal to one of them
        held = trained_params(t, params, cfg)
        val = make_split(task, cfg.n_val, cfg.seed + 1, held, split="test")
        seen = val.row_keys()
        test = make_split(task, cfg.n_test, cfg.seed + 2, held, exclude=seen, split="test")
        seen |= test.row_keys()
        length_data = {L: length_split(t, params, L, cfg.n_length_test, cfg.seed, seen) for L in cfg.eval_lengths}
        setting_data = {setting_name(s): setting_split(t, params, s, cfg, seen) for s in cfg.eval_settings}
        for d in [*length_data.values(), *setting_data.values()]:
            seen |= d.row_keys()
        train = FreshRows(task, params, cfg, seen)
        log(
            f"{task} {params}: fresh training rows for each of {cfg.steps} steps / {cfg.n_val} val / {cfg.n_test} test rows of {val.inputs.shape[1]} tokens"
        )
    else:
        train = make_split(task, cfg.n_train or t.train_size, cfg.seed, params)
        seen = train.row_keys()
        val = make_split(task, cfg.n_val, cfg.seed + 1, params, exclude=seen, split="test")
        seen |= val.row_keys()
        test = make_split(task, cfg.n_test, cfg.seed + 2, params, exclude=seen, split="test")
        seen |= test.row_keys()
        length_data = {L: length_split(t, params, L, cfg.n_length_test, cfg.seed, seen) for L in cfg.eval_lengths}
        setting_data = {setting_name(s): setting_split(t, params, s, cfg, seen) for s in cfg.eval_settings}
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
    tokens = sum(d.inputs.numel() for d in [*length_data.values(), *setting_data.values()])
    bar = Progress(
        tokens, "test at eval_lengths" + (" and eval_settings" if setting_data else ""), "token", show=progress
    )
    for L, data in length_data.items():
        by_length[L] = evaluate(learner, data, cfg.chunk, cfg.eval_batch_size, bar.update).headline(t.metric)
        log(f"  {task} at length {L}: test accuracy {by_length[L]:.4f}")
    by_setting: dict[str, float] = {}
    for name, data in setting_data.items():
        by_setting[name] = evaluate(learner, data, cfg.chunk, cfg.eval_batch_size, bar.update).headline(t.metric)
        log(f"  {task} at {name}: test accuracy {by_setting[name]:.4f}")
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
        by_setting=by_setting,
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
    return make_split(t.name, n, seed + 3 + L, t.at_length(params, L), exclude=exclude, split="test")


def setting_split(
    t: Task, params: dict[str, Any], setting: dict[str, Any], cfg: SynthConfig, exclude: set[bytes]
) -> TaskData:
    """The ``cfg.n_length_test`` test rows of ``t`` at one setting of ``eval_settings``, none in
    ``exclude``, from a seed of the run's seed and the setting itself (its rows do not depend on
    the other settings listed)."""
    seed = cfg.seed + 5 + zlib.crc32(setting_name(setting).encode())
    return make_split(
        t.name,
        cfg.n_length_test,
        seed,
        with_setting(t, params, setting, "eval_settings"),
        exclude=exclude,
        split="test",
    )


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
    bar = Progress(total, "evaluate", "token", show=progress)
    scores = {
        L: evaluate(learner, length_split(t, params, L, n_rows, cfg.seed), cfg.chunk, cfg.eval_batch_size, bar.update)
        for L in lengths
    }
    bar.close()
    return scores


def result_dict(r: SynthResult) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["by_length"] = {str(k): v for k, v in r.by_length.items()}
    return d


def summary(r: SynthResult) -> str:
    kind = "micro token accuracy" if r.metric == "token" else "exact match"
    s = r.test
    settings = "".join(f"\n  at {name}: test {kind} {acc:.4f}" for name, acc in r.by_setting.items())
    return (
        f"{r.task} / {r.model}: test {kind} {r.accuracy:.4f} (lr {r.lr:g}; token {s.token_accuracy:.4f}, "
        f"macro {s.macro_accuracy:.4f}, exact {s.exact_match:.4f} over {s.rows} rows)"
    ) + settings
