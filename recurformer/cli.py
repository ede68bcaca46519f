"""The ``recurformer`` command line: ``info``, ``prepare``, ``train``, ``eval``, ``generate``, ``synth``, ``probe``,
``readout``, ``niah``, ``export``, ``lm-eval``.

Every user error (bad config key, missing file, wrong checkpoint, ...) is printed as one line
``recurformer: error: ...`` with exit code 2, never as a traceback. SIGINT and SIGTERM stop with
exit code 128 + the signal number (``train`` first saves a checkpoint); a closed output pipe
(``| head``) ends the command quietly."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import signal
import sys
import threading
import typing
from typing import Any, Callable

from .config import RecurformerError, parse_overrides, spell


def add_options(p: argparse.ArgumentParser, cls: type[Any]) -> dict[str, Any]:
    """One flag per field of the options dataclass ``cls`` (``config.option``): ``--name-like-this``
    (or the field's ``flag``), its help, its default; a list of numbers is one comma-separated
    argument, a bool with a True default a ``--x/--no-x`` pair; fields of one ``group`` exclude each
    other (the groups are returned by name, for flags of the command line's own)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        extra = dict(f.metadata.get("cli", {}))
        if not extra.pop("cli", True):
            continue
        default: Any = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": f.metadata.get("help", "")}
        tp = _base(hints[f.name])
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif typing.get_origin(tp) is typing.Literal:
            kw["choices"] = list(typing.get_args(tp))
        elif typing.get_origin(tp) in (list, tuple):
            if "nargs" not in extra and "action" not in extra:  # numbers: one comma-separated argument
                kw["default"] = ",".join(str(v) for v in default) if default is not None else None
        else:
            kw["type"] = tp
        if extra.get("required"):
            kw.pop("default")
        group = extra.pop("group", None)
        if group and group not in groups:
            groups[group] = p.add_mutually_exclusive_group()
        (groups[group] if group else p).add_argument(flag_of(f), **kw | extra)
    return groups


def _base(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    return (
        next((a for a in typing.get_args(tp) if a is not type(None)), tp) if type(None) in typing.get_args(tp) else tp
    )


def options_of(cls: type[Any], args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s fields among the parsed ``args``, comma-separated lists parsed
    (one line naming the flag when one is not a list of numbers)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        tp = _base(hints[f.name])
        if isinstance(value, str) and typing.get_origin(tp) in (list, tuple):
            value = _numbers(value, flag_of(f), typing.get_args(tp)[0], bool(f.metadata.get("bounds")))
        out[f.name] = value
    return out


def _help(cls: type[Any], name: str) -> str:
    """The help of the option field ``name`` of ``cls``, for a flag the command line adds itself."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def flag_of(f: dataclasses.Field) -> str:
    """The command line's flag for the option field ``f``."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _numbers(text: str, flag: str, kind: type, positive: bool) -> list[Any]:
    """``"256,512"`` -> ``[256, 512]``: integers (positive ones where the option has a range) or numbers."""
    what = "integers" if kind is int else "numbers"
    try:
        out = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise RecurformerError(f"{flag} must be comma-separated {what}, got {text!r}") from None
    if positive and (not out or min(out) < 1):
        raise RecurformerError(f"{flag} must be positive {what}, got {text!r}")
    return out


def cli_spelling(command: str) -> Callable[[str], str]:
    """A message's options (``config.opt``) spelled as ``command``'s flags: ``--top-p``,
    ``--resume DIR``, ``--overwrite``, ``--set train.out_dir=DIR``."""
    cls = _options_classes().get(command)
    flags = {f.name: flag_of(f) for f in dataclasses.fields(cls)} if cls else {}
    flags |= ALIASES.get(command, {})

    def flag(name: str, value: Any, literal: bool) -> str:
        if "." in name:
            return f"--set {name}={value}"
        if value is not None and f"{name}={value}" in flags:
            return flags[f"{name}={value}"]
        spelled = flags.get(name, "--" + name.replace("_", "-"))
        shown = ",".join(map(str, value)) if isinstance(value, list) else value  # a list as --lengths takes it
        return spelled if value is None or value is True else f"{spelled} {shown}"

    return lambda text: spell(text, flag)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value (repeatable)"
    )


def cmd_info(args: argparse.Namespace) -> None:
    from .info import InfoOptions, model_info

    for line in model_info(InfoOptions(**options_of(InfoOptions, args)), parse_overrides(args.set)):
        print(line)


def cmd_prepare(args: argparse.Namespace) -> None:
    from .config import check_values
    from .data import DataConfig

    if not args.dataset and not args.text_files:
        raise RecurformerError("give --dataset NAME or --text FILE ...")
    options = options_of(DataConfig, args)
    if options["tokenizer"] == "bpe":
        check_values(DataConfig, vocab_size=options["vocab_size"])  # as the flag, not as data.vocab_size
    dc = DataConfig(**options)
    out = dc.resolved_dir()  # --out, or where `train` with the same data section looks
    meta = dc.prepare(out)
    print(f"prepared {out}: " + ", ".join(f"{k}={v}" for k, v in meta.items() if not isinstance(v, (dict, list))))


def cmd_train(args: argparse.Namespace) -> None:
    from .training.command import TrainOptions, train_command

    last = train_command(TrainOptions(**options_of(TrainOptions, args)), args.set)
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
    from .evaluate.command import EvalOptions, evaluate_checkpoints

    options = options_of(EvalOptions, args)
    evaluate_checkpoints(
        options.pop("checkpoint"),
        meta={k: v for k, v in vars(args).items() if k != "func"},
        log=lambda line: print(cli_spelling("eval")(line)),
        **options,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from .api import generate_text
    from .generate import GenerateOptions

    options = options_of(GenerateOptions, args)
    g = generate_text(
        options.pop("checkpoint"),
        options.pop("prompt"),
        on_text=lambda t: print(t, end="", flush=True),
        note=lambda t: print(t, file=sys.stderr),
        **options,
    )
    print()
    if args.stats:
        print(
            f"[{g.tokens} tokens in {g.seconds:.2f}s: {g.tokens / max(g.seconds, 1e-9):,.1f} tok/s, "
            f"peak {g.memory_kind} {g.peak_memory_mb:,.0f} MB]",
            file=sys.stderr,
        )


def cmd_synth(args: argparse.Namespace) -> None:
    from .synth.command import SynthCommandOptions, synth_command

    synth_command(SynthCommandOptions(**options_of(SynthCommandOptions, args)))


def cmd_niah(args: argparse.Namespace) -> None:
    from .niah import NiahOptions, niah_checkpoint

    options = options_of(NiahOptions, args)
    niah_checkpoint(options.pop("checkpoint"), **options)


def cmd_export(args: argparse.Namespace) -> None:
    from .api import ExportOptions, export

    options = options_of(ExportOptions, args)
    out = export(options.pop("checkpoint"), options.pop("out"), **options)
    print(
        f"wrote {out} ("
        + ", ".join(sorted(f.name for f in out.iterdir()))
        + ")"
        + (f"; uploaded to {args.push_to_hub}" if args.push_to_hub else "")
    )


def cmd_probe(args: argparse.Namespace) -> None:
    from .probe.command import ProbeCommandOptions, merge_probes, probe_checkpoints

    if args.merge:
        merge_probes(args.merge, args.out)
        return
    if args.warm_min > args.warm_max:  # the command line's two flags for Python's warm=(min, max)
        raise RecurformerError(f"need 0 <= --warm-min <= --warm-max, got {args.warm_min} and {args.warm_max}")
    options = options_of(ProbeCommandOptions, args) | {"warm": (args.warm_min, args.warm_max)}
    probe_checkpoints(
        options.pop("checkpoint"),
        options.pop("out"),
        meta={k: v for k, v in vars(args).items() if k != "func"},
        **options,
    )


def cmd_readout(args: argparse.Namespace) -> None:
    from .readout import ReadoutOptions, readout_checkpoint
    from .synth.config import split_overrides

    _, task_values, _ = split_overrides(args.set) if args.task else ({}, {}, {})
    options = options_of(ReadoutOptions, args)
    readout_checkpoint(options.pop("checkpoint"), task_values=task_values, **options)


def _options_classes() -> dict[str, type[Any]]:
    """Each command's options dataclass (where it has one): its fields name its flags in errors."""
    from .api import ExportOptions
    from .data import DataConfig
    from .evaluate.command import EvalOptions
    from .generate import GenerateOptions
    from .info import InfoOptions
    from .niah import NiahOptions
    from .probe.command import ProbeCommandOptions
    from .readout import ReadoutOptions
    from .synth.command import SynthCommandOptions
    from .training.command import TrainOptions

    return {
        "info": InfoOptions,
        "train": TrainOptions,
        "export": ExportOptions,
        "prepare": DataConfig,
        "eval": EvalOptions,
        "generate": GenerateOptions,
        "synth": SynthCommandOptions,
        "probe": ProbeCommandOptions,
        "readout": ReadoutOptions,
        "niah": NiahOptions,
    }


ALIASES: dict[str, dict[str, str]] = {  # options the command line spells otherwise than Python
    "eval": {"windows=None": "--all"},
    "probe": {"warm": "--warm-min/--warm-max"},
}

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
    from .api import ExportOptions
    from .data import DataConfig
    from .evaluate.command import EvalOptions
    from .generate import GenerateOptions
    from .info import InfoOptions
    from .niah import NiahOptions
    from .probe.command import ProbeCommandOptions
    from .readout import ReadoutOptions
    from .synth.command import SynthCommandOptions
    from .training.command import TrainOptions

    summary = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "")  # the docstring's first paragraph
    ap = argparse.ArgumentParser(prog="recurformer", description=summary)
    ap.add_argument("--version", action="version", version=f"recurformer {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    def command(
        name: str, help: str, options: type, with_set: bool = False
    ) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
        """A subcommand with the flags of ``options`` (and ``--set`` where ``with_set``)."""
        p = sub.add_parser(name, formatter_class=_Help, help=help)
        groups = add_options(p, options)
        if with_set:
            _add_set(p)
        return p, groups

    command("info", "print a model's configuration and parameter counts", InfoOptions, with_set=True)
    command("prepare", "tokenize a corpus into train/val token files", DataConfig)
    command("train", "train a model (stateful TBPTT) from a YAML config", TrainOptions, with_set=True)
    _, groups = command(
        "eval", "length-extrapolation evaluation (loss on the last tokens at several lengths)", EvalOptions
    )
    groups["windows"].add_argument(
        "--all",
        dest="windows",
        action="store_const",
        const=None,
        help="every window, so the scored blocks tile the whole text after the first --context tokens "
        "(the default run's val split: 743 windows, longer than its training)",
    )
    p, _ = command("generate", "stream text from a checkpoint", GenerateOptions)
    p.add_argument("--stats", action="store_true", help="print tokens/s and peak memory")
    command("synth", "train a small model on a synthetic diagnostic task and report its accuracy", SynthCommandOptions)
    command(
        "readout",
        "does a model read its memory, and does a later loss reach it: attention share and gradient norms",
        ReadoutOptions,
        with_set=True,
    )

    p = sub.add_parser(
        "probe",
        formatter_class=_Help,
        help="how far back the state carries information: copy and swap probes with bootstrap intervals",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", nargs="+", help=_help(ProbeCommandOptions, "checkpoint"))
    what.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="instead: one table, JSON and plot from earlier probe results run with the same documents and settings",
    )
    add_options(p, ProbeCommandOptions)
    warm_min, warm_max = ProbeCommandOptions().warm
    p.add_argument(
        "--warm-min",
        type=int,
        default=warm_min,
        help="fewest tokens of stream text read before each document (a random "
        "prefix length between --warm-min and --warm-max varies the chunk phases)",
    )
    p.add_argument(
        "--warm-max", type=int, default=warm_max, help="most tokens of stream text read before each document"
    )
    command(
        "niah",
        "needle in a haystack: a passkey at depth d%% of a context of length L, retrieved at the end "
        "(exact match and answer log-likelihood; a depth x length heatmap)",
        NiahOptions,
    )
    p = sub.add_parser(
        "lm-eval",
        add_help=False,
        help="EleutherAI's lm-evaluation-harness with the 'recurformer' model "
        "(needs recurformer[eval]); every argument is lm-eval's own, e.g. --model_args pretrained=DIR --tasks NAME",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's own arguments")
    command("export", "write a run's checkpoint in Hugging Face Hub layout with a model card", ExportOptions)
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
    from .training.signals import TrainingInterrupted

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
        print(f"recurformer: error: {cli_spelling(args.command)(ValueError.__str__(e))}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        print(f"recurformer: {e.said(cli=True)}", file=sys.stderr)
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
