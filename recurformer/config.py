"""Dataclass configs: building from dicts / YAML files / dotted ``key=value`` overrides, with
validation that fails with a one-line message naming the problem (and the closest valid key)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import re
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml


class RecurformerError(ValueError):
    """A user-facing error: the CLI prints its message on one line, without a traceback. An
    option named in the message (``opt``) reads as a Python keyword (``top_p``) here, and as its
    flag (``--top-p``) where the command line prints it (``spell``)."""

    def __str__(self) -> str:
        return spell(super().__str__())


T = TypeVar("T")


def edit_distance(a: str, b: str) -> int:
    """The optimal string alignment distance between ``a`` and ``b``: insertions, deletions,
    substitutions and transpositions of two neighbours ("nmae" -> "name") count one edit each."""
    rows = [list(range(len(b) + 1))]
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            row.append(min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (ca != cb)))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def closest(key: str, valid: list[str]) -> str | None:
    """The one of ``valid`` closest to ``key``: the fewest edits (``edit_distance``) among those
    ``difflib`` finds alike and those within a third of ``key``'s length in edits, ties in
    ``difflib``'s order; None when none is close."""
    alike = difflib.get_close_matches(key, valid, n=max(1, len(valid)), cutoff=0.5)
    near = alike + [v for v in valid if v not in alike and edit_distance(key, v) <= max(1, len(key) // 3)]
    return min(near, key=lambda v: edit_distance(key, v), default=None)


def suggest(key: str, valid: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid key ``x`` closest to ``key``; else the valid keys."""
    close = closest(key, valid)
    return f" (did you mean '{close}'?)" if close else f" (valid keys: {', '.join(sorted(valid))})"


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check (and gently coerce) ``value`` against the annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, where)
            except RecurformerError as e:
                errors.append(str(e))
        raise RecurformerError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise RecurformerError(f"{where} must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):  # "--set k=64": a list of one
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise RecurformerError(f"{where} must be a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        out = [coerce(v, inner, where) for v in value]
        return tuple(out) if origin is tuple else out
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise RecurformerError(f"{where} must be true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise RecurformerError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                pass
        raise RecurformerError(f"{where} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise RecurformerError(f"{where} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise RecurformerError(f"{where} must be a string, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise RecurformerError."""
    if not isinstance(data, dict):
        raise RecurformerError(f"{where or cls.__name__} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            raise RecurformerError(f"unknown config key '{name}'{suggest(key, list(fields))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, name)  # type: ignore[arg-type]
        else:
            kwargs[key] = coerce(value, tp, f"config key '{name}'")
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise RecurformerError(f"{where or cls.__name__}: {e}") from None
    return obj


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise RecurformerError(f"--set expects key=value, got '{item}'")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise RecurformerError(
                f"--set {item}: the value is not valid YAML ({getattr(e, 'problem', None) or e})"
            ) from None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise RecurformerError(f"--set {key}: '{p}' is not a section")
        node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge (``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def bundled_configs() -> list[str]:
    """Names of the configs shipped inside the package (``recurformer/configs/``), e.g.
    ``tinystories-cpu`` or ``repro/base``; each is usable wherever a config path is."""
    root = resources.files("recurformer") / "configs"
    names = [f.name[:-5] for f in root.iterdir() if f.name.endswith(".yaml")]
    names += [
        f"{d.name}/{f.name[:-5]}" for d in root.iterdir() if d.is_dir() for f in d.iterdir() if f.name.endswith(".yaml")
    ]
    return sorted(names)


# A study's configs stay beside the study in a repository checkout, outside the wheel: study -> folder.
STUDY_CONFIGS = {"memory": Path(__file__).resolve().parent.parent / "experiments" / "memory" / "configs"}


def study_configs() -> dict[str, Path]:
    """The configs of the studies under ``experiments/`` by name, in a repository checkout
    (``memory/passkey-rmt-mixed`` is ``experiments/memory/configs/passkey-rmt-mixed.yaml``); none
    where the package is installed from a wheel. Each is usable wherever a config path is."""
    return {f"{study}/{f.stem}": f for study, d in STUDY_CONFIGS.items() if d.is_dir() for f in d.glob("*.yaml")}


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML config: the file ``path``, or else the bundled config of that name (``tinystories-cpu``),
    or in a repository checkout the study config of that name (``memory/mqar-fixed``)."""
    p: Any = Path(path)  # or a package resource (importlib.resources)
    name = str(path).removesuffix(".yaml")
    if not p.is_file():
        studies = study_configs()
        names = sorted([*bundled_configs(), *studies])
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.8)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise RecurformerError(f"config file not found: {p} ({hint}bundled configs: {', '.join(names)})")
        p = studies.get(name) or resources.files("recurformer") / "configs" / f"{name}.yaml"
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:  # file:line:column of the problem, as compilers write it
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecurformerError(f"{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise RecurformerError(f"config file {p} must hold a mapping at the top level")
    return data


def _range_text(low: float, low_ok: bool, high: float | None, high_ok: bool) -> str:
    """What a value in the range must do: ``be >= 1``, ``be in [0, 1)``, ``lie strictly between 0 and 1``."""
    num = lambda x: str(int(x)) if float(x).is_integer() else f"{x:g}"  # noqa: E731
    if high is None:
        return f"be {'>=' if low_ok else '>'} {num(low)}"
    if not low_ok and not high_ok:
        return f"lie strictly between {num(low)} and {num(high)}"
    return f"be in {'[' if low_ok else '('}{num(low)}, {num(high)}{']' if high_ok else ')'}"


def check_range(
    name: str, value: Any, bounds: tuple[float, bool, float | None, bool], label: str = "", note: str = ""
) -> None:
    """One line naming the option ``name`` (``opt``; or ``label``) when ``value`` lies outside
    ``bounds`` (lowest, is the lowest allowed, highest or None, is the highest allowed), with
    ``note`` after the range (``"0: only at the end"``); None is not given."""
    if value is None:
        return
    low, low_ok, high, high_ok = bounds
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (value >= low if low_ok else value > low)
    ok = ok and (high is None or (value <= high if high_ok else value < high))
    if not ok:
        said = f" ({note})" if note else ""
        raise RecurformerError(
            f"{label or opt(name)} must {_range_text(low, low_ok, high, high_ok)}{said}, got {value!r}"
        )


# ----------------------------------------------------------------------------------------------
# options and config sections: each command's options are a dataclass beside the function that
# runs it, each config section a dataclass; their fields (``option``) carry the help, the range
# and the flag the command line generates from them, and the range is checked as one is built
# (``Checked``)


def option(
    default: Any = None,
    help: str = "",
    *,
    range: str | None = None,
    note: str = "",
    key: str | None = None,
    flag: str | None = None,
    **cli: Any,
) -> Any:
    """An option (or a config key) as a dataclass field: its ``default`` (a list is copied per
    instance), its ``help``, the ``range`` its value must lie in (``">= 1"``, ``"> 0"``, ``"(0, 1]"``,
    ``"[258, 1048576]"``) with a ``note`` its message adds (``"0: only at the end"``), the ``key``
    a message names it by where that is not the field's name, its ``flag`` where the command line
    does not spell it ``--name-like-this``, and further ``argparse`` settings (``metavar``,
    ``nargs``, ``choices``, ``cli=False``: Python only)."""
    meta = {
        "help": help,
        "bounds": parse_range(range) if range else None,
        "note": note,
        "key": key,
        "flag": flag,
        "cli": cli,
    }
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def parse_range(text: str) -> tuple[float, bool, float | None, bool]:
    """``">= 1"`` -> (1, True, None, False); ``"(0, 1]"`` -> (0, False, 1, True)."""
    if text[0] in "[(":
        low, high = (float(v) for v in text[1:-1].split(","))
        return low, text[0] == "[", high, text[-1] == "]"
    op, value = text.split()
    return float(value), op == ">=", None, False


def check_fields(obj: Any, key_format: str = "") -> None:
    """``check_range`` for every field of the dataclass ``obj`` that has a range (each value of a
    list), in field order; ``key_format`` names a field in the message (``"config key 'train.{}'"``; by
    default it is an option, ``opt``)."""
    for f in dataclasses.fields(obj):
        if not f.metadata.get("bounds"):
            continue
        name = f.metadata.get("key") or f.name
        value = getattr(obj, f.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:  # a list: each of its values
            check_range(name, v, f.metadata["bounds"], key_format.format(name), f.metadata.get("note", ""))


class Checked:
    """The base of an options or config dataclass: its fields' ranges are checked as it is built
    (``check_fields``); a subclass's own ``__post_init__`` calls this one first, then checks what
    no range says (how fields fit together)."""

    key_format: ClassVar[str] = ""  # how a message names a field: "config key 'train.{}'" ("": as an option)

    def __post_init__(self) -> None:
        check_fields(self, self.key_format)


def check_values(cls: type[Any], **values: Any) -> None:
    """``check_range`` for ``values`` (a function's arguments, say) by the ranges of the fields of
    the same names of ``cls``, each named as an option (``opt``)."""
    bounds = {f.name: f.metadata["bounds"] for f in dataclasses.fields(cls) if f.metadata.get("bounds")}
    for name, value in values.items():
        check_range(name, value, bounds[name])


def make_options(cls: type[T], values: dict[str, Any]) -> T:
    """The options dataclass ``cls`` from keyword ``values`` (its ranges checked as it is built,
    ``Checked``); an unknown keyword is one line naming the closest option."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for key in values:
        if key not in names:
            raise RecurformerError(f"unknown option '{key}'{suggest(key, names)}")
    return cls(**values)


# An option named in a message: its name (and value) between markers, spelled when the message
# is shown, as a Python keyword (``spell``) or as the command line's flag (``cli.spell_flags``).
_MARK = re.compile("\x00(.*?)\x00")


def opt(name: str, value: Any = None, literal: bool = False) -> str:
    """The option ``name`` (``"top_p"``, a config key ``"train.out_dir"``) inside a message, with
    ``value`` where the message shows one (True: a switch); ``literal``: the value is a
    placeholder (``DIR``), never quoted. Python: ``top_p``, ``resume='runs/x'``, ``overwrite=True``,
    ``train={"out_dir": DIR}``; command line: ``--top-p``, ``--resume runs/x``, ``--overwrite``,
    ``--set train.out_dir=DIR``."""
    return "\x00" + json.dumps([name, value, literal]) + "\x00"


def spell(text: str, flag: Any = None) -> str:
    """``text`` with each ``opt`` in it spelled by ``flag(name, value, literal)`` (default: as a
    Python keyword)."""
    return _MARK.sub(lambda m: (flag or python_keyword)(*json.loads(m.group(1))), text)


def say(text: str) -> None:
    """Print a line of a command's log, its options (``opt``) spelled as Python keywords: the
    default ``log`` of the Python API's commands (the command line passes its own)."""
    print(spell(text))


def python_keyword(name: str, value: Any, literal: bool) -> str:
    """An option as a Python call writes it (see ``opt``)."""
    shown = value if literal or not isinstance(value, str) else repr(value)
    section, _, key = name.rpartition(".")
    if value is None:
        return name
    return f'{section}={{"{key}": {shown}}}' if section else f"{name}={shown}"
