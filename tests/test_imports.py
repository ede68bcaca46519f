"""The package's import graph, read from the source (every ``import`` and ``from ... import``,
including those inside functions and under ``if TYPE_CHECKING``): it has no cycle, and every
module imports only modules on a lower floor of the layering below. The streaming contract
(``state``, ``modules``) is the ground floor; the model, the models, training and the CLI stand on it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "recurformer"

# The floors, lowest first. A module may import only modules on a lower floor.
FLOORS: list[list[str]] = [
    # 0: nothing of the package
    ["config", "modules", "compat", "optim", "ops", "ops.reference", "tap", "openmp", "progress"],
    # 1: the state types, files, the registry, the recurrent cell, devices, data readers, the attention ops
    [
        "files",
        "state",
        "registry",
        "cells",
        "device",
        "ops.relative",
        "ops.recurrent_attention.common",
        "ops.delta_rule.chunk",
        "ops.delta_rule.naive",
        "ops.delta_rule.fla",
        "data.tokenizer",
        "data.streams",
        "data.sources",
    ],
    # 2: file formats and helpers on the state types; the captured step (a model's calls replayed); the
    # report writer of the commands that measure a model (table, JSON, figure), their bootstrap intervals
    # and the probe's options; the layer contract and what a model reads of its stack of layers
    [
        "checkpoint",
        "stack",
        "report",
        "intervals",
        "probe.options",
        "flops",
        "data.prepare",
        "data.rows",
        "capture",
        "ops.delta_rule",
        "ops.recurrent_attention.naive",
    ],
    # 3: also what eval and probe measured, as tables, JSON and figures; the probe's documents; the book text
    # of the long-context tasks (a BPE over the bundled books)
    ["data", "loggers", "ops.recurrent_attention.tiled", "evaluate.results", "probe.results", "probe.samples"]
    + ["data.booktext"],
    # 4: loading models from disk or the Hub (the Hub methods of a model, as a mixin); the long-context tasks
    ["hub", "ops.recurrent_attention", "data.needles", "data.babi", "data.zoology"],
    # 5: generation (a mixin of the model; ``recurformer generate`` is ``api.generate_text``); the task registry
    ["generate", "data.synthetic"],
    # 6: the model around a stack of layers
    ["nn"],
    # 7: what reads a model; Llama, which other architectures build on
    ["layers", "evaluate", "evaluate.lengths", "probe", "probe.measure", "models.llama", "hf", "lm_eval", "curriculum"],
    # 8: the architectures (``models.*`` files not named elsewhere live on this floor too)
    [],
    # a variant composed onto its base architecture (ARMT onto the RMT)
    ["models.armt"],
    # 9
    ["models", "reference"],
    # 10: measure a built model's state; one step of truncated BPTT; whether a model reads its memory
    # the eval and probe commands
    ["statesize", "tbptt", "readout", "niah", "evaluate.command", "probe.command"]
    + ["training", "training.ranks", "training.signals", "training.parts"],
    # 11: the one training loop; the run config of ``recurformer train``
    ["training.loop", "training.config"],
    # 12: what a run is built from: its data, its meter and logs; ``recurformer info``
    ["training.data", "training.meter", "info"],
    # 13: one optimizer step of stateful segment training, and a run of it
    ["training.steps"],
    ["training.trainer"],
    # 15: synth: its settings and its learner, one learning rate's training as a job of the loop, the run,
    # the command
    ["synth", "synth.config", "synth.learner"],
    ["synth.job"],
    ["synth.run"],
    ["synth.command", "training.command"],
    ["api"],
    ["__init__"],  # the package's public names
    ["cli"],  # reads ``__version__``
    ["__main__"],
]
DEFAULT_FLOOR = {"models.": 8}  # a new architecture file needs no entry


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that module ``name`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg and name != "__init__" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("recurformer."):
                    found.add(a.name[len("recurformer.") :])
                elif a.name == "recurformer":
                    found.add("__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "recurformer" or node.module.startswith("recurformer.")):
                target = node.module[len("recurformer") :].lstrip(".")
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}" if target else a.name
                found.add(sub if sub in modules else (target or "__init__"))
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    mods = module_names()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def floor_of(name: str) -> int | None:
    for i, floor in enumerate(FLOORS):
        if name in floor:
            return i
    return next((f for prefix, f in DEFAULT_FLOOR.items() if name.startswith(prefix)), None)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_import_graph_is_read():
    g = graph()
    assert {"config", "nn"} <= g["models.llama"]  # relative imports are resolved
    assert "training.command" in g["cli"]  # so are imports inside functions
    assert "config" in g["data.tokenizer"]  # and absolute ones


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_every_module_has_a_floor():
    assert [m for m in graph() if floor_of(m) is None] == []


def test_imports_only_go_down():
    upward = [
        f"{m} (floor {floor_of(m)}) imports {t} (floor {floor_of(t)})"
        for m, targets in sorted(graph().items())
        for t in sorted(targets)
        if floor_of(m) is not None and floor_of(t) is not None and floor_of(t) >= floor_of(m)  # type: ignore[operator]
    ]
    assert upward == []


def test_ground_floor_imports_nothing_of_the_package():
    g = graph()
    assert {m: g[m] for m in FLOORS[0] if m in g and g[m]} == {}


SHADOWED = {"evaluate", "probe"}  # package names that are the API functions, not the modules


def test_no_module_imports_a_module_shadowed_by_an_api_function():
    """``recurformer.evaluate`` (``probe``) is the API function, so ``from . import evaluate``
    or ``import recurformer.evaluate as e`` would get the function; a package module names what it
    needs from the module instead (``from .evaluate import evaluate_lengths``). Only ``__init__`` imports the
    modules themselves, before binding the functions."""
    found = []
    for name, path in sorted(module_names().items()):
        if name == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (
                node.module == "recurformer" or (node.level == 1 and not node.module)
            ):
                found += [f"{name}: from ... import {a.name}" for a in node.names if a.name in SHADOWED]
            elif isinstance(node, ast.Import):
                found += [
                    f"{name}: import {a.name} as {a.asname}"
                    for a in node.names
                    if a.asname and a.name.removeprefix("recurformer.") in SHADOWED
                ]
    assert found == []
