"""The ``recurformer`` command line: ``info``, ``prepare``, ``train``, ``eval``, ``generate``.

Every user error (bad config key, missing file, wrong checkpoint, ...) is printed as one line
``recurformer: error: ...`` with exit code 2, never as a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .config import RecurformerError, parse_overrides


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value (repeatable)")


def cmd_info(args: argparse.Namespace) -> None:
    from .config import load_yaml, merge
    from .models import build_model

    values: dict = {}
    name = args.model
    if args.config:
        cfg = load_yaml(args.config)
        values = dict(cfg.get("model", {}))
        name = name or values.pop("name", None)
    over = parse_overrides(args.set)  # "dim=288" and "model.dim=288" both accepted
    values = merge(merge(values, over.pop("model", {})), over)
    name = values.pop("name", name)
    if not name:
        raise RecurformerError("give --model NAME (or a --config with model.name)")
    model = build_model(name, values)
    print(f"model: {name}")
    for k, v in vars(model.config).items():
        print(f"  {k}: {v}")
    n = model.num_params()
    print(f"parameters: {n:,} ({n / 1e6:.2f}M; token embedding {model.tok_emb.weight.numel():,}, tied with the output head)")
    for group, count in model.param_groups().items():
        print(f"  {group}: {count:,}")
    for line in model.info_lines():
        print(line)


def cmd_prepare(args: argparse.Namespace) -> None:
    from .data import prepare
    from .train import DataConfig

    if not args.dataset and not args.text:
        raise RecurformerError("give --dataset NAME or --text FILE ...")
    dc = DataConfig(dataset=args.dataset, text_files=args.text or [], tokenizer=args.tokenizer, vocab_size=args.vocab_size)
    out = args.out or dc.resolved_dir()
    meta = prepare(out, dataset=args.dataset, text_files=args.text or None, tokenizer=args.tokenizer, vocab_size=args.vocab_size)
    print(f"prepared {out}: " + ", ".join(f"{k}={v}" for k, v in meta.items() if not isinstance(v, (dict, list))))


def cmd_train(args: argparse.Namespace) -> None:
    from .train import train_main

    if not args.config and not args.resume:
        raise RecurformerError("give --config FILE (see configs/) or --resume DIR")
    last = train_main(args.config, args.set, args.resume)
    if last:
        print("done: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in last.items()))


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {"info": cmd_info, "prepare": cmd_prepare, "train": cmd_train}


def build_parser() -> argparse.ArgumentParser:
    from .models import model_names

    ap = argparse.ArgumentParser(prog="recurformer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print a model's configuration and parameter counts")
    p.add_argument("--model", help=f"one of: {', '.join(model_names())}")
    p.add_argument("--config", help="a YAML config file (its model section is used)")
    _add_set(p)

    p = sub.add_parser("prepare", help="tokenize a corpus into train/val token files")
    p.add_argument("--dataset", help="tinystories-sample, tinystories-repeat, warpeace, books, tinystories (hub)")
    p.add_argument("--text", nargs="+", metavar="FILE", help="your own text files instead of a dataset")
    p.add_argument("--tokenizer", choices=["bpe", "byte"], default="bpe")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--out", help="output directory (default: prepared/<dataset>-<tokenizer><vocab>)")

    p = sub.add_parser("train", help="train a model (stateful TBPTT) from a YAML config")
    p.add_argument("--config", help="YAML file with model/data/train sections (see configs/)")
    p.add_argument("--resume", help="a run or checkpoint directory to continue exactly")
    _add_set(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except RecurformerError as e:
        print(f"recurformer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("recurformer: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
