"""The Python API: what the command line does, callable without a subprocess.

    import recurformer

    run = recurformer.train("tinystories-cpu", train={"steps": 50, "out_dir": "runs/short"})  # or **{"train.steps": 50}
    model, tok = recurformer.load(run.checkpoint)                      # or a pretrained dir / Hub id
    results = recurformer.evaluate(model, tok, dataset="tinystories-sample", lengths=[256, 1024])
    probed = recurformer.probe(model, tok, task="repeat", docs=50)
    recurformer.export(run.dir, "my-model")                            # Hub layout + model card

Every function raises ``RecurformerError`` (a one-line message) on bad input, as the CLI does,
naming the options as Python keywords (the CLI's calls pass ``style="cli"`` for its flags);
running out of memory in training, evaluation or generation is such a message too, naming the
sizes that failed and what to lower."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from .config import RecurformerError, check_options, merge, option_name
from .data import Tokenizer
from .device import cpu_threads
from .evaluate import DEFAULT_WINDOWS, LengthResult, evaluate_lengths
from .nn import StreamingLM
from .probe import ProbeResult

if TYPE_CHECKING:
    from .niah import Cell
    from .readout import Readout


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


@cpu_threads()
def train(
    config: str | Path | dict[str, Any] | None = None,
    *,
    resume: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    style: str = "python",
    **overrides: Any,
) -> Run:
    """Train as ``recurformer train`` does. ``config``: a YAML path, a bundled config name
    (``"tinystories-cpu"``) or a dict with model/data/train sections; ``overrides`` as sections
    (``model={"dim": 64}``) or dotted keys (``**{"train.steps": 10}``); ``resume``: a run or
    checkpoint directory to continue exactly (written into that run's directory unless
    ``train.out_dir`` is given); ``overwrite``: replace a run already in ``train.out_dir``.
    ``style`` names the options in errors (``"cli"``: ``--resume``)."""
    from . import checkpoint as ckpt
    from .train import train_main

    resumed = str(resume) if resume is not None else None
    trainer, metrics = train_main(config, _overrides(overrides), resumed, overwrite, progress, style)
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


@cpu_threads()
def evaluate(
    model: StreamingLM,
    tokenizer: Tokenizer | None = None,
    *,
    tokens: np.ndarray | None = None,
    dataset: str | None = None,
    text: Sequence[str | Path] | None = None,
    lengths: Sequence[int] = (256, 512, 1024, 2048, 4096),
    last: int = 256,
    windows: int | None = DEFAULT_WINDOWS,
    chunk: int = 256,
    warm_state: int = 0,
    batch_size: int = 8,
    context: int | None = None,
) -> list[LengthResult]:
    """Length extrapolation as ``recurformer eval``: loss (with a 95% bootstrap interval over
    documents) and accuracy on the last ``last`` tokens of windows of each length, on ``tokens``
    or a dataset's val split or text files. The windows are deterministic: ``windows`` evenly
    spaced ones (default ``DEFAULT_WINDOWS``), or all of them with ``windows=None`` (the scored
    blocks tile the text); ``evaluate.paired_differences``
    compares two models' results on the same tokens."""
    from .device import out_of_memory

    data = np.asarray(tokens, dtype=np.int64) if tokens is not None else _tokens(tokenizer, dataset, text)
    with out_of_memory(*eval_sizes("the model", model, batch_size, chunk, lengths, "python")):
        return evaluate_lengths(
            model,
            data,
            list(lengths),
            last,
            windows,
            chunk,
            warm_state,
            batch_size,
            context,
            tokenizer.bos_id if tokenizer is not None else None,
        )


