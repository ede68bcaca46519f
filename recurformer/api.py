"""The Python API: what the command line does, callable without a subprocess.

    import recurformer

    run = recurformer.train("tinystories-cpu", {"train.steps": 50, "train.out_dir": "runs/short"})  # or train={...}
    model, tok = recurformer.load(run.checkpoint)                      # or a pretrained dir / Hub id
    results = recurformer.evaluate(model, tok, dataset="tinystories-sample", lengths=[256, 1024])
    probed = recurformer.probe(model, tok, task="repeat", docs=50)
    recurformer.export(run.dir, "my-model")                            # Hub layout + model card
    generate_text(run.dir, "Once upon a time")                         # recurformer generate

Every function raises ``RecurformerError`` (a one-line message) on bad input, as the CLI does,
naming the options as Python keywords (``config.opt``; the command line names its flags);
running out of memory in training, evaluation or generation is such a message too, naming the
sizes that failed and what to lower."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch

from .config import RecurformerError, make_options, merge, opt, option, suggest
from .data import Tokenizer
from .device import cpu_threads, graphs_or_eager
from .evaluate.lengths import LengthOptions, evaluate_options
from .evaluate.results import LengthResult
from .nn import StreamingLM
from .probe.results import ProbeResult


@dataclass
class Run:
    """A finished (or stopped) training run."""

    dir: Path  # the run directory: metrics.jsonl, step_XXXXXX/ checkpoints
    checkpoint: Path | None  # the last checkpoint written (None if none was)
    metrics: dict[str, Any]  # the last logged metrics: step, loss, val_loss, tokens, ...
    model: StreamingLM  # the trained model, in eval mode
    tokenizer: Tokenizer
    config: dict[str, Any] = field(default_factory=dict)  # the full run config as saved


def _sections() -> dict[str, set[str] | None]:
    """The sections an override may name, each with its keys (None: any key; ``per_model``'s are
    model names and the model's keys depend on the model, which its own check names)."""
    from .data import DataConfig
    from .models import model_names
    from .registry import config_keys
    from .training.config import TrainConfig

    models = {k for name in model_names() for k in config_keys(name)} | {"name"}
    train, data = ({f.name for f in dataclasses.fields(c) if f.init} for c in (TrainConfig, DataConfig))
    return {"model": models, "data": data, "train": train, "per_model": None}


def _overrides(given: Mapping[str, Any]) -> dict[str, Any]:
    """``{"train": {"steps": 5}}``, ``{"train.steps": 5}`` (or either as keywords) -> a nested dict
    of config values. A key that names no section, and a section given something else than a dict,
    are one line in the caller's spelling; a section's unknown keys are the config's own check."""
    if not isinstance(given, Mapping):
        raise RecurformerError(
            f'overrides must be a dict of config keys, as {{"train.steps": 20}} or {opt("train.steps", 20)}, '
            f"got {given!r}"
        )
    sections = _sections()
    out: dict[str, Any] = {}
    for key, value in given.items():
        section, *rest = str(key).split(".")
        if section not in sections:
            owners = [s for s, keys in sections.items() if keys and section in keys]
            if owners and not rest:  # a section's key given alone: steps=20
                ways = [opt(f"{o}.{key}", value) for o in owners] + [f'{{"{o}.{key}": {value!r}}}' for o in owners]
                raise RecurformerError(f"'{key}' is a config key, not a section: give it as {' or '.join(ways)}")
            raise RecurformerError(
                f"'{key}' names no config section{suggest(section, list(sections)).replace('keys', 'sections')}; "
                f'override as {opt("train.steps", 20)} or {{"train.steps": 20}}'
            )
        if not rest and not isinstance(value, Mapping):
            raise RecurformerError(
                f'{section} takes a dict of its config keys, as {section}={{"KEY": {value!r}}} or '
                f'{{"{section}.KEY": {value!r}}}; got {value!r}'
            )
        nested: Any = dict(value) if isinstance(value, Mapping) else value
        for part in reversed(rest):
            nested = {part: nested}
        out = merge(out, {section: nested})
    return out


@cpu_threads()
def train(
    config: str | Path | dict[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    resume: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    **sections: Any,
) -> Run:
    """Train as ``recurformer train`` does. ``config``: a YAML path, a bundled config name
    (``"tinystories-cpu"``) or a dict with model/data/train sections. Config values override it
    as a dict of dotted keys, ``train("tinystories-cpu", {"train.steps": 20, "model.dim": 64})``
    (what ``--set`` takes), or as keywords, one dict per section:
    ``train("tinystories-cpu", train={"steps": 20}, model={"dim": 64})``; both may be given (the
    keywords win); the dict may hold sections too (``{"train": {"steps": 20}}``), and dotted keys
    may be keywords (``**{"train.steps": 20}``). ``resume``:
    a run or checkpoint directory to continue exactly (written into that run's directory unless
    ``train.out_dir`` is given); ``overwrite``: replace a run already in ``train.out_dir``."""
    from . import checkpoint as ckpt
    from .training.command import train_main

    resumed = str(resume) if resume is not None else None
    over = merge(_overrides({} if overrides is None else overrides), _overrides(sections))
    trainer, metrics = train_main(config, over, resumed, overwrite, progress)
    try:
        last = ckpt.resolve(trainer.out_dir)
    except RecurformerError:
        last = None
    return Run(trainer.out_dir, last, metrics, trainer.model.eval(), trainer.tokenizer, trainer._config_dict())


def load(dir_or_repo_id: str | Path, device: str = "cpu") -> tuple[StreamingLM, Tokenizer | None]:
    """(model in eval mode, tokenizer or None) from a run, a checkpoint, a pretrained directory
    or a Hub repo id; ``hub.load`` gives its config, name and directory too."""
    from . import hub

    loaded = hub.load(dir_or_repo_id, device)
    return loaded.model, loaded.tokenizer


def _tokens(tokenizer: Tokenizer | None, dataset: str | None, text: Sequence[str | Path] | None) -> np.ndarray:
    """A bundled dataset's val split, or text files, as one token stream (BOS before each document)."""
    from .evaluate.lengths import eval_tokens

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
    **options: Any,
) -> list[LengthResult]:
    """Length extrapolation as ``recurformer eval``: loss (with a 95% bootstrap interval over
    documents) and accuracy on the last ``last`` tokens of windows of each length, on ``tokens``
    or a dataset's val split or text files; ``options``: the fields of
    ``evaluate.lengths.LengthOptions`` (``lengths``, ``last``, ``windows``, ``chunk``, ``batch_size``,
    ``warm_state``, ``context``, ``cuda_graphs``: every aligned chunk read through a CUDA graph, a
    model on a CUDA GPU).
    The windows are deterministic: ``windows`` evenly spaced ones (default ``DEFAULT_WINDOWS``),
    or all of them with ``windows=None`` (the scored blocks tile the text);
    ``evaluate.results.paired_differences`` compares two models' results on the same tokens."""
    o = make_options(LengthOptions, options)  # checked where built (LengthOptions.__post_init__)
    graphs = graphs_or_eager(o.cuda_graphs, model.tok_emb.weight.device, opt("cuda_graphs"), "this model is")
    data = np.asarray(tokens, dtype=np.int64) if tokens is not None else _tokens(tokenizer, dataset, text)
    return evaluate_options("the model", model, data, o, tokenizer.bos_id if tokenizer is not None else None, graphs)


@cpu_threads()
def probe(model: StreamingLM, tokenizer: Tokenizer, *, label: str = "model", **options: Any) -> ProbeResult:
    """The copy (``repeat``) or ``swap`` probe as ``recurformer probe`` (``options``: the fields of
    ``probe.options.ProbeOptions``): per-distance-bin means with bootstrap intervals. ``dataset``
    defaults to ``tinystories-repeat`` for ``repeat``."""
    from .models import model_name
    from .probe.measure import probe_model, receptive_field
    from .probe.options import METRICS, ProbeOptions
    from .probe.samples import samples_for

    o = make_options(ProbeOptions, options)  # checked where built (ProbeOptions.__post_init__)
    dataset = o.dataset
    if dataset is None and not o.text:
        if o.task != "repeat":
            raise RecurformerError("the swap probe needs dataset=NAME or text=[FILE, ...]")
        dataset = "tinystories-repeat"
    samples = samples_for(o, tokenizer, dataset, model.config.vocab_size)
    with torch.no_grad():
        metrics = probe_model(model, samples, METRICS[o.task], o.chunk, o.batch_size, o.precision, o.seed)
    facts = {"step": None, "tokens_seen": None, "val_loss": None, "train_tok_per_s": None}
    return ProbeResult(label, "", model_name(model.config), receptive_field(model), metrics=metrics, **facts)


@dataclass
class ExportOptions:
    """``recurformer export`` (``recurformer.export``): which run, where, in which layout."""

    checkpoint: str = option(None, "a run or checkpoint directory", required=True)
    out: str = option(
        None, "the directory to write (model.safetensors, config.json, tokenizer.json, README.md)", required=True
    )
    push_to_hub: str | None = option(
        None, "also upload it to this Hub repo (needs a network and a token)", metavar="REPO_ID"
    )
    format: Literal["recurformer", "transformers"] = option(
        "recurformer", "transformers: also readable by AutoModelForCausalLM / AutoTokenizer (needs recurformer[hf])"
    )
    overwrite: bool = option(
        False, "write into --out although it holds other files or another run's export (never a run: refused)"
    )


def export(checkpoint: str | Path, out: str | Path, push_to_hub: str | None = None, **options: Any) -> Path:
    """A run or checkpoint -> a pretrained directory (weights, config, tokenizer, model card),
    uploaded to the Hub repo ``push_to_hub`` when given; ``options``: the fields of
    ``ExportOptions`` (``format="transformers"``: also readable by ``AutoModelForCausalLM``,
    ``overwrite``). ``out`` never holds a run; anything there but an earlier export of the same run
    is replaced only with ``overwrite`` (``hub.claim_export_dir``)."""
    from . import hub

    given = {"checkpoint": str(checkpoint), "out": str(out), "push_to_hub": push_to_hub}
    o = make_options(ExportOptions, given | options)
    if o.format == "transformers":
        if o.push_to_hub:
            raise RecurformerError(
                f"{opt('push_to_hub')} goes with {opt('format', 'recurformer')}; upload a transformers "
                "directory with `hf upload`"
            )
        from .hf import export as export_transformers

        return export_transformers(o.checkpoint, o.out, o.overwrite)
    path = export_pretrained(o.checkpoint, o.out, o.overwrite)
    if o.push_to_hub:
        hub.upload(path, o.push_to_hub)
    return path


def export_pretrained(checkpoint: str | Path, out: str | Path, overwrite: bool) -> Path:
    """A run or checkpoint directory -> a pretrained directory with its model card (the results
    row is the run's last logged metrics up to the checkpoint's step). ``out`` must not hold a run,
    nor, unless ``overwrite``, anything but an earlier export of the same run (``hub.claim_export_dir``)."""
    from .checkpoint import train_json
    from .hub import claim_export_dir, load, results_row, run_config_of, save_pretrained, shareable

    loaded = load(checkpoint)
    claim_export_dir(Path(out), shareable(run_config_of(loaded.model, loaded.config)), overwrite)
    state = train_json(loaded.path)
    if state is None:  # not a training checkpoint: no run to take results from
        return save_pretrained(loaded.model, out, loaded.tokenizer, loaded.config)
    results = results_row(loaded.path.parent, state.get("step"))
    return save_pretrained(loaded.model, out, loaded.tokenizer, loaded.config, results)


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
    on_text: Callable[[str], object] | None = None,
    note: Callable[[str], object] = print,
    **options: Any,
) -> Generated:
    """``recurformer generate``: continue ``prompt`` with a checkpoint's model (``options``: the
    fields of ``generate.GenerateOptions``), streaming the text (the prompt first) to ``on_text`` as whole
    characters arrive; ``load_state`` continues a saved generation (the prompt is appended),
    ``save_state`` saves it to continue later; ``cuda_graphs``: each new token sampled and read
    through a captured decoding step, the host reading the tokens every ``decode_block`` of them
    (``capture.DecodeGraphs.sampler``). Running out of memory is one line naming the model,
    the prompt's length and what to lower."""
    from .capture import DecodeGraphs
    from .device import (
        graphs_or_eager,
        memory_kind,
        out_of_memory,
        peak_memory_mb,
        pick_device,
        reset_peak_memory,
        synchronize,
    )
    from .files import check_writable
    from .generate import GenerateOptions, load_session, new_session, save_session, stream
    from .hub import load

    o = make_options(GenerateOptions, {"checkpoint": str(checkpoint), "prompt": prompt, **options})
    if o.save_state:
        check_writable(Path(o.save_state), f"{opt('save_state')} file")  # before generating, not after
    dev = pick_device(o.device)
    graphs = graphs_or_eager(o.cuda_graphs, dev, opt("cuda_graphs"), "this generation runs")
    where = opt("device", "cpu")
    with out_of_memory(
        f"loading {o.checkpoint} onto {dev}", f"the model does not fit there: use another device ({where})"
    ):
        loaded = load(o.checkpoint, dev)
    model, name, tok = loaded.model, loaded.name, loaded.tokenizer
    decode = DecodeGraphs(model, graphs) if graphs else None
    if tok is None:
        raise RecurformerError("this checkpoint has no tokenizer.json, so it cannot read a text prompt")
    prompt = o.prompt
    if tok.lowercase and prompt != prompt.lower():
        note("[this model's tokenizer was learned from lower-case text: the prompt is lower-cased]")
        prompt = prompt.lower()
    ids = ([] if o.load_state else [tok.bos_id]) + tok.encode(prompt)
    doing = (
        f"generating with {name} ({model.num_params():,} parameters) on {dev} from a prompt of {len(ids)} "
        f"tokens, at most {o.max_new_tokens} new ones"
    )
    emit = on_text or (lambda t: None)
    with out_of_memory(doing, f"lower the prompt's length or {opt('max_new_tokens')}"):
        session = load_session(o.load_state, model, name) if o.load_state else new_session(model, 1, o.seed)
        tokens = torch.tensor([ids], dtype=torch.long) if ids else None
        stops = [tok.eos_id, tok.bos_id] if o.stop_at_eos else []
        emit(prompt)
        out: list[int] = []
        shown = ""
        reset_peak_memory(dev)
        t0 = time.perf_counter()
        for step in stream(
            model,
            tokens,
            o.max_new_tokens,
            o.temperature,
            o.top_k,
            o.top_p,
            session=session,
            stop_tokens=stops,
            graphs=decode,
            block=o.decode_block,
            note=note,
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
        if o.save_state:
            save_session(session, o.save_state, name)
            note(f"[saved the generation state to {o.save_state}]")
    return Generated(text, len(out), dt, peak_memory_mb(dev), memory_kind(dev))
