"""The synthetic diagnostics of *The Recurrent Transformer: Greater Effective Depth and Efficient
Decoding* (appendix "Synthetic diagnostics": MAD and the copy task) as a grid: every task x every registered model, trained with
``recurformer.synth.run.run_synth`` (lr sweep selected on validation), one cell after the other.
Writes ``<out>.json`` (every result, rewritten after each cell so a stopped run keeps what it
finished), ``<out>.md`` (the tables) and ``<out>.png`` (bars per task; accuracy vs length).

    OMP_NUM_THREADS=1 python benchmarks/synthetic.py                       # full grid (hours on CPU)
    OMP_NUM_THREADS=1 python benchmarks/synthetic.py --tasks in_context_recall,passkey \\
        --steps 200 --lrs 1e-3 --n-train 2048 --n-test 256 --set dim=64 --set n_heads=8
    python benchmarks/synthetic.py --merge out/synth_a.json out/synth_b.json --out out/synthetic

``--set`` takes the keys of ``recurformer synth --set`` (bare/model.K, task.K, synth.K) and applies
them to every cell. ``--task-set TASK:K=V`` applies to one task (bare K: a task parameter;
``synth.K`` / ``model.K`` also allowed), ``--model-set MODEL:K=V`` to one model (bare K: a model
key; ``synth.K`` allowed, e.g. shorter ``synth.eval_lengths`` for a model whose state grows).
``--merge`` skips training and builds the outputs from earlier JSON files: runs of one cell that
differ only in their learning rates join one sweep, and the one with the best validation accuracy
is reported (so a sweep can be split across processes or extended later).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recurformer.config import RecurformerError, merge  # noqa: E402
from recurformer.data.synthetic import TASKS  # noqa: E402
from recurformer.models import model_names  # noqa: E402
from recurformer.synth.config import split_overrides, synth_config  # noqa: E402
from recurformer.synth.run import result_dict, run_synth, summary  # noqa: E402

Result = dict[str, Any]  # ``result_dict`` of a SynthResult


def scoped(items: list[str], names: list[str], flag: str) -> dict[str, list[str]]:
    """``["name:k=v", ...]`` -> ``{name: ["k=v", ...]}``, names checked against ``names``."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, _, kv = item.partition(":")
        if name not in names or "=" not in kv:
            raise RecurformerError(f"{flag} expects NAME:KEY=VALUE with NAME one of {names}, got '{item}'")
        out.setdefault(name, []).append(kv)
    return out


def task_items(items: list[str]) -> list[str]:
    """Bare keys of ``--task-set`` are task parameters."""
    return [kv if kv.split("=", 1)[0].split(".")[0] in ("synth", "model", "task") else "task." + kv for kv in items]


def metric_name(task: str) -> str:
    return "tok" if TASKS[task].metric == "token" else "exact"


def tables(results: list[Result]) -> str:
    """Table 1: models x tasks (headline test accuracy and the selected lr). Table 2 per task with
    a length sweep: models x lengths."""
    tasks = list(dict.fromkeys(r["task"] for r in results))
    models = list(dict.fromkeys(r["model"] for r in results))
    cell = {(r["model"], r["task"]): r for r in results}
    out = ["| model | " + " | ".join(f"{t} ({metric_name(t)})" for t in tasks) + " |", "|---" * (1 + len(tasks)) + "|"]
    for m in models:
        cells = [f"{cell[m, t]['accuracy']:.3f} (lr {cell[m, t]['lr']:g})" if (m, t) in cell else "" for t in tasks]
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    for t in tasks:
        lengths = sorted({int(L) for r in results if r["task"] == t for L in r["by_length"]})
        if not lengths:
            continue
        out += ["", f"{t} ({metric_name(t)}) by length:", "", "| model | " + " | ".join(f"{L}" for L in lengths) + " |"]
        out.append("|---" * (1 + len(lengths)) + "|")
        for m in models:
            r = cell.get((m, t))
            if r is not None:
                out.append(
                    f"| {m} | "
                    + " | ".join(f"{r['by_length'][str(L)]:.3f}" if str(L) in r["by_length"] else "" for L in lengths)
                    + " |"
                )
    return "\n".join(out)


MARKERS = "osD^vPX*<>"