def eval_sizes(
    label: str, model: StreamingLM, batch_size: int, chunk: int, lengths: Sequence[int], style: str
) -> tuple[str, str]:
    """What an evaluation holds in memory (the model, windows side by side, tokens per call, the
    longest window) and what to lower, for ``device.out_of_memory``."""
    from .models import model_name

    doing = (
        f"evaluating {label} ({model_name(model.config)}, {model.num_params():,} parameters): batch_size "
        f"{batch_size} windows side by side, chunk {chunk} tokens per call, lengths up to {max(lengths)}"
    )
    name = lambda o: option_name(o, style)  # noqa: E731
    return doing, f"lower {name('batch_size')} or {name('chunk')} (a state that grows with the text: {name('lengths')})"


def check_probe(
    task: str,
    *,
    docs: int,
    passage: int,
    span: int,
    chunk: int,
    batch_size: int,
    warm: tuple[int, int],
    style: str = "python",
) -> None:
    """The probe's options checked, for ``probe`` and ``probe_checkpoints`` alike (one-line errors
    naming them as ``style`` does: ``"cli"`` gives ``--warm-min``)."""
    from .probe import TASKS

    if task not in TASKS:
        raise RecurformerError(f"unknown probe task '{task}'; valid tasks: {', '.join(TASKS)}")
    check_options(style, docs=docs, batch_size=batch_size, chunk=chunk, passage=passage, span=span, warm_min=warm[0])
    if warm[0] > warm[1]:
        if style == "cli":
            raise RecurformerError(f"need 0 <= --warm-min <= --warm-max, got {warm[0]} and {warm[1]}")
        raise RecurformerError(f"warm must be (min, max) with min <= max, got {warm}")


@cpu_threads()
def probe(
    model: StreamingLM,
    tokenizer: Tokenizer,
    *,
    task: str = "repeat",
    dataset: str | None = None,
    text: Sequence[str | Path] | None = None,
    docs: int = 500,
    passage: int = 128,
    distances: Sequence[int] = (1, 4, 16, 64, 256, 1024),
    span: int = 32,
    warm: tuple[int, int] = (32, 288),
    chunk: int = 256,
    batch_size: int = 16,
    precision: str = "fp32",
    seed: int = 0,
    label: str = "model",
) -> ProbeResult:
    """The copy (``repeat``) or ``swap`` probe as ``recurformer probe``: per-distance-bin means
    with bootstrap intervals. ``dataset`` defaults to ``tinystories-repeat`` for ``repeat``."""
    from .models import model_name
    from .probe import METRICS, make_samples, probe_model, receptive_field

    check_probe(task, docs=docs, passage=passage, span=span, chunk=chunk, batch_size=batch_size, warm=warm)
    if dataset is None and not text:
        if task != "repeat":
            raise RecurformerError("the swap probe needs dataset=NAME or text=[FILE, ...]")
        dataset = "tinystories-repeat"
    files = [str(f) for f in text] if text else None
    samples = make_samples(
        tokenizer,
        task,
        dataset,
        files,
        model.config.vocab_size,
        docs=docs,
        passage=passage,
        distances=distances,
        span=span,
        warm=warm,
        seed=seed,
    )
    with torch.no_grad():
        metrics = probe_model(model, samples, METRICS[task], chunk, batch_size, precision, seed)
    facts = {"step": None, "tokens_seen": None, "val_loss": None, "train_tok_per_s": None}
    return ProbeResult(label, "", model_name(model.config), receptive_field(model), metrics=metrics, **facts)


@dataclass
class Generated:
    """What ``generate_text`` produced, with its speed and peak memory."""

    text: str  # the continuation (without the prompt)
    tokens: int
    seconds: float
    peak_memory_mb: float
    memory_kind: str  # what the peak counts ('GPU memory', 'RSS', ...)


