"""``recurformer probe``: the copy or swap probe of each checkpoint on the same documents, or
(``--merge``) one report from earlier probe files; a table, JSON and figure."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..checkpoint import metrics, train_json
from ..config import RecurformerError, make_options, opt, option
from ..device import device_option
from ..report import claim_outputs, json_option, write_report
from .measure import probe_model, receptive_field
from .options import METRICS, ProbeOptions
from .results import ProbeResult, figure, markdown_tables, merge, text_sha256, to_json
from .samples import samples_for


@dataclass
class ProbeCommandOptions(ProbeOptions):
    """``recurformer probe`` (``probe_checkpoints``): ``ProbeOptions`` for each checkpoint, and
    where the results go."""

    checkpoint: list[str] = option(
        None, "run or checkpoint directories or Hub repo ids (one line each in the plot)", cli=False
    )  # the command line's, beside --merge
    device: str = device_option()
    out: str | None = json_option(
        "output JSON, a PNG plot beside it (default: probe.json in the first checkpoint's run directory; with "
        "--merge, probe-merged.json beside the first merged file)"
    )


def run_facts(ckpt_dir: Path) -> dict[str, Any]:
    """Step and tokens of a checkpoint, and its run's validation loss and training speed so far."""
    facts: dict[str, Any] = {"step": None, "tokens_seen": None, "val_loss": None, "train_tok_per_s": None}
    state = train_json(ckpt_dir)
    if state is None:  # a pretrained directory: no run
        return facts
    facts["step"], facts["tokens_seen"] = state.get("step"), state.get("tokens_seen")
    rows = metrics(ckpt_dir.parent, facts["step"])
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    speeds = [r["tok_per_s"] for r in rows if "tok_per_s" in r]
    facts["val_loss"] = vals[-1] if vals else None
    facts["train_tok_per_s"] = float(np.median(speeds)) if speeds else None
    return facts


def probe_checkpoints(
    checkpoints: Sequence[str],
    out: str | Path | None = None,
    *,
    meta: dict[str, Any] | None = None,
    log: Callable[[str], object] = print,
    **options: Any,
) -> list[ProbeResult]:
    """``recurformer probe``: the copy or swap probe of each checkpoint (``options``: the fields of
    ``ProbeOptions``, ``device``) on the same documents
    (``dataset`` defaults to ``tinystories-repeat`` for ``repeat``, else the checkpoint's own);
    logs the tables, writes ``out`` (JSON with ``meta``; default ``probe.json`` in the first
    checkpoint's run directory) and its PNG plot; progress on stderr (``progress.Progress``): a bar on a
    terminal, lines with the time left in a log."""
    from ..device import pick_device, slow_bf16_warning
    from ..hub import default_output, eval_labels, load, locate
    from ..progress import Progress

    o = make_options(ProbeCommandOptions, {"checkpoint": list(checkpoints), "out": out, **options})
    task, dataset, text, precision, chunk, batch_size, seed = (
        o.task,
        o.dataset,
        o.text,
        o.precision,
        o.chunk,
        o.batch_size,
        o.seed,
    )
    path_out = default_output(out, checkpoints[0], "probe.json")
    claim_outputs(path_out, f"{opt('out')} file")  # before the work, not after it
    dev = pick_device(o.device)
    if warning := slow_bf16_warning(precision, dev):
        print(warning, file=sys.stderr)
    dataset = dataset if (dataset or text) else ("tinystories-repeat" if task == "repeat" else None)
    results = []
    dirs = [locate(p) for p in checkpoints]
    for path, d, label in zip(checkpoints, dirs, eval_labels(checkpoints, dirs)):
        loaded = load(d, dev)
        model, name, tok, config = loaded.model, loaded.name, loaded.tokenizer, loaded.config
        if tok is None:
            raise RecurformerError(f"checkpoint {path} has no tokenizer.json, so it cannot read text")
        if dataset is None and not text:
            dataset = config.get("data", {}).get("dataset")
            if not dataset:
                raise RecurformerError(
                    f"checkpoint {path} does not name a bundled dataset; give {opt('dataset')} or {opt('text')}"
                )
        samples = samples_for(o, tok, dataset, model.config.vocab_size)
        R = receptive_field(model)
        log(
            f"probing {label} ({name}, receptive field {'unbounded' if R is None else R}) on {len(samples)} documents, task {task}"
        )
        progress = Progress(sum(len(r) for s in samples for r in s.rows), label, "token")
        try:
            metrics = probe_model(model, samples, METRICS[task], chunk, batch_size, precision, seed, progress.update)
        finally:
            progress.close()
        facts = run_facts(loaded.path)
        results.append(ProbeResult(label, str(loaded.path), name, R, metrics=metrics, **facts))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    meta = (meta or {}) | {"dataset_used": dataset, "text_sha256": text_sha256(text)}
    drawn = partial(figure, results, f"{task} probe")
    write_report(path_out, ["", markdown_tables(results)], to_json(results, meta), drawn, log)
    return results


def merge_probes(
    files: Sequence[str | Path], out: str | Path | None = None, log: Callable[[str], object] = print
) -> list[ProbeResult]:
    """``recurformer probe --merge``: one table, JSON and plot (``out``, default
    ``probe-merged.json`` beside the first file) from earlier probe results run with the same
    documents and settings."""
    path_out = Path(out) if out else Path(files[0]).with_name("probe-merged.json")
    claim_outputs(path_out, "output file")
    results, meta = merge([Path(f) for f in files])
    drawn = partial(figure, results, f"{meta['task']} probe")
    write_report(path_out, [markdown_tables(results)], to_json(results, meta), drawn, log)
    return results
