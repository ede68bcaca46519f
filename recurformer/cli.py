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


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {"info": cmd_info}


def build_parser() -> argparse.ArgumentParser:
    from .models import model_names

    ap = argparse.ArgumentParser(prog="recurformer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print a model's configuration and parameter counts")
    p.add_argument("--model", help=f"one of: {', '.join(model_names())}")
    p.add_argument("--config", help="a YAML config file (its model section is used)")
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