def figure(results: list[Result]):  # type: ignore[no-untyped-def]
    """Bars of test accuracy per task (first panel), then accuracy against length for every task
    with a length sweep. One legend for the figure; each model has its own colour and (hollow,
    so overlapping points stay visible) marker shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    tasks = list(dict.fromkeys(r["task"] for r in results))
    models = list(dict.fromkeys(r["model"] for r in results))
    swept = [t for t in tasks if any(r["by_length"] for r in results if r["task"] == t)]
    cell = {(r["model"], r["task"]): r for r in results}
    style = {m: dict(color=f"C{i}", marker=MARKERS[i % len(MARKERS)]) for i, m in enumerate(models)}
    fig, axes = plt.subplots(1, 1 + len(swept), figsize=(2.2 + 1.3 * len(tasks) + 3.6 * len(swept), 4.8), squeeze=False)
    ax = axes[0, 0]
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        js = [j for j, t in enumerate(tasks) if (m, t) in cell]
        ax.bar([j + i * width for j in js], [cell[m, tasks[j]]["accuracy"] for j in js], width, color=style[m]["color"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))])
    ax.set_xticklabels(
        [f"{t}\n({'token acc' if metric_name(t) == 'tok' else 'exact'})" for t in tasks], fontsize=6, rotation=30
    )
    ax.set_ylim(0, 1)
    ax.set_ylabel("test accuracy")
    ax.set_title("test accuracy per task", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    for ax, t in zip(axes[0, 1:], swept):
        for m in models:
            r = cell.get((m, t))
            if r and r["by_length"]:
                Ls = sorted(int(L) for L in r["by_length"])
                ax.plot(
                    Ls,
                    [r["by_length"][str(L)] for L in Ls],
                    "-",
                    **style[m],
                    markersize=7,
                    markerfacecolor="none",
                    markeredgewidth=1.5,
                    alpha=0.85,
                )
                if Ls[-1] >= 8 * Ls[0]:
                    ax.set_xscale("log", base=2)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel({"passkey": "filler tokens L", "copy": "string length", "delayed_copy": "delay"}.get(t, "length"))
        ax.set_ylabel("test accuracy")
        ax.set_title(
            f"{t}: accuracy vs length ({'token acc' if metric_name(t) == 'tok' else 'exact match'})", fontsize=9
        )
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], **style[m], markerfacecolor="none", markeredgewidth=1.5, label=m) for m in models]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(models), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def plot(results: list[Result], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def suffixed(out: Path, suffix: str) -> Path:
    """``out`` + suffix (not ``with_suffix``: "out/synthetic.a" must not become "out/synthetic.json")."""
    return out.parent / (out.name + suffix)


def merge_runs(runs: list[Result]) -> list[Result]:
    """One result per (model, task): the run with the best validation accuracy, its ``sweep`` the
    union of every run's. Runs of one cell must share the task, the model and every protocol setting
    that changes training or selection (so not the lrs, nor the extra length evaluation, whose
    results come from the winning run)."""
    free = {"lrs", "eval_lengths", "n_length_test", "eval_batch_size"}
    cells: dict[tuple[str, str], Result] = {}
    for r in runs:
        key = r["model"], r["task"]
        if key not in cells:
            cells[key] = r
            continue
        old = cells[key]
        for part in ("task_params", "model_config", "synth"):
            a, b = old.get(part, {}), r.get(part, {})
            diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in free)
            if diff:
                raise RecurformerError(
                    f"cannot merge two runs of {key[1]} / {key[0]}: their {part} differ in {', '.join(diff)}"
                )
        best = r if r["val_accuracy"] > old["val_accuracy"] else old
        cells[key] = best | {"sweep": sorted(old["sweep"] + r["sweep"], key=lambda x: x["lr"])}
    return list(cells.values())


def write(results: list[Result], out: Path, meta: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    suffixed(out, ".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    suffixed(out, ".md").write_text(tables(results) + "\n")
    plot(results, suffixed(out, ".png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks (default: all)")
    ap.add_argument(
        "--models", default=",".join(model_names()), help="comma-separated models (default: the whole registry)"
    )
    ap.add_argument("--steps", type=int, help="optimizer steps per learning rate")
    ap.add_argument("--lrs", help="comma-separated learning rates")
    ap.add_argument("--n-train", type=int)
    ap.add_argument("--n-test", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--model-set", action="append", default=[], metavar="MODEL:KEY=VALUE")
    ap.add_argument(
        "--task-set", action="append", default=[], metavar="TASK:KEY=VALUE", help="a task parameter for one task"
    )
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="only build the outputs from these result files")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    ap.add_argument("--out", default=str(ROOT / "out" / "synthetic"), help="output path without suffix")
    args = ap.parse_args()
    out = Path(args.out)
    try:
        if args.merge:
            runs: list[Result] = []
            for f in args.merge:
                if not Path(f).is_file():
                    raise RecurformerError(f"no such result file: {f}")
                runs += json.loads(Path(f).read_text())["results"]
            results = merge_runs(runs)
            write(results, out, {"merged": args.merge})
            print(tables(results))
            print(f"wrote {', '.join(str(suffixed(out, x)) for x in ('.json', '.md', '.png'))}")
            return
        tasks = [t for t in args.tasks.split(",") if t]
        models = [m for m in args.models.split(",") if m]
        model_over, task_over, synth_over = split_overrides(args.set)
        for key in ("steps", "lrs", "n_train", "n_test"):
            if getattr(args, key) is not None:
                synth_over[key] = getattr(args, key)
        per_model, per_task = scoped(args.model_set, models, "--model-set"), scoped(args.task_set, tasks, "--task-set")
        plans = []
        for task in tasks:
            for m in models:  # validate every cell's settings before the first one trains
                pm, pt = split_overrides(per_model.get(m)), split_overrides(task_items(per_task.get(task, [])))
                cfg = synth_config(merge(merge(synth_over, pt[2]), pm[2]))
                plans.append((task, m, merge(merge(model_over, pt[0]), pm[0]), merge(task_over, pt[1]), cfg))
        results: list[Result] = []
        meta = {"argv": sys.argv[1:]}
        for task, m, values, params, cfg in plans:
            r = run_synth(
                task,
                m,
                values,
                params,
                cfg,
                log=lambda s: print(s, flush=True),
                device=args.device,
                progress=sys.stderr.isatty(),
            )
            print(summary(r) + f" [{r.seconds:.0f}s]", flush=True)
            results.append(result_dict(r) | {"synth": vars(cfg)})
            write(results, out, meta)
    except RecurformerError as e:
        sys.exit(f"synthetic.py: error: {e}")
    print(tables(results))
    print(f"wrote {', '.join(str(suffixed(out, x)) for x in ('.json', '.md', '.png'))}")


if __name__ == "__main__":
    main()
