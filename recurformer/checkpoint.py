"""Checkpoints: a directory per save, written atomically (a temporary directory renamed into
place), so a crash mid-write never leaves a checkpoint that loads half-written.

    step_000100/
      model.safetensors        weights
      config.json              the full run config (model name + model/data/train sections)
      tokenizer.json           the tokenizer, so a checkpoint is self-describing
      train_state.safetensors  optimizer tensors, carried model state, torch RNG state
      train_state.json         step, scheduler, optimizer hyper-parameters, data cursors, RNG

Nothing is unpickled: tensors go through safetensors, everything else through JSON."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .compat import FORMAT, upgrade_weights
from .config import RecurformerError

LATEST = "latest"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    but the last ``keep_last`` checkpoints."""
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"step_{step:06d}"
    tmp = run_dir / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    meta = {"format": str(FORMAT)}
    save_file({k: v.detach().contiguous().cpu() for k, v in model_tensors.items()}, tmp / "model.safetensors", metadata=meta)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_json is not None:
        (tmp / "tokenizer.json").write_text(tokenizer_json)
    if train_tensors is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in train_tensors.items()}, tmp / "train_state.safetensors")
    if train_json is not None:
        (tmp / "train_state.json").write_text(json.dumps(train_json))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(run_dir / LATEST, final.name)
    if keep_last > 0:
        for old in sorted(run_dir.glob("step_*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its latest checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise RecurformerError(f"checkpoint not found: {p}")
    if (p / "model.safetensors").is_file():
        return p
    if (p / LATEST).is_file():
        ck = p / (p / LATEST).read_text().strip()
        if (ck / "model.safetensors").is_file():
            return ck
    steps = sorted(d for d in p.glob("step_*") if (d / "model.safetensors").is_file())
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


def load_checkpoint(path: str | Path, with_train_state: bool = False) -> dict[str, Any]:
    """Returns ``{"dir", "config", "model", "tokenizer_dir"}`` (+ ``"train_tensors"``,
    ``"train_json"`` when asked)."""
    ck = resolve(path)
    out: dict[str, Any] = {"dir": ck, "config": _load_json(ck / "config.json"), "model": _load_tensors(ck / "model.safetensors")}
    out["tokenizer_dir"] = ck if (ck / "tokenizer.json").is_file() else None
    if with_train_state:
        out["train_tensors"] = _load_tensors(ck / "train_state.safetensors")
        out["train_json"] = _load_json(ck / "train_state.json")
    return out


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
            raise RecurformerError(f"checkpoint {where}: '{k}' has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}")
    model.load_state_dict(tensors)


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode, model name, tokenizer or None, run config dict) from a checkpoint."""
    from .data import Tokenizer
    from .models import build_model

    ck = load_checkpoint(path)
    mcfg = dict(ck["config"].get("model", {}))
    name = mcfg.pop("name", None)
    if name is None:
        raise RecurformerError(f"{ck['dir'] / 'config.json'} has no model.name")
    model = build_model(name, mcfg)
    load_model_weights(model, ck["model"], str(ck["dir"]))
    tok = Tokenizer.load(ck["tokenizer_dir"]) if ck["tokenizer_dir"] is not None else None
    return model.to(device).eval(), name, tok, ck["config"]
