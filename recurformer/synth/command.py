"""``recurformer synth`` (``synth_command``): train on a task and report, continue a saved run
(``synth_resume``), or score a saved model at more lengths (``synth_evaluate``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Checked, RecurformerError, merge, option
from ..data.synthetic import TASKS
from ..device import device_option, pick_device
from ..models import model_names
from .config import SynthConfig, split_overrides, synth_config
from .job import load_progress
from .run import result_dict, run_synth, score_lengths, summary

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
    from ..config import load_yaml
    from ..files import check_writable

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

    from ..files import atomic_write_text

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

    from ..files import atomic_write_text
    from ..hub import load

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
