"""The Python API: what the command line does, callable without a subprocess.

    import recurformer

    run = recurformer.train("tinystories-cpu", train={"steps": 50})   # or **{"train.steps": 50}
    model, tok = recurformer.load(run.checkpoint)                      # or a pretrained dir / Hub id
    results = recurformer.evaluate(model, tok, dataset="tinystories-sample", lengths=[256, 1024])
    probed = recurformer.probe(model, tok, task="repeat", docs=50)
    recurformer.export(run.dir, "my-model")                            # Hub layout + model card

Every function raises ``RecurformerError`` (a one-line message) on bad input, as the CLI does."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .config import RecurformerError, check_options, merge
from .data import Tokenizer
from .evaluate import LengthResult, evaluate_lengths
from .nn import StreamingLM
from .probe import ProbeResult


@dataclass
class Run:
    """A finished (or stopped) training run."""

    dir: Path  # the run directory: metrics.jsonl, step_XXXXXX/ checkpoints
    checkpoint: Path | None  # the last checkpoint written (None if none was)
    metrics: dict[str, Any]  # the last logged metrics: step, loss, val_loss, tokens, ...
    model: StreamingLM  # the trained model, in eval mode
    tokenizer: Tokenizer
    config: dict[str, Any] = field(default_factory=dict)  # the full run config as saved


def _overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """``train={"steps": 5}`` and ``**{"train.steps": 5}`` -> a nested dict of config values."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        nested: Any = value
        for part in reversed(key.split(".")[1:]):
            nested = {part: nested}
        out = merge(out, {key.split(".")[0]: nested})
    return out


def train(config: str | Path | dict[str, Any] | None = None, *, resume: str | Path | None = None,
          progress: bool = True, overwrite: bool = False, **overrides: Any) -> Run:
    """Train as ``recurformer train`` does. ``config``: a YAML path, a bundled config name
    (``"tinystories-cpu"``) or a dict with model/data/train sections; ``overrides`` as sections
    (``model={"dim": 64}``) or dotted keys (``**{"train.steps": 10}``); ``resume``: a run or
    checkpoint directory to continue exactly (written into that run's directory unless
    ``train.out_dir`` is given); ``overwrite``: replace a run already in ``train.out_dir``."""
    from . import checkpoint as ckpt
    from .train import train_main

    resumed = str(resume) if resume is not None else None
    trainer, metrics = train_main(config, _overrides(overrides), resumed, overwrite, show_progress=progress)
    try:
        last = ckpt.resolve(trainer.out_dir)
    except RecurformerError:
        last = None
    return Run(trainer.out_dir, last, metrics, trainer.model.eval(), trainer.tokenizer, trainer._config_dict())


def load(dir_or_repo_id: str | Path, device: str = "cpu") -> tuple[StreamingLM, Tokenizer | None]:
    """(model in eval mode, tokenizer or None) from a run, a checkpoint, a pretrained directory
    or a Hub repo id."""
    from .hub import from_pretrained

    model, tok, _ = from_pretrained(dir_or_repo_id, device)
    return model, tok


def _tokens(tokenizer: Tokenizer | None, dataset: str | None, text: Sequence[str | Path] | None) -> np.ndarray:
    """A bundled dataset's val split, or text files, as one token stream (BOS before each document)."""
    from .evaluate import eval_tokens

    if tokenizer is None:
        raise RecurformerError("this model has no tokenizer; pass token ids instead of a dataset or text")
    if (dataset is None) == (not text):
        raise RecurformerError("give exactly one of dataset=NAME or text=[FILE, ...]")
    missing = [str(f) for f in text or [] if not Path(f).is_file()]
    if missing:
        raise RecurformerError(f"text file not found: {missing[0]}")
    return eval_tokens(tokenizer, {}, dataset=dataset, text=[str(f) for f in text] if text else None)


def evaluate(model: StreamingLM, tokenizer: Tokenizer | None = None, *, tokens: np.ndarray | None = None,
             dataset: str | None = None, text: Sequence[str | Path] | None = None,
             lengths: Sequence[int] = (256, 512, 1024, 2048, 4096), last: int = 256, windows: int | None = None,
             chunk: int = 256, warm_state: int = 0, batch_size: int = 8,
             context: int | None = None) -> list[LengthResult]:
    """Length extrapolation as ``recurformer eval``: loss (with a 95% bootstrap interval over
    documents) and accuracy on the last ``last`` tokens of windows of each length, on ``tokens``
    or a dataset's val split or text files. The windows are deterministic: all of them (the scored
    blocks tile the text), or ``windows`` evenly spaced ones; ``evaluate.paired_differences``
    compares two models' results on the same tokens."""
    data = np.asarray(tokens, dtype=np.int64) if tokens is not None else _tokens(tokenizer, dataset, text)
    return evaluate_lengths(model, data, list(lengths), last, windows, chunk, warm_state, batch_size, context,
                            tokenizer.bos_id if tokenizer is not None else None)


def probe(model: StreamingLM, tokenizer: Tokenizer, *, task: str = "repeat", dataset: str | None = None,
          text: Sequence[str | Path] | None = None, docs: int = 500, passage: int = 128,
          distances: Sequence[int] = (1, 4, 16, 64, 256, 1024), span: int = 32, warm: tuple[int, int] = (32, 288),
          chunk: int = 256, batch_size: int = 16, precision: str = "fp32", seed: int = 0,
          label: str = "model") -> ProbeResult:
    """The copy (``repeat``) or ``swap`` probe as ``recurformer probe``: per-distance-bin means
    with bootstrap intervals. ``dataset`` defaults to ``tinystories-repeat`` for ``repeat``."""
    from .models import model_name
    from .probe import METRICS, TASKS, make_samples, probe_model, receptive_field

    if task not in TASKS:
        raise RecurformerError(f"unknown probe task '{task}'; valid tasks: {', '.join(TASKS)}")
    check_options(docs=docs, passage=passage, span=span, chunk=chunk, batch_size=batch_size, warm_min=warm[0])
    if warm[0] > warm[1]:
        raise RecurformerError(f"warm must be (min, max) with min <= max, got {warm}")
    if dataset is None and not text:
        if task != "repeat":
            raise RecurformerError("the swap probe needs dataset=NAME or text=[FILE, ...]")
        dataset = "tinystories-repeat"
    files = [str(f) for f in text] if text else None
    samples = make_samples(tokenizer, task, dataset, files, model.config.vocab_size, docs=docs, passage=passage,
                             distances=distances, span=span, warm=warm, seed=seed)
    with torch.no_grad():
        metrics = probe_model(model, samples, METRICS[task], chunk, batch_size, precision, seed)
    facts = {"step": None, "tokens_seen": None, "val_loss": None, "train_tok_per_s": None}
    return ProbeResult(label, "", model_name(model.config), receptive_field(model), metrics=metrics, **facts)


def export(checkpoint: str | Path, out: str | Path, push_to_hub: str | None = None) -> Path:
    """A run or checkpoint -> a pretrained directory (weights, config, tokenizer, model card),
    uploaded to the Hub repo ``push_to_hub`` when given."""
    from . import hub

    path = hub.export(checkpoint, out)
    if push_to_hub:
        hub.upload(path, push_to_hub)
    return path
