"""Checkpoints: a directory per save, written atomically (a temporary directory renamed into
place), so a crash mid-write never leaves a checkpoint that loads half-written. Directories are
also deleted atomically (renamed aside first), and leftovers of a killed process are removed by
``remove_stale`` before the next write.

    step_000100/
      model.safetensors        weights
      config.json              the full run config (model name + model/data/train sections)
      tokenizer.json           the tokenizer, so a checkpoint is self-describing
      train_state.safetensors  optimizer tensors, carried model state, torch RNG state
      train_state.json         step, scheduler, optimizer hyper-parameters, data cursors, RNG

Nothing is unpickled: tensors go through safetensors, everything else through JSON.

Paths in ``config.json`` (``data.dir``, ``data.text_files``) are stored relative to the checkpoint
directory, with their absolute form under ``"locations"``; ``load_checkpoint`` resolves them, so a
checkpoint reads its data from any working directory, and a copied or moved run finds data that
moved along with it (relative) or stayed where it was (absolute)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .compat import FORMAT, upgrade_weights
from .config import RecurformerError, opt
from .files import atomic_dir, atomic_write_text
from .files import atomic_write as atomic_write  # re-exported: its home is files.py
from .files import check_writable as check_writable  # re-exported

LATEST = "latest"
STEP_DIR = re.compile(r"step_(\d+)")
STALE_PREFIXES = (".tmp_step_", ".old_step_", ".del_step_")


def step_of(path: Path) -> int | None:
    """The step of a ``step_XXXXXX`` directory name, else None."""
    m = STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run directory, ordered by step (not by name)."""
    if not run_dir.is_dir():
        return []
    found = [d for d in run_dir.iterdir() if step_of(d) is not None and (d / "model.safetensors").is_file()]
    return sorted(found, key=lambda d: step_of(d))  # type: ignore[arg-type, return-value]


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory so that a kill mid-way never leaves a partial one under its
    name: rename it aside (atomic), then delete the renamed copy."""
    aside = path.with_name(f".del_{path.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_stale(run_dir: Path) -> None:
    """Delete what a killed save left behind: temporary and half-deleted checkpoint directories."""
    if run_dir.is_dir():
        for d in run_dir.iterdir():
            if d.name.startswith(STALE_PREFIXES):
                shutil.rmtree(d, ignore_errors=True)
        (run_dir / f".{LATEST}.tmp").unlink(missing_ok=True)


def _relative(path: str, base: Path) -> str:
    """``path`` relative to ``base`` (both made absolute), or absolute across drives."""
    try:
        return os.path.relpath(Path(path).resolve(), base.resolve())
    except ValueError:  # another drive (Windows)
        return str(Path(path).resolve())


def portable_config(config: dict[str, Any], ck_dir: Path) -> dict[str, Any]:
    """A copy of ``config`` whose data paths are relative to ``ck_dir``, plus their absolute forms."""
    out = json.loads(json.dumps(config))
    data = out.get("data", {})
    locations: dict[str, Any] = {}
    if data.get("dir"):
        locations["data.dir"] = str(Path(data["dir"]).resolve())
        data["dir"] = _relative(data["dir"], ck_dir)
    if data.get("text_files"):
        locations["data.text_files"] = [str(Path(f).resolve()) for f in data["text_files"]]
        data["text_files"] = [_relative(f, ck_dir) for f in data["text_files"]]
    if locations:
        out["locations"] = locations
    return out


def _resolve_paths(config: dict[str, Any], ck_dir: Path) -> dict[str, Any]:
    """Undo ``portable_config``: each data path becomes the first existing of (relative to the
    checkpoint, the stored absolute path, relative to the working directory), else the first."""
    locations = config.pop("locations", {})
    data = config.get("data", {})

    def pick(stored: str, absolute: str | None) -> str:
        candidates = [ck_dir / stored, *([Path(absolute)] if absolute else []), Path(stored)]
        return str(next((c for c in candidates if c.exists()), candidates[0]).resolve())

    if data.get("dir"):
        data["dir"] = pick(data["dir"], locations.get("data.dir"))
    if data.get("text_files"):
        absolute = locations.get("data.text_files") or [None] * len(data["text_files"])
        data["text_files"] = [pick(f, a) for f, a in zip(data["text_files"], absolute)]
    return config


def save_checkpoint(
    run_dir: Path,
    step: int,
    model_tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    tokenizer_json: str | None,
    train_tensors: dict[str, torch.Tensor] | None = None,
    train_json: dict[str, Any] | None = None,
    keep_last: int = 3,
) -> Path:
    """Write ``run_dir/step_XXXXXX`` atomically, point ``run_dir/latest`` at it, and delete all
    but the last ``keep_last`` checkpoints by step, never the one just written. A write that fails
    (disk full, no permission) raises a one-line RecurformerError and leaves no partial checkpoint."""
    final = run_dir / f"step_{step:06d}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale(run_dir)
        # the same step again (a resumed run re-reaching it) is swapped in atomically
        with atomic_dir(final, run_dir / f".tmp_step_{step:06d}", run_dir / f".old_step_{step:06d}") as tmp:
            meta = {"format": str(FORMAT)}
            save_file(
                {k: v.detach().contiguous().cpu() for k, v in model_tensors.items()},
                tmp / "model.safetensors",
                metadata=meta,
            )
            (tmp / "config.json").write_text(json.dumps(portable_config(config, final), indent=2))
            if tokenizer_json is not None:
                (tmp / "tokenizer.json").write_text(tokenizer_json)
            if train_tensors is not None:
                save_file(
                    {k: v.detach().contiguous().cpu() for k, v in train_tensors.items()},
                    tmp / "train_state.safetensors",
                )
            if train_json is not None:
                (tmp / "train_state.json").write_text(json.dumps(train_json))
    except OSError as e:
        kept = checkpoints(run_dir)
        last = f"; the last complete checkpoint is {kept[-1]}" if kept else ""
        raise RecurformerError(f"cannot write checkpoint {final}: {e.strerror or e}{last}") from None
    atomic_write_text(run_dir / LATEST, final.name, "checkpoint pointer")
    if keep_last > 0:
        for old_ck in [c for c in checkpoints(run_dir)[:-keep_last] if c != final]:
            remove_dir(old_ck)
    return final


def resolve(path: str | Path) -> Path:
    """A checkpoint or pretrained directory (``model.safetensors``), or a run directory (its
    checkpoint of the highest step). A run directory resolves only to its own checkpoints: one
    that also holds a model of its own (files exported into it) is ambiguous, a one-line error."""
    p = Path(path)
    if not p.exists():
        raise RecurformerError(f"checkpoint not found: {p}")
    steps = checkpoints(p)  # every step_* directory is complete (renamed into place), so the newest wins
    if (p / "model.safetensors").is_file():
        if steps:
            raise RecurformerError(
                f"{p} holds both a run's checkpoints ({steps[-1].name}, ...) and a model beside them (model.safetensors, "
                f"config.json: an export into the run directory?); name one ({steps[-1]} is the run's newest), or move "
                f"the top-level model files to a directory of their own"
            )
        return p
    if not steps:
        raise RecurformerError(f"no checkpoint in {p} (expected model.safetensors or step_* directories)")
    return steps[-1]


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise RecurformerError(f"checkpoint file missing: {path}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise RecurformerError(f"cannot read {path}: {str(e).splitlines()[0]} (corrupted or truncated file?)") from None


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RecurformerError(f"checkpoint file missing: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecurformerError(f"cannot read {path}: {e}") from None


def load_config(path: str | Path) -> dict[str, Any]:
    """The run config stored in a checkpoint (or a run's newest checkpoint), its data paths resolved."""
    ck = resolve(path)
    return _resolve_paths(_load_json(ck / "config.json"), ck)


def load_checkpoint(path: str | Path, with_train_state: bool = False, resuming: bool = False) -> dict[str, Any]:
    """Returns ``{"dir", "config", "model", "tokenizer_dir"}`` (+ ``"train_tensors"``,
    ``"train_json"`` when asked). A run's checkpoint that does not read (a truncated file) is one
    line naming the run's newest checkpoint before it that reads (``resuming``: and the option
    that resumes from it)."""
    ck = resolve(path)
    try:
        return _read_checkpoint(ck, with_train_state)
    except RecurformerError as e:
        raise RecurformerError(e.args[0] + _readable_before(ck, resuming)) from None


def _read_checkpoint(ck: Path, with_train_state: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"dir": ck, "config": load_config(ck), "model": _load_tensors(ck / "model.safetensors")}
    out["tokenizer_dir"] = ck if (ck / "tokenizer.json").is_file() else None
    if with_train_state:
        out["train_tensors"] = _load_tensors(ck / "train_state.safetensors")
        out["train_json"] = _load_json(ck / "train_state.json")
    return out


def readable(ck: Path) -> bool:
    """Whether every file of the run checkpoint ``ck`` reads (weights and train state): a run can resume from it."""
    try:
        _read_checkpoint(ck, with_train_state=True)
    except RecurformerError:
        return False
    return True


def _readable_before(ck: Path, resuming: bool) -> str:
    """``"; RUN/step_000750, the run's newest checkpoint before it, reads"`` for the run checkpoint
    ``ck`` (``resuming``: with the option that resumes from it); empty when there is none."""
    step = step_of(ck)
    earlier = [c for c in checkpoints(ck.parent) if step is not None and (step_of(c) or 0) < step]
    for c in reversed(earlier):
        if readable(c):
            how = f": resume from it with {opt('resume', str(c))}" if resuming else ""
            return f"; {c}, the run's newest checkpoint before it, reads{how}"
    return ""


def load_model_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Strict load with a one-line message when the checkpoint holds another architecture
    (format-1 names are mapped to today's first)."""
    tensors = upgrade_weights(model, tensors)
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise RecurformerError(f"checkpoint {where} does not fit a {type(model).__name__} of this config ({what})")
    for k, v in tensors.items():
        if own[k].shape != v.shape:
            raise RecurformerError(
                f"checkpoint {where}: '{k}' has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}"
            )
    model.load_state_dict(tensors)


# ----------------------------------------------------------------------------------------------
# the run directory: checkpoints plus what a run writes beside them

RUN_FILES = ("metrics.jsonl", LATEST, "tensorboard")  # what a run writes besides step_* checkpoints


def run_contents(out_dir: Path) -> list[str]:
    """Names of the run files (checkpoints, metrics, ...) present in ``out_dir``."""
    return [c.name for c in checkpoints(out_dir)] + [n for n in RUN_FILES if (out_dir / n).exists()]


def clear_run(out_dir: Path, keep_until: int | None = None) -> None:
    """Delete a run's files (everything after step ``keep_until`` when it is given)."""
    for c in checkpoints(out_dir):
        if keep_until is None or (step_of(c) or 0) > keep_until:
            remove_dir(c)
    if keep_until is None:
        for name in RUN_FILES:
            target = out_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)


def metrics(run_dir: Path, until: int | None = None) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``, in order, up to step ``until`` (all without it);
    a torn line (a killed write) is skipped; none when the run has no metrics file."""
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and (until is None or row.get("step", 0) <= until):
            rows.append(row)
    return rows


def train_json(ck: Path) -> dict[str, Any] | None:
    """A training checkpoint's ``train_state.json`` (``step``, ``tokens_seen``, ...); None for a
    pretrained directory, which has none."""
    return _load_json(ck / "train_state.json") if (ck / "train_state.json").is_file() else None


def copy_metrics(source: Path, target: Path, until: int) -> None:
    """Write the rows of the run ``source`` up to step ``until`` to ``target`` (a metrics.jsonl),
    atomically; a torn last line (a killed write) is dropped."""
    text = "".join(json.dumps(row) + "\n" for row in metrics(source, until))
    atomic_write_text(target, text, "metrics file")


def describe_run(out: Path) -> tuple[str | None, str]:
    """The model name of the run in ``out`` (from its newest checkpoint's config; None when it has
    none or it cannot be read) and what ``--overwrite`` would delete, in words: the model, the newest
    step and the size on disk (``"a 'llama' model at step 1000, 12.4 MB"``)."""
    found = checkpoints(out)
    name = None
    if found:
        try:
            name = _load_json(found[-1] / "config.json").get("model", {}).get("name")
        except (RecurformerError, AttributeError):
            name = None
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    what = f"a '{name}' model" if name else "a model"
    where = f" at step {step_of(found[-1])}" if found else ""
    return name, f"{what}{where}, {size / 1e6:.1f} MB"


def free_sibling(out: Path, model: str) -> Path:
    """A directory beside ``out`` for a run of ``model`` that does not exist yet:
    ``OUT-MODEL``, else ``OUT-MODEL-2``, ``OUT-MODEL-3``, ..."""
    base = out.with_name(f"{out.name}-{model}")
    candidate, n = base, 2
    while candidate.exists():
        candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    return candidate


def claim_run_dir(out: Path, resumed: dict[str, Any] | None, overwrite: bool, model: str) -> list[str]:
    """Refuse (one line, naming its options with ``config.opt``) to write into a run directory that is
    not writable, or that holds a model of its own (an exported or pretrained directory: never
    replaced), another run, or readable checkpoints beyond the resumed step (``resumed`` is what
    ``load_checkpoint`` returned with the train state); with ``overwrite``, delete those. Checkpoints
    beyond the resumed step that do not read (``readable``) are no history to keep: they are
    deleted, and their names returned. ``model``: the name of the model this run trains; a directory
    holding another model's run is refused with a free directory beside it offered first, and what
    ``overwrite`` would delete named."""
    check_writable(out, "run directory", is_dir=True)
    elsewhere = opt("train.out_dir", "DIR", True)
    if (out / "model.safetensors").is_file():
        raise RecurformerError(
            f"{out} holds a model (model.safetensors: an exported or pretrained directory), not a run; "
            f"train into another directory ({elsewhere})"
        )
    if resumed is not None and out.resolve() == resumed["dir"].parent.resolve():  # the same run
        step = resumed["train_json"]["step"]
        later = [c for c in checkpoints(out) if (step_of(c) or 0) > step]
        kept = [c for c in later if readable(c)]
        if kept and not overwrite:
            newest = out if kept[-1] == later[-1] else kept[-1]  # the run itself, unless its newest does not read
            raise RecurformerError(
                f"{out} has checkpoints after step {step} ({', '.join(c.name for c in later)}); continuing from step "
                f"{step} would mix two histories: resume the newest with {opt('resume', str(newest))}, write elsewhere "
                f"with {elsewhere}, or pass {opt('overwrite', True)} to delete them"
            )
        if later:
            clear_run(out, keep_until=step)
        return [c.name for c in later if c not in kept]
    found = run_contents(out)
    if found and not overwrite and not checkpoints(out):  # e.g. a run killed before its first save
        raise RecurformerError(
            f"{out} holds the logs of a run that wrote no checkpoint ({', '.join(found)}), so nothing to resume; "
            f"train into another directory ({elsewhere}), or pass {opt('overwrite', True)} to replace them"
        )
    if found and not overwrite:
        saved, what = describe_run(out)
        if saved is not None and saved != model:
            raise RecurformerError(
                f"{out} holds the run of another model ({what}); train '{model}' into another directory "
                f"({opt('train.out_dir', str(free_sibling(out, model)))}), or pass {opt('overwrite', True)} "
                f"to replace it (deleting {what})"
            )
        how = f"continue it with {opt('resume', str(out))}, " if resumed is None else ""
        raise RecurformerError(
            f"{out} already holds a run ({', '.join(found[-3:])}); {how}train into another directory "
            f"({elsewhere}), or pass {opt('overwrite', True)} to replace it (deleting {what})"
        )
    if found:
        clear_run(out)
    return []


def entries(out: Path) -> set[str] | None:
    """The names in the directory ``out``, or None when there is no such directory."""
    return {p.name for p in out.iterdir()} if out.is_dir() else None


def discard_unsaved(out: Path, existing: set[str] | None) -> None:
    """After a run that failed before its first checkpoint (out of memory, a non-finite loss, a
    signal): delete the run files it created in ``out`` (its logs: ``RUN_FILES``, ``wandb``) and
    ``out`` itself when the run created it and nothing else is left, so that a retry finds no run
    in the way. ``existing``: ``entries(out)`` before the run; nothing that was there is touched,
    nor any file a run does not write."""
    if not out.is_dir() or checkpoints(out):
        return
    for name in (entries(out) or set()) - (existing or set()):
        target = out / name
        if name in (*RUN_FILES, "wandb") and target.is_dir():
            shutil.rmtree(target)
        elif name in RUN_FILES:
            target.unlink()
    if existing is None and not any(out.iterdir()):
        out.rmdir()


def open_run_dir(out: Path, resumed_run: Path | None, step: int) -> None:
    """Create ``out`` and remove a killed save's leftovers; a resumed run gets the metrics history
    of ``resumed_run`` up to ``step``, without the rows a killed run wrote later."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
    except OSError as e:
        raise RecurformerError(f"cannot write run directory {out}: {e.strerror or e}") from None
    if resumed_run is not None:
        copy_metrics(resumed_run, out / "metrics.jsonl", step)


class RNGState:
    """The torch (and CUDA) generators as ``rng.*`` tensors; Python's and NumPy's under ``rng``."""

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"rng.torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            sd["rng.cuda"] = torch.cuda.get_rng_state()
        np_state: Any = np.random.get_state()
        sd["rng"] = {"python": random.getstate(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["rng.torch"])
        if "rng.cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["rng.cuda"])
        py, n = sd["rng"]["python"], sd["rng"]["numpy"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
