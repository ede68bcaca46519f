"""The ``recurformer`` command line: ``info``, ``prepare``, ``train``, ``eval``, ``generate``, ``synth``, ``probe``,
``readout``, ``niah``, ``export``, ``lm-eval``.

Every user error (bad config key, missing file, wrong checkpoint, ...) is printed as one line
``recurformer: error: ...`` with exit code 2, never as a traceback. SIGINT and SIGTERM stop with
exit code 128 + the signal number (``train`` first saves a checkpoint); a closed output pipe
(``| head``) ends the command quietly."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from .config import RecurformerError, parse_overrides


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value (repeatable)"
    )


def cmd_info(args: argparse.Namespace) -> None:
    from .config import load_yaml, merge
    from .models import build_model
    from .train import merge_config

    over = parse_overrides(args.set)  # "dim=288" and "model.dim=288" both accepted
    values = merge(over.pop("model", {}), over)
    if args.model:
        values.setdefault("name", args.model)
    if args.config:  # the model a run of this config trains (its per_model entry included)
        values = dict(merge_config(load_yaml(args.config), {"model": values}).get("model", {}))
    name = values.pop("name", None)
    if not name:
        raise RecurformerError("give --model NAME (or a --config with model.name)")
    model = build_model(name, values)
    if args.config:
        print(f"model: {name}, the model section of {args.config}" + (" with --set overrides" if args.set else ""))
    else:
        print(
            f"model: {name}, its defaults (the size of its paper)"
            + (" with --set overrides" if args.set else "")
            + "; --config tinystories-cpu shows the model the bundled default run trains"
        )
    for k, v in vars(model.config).items():
        print(f"  {k}: {v}")
    n = model.num_params()
    print(
        f"parameters: {n:,} ({n / 1e6:.2f}M; token embedding {model.tok_emb.weight.numel():,}, tied with the output head)"
    )
    for group, count in model.param_groups().items():
        print(f"  {group}: {count:,}")
    for line in model.info_lines():
        print(line)
    print(state_size_line(model))


def state_size_line(model) -> str:  # type: ignore[no-untyped-def]
    """The state's size per batch row, measured (``statesize.measure``)."""
    from .statesize import measure

    size = measure(model)
    if not size.bounded:
        return f"state size per row (measured): grows with the text, {size.numbers:,} numbers after {size.after:,} tokens ({size.per_token:,.0f} per token)"
    return (
        f"state size per row (measured): {size.numbers:,} numbers ({4 * size.numbers / 2**20:.2f} MiB at fp32), the same at any length "
        f"(measured after {size.after - size.period:,} and {size.after:,} tokens, past every layer's reach)"
    )


def cmd_prepare(args: argparse.Namespace) -> None:
    from .config import check_options
    from .data import prepare
    from .train import DataConfig

    if not args.dataset and not args.text:
        raise RecurformerError("give --dataset NAME or --text FILE ...")
    if args.tokenizer == "bpe":
        check_options("cli", vocab_size=args.vocab_size)
    dc = DataConfig(
        dataset=args.dataset,
        text_files=args.text or [],
        text_field=args.text_field,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
    )
    out = args.out or dc.resolved_dir()  # where `train` with the same data section looks
    meta = prepare(
        out,
        dataset=args.dataset,
        text_files=args.text or None,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        text_field=args.text_field,
    )
    print(f"prepared {out}: " + ", ".join(f"{k}={v}" for k, v in meta.items() if not isinstance(v, (dict, list))))


def cmd_train(args: argparse.Namespace) -> None:
    from .api import train

    if not args.config and not args.resume:
        raise RecurformerError("give --config FILE (see configs/) or --resume DIR")
    sets = (
        args.set
        + (["train.compile=true"] if args.compile else [])
        + ([f"train.device={args.device}"] if args.device else [])
        + ([f"data.text_field={args.text_field}"] if args.text_field else [])
    )
    last = train(
        args.config, resume=args.resume, overwrite=args.overwrite, style="cli", **parse_overrides(sets)
    ).metrics
    if last:  # the run's mean speed first; the last log interval's rate named as such
        names = {"tok_per_s": "last_interval_tok_per_s"}
        last = {k: last[k] for k in ("step", "loss", "val_loss", "mean_tok_per_s", "mfu") if k in last} | last
        print(
            "done: "
            + ", ".join(
                f"{names.get(k, k)}={v:.4g}" if isinstance(v, float) else f"{names.get(k, k)}={v}"
                for k, v in last.items()
            )
        )