@cpu_threads()
def generate_text(
    checkpoint: str | Path,
    prompt: str = "",
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_at_eos: bool = True,
    load_state: str | Path | None = None,
    save_state: str | Path | None = None,
    device: str = "auto",
    cuda_graphs: bool = False,
    on_text: Callable[[str], object] | None = None,
    note: Callable[[str], object] = print,
    style: str = "python",
) -> Generated:
    """``recurformer generate``: continue ``prompt`` with a checkpoint's model, streaming the text
    (the prompt first) to ``on_text`` as whole characters arrive; ``load_state`` continues a
    saved generation (the prompt is appended), ``save_state`` saves it to continue later;
    ``cuda_graphs``: each new token through a captured decoding step (``capture.DecodeGraphs``). ``style`` names the options in errors (``"cli"``: ``--top-p``); running out of memory is one
    line naming the model, the prompt's length and what to lower."""
    import time

    from .capture import DecodeGraphs
    from .checkpoint import quoted, spelled
    from .device import memory_kind, out_of_memory, peak_memory_mb, pick_device, reset_peak_memory, synchronize
    from .files import check_writable
    from .generate import load_session, new_session, save_session, stream
    from .hub import load_model

    check_options(style, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    if save_state:
        check_writable(Path(save_state), f"{option_name('save_state', style)} file")  # before generating, not after
    dev = pick_device(device)
    if cuda_graphs and dev.type != "cuda":
        raise RecurformerError(f"{option_name('cuda_graphs', style)} needs a CUDA GPU; this generation runs on {dev}")
    where = spelled(style, "device", quoted("cpu", style))
    with out_of_memory(
        f"loading {checkpoint} onto {dev}", f"the model does not fit there: use another device ({where})"
    ):
        model, name, tok, _ = load_model(checkpoint, dev)
    decode = DecodeGraphs(model, "cuda").or_eager(note) if cuda_graphs else None
    if tok is None:
        raise RecurformerError("this checkpoint has no tokenizer.json, so it cannot read a text prompt")
    if tok.lowercase and prompt != prompt.lower():
        note("[this model's tokenizer was learned from lower-case text: the prompt is lower-cased]")
        prompt = prompt.lower()
    ids = ([] if load_state else [tok.bos_id]) + tok.encode(prompt)
    doing = (
        f"generating with {name} ({model.num_params():,} parameters) on {dev} from a prompt of {len(ids)} "
        f"tokens, at most {max_new_tokens} new ones"
    )
    lower = f"lower the prompt's length or {option_name('max_new_tokens', style)}"
    emit = on_text or (lambda t: None)
    with out_of_memory(doing, lower):
        session = load_session(load_state, model, name) if load_state else new_session(model, 1, seed)
        tokens = torch.tensor([ids], dtype=torch.long) if ids else None
        stops = [tok.eos_id, tok.bos_id] if stop_at_eos else []
        emit(prompt)
        out: list[int] = []
        shown = ""
        reset_peak_memory(dev)
        t0 = time.perf_counter()
        for step in stream(
            model, tokens, max_new_tokens, temperature, top_k, top_p, session=session, stop_tokens=stops, step=decode
        ):
            t = int(step[0])
            if t < 0:
                break
            out.append(t)
            text = tok.decode(out)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                emit(text[len(shown) :])
                shown = text
        synchronize(dev)
        dt = time.perf_counter() - t0
        text = tok.decode(out)
        emit(text[len(shown) :])
        if save_state:
            save_session(session, save_state, name)
            note(f"[saved the generation state to {save_state}]")
    return Generated(text, len(out), dt, peak_memory_mb(dev), memory_kind(dev))


# ----------------------------------------------------------------------------------------------
# what ``recurformer eval`` and ``recurformer probe`` run: several checkpoints, one table, JSON + plot


def eval_labels(paths: Sequence[str]) -> list[str]:
    """One unique label per checkpoint: the run's name, plus the step where two share a run
    name, plus the full path where even that is not unique."""
    from .checkpoint import resolve

    dirs = [resolve(p) for p in paths]
    seen: dict[Any, Any] = {}
    for p, d in zip(paths, dirs):
        if d.resolve() in seen:
            raise RecurformerError(f"checkpoints {p} and {seen[d.resolve()]} are the same checkpoint ({d})")
        seen[d.resolve()] = p
    runs = [d.parent.name if d.name.startswith("step_") else d.name for d in dirs]
    labels = [f"{r} {d.name}" if runs.count(r) > 1 and d.name.startswith("step_") else r for r, d in zip(runs, dirs)]
    return [str(d) if labels.count(lab) > 1 else lab for lab, d in zip(labels, dirs)]


def default_output(given: str | Path | None, checkpoint: str | Path, name: str) -> Path:
    """``given``, or ``name`` in the run directory of ``checkpoint`` (the directory that holds its
    step_* checkpoints, or the checkpoint / pretrained directory itself)."""
    from .checkpoint import resolve

    if given:
        return Path(given)
    d = resolve(checkpoint)
    return (d.parent if d.name.startswith("step_") else d) / name


@cpu_threads()
def evaluate_checkpoints(
    checkpoints: Sequence[str],
    lengths: Sequence[int] = (256, 512, 1024, 2048, 4096),
    out: str | Path | None = None,
    *,
    last: int = 256,
    windows: int | None = DEFAULT_WINDOWS,
    chunk: int = 256,
    warm_state: int = 0,
    batch_size: int = 8,
    context: int | None = None,
    window: int | None = None,
    data: str | None = None,
    dataset: str | None = None,
    text: list[str] | None = None,
    device: str = "auto",
    meta: dict[str, Any] | None = None,
    log: Callable[[str], object] = print,
    style: str = "python",
) -> dict[str, list[LengthResult]]:
    """``recurformer eval``: length extrapolation of each checkpoint (on its own val split by
    default, or ``data``/``dataset``/``text``; ``windows`` evenly spaced windows per length, all of
    them with None), ``window`` W evaluating a dense model with a sliding window; logs a table,
    writes ``out`` (JSON with ``meta``; default ``eval.json`` in the first checkpoint's run
    directory) and its PNG plot. The JSON is rewritten (atomically) as each length finishes, with
    ``"complete": false`` until the end, so an interrupted eval keeps what it finished; progress
    shows as a bar on a terminal, as lines through ``log`` elsewhere. Every option is checked
    before any work."""
    import math

    from .device import memory_kind, out_of_memory, pick_device
    from .evaluate import check_lengths, eval_tokens, markdown_table, plot, save_json, window_ends
    from .files import check_writable
    from .hub import load_model
    from .loggers import Progress

    lengths = list(lengths)
    check_options(style, window=window)
    check_lengths(lengths, last, windows, chunk, warm_state, batch_size, context, style)
    labels = eval_labels(checkpoints)
    path_out = default_output(out, checkpoints[0], "eval.json")
    check_writable(path_out, "--json file" if style == "cli" else "out file")  # before the work, not after it
    check_writable(path_out.with_suffix(".png"), "plot")
    dev = pick_device(device)
    results: dict[str, list[LengthResult]] = {}
    cache: dict[Any, Any] = {}
    trained: dict[str, Any] = {}
    for path, label in zip(checkpoints, labels):
        model, name, tok, config = load_model(path, dev)
        if window:
            if not hasattr(model, "set_window"):
                raise RecurformerError(
                    f"{option_name('window', style)} applies to dense attention models (llama), not {name}"
                )
            model.set_window(window)
            label += f" (window {window})"
        tokens = eval_tokens(tok, config, data=data, dataset=dataset, text=text, cache=cache)
        span = context or warm_state + max(lengths)
        every = len(window_ends(len(tokens), span, last)) if len(tokens) > span else 0
        n = min(every, windows or every)
        every_one = "--all" if style == "cli" else "windows=None"
        how = (
            "every window of the evaluation text" if n == every else f"evenly spaced, of {every:,}; {every_one} for all"
        )
        log(
            f"evaluating {label} ({name}) at lengths {lengths}: {n:,} windows ({how}), loss on the last {last} tokens of each, "
            f"{n * sum(warm_state + L for L in lengths):,} tokens to read"
        )

        def keep(r: LengthResult, label: str = label, path: str = path) -> None:
            """Each length as it finishes, into the JSON: an interrupted eval keeps what it finished."""
            if not math.isfinite(r.loss):
                kept = f"{path_out} keeps the results before it" if results else "nothing written"
                raise RecurformerError(
                    f"{path} gives non-finite logits (loss {r.loss} at length {r.length}) although its weights load; {kept}"
                )
            results[label] = [*results.get(label, []), r]
            save_json(results, path_out, meta or {}, complete=False)
            log(
                f"  L={r.length:>6}: loss {r.loss:.4f} [{r.loss_low:.4f}, {r.loss_high:.4f}]  acc {r.accuracy:.3f}  "
                f"{r.windows} windows, bootstrap over {r.units} {r.unit}  {r.tokens_per_s:,.0f} tok/s  peak {memory_kind(dev)} {r.peak_memory_mb:,.0f} MB"
            )

        progress = Progress(n * len(lengths), label, "window", log)
        try:
            with out_of_memory(*eval_sizes(label, model, batch_size, chunk, lengths, style)):
                evaluate_lengths(
                    model,
                    tokens,
                    lengths,
                    last,
                    windows,
                    chunk,
                    warm_state,
                    batch_size,
                    context,
                    tok.bos_id if tok is not None else None,
                    style=style,
                    progress=progress.update,
                    done=keep,
                )
        except BaseException as e:  # Ctrl-C, a scheduler's SIGTERM, a failure
            if results and not isinstance(e, RecurformerError):
                log(f'stopped: {path_out} keeps the lengths finished so far ("complete": false)')
            raise
        finally:
            progress.close()
        trained[label] = config.get("train", {}).get("seq_len")
    log("")
    log(markdown_table(results))
    save_json(results, path_out, meta or {})
    png = path_out.with_suffix(".png")
    plot(results, png, f"loss on the last {last} tokens (nats/token, lower is better)", last, trained, warm_state)
    log(f"wrote {path_out} and {png}")
    return results


def probe_checkpoints(
    checkpoints: Sequence[str],
    out: str | Path | None = None,
    *,
    task: str = "repeat",
    dataset: str | None = None,
    text: list[str] | None = None,
    docs: int = 500,
    passage: int = 128,
    distances: Sequence[int] = (1, 4, 16, 64, 256, 1024),
    span: int = 32,
    warm: tuple[int, int] = (32, 288),
    chunk: int = 256,
    batch_size: int = 16,
    precision: str = "fp32",
    seed: int = 0,
    device: str = "auto",
    meta: dict[str, Any] | None = None,
    log: Callable[[str], object] = print,
    style: str = "python",
) -> list[ProbeResult]:
    """``recurformer probe``: the copy or swap probe of each checkpoint on the same documents
    (``dataset`` defaults to ``tinystories-repeat`` for ``repeat``, else the checkpoint's own);
    logs the tables, writes ``out`` (JSON with ``meta``; default ``probe.json`` in the first
    checkpoint's run directory) and its PNG plot; progress as a bar on a terminal, as lines in a log."""
    from .checkpoint import resolve
    from .device import pick_device, slow_bf16_warning
    from .files import atomic_write, check_writable
    from .hub import load_model
    from .loggers import Progress
    from .probe import (
        METRICS,
        make_samples,
        markdown_tables,
        plot,
        probe_model,
        receptive_field,
        run_facts,
        text_sha256,
        to_json,
    )

    check_probe(task, docs=docs, passage=passage, span=span, chunk=chunk, batch_size=batch_size, warm=warm, style=style)
    path_out = default_output(out, checkpoints[0], "probe.json")
    check_writable(path_out, "--json file" if style == "cli" else "out file")  # before the work, not after it
    check_writable(path_out.with_suffix(".png"), "plot")
    dev = pick_device(device)
    if warning := slow_bf16_warning(precision, dev):
        print(warning, file=sys.stderr)
    dataset = dataset if (dataset or text) else ("tinystories-repeat" if task == "repeat" else None)
    results = []
    for path, label in zip(checkpoints, eval_labels(checkpoints)):
        model, name, tok, config = load_model(path, dev)
        if tok is None:
            raise RecurformerError(f"checkpoint {path} has no tokenizer.json, so it cannot read text")
        if dataset is None and not text:
            dataset = config.get("data", {}).get("dataset")
            if not dataset:
                raise RecurformerError(
                    f"checkpoint {path} does not name a bundled dataset; give {option_name('dataset', style)} or {option_name('text', style)}"
                )
        samples = make_samples(
            tok,
            task,
            dataset,
            text,
            model.config.vocab_size,
            docs=docs,
            passage=passage,
            distances=list(distances),
            span=span,
            warm=warm,
            seed=seed,
        )
        R = receptive_field(model)
        log(
            f"probing {label} ({name}, receptive field {'unbounded' if R is None else R}) on {len(samples)} documents, task {task}"
        )
        rows = sum(len(s.rows) for s in samples)
        progress = Progress(rows, label, "row", log)
        try:
            metrics = probe_model(model, samples, METRICS[task], chunk, batch_size, precision, seed, progress.update)
        finally:
            progress.close()
        facts = run_facts(resolve(path))
        results.append(ProbeResult(label, str(resolve(path)), name, R, metrics=metrics, **facts))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    log("")
    log(markdown_tables(results))
    meta = (meta or {}) | {"dataset_used": dataset, "text_sha256": text_sha256(text)}
    atomic_write(path_out, lambda p: p.write_text(json.dumps(to_json(results, meta), indent=2) + "\n"))
    png = path_out.with_suffix(".png")
    atomic_write(png, lambda p: plot(results, p, f"{task} probe"))
    log(f"wrote {path_out} and {png}")
    return results


def merge_probes(
    files: Sequence[str | Path], out: str | Path | None = None, log: Callable[[str], object] = print
) -> list[ProbeResult]:
    """``recurformer probe --merge``: one table, JSON and plot (``out``, default
    ``probe-merged.json`` beside the first file) from earlier probe results run with the same
    documents and settings."""
    from .files import atomic_write, check_writable
    from .probe import markdown_tables, merge, plot, to_json

    path_out = Path(out) if out else Path(files[0]).with_name("probe-merged.json")
    check_writable(path_out, "output file")
    check_writable(path_out.with_suffix(".png"), "plot")
    results, meta = merge([Path(f) for f in files])
    log(markdown_tables(results))
    atomic_write(path_out, lambda p: p.write_text(json.dumps(to_json(results, meta), indent=2) + "\n"))
    atomic_write(path_out.with_suffix(".png"), lambda p: plot(results, p, f"{meta['task']} probe"))
    log(f"wrote {path_out} and {path_out.with_suffix('.png')}")
    return results


@cpu_threads()
def niah_checkpoint(
    checkpoint: str | Path,
    lengths: Sequence[int] = (256, 512, 1024, 2048),
    depths: Sequence[float] = (0, 25, 50, 75, 100),
    out: str | Path | None = None,
    *,
    trials: int = 4,
    chunk: int = 256,
    text: list[str] | None = None,
    via: str = "recurformer",
    seed: int = 0,
    device: str = "auto",
    log: Callable[[str], object] = print,
) -> list[Cell]:
    """``recurformer niah``: needle in a haystack over depths x lengths for a checkpoint, read by
    recurformer or (``via="transformers"``) through ``AutoModelForCausalLM``; logs the table and
    writes ``out`` (JSON; default ``niah.json`` in the checkpoint's run directory) and its heatmap PNG."""
    from .device import pick_device
    from .files import check_writable
    from .niah import niah, save, table

    path_out = default_output(out, checkpoint, "niah.json")
    check_writable(path_out, "output JSON")
    check_writable(path_out.with_suffix(".png"), "heatmap")
    dev = pick_device(device)
    model: Any
    if via == "transformers":
        from .hf import RecurformerForCausalLM

        _, tok = load(checkpoint)
        model = RecurformerForCausalLM.from_pretrained(checkpoint).to(dev)
    else:
        model, tok = load(checkpoint, str(dev))
    if tok is None:
        raise RecurformerError(f"{checkpoint} has no tokenizer.json: the haystack is text")
    cells = niah(model, tok, lengths, depths, trials, chunk, text, seed)
    log(table(cells))
    meta = {
        "checkpoint": str(checkpoint),
        "via": via,
        "trials": trials,
        "chunk": chunk,
        "seed": seed,
        "haystack": text or "bundled books (val)",
        "label": Path(checkpoint).name,
    }
    save(cells, path_out, meta)
    log(f"wrote {path_out} and {path_out.with_suffix('.png')}")
    return cells


@cpu_threads()
def readout_checkpoint(
    checkpoint: str | Path,
    *,
    task: str | None = None,
    task_values: dict[str, Any] | None = None,
    segment: int | None = None,
    segments: int = 4,
    rows: int = 16,
    seed: int = 0,
    out: str | Path | None = None,
    log: Callable[[str], object] = print,
    style: str = "python",
) -> Readout:
    """``recurformer readout``: does a model read its memory, and does a later loss reach it
    (``readout.readout``) on ``rows`` rows of a synthetic ``task`` (with ``task_values``) or of the
    checkpoint's validation text; logs the table, writes ``out`` (JSON) when given."""
    from .data import eval_windows
    from .data.synthetic import get_task, make_split
    from .evaluate import eval_tokens
    from .files import atomic_write, check_writable
    from .hub import from_pretrained
    from .readout import default_segment, readout, table

    check_options(style, segments=segments, rows=rows, segment=segment)
    if out:
        check_writable(Path(out), "--json file" if style == "cli" else "out file")
    model, tok, config = from_pretrained(checkpoint)
    segment = segment or default_segment(model)
    need = (segments + 1) * segment
    if task:
        params = get_task(task).params(task_values or {})
        if int(params["vocab_size"]) != model.config.vocab_size:
            raise RecurformerError(
                f"task {task} has vocab_size {params['vocab_size']}, the model {model.config.vocab_size}; set task.vocab_size"
            )
        data = make_split(task, rows, seed, params)
        x, y = data.inputs, data.targets
        if x.shape[1] < need:
            raise RecurformerError(
                f"task rows have {x.shape[1]} tokens, the read-out needs {need} ({segments + 1} segments of {segment}); lengthen the task"
            )
    else:
        w = eval_windows(eval_tokens(tok, config), need, rows, seed=seed)
        x, y = w[:, :-1], w[:, 1:]
    r = readout(model, x, y, segment, segments)
    log(f"{checkpoint}: {type(model).__name__}, {x.shape[0]} rows of {x.shape[1]} tokens")
    log(table(r, [layer.kind for layer in model.layers]))
    if out:
        atomic_write(Path(out), lambda p: p.write_text(json.dumps(r.to_json(), indent=2) + "\n"))
        log(f"wrote {out}")
    return r


def export(
    checkpoint: str | Path,
    out: str | Path,
    push_to_hub: str | None = None,
    *,
    overwrite: bool = False,
    style: str = "python",
) -> Path:
    """A run or checkpoint -> a pretrained directory (weights, config, tokenizer, model card),
    uploaded to the Hub repo ``push_to_hub`` when given. ``out`` never holds a run; anything there
    but an earlier export of the same run is replaced only with ``overwrite`` (``hub.claim_export_dir``)."""
    from . import hub

    path = hub.export(checkpoint, out, overwrite, style)
    if push_to_hub:
        hub.upload(path, push_to_hub)
    return path
