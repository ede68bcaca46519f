"""Seed 003's synthetic diagnostics as a grid: every task x every registered model, trained with
``recurformer.synth.run_synth`` (lr sweep selected on validation), one process, one cell after
the other. Writes ``<out>.json`` (every result), ``<out>.md`` (the table) and ``<out>.png``.

    OMP_NUM_THREADS=1 python benchmarks/synthetic.py                       # full grid (hours on CPU)
    OMP_NUM_THREADS=1 python benchmarks/synthetic.py --tasks in_context_recall,passkey \\
        --steps 200 --lrs 1e-3 --n-train 2048 --n-test 256 --set dim=64 --set n_heads=8

``--set`` takes the keys of ``recurformer synth --set`` (bare/model.K, task.K, synth.K) and applies
them to every cell; ``--model-set MODEL:K=V`` and ``--task-set TASK:K=V`` to one model or task only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recurformer.config import RecurformerError, merge  # noqa: E402
from recurformer.data.synthetic import TASKS  # noqa: E402
from recurformer.models import model_names  # noqa: E402
from recurformer.synth import SynthResult, result_dict, run_synth, split_overrides, summary, synth_config  # noqa: E402


def scoped(items: list[str], names: list[str], flag: str) -> dict[str, list[str]]:
    """``["name:k=v", ...]`` -> ``{name: ["k=v", ...]}``, names checked against ``names``."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, _, kv = item.partition(":")
        if name not in names or "=" not in kv:
            raise RecurformerError(f"{flag} expects NAME:KEY=VALUE with NAME one of {names}, got '{item}'")
        out.setdefault(name, []).append(kv)
    return out


def table(results: list[SynthResult]) -> str:
    """Rows: models; columns: tasks (headline test accuracy, selected lr) and passkey lengths."""
    tasks = list(dict.fromkeys(r.task for r in results))
    models = list(dict.fromkeys(r.model for r in results))
    lengths = sorted({L for r in results for L in r.by_length})
    cell = {(r.model, r.task): r for r in results}
    head = "| model | " + " | ".join(f"{t} ({'tok' if TASKS[t].metric == 'token' else 'exact'})" for t in tasks)
    head += "".join(f" | passkey L={L}" for L in lengths) + " |"
    rows = [head, "|---" * (1 + len(tasks) + len(lengths)) + "|"]
    for m in models:
        cells = [f"{cell[m, t].accuracy:.3f} (lr {cell[m, t].lr:g})" if (m, t) in cell else "" for t in tasks]
        pk = cell.get((m, "passkey"))
        cells += [f"{pk.by_length[L]:.3f}" if pk and L in pk.by_length else "" for L in lengths]
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: list[SynthResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r.task for r in results))
    models = list(dict.fromkeys(r.model for r in results))
    cell = {(r.model, r.task): r.accuracy for r in results}
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(tasks), 4))
    for i, m in enumerate(models):
        xs = [j + i * width for j, t in enumerate(tasks) if (m, t) in cell]
        ax.bar(xs, [cell[m, t] for t in tasks if (m, t) in cell], width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))])
    ax.set_xticklabels([f"{t}\n({'token acc' if TASKS[t].metric == 'token' else 'exact match'})" for t in tasks], fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("test accuracy")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks (default: all)")
    ap.add_argument("--models", default=",".join(model_names()), help="comma-separated models (default: the whole registry)")
    ap.add_argument("--steps", type=int, help="optimizer steps per learning rate")
    ap.add_argument("--lrs", help="comma-separated learning rates")
    ap.add_argument("--n-train", type=int)
    ap.add_argument("--n-test", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--model-set", action="append", default=[], metavar="MODEL:KEY=VALUE")
    ap.add_argument("--task-set", action="append", default=[], metavar="TASK:KEY=VALUE", help="a task parameter for one task")
    ap.add_argument("--out", default=str(ROOT / "docs" / "synthetic"), help="output path without suffix")
    args = ap.parse_args()
    try:
        tasks = [t for t in args.tasks.split(",") if t]
        models = [m for m in args.models.split(",") if m]
        model_over, task_over, synth_over = split_overrides(args.set)
        for key in ("steps", "lrs", "n_train", "n_test"):
            if getattr(args, key) is not None:
                synth_over[key] = getattr(args, key)
        per_model, per_task = scoped(args.model_set, models, "--model-set"), scoped(args.task_set, tasks, "--task-set")
        cfg = synth_config(synth_over)
        results = []
        for task in tasks:
            for m in models:
                values = merge(model_over, split_overrides(per_model.get(m))[0])
                params = merge(task_over, split_overrides(per_task.get(task))[0])
                r = run_synth(task, m, values, params, cfg, log=print)
                print(summary(r) + f" [{r.seconds:.0f}s]", flush=True)
                results.append(r)
    except RecurformerError as e:
        sys.exit(f"synthetic.py: error: {e}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv[1:], "synth": vars(cfg)}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": [result_dict(r) for r in results]}, indent=2))
    md = table(results)
    out.with_suffix(".md").write_text(md + "\n")
    plot(results, out.with_suffix(".png"))
    print(md)
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