def cmd_eval(args: argparse.Namespace) -> None:
    from .api import evaluate_checkpoints

    try:
        lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        raise RecurformerError(f"--lengths must be comma-separated integers, got '{args.lengths}'") from None
    if not lengths or min(lengths) < 1:
        raise RecurformerError(f"--lengths must be positive integers, got '{args.lengths}'")
    evaluate_checkpoints(
        args.checkpoint,
        lengths,
        args.json,
        last=args.last,
        windows=args.windows,
        chunk=args.chunk,
        warm_state=args.warm_state,
        batch_size=args.batch_size,
        context=args.context,
        window=args.window,
        data=args.data,
        dataset=args.dataset,
        text=args.text,
        device=args.device,
        meta={k: v for k, v in vars(args).items() if k != "func"},
        style="cli",
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from .api import generate_text

    g = generate_text(
        args.checkpoint,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_at_eos=args.stop_at_eos,
        load_state=args.load_state,
        save_state=args.save_state,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
        on_text=lambda t: print(t, end="", flush=True),
        note=lambda t: print(t, file=sys.stderr),
        style="cli",
    )
    print()
    if args.stats:
        print(
            f"[{g.tokens} tokens in {g.seconds:.2f}s: {g.tokens / max(g.seconds, 1e-9):,.1f} tok/s, "
            f"peak {g.memory_kind} {g.peak_memory_mb:,.0f} MB]",
            file=sys.stderr,
        )


def cmd_synth(args: argparse.Namespace) -> None:
    from .config import load_yaml, merge
    from .data.synthetic import TASKS
    from .files import atomic_write_text, check_writable
    from .synth import result_dict, run_synth, split_overrides, summary, synth_config

    if args.json:
        check_writable(Path(args.json), "--json file")  # before training, not after it
    if args.evaluate:
        return synth_evaluate(args)
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
    r = run_synth(
        task,
        model,
        model_over,
        task_over,
        synth_config(synth_over),
        log=print,
        device=args.device,
        progress=sys.stderr.isatty(),
        save=args.save,
    )
    print(summary(r))
    if args.json:
        atomic_write_text(args.json, json.dumps(result_dict(r), indent=2) + "\n")
        print(f"wrote {args.json}")


def synth_evaluate(args: argparse.Namespace) -> None:
    """``synth --evaluate DIR --lengths ...``: a model saved by ``synth --save`` scored at more lengths."""
    import dataclasses

    from .device import pick_device
    from .files import atomic_write_text
    from .hub import load_model
    from .synth import score_lengths, split_overrides, synth_config

    if not args.lengths:
        raise RecurformerError("synth --evaluate needs --lengths, e.g. --lengths 128,256,512")
    lengths = _int_list(args.lengths, "--lengths")
    model_over, task_over, synth_over = split_overrides(args.set)
    if model_over:
        raise RecurformerError(
            f"synth --evaluate reads the saved model as it is; --set {next(iter(model_over))}=... does not apply"
        )
    model, name, _, saved = load_model(args.evaluate, pick_device(args.device))
    params = dict(saved.get("task") or {})
    task = params.pop("name", None)
    if task is None:
        raise RecurformerError(f"{args.evaluate} holds no synthetic task (task.name): not saved by synth --save")
    params.update(task_over)
    rows = args.n_test or 128
    scores = score_lengths(model, task, params, lengths, rows, synth_config(synth_over))
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


def cmd_niah(args: argparse.Namespace) -> None:
    from .api import niah_checkpoint

    lengths, depths = _int_list(args.lengths, "--lengths"), _float_list(args.depths, "--depths")
    niah_checkpoint(
        args.checkpoint,
        lengths,
        depths,
        args.json,
        trials=args.trials,
        chunk=args.chunk,
        text=args.text,
        via=args.via,
        seed=args.seed,
        device=args.device,
    )


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise RecurformerError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise RecurformerError(f"{flag} must be positive integers, got {text!r}")
    return out


def _float_list(text: str, flag: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise RecurformerError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def cmd_export(args: argparse.Namespace) -> None:
    from .api import export

    if args.format == "transformers":
        if args.push_to_hub:
            raise RecurformerError(
                "--push-to-hub goes with --format recurformer; upload a transformers directory with `hf upload`"
            )
        from .hf import export as export_transformers

        out = export_transformers(args.checkpoint, args.out, args.overwrite, style="cli")
    else:
        out = export(args.checkpoint, args.out, args.push_to_hub, overwrite=args.overwrite, style="cli")
    print(
        f"wrote {out} ("
        + ", ".join(sorted(f.name for f in out.iterdir()))
        + ")"
        + (f"; uploaded to {args.push_to_hub}" if args.push_to_hub else "")
    )


def cmd_probe(args: argparse.Namespace) -> None:
    from .api import merge_probes, probe_checkpoints

    if args.merge:
        merge_probes(args.merge, args.json)
        return
    try:
        distances = [int(x) for x in args.distances.split(",") if x.strip()]
    except ValueError:
        raise RecurformerError(f"--distances must be comma-separated integers, got '{args.distances}'") from None
    probe_checkpoints(
        args.checkpoint,
        args.json,
        task=args.task,
        dataset=args.dataset,
        text=args.text,
        docs=args.docs,
        passage=args.passage,
        distances=distances,
        span=args.span,
        warm=(args.warm_min, args.warm_max),
        chunk=args.chunk,
        batch_size=args.batch_size,
        precision=args.precision,
        seed=args.seed,
        device=args.device,
        meta={k: v for k, v in vars(args).items() if k != "func"},
        style="cli",
    )


def cmd_readout(args: argparse.Namespace) -> None:
    from .api import readout_checkpoint
    from .synth import split_overrides

    _, task_values, _ = split_overrides(args.set) if args.task else ({}, {}, {})
    readout_checkpoint(
        args.checkpoint,
        task=args.task,
        task_values=task_values,
        segment=args.segment,
        segments=args.segments,
        rows=args.rows,
        seed=args.seed,
        out=args.json,
        style="cli",
    )


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "info": cmd_info,
    "prepare": cmd_prepare,
    "train": cmd_train,
    "eval": cmd_eval,
    "generate": cmd_generate,
    "synth": cmd_synth,
    "probe": cmd_probe,
    "readout": cmd_readout,
    "niah": cmd_niah,
    "export": cmd_export,
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .evaluate import DEFAULT_WINDOWS
    from .models import model_names
    from .probe import TASKS as PROBE_TASKS

    summary = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "")  # the docstring's first paragraph
    ap = argparse.ArgumentParser(prog="recurformer", description=summary)
    ap.add_argument("--version", action="version", version=f"recurformer {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", formatter_class=_Help, help="print a model's configuration and parameter counts")
    p.add_argument("--model", help=f"one of: {', '.join(model_names())}")
    p.add_argument("--config", help="a YAML config file (its model section is used)")
    _add_set(p)

    p = sub.add_parser("prepare", formatter_class=_Help, help="tokenize a corpus into train/val token files")
    p.add_argument(
        "--dataset",
        help="tinystories-sample, tinystories-repeat, tinystories-cased, warpeace, books, tinystories (hub)",
    )
    p.add_argument(
        "--text",
        nargs="+",
        metavar="FILE",
        help="your own corpus instead of a dataset: text files, JSONL, "
        "Parquet or datasets directories (save_to_disk), streamed",
    )
    p.add_argument(
        "--text-field", default="text", help="the field / column holding the text in JSONL, Parquet and datasets inputs"
    )
    p.add_argument(
        "--tokenizer",
        choices=["bpe", "byte"],
        default="bpe",
        help="byte-level BPE (learned on the train split) or raw bytes",
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, special tokens included")
    p.add_argument("--out", help="output directory (default: prepared/<dataset>-<tokenizer><vocab>)")

    p = sub.add_parser("train", formatter_class=_Help, help="train a model (stateful TBPTT) from a YAML config")
    p.add_argument("--config", help="YAML file with model/data/train sections (see configs/)")
    p.add_argument(
        "--resume",
        help="a run or checkpoint directory to continue exactly (written into that run "
        "directory unless --set train.out_dir=... is given)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in train.out_dir (or, with --resume of an "
        "older checkpoint, delete the run's later checkpoints)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every layer (regional compilation; same as --set train.compile=true)",
    )
    p.add_argument(
        "--device", help="auto (CUDA when present; the default), cpu, cuda or cuda:N (same as --set train.device=...)"
    )
    p.add_argument(
        "--text-field",
        help="the field / column holding the text in JSONL, Parquet and datasets inputs of data.text_files, as for "
        "prepare (same as --set data.text_field=...; default: text)",
    )
    _add_set(p)

    p = sub.add_parser(
        "eval",
        formatter_class=_Help,
        help="length-extrapolation evaluation (loss on the last tokens at several lengths)",
    )
    p.add_argument(
        "--checkpoint", nargs="+", required=True, help="run or checkpoint directories (one line each in the plot)"
    )
    p.add_argument("--lengths", default="256,512,1024,2048,4096", help="comma-separated window lengths L")
    p.add_argument("--last", type=int, default=256, help="score only the last N tokens of each window")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--windows",
        type=int,
        default=DEFAULT_WINDOWS,
        help="windows per length, evenly spaced over the evaluation text (a quick, deterministic look)",
    )
    which.add_argument(
        "--all",
        dest="windows",
        action="store_const",
        const=None,
        help="every window, so the scored blocks tile the whole text after the first --context tokens "
        "(the default run's val split: 743 windows, longer than its training)",
    )
    p.add_argument("--chunk", type=int, default=256, help="tokens per model call (the state carries the rest)")
    p.add_argument("--batch-size", type=int, default=8, help="windows read side by side")
    p.add_argument("--warm-state", type=int, default=0, metavar="N", help="read N tokens before each window, unscored")
    p.add_argument("--window", type=int, help="evaluate a dense model with a sliding-window mask of this size")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="a prepared dataset directory (default: the checkpoint's own)")
    src.add_argument("--dataset", help="a bundled dataset's val split, encoded with the checkpoint's tokenizer")
    src.add_argument("--text", nargs="+", help="text files, encoded with the checkpoint's tokenizer")
    p.add_argument(
        "--context",
        type=int,
        help="windows end where this many tokens fit before them (default: warm-up + the "
        "longest length); give the same value to compare runs with different lengths on the same tokens",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument(
        "--json",
        metavar="FILE",
        help="output JSON, a PNG plot beside it (default: eval.json in the first checkpoint's run directory)",
    )

    p = sub.add_parser("generate", formatter_class=_Help, help="stream text from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="a run, checkpoint or pretrained directory, or a Hub repo id")
    p.add_argument("--prompt", default="", help="text to continue (lower-cased for a lower-case tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens only (default: all)")
    p.add_argument(
        "--top-p",
        type=float,
        help="sample from the smallest set of tokens whose probability reaches p, in (0, 1] (default: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--stop-at-eos", action=argparse.BooleanOptionalAction, default=True, help="stop at the end of a document"
    )
    p.add_argument("--save-state", metavar="FILE", help="save the generation state (safetensors) to continue later")
    p.add_argument("--load-state", metavar="FILE", help="continue a saved generation (the prompt is appended)")
    p.add_argument("--stats", action="store_true", help="print tokens/s and peak memory")
    p.add_argument(
        "--cuda-graphs", action="store_true", help="decode each new token through a captured CUDA graph (a CUDA GPU)"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")

    from .data.synthetic import TASKS

    p = sub.add_parser(
        "synth",
        formatter_class=_Help,
        help="train a small model on a synthetic diagnostic task and report its accuracy",
    )
    p.add_argument(
        "--task",
        choices=sorted(TASKS),
        help="the diagnostic task (MAD tasks, copy, delayed copy, passkey); or task.name in a --config",
    )
    p.add_argument("--model", help=f"one of: {', '.join(model_names())}; or model.name in a --config")
    p.add_argument(
        "--config",
        action="append",
        metavar="FILE",
        help="YAML with model/task/synth sections (repeatable; --set wins); a config that names its task and "
        "model (task.name, model.name) is a whole experiment: `recurformer synth --config FILE`",
    )
    _add_set(p)
    p.add_argument("--steps", type=int, help="optimizer steps per learning rate (default 500)")
    p.add_argument("--lrs", help="comma-separated learning rates to sweep (default 5e-4,1e-3,3e-3)")
    p.add_argument("--n-train", type=int, help="training examples (default: the task's MAD baseline)")
    p.add_argument("--n-test", type=int, help="test examples (default 1280)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--json", help="write the full result as JSON here")
    p.add_argument(
        "--save", metavar="DIR", help="save the selected model (pretrained layout) for `recurformer readout`"
    )
    p.add_argument(
        "--evaluate",
        metavar="DIR",
        help="instead of training, score a model saved by --save on its task at --lengths (--n-test rows each, default 128)",
    )
    p.add_argument("--lengths", help="with --evaluate: comma-separated task lengths, e.g. 128,256,512")

    p = sub.add_parser(
        "readout",
        formatter_class=_Help,
        help="does a model read its memory, and does a later loss reach it: attention share and gradient norms",
    )
    p.add_argument(
        "--checkpoint", required=True, help="a run, checkpoint or pretrained directory (e.g. from synth --save)"
    )
    p.add_argument("--task", help="read synthetic task rows (see synth) instead of the checkpoint's validation text")
    _add_set(p)
    p.add_argument(
        "--segment", type=int, help="tokens per segment (default: the model's chunk / segment / block length)"
    )
    p.add_argument(
        "--segments", type=int, default=4, help="K: gradient norms from the losses of segments 1..K (default 4)"
    )
    p.add_argument("--rows", type=int, default=16, help="rows to read (default 16)")
    p.add_argument("--seed", type=int, default=0, help="which rows are read")
    p.add_argument("--json", help="write the read-out as JSON here")

    p = sub.add_parser(
        "probe",
        formatter_class=_Help,
        help="how far back the state carries information: copy and swap probes with bootstrap intervals",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", nargs="+", help="run or checkpoint directories (one line each in the plot)")
    what.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="instead: one table, JSON and plot from earlier probe results run with the same documents and settings",
    )
    p.add_argument(
        "--task",
        default="repeat",
        metavar="{" + ",".join(PROBE_TASKS) + "}",  # checked in cmd_probe: one line
        help="repeat (copy: s1, marker, s2 = s1) or swap (replace the history older than d)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--dataset",
        help="a bundled dataset's val split (default: tinystories-repeat for repeat, the checkpoint's own for swap)",
    )
    src.add_argument(
        "--text", nargs="+", metavar="FILE", help="UTF-8 text files, encoded with the checkpoint's tokenizer"
    )
    p.add_argument("--docs", type=int, default=500, help="documents (the bootstrap resamples these)")
    p.add_argument(
        "--passage", type=int, default=128, help="repeat on a corpus other than tinystories-repeat: passage length n"
    )
    p.add_argument(
        "--distances", default="1,4,16,64,256,1024", help="swap: replace the history older than each of these"
    )
    p.add_argument("--span", type=int, default=32, help="swap: target tokens scored after the history")
    p.add_argument(
        "--warm-min",
        type=int,
        default=32,
        help="fewest tokens of stream text read before each document (a random "
        "prefix length between --warm-min and --warm-max varies the chunk phases)",
    )
    p.add_argument("--warm-max", type=int, default=288, help="most tokens of stream text read before each document")
    p.add_argument("--chunk", type=int, default=256, help="tokens per model call (the state carries the rest)")
    p.add_argument("--batch-size", type=int, default=16, help="documents read side by side")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: CPU/CUDA autocast")
    p.add_argument("--seed", type=int, default=0, help="which documents and warm-up prefixes, and the bootstrap")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument(
        "--json",
        metavar="FILE",
        help="output JSON, a PNG plot beside it (default: probe.json in the first "
        "checkpoint's run directory; with --merge, probe-merged.json beside the first merged file)",
    )
    p = sub.add_parser(
        "niah",
        formatter_class=_Help,
        help="needle in a haystack: a passkey at depth d%% of a context of length L, retrieved at the end "
        "(exact match and answer log-likelihood; a depth x length heatmap)",
    )
    p.add_argument("--checkpoint", required=True, help="a run, checkpoint or pretrained directory")
    p.add_argument("--lengths", default="256,512,1024,2048", help="context lengths in tokens")
    p.add_argument("--depths", default="0,25,50,75,100", help="needle depths in percent of the haystack")
    p.add_argument("--trials", type=int, default=4, help="prompts per cell (random passkeys and haystack offsets)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per model call (the state carries the rest)")
    p.add_argument(
        "--text", nargs="+", metavar="FILE", help="haystack text files (default: the bundled books, val split)"
    )
    p.add_argument(
        "--via",
        choices=["recurformer", "transformers"],
        default="recurformer",
        help="transformers: load and run the model through AutoModelForCausalLM (needs recurformer[hf])",
    )
    p.add_argument("--seed", type=int, default=0, help="passkeys and haystack offsets")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument(
        "--json", help="output JSON, the heatmap PNG beside it (default: niah.json in the checkpoint's run directory)"
    )
    p = sub.add_parser(
        "lm-eval",
        add_help=False,
        help="EleutherAI's lm-evaluation-harness with the 'recurformer' model "
        "(needs recurformer[eval]); every argument is lm-eval's own, e.g. --model_args pretrained=DIR --tasks NAME",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's own arguments")
    p = sub.add_parser(
        "export", formatter_class=_Help, help="write a run's checkpoint in Hugging Face Hub layout with a model card"
    )
    p.add_argument("--checkpoint", required=True, help="a run or checkpoint directory")
    p.add_argument(
        "--out",
        required=True,
        help="the directory to write (model.safetensors, config.json, tokenizer.json, README.md)",
    )
    p.add_argument(
        "--push-to-hub", metavar="REPO_ID", help="also upload it to this Hub repo (needs a network and a token)"
    )
    p.add_argument(
        "--format",
        choices=["recurformer", "transformers"],
        default="recurformer",
        help="transformers: also readable by AutoModelForCausalLM / AutoTokenizer (needs recurformer[hf])",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into --out although it holds other files or another run's export (never a run: refused)",
    )
    return ap


def _run_lm_eval(argv: list[str]) -> int:
    """``recurformer lm-eval ARGS``: lm-eval's command line with the ``recurformer`` model type."""
    try:
        from .lm_eval import launch

        launch(argv)
    except RecurformerError as e:
        print(f"recurformer: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # lm-eval's argparse and its own exits
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it has one (not None, not a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        empty = action.default is None or action.default is False or action.default in ("", [], argparse.SUPPRESS)
        if empty or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


class _Terminated(BaseException):
    """SIGTERM outside training: unwinds like Ctrl-C, so temporary files are removed."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    from .train import TrainingInterrupted

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # every argument is lm-eval's own: no parsing here
        return _run_lm_eval(argv[1:])
    if isinstance(sys.stdout, io.TextIOWrapper):  # into a log or a pipe line by line, not all at the end
        sys.stdout.reconfigure(line_buffering=True)
    ap = build_parser()
    args = ap.parse_args(argv)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        COMMANDS[args.command](args)
    except RecurformerError as e:
        print(f"recurformer: error: {e}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        print(f"recurformer: {e}", file=sys.stderr)
        return 128 + e.signum
    except (KeyboardInterrupt, _Terminated) as e:
        print("recurformer: interrupted", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(e, _Terminated) else getattr(e, "signum", signal.SIGINT))
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as `cat` does
        with contextlib.suppress(OSError, ValueError):  # no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
