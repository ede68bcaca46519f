"""The two standard pictures of multi-query associative recall (Arora et al., "Zoology: Measuring
and Improving Recall in Efficient Language Models", 2023, Fig. 2 and §4), and a passkey table,
from ``recurformer synth --json`` results (e.g. those ``experiments/memory/run_grid.sh`` writes):

- ``<out>_distance.png``: test accuracy vs the task's length (MQAR: the distance between the
  pairs and the queries; passkey: the filler), one line per model and recipe, mean over seeds with
  min-max bars;
- ``<out>_state.png``: accuracy vs the state's size in bytes per row at one distance, measured
  as ``recurformer info`` does, from the state itself (``statesize.measure``) at that row length;
- ``<out>.md`` / ``<out>.json``: the table behind both (every number with its seeds).

With ``--setting KEY`` instead of ``--distance`` (results of ``synth.eval_settings``, e.g. Zoology's
MQAR protocol, ``experiments/memory/configs/mqar_zoology-fixed.yaml``): the first picture is
``<out>_setting.png``, accuracy per setting, and the state picture and the table read
``by_setting[KEY]``, with full attention (llama) as the ceiling, a dashed line at its accuracy;
``--extra`` results (earlier runs) are drawn beside in grey where they were tested at KEY too.

    python benchmarks/memory_plots.py runs/memory/*.json --distance 128 --out out/memory/mqar
    python benchmarks/memory_plots.py runs/longcontext/mqar_zoology/*.json --setting seq_len=1024,num_pairs=256 \
        --out out/zoology --extra docs/results/data/synthetic/mqar_*/*.seed*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recurformer.config import RecurformerError  # noqa: E402
from recurformer.data.synthetic import get_task, make_split, row_tokens  # noqa: E402
from recurformer.models import build_model  # noqa: E402
from recurformer.statesize import measure  # noqa: E402
from recurformer.synth.config import with_setting  # noqa: E402


def state_bytes(name: str, config: dict[str, Any], length: int) -> int:
    """Bytes per row of the state after reading ``length`` tokens (``statesize.measure``; fp32):
    constant for a bounded state, the KV cache of the row for full attention."""
    return int(4 * measure(build_model(name, {k: v for k, v in config.items() if k != "name"})).at(length))


def row_length(task: str, params: dict[str, Any], length: int) -> int:
    """Tokens in a row of ``task`` (parameters ``params``) set to ``length`` (MQAR: the distance)."""
    return int(make_split(task, 1, 0, get_task(task).at_length(params, length)).inputs.shape[1])


def setting_length(task: str, params: dict[str, Any], key: str) -> int:
    """Tokens in a row of ``task`` at the setting ``key`` (``seq_len=1024,num_pairs=256``)."""
    setting = dict(kv.split("=", 1) for kv in key.split(","))
    return row_tokens(task, with_setting(get_task(task), params, setting, "eval_settings"))


LENGTH_LABEL = {
    "mqar": "distance from the pairs to the queries (tokens; 0 plotted at 1)",
    "passkey": "the passkey's filler length L (tokens)",
}


def look(i: int) -> dict[str, str]:
    """The i-th line's colour, line style and marker: ten colours, then a new style and marker."""
    return {"color": f"C{i % 10}", "ls": ("-", "--", "-.")[i // 10 % 3], "marker": ("o", "s", "^")[i // 10 % 3]}


def label(r: dict[str, Any]) -> str:
    return f"{r['model']} {r.get('recipe', '')}".strip()


def load(paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        r = json.loads(Path(p).read_text())
        if "by_length" not in r:
            raise RecurformerError(f"{p} is not a `recurformer synth --json` result")
        r.setdefault("recipe", Path(p).stem.split(".")[1] if "." in Path(p).stem else "")
        out.append(r)
    return out


def summarise(results: list[dict[str, Any]], setting: bool = False) -> dict[str, dict[Any, list[float]]]:
    """label -> distance (``setting``: the setting's name, from ``by_setting``) -> accuracies over seeds."""
    table: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        for d, acc in r.get("by_setting", {}).items() if setting else r["by_length"].items():
            table[label(r)][d if setting else int(d)].append(acc)
    return table


def ceiling(ax: Any, table: dict[str, dict[Any, list[float]]], at: Any) -> str:
    """Full attention's accuracy at ``at`` (the best llama line) as a dashed horizontal line, labelled;
    returns that label ("" without a llama result)."""
    full = {lab: statistics.fmean(by[at]) for lab, by in table.items() if lab.startswith("llama") and by.get(at)}
    if not full:
        return ""
    lab = max(full, key=full.__getitem__)
    ax.axhline(full[lab], color="k", ls="--", lw=1, label=(said := f"ceiling: full attention ({lab}) {full[lab]:.3f}"))
    return said


def extras(paths: list[str], key: str, task: str) -> list[dict[str, Any]]:
    """The ``--extra`` results tested at setting ``key`` on ``task``; each other one skipped with a note."""
    out = []
    for r, p in zip(load(paths), paths):
        if r["task"] == task and key in r.get("by_setting", {}):
            out.append(r)
        else:
            print(f"note: --extra {p} skipped: no result at {key} on {task}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="synth --json files (named MODEL.RECIPE.seedN.json by the runner)")
    at = ap.add_mutually_exclusive_group(required=True)
    at.add_argument("--distance", type=int, help="the distance of the accuracy vs state size picture")
    at.add_argument("--setting", help="instead: a setting of synth.eval_settings, e.g. seq_len=1024,num_pairs=256")
    ap.add_argument("--extra", nargs="+", default=[], help="with --setting: earlier results drawn in grey")
    ap.add_argument(
        "--out", required=True, help="output prefix: <out>_distance.png, <out>_state.png, <out>.md, <out>.json"
    )
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load(args.results)
    task = {r["task"] for r in results}
    if len(task) != 1:
        raise RecurformerError(f"give results of one task, got {sorted(task)}")
    by_setting = args.setting is not None
    at = args.setting if by_setting else args.distance
    table = summarise(results, by_setting)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    name = task.pop()

    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    order = list(dict.fromkeys(k for r in results for k in r.get("by_setting", {})))  # as the runs list them
    for i, (lab, by_d) in enumerate(sorted(table.items())):
        ds = [d for d in order if d in by_d] if by_setting else sorted(by_d)
        mean = [statistics.fmean(by_d[d]) for d in ds]
        lo = [m - min(by_d[d]) for m, d in zip(mean, ds)]
        hi = [max(by_d[d]) - m for m, d in zip(mean, ds)]
        xs = [order.index(d) for d in ds] if by_setting else [max(d, 1) for d in ds]
        ax.errorbar(xs, mean, yerr=[lo, hi], capsize=3, label=lab, **look(i))
    if by_setting:
        ax.set_xticks(range(len(order)), [d.replace(",", "\n") for d in order], fontsize=7)
        ax.set_xlabel("test setting")
    else:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(LENGTH_LABEL.get(name, "task length (tokens; 0 plotted at 1)"))
    ax.set_ylabel("test accuracy" if name != "passkey" else "exact match")
    ax.set_title(f"{name}: accuracy vs {'setting' if by_setting else 'length'} (mean over seeds, min-max bars)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(f"{out}_{'setting' if by_setting else 'distance'}.png", dpi=120)

    def row_at(r: dict[str, Any]) -> int:
        if by_setting:
            return setting_length(r["task"], r["task_params"], args.setting)
        return row_length(r["task"], r["task_params"], args.distance)

    rows = []
    sizes: dict[str, int] = {}
    for r in results:
        lab = label(r)
        if lab not in sizes:
            sizes[lab] = state_bytes(r["model"], r["model_config"], row_at(r))
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    for i, (lab, by_d) in enumerate(sorted(table.items())):
        accs = by_d.get(at)
        if not accs:
            continue
        m = statistics.fmean(accs)
        ax.errorbar([sizes[lab]], [m], yerr=[[m - min(accs)], [max(accs) - m]], capsize=3, label=lab, **look(i))
        rows.append({"label": lab, "state_bytes": sizes[lab], "accuracy": accs, "mean": m})
    notes = []  # the ceiling and the earlier results, under the table
    if by_setting:
        notes.append(ceiling(ax, table, at))
        for r in extras(args.extra, args.setting, name):
            size = state_bytes(r["model"], r["model_config"], row_at(r))
            said = f"earlier: {label(r)} {r['by_setting'][at]:.3f} ({size:,} state bytes)"
            ax.scatter([size], [r["by_setting"][at]], color="0.6", marker="x", label=said)
            notes.append(said)
    where = f"setting {at}" if by_setting else f"distance {at}"
    ax.set_xscale("log")
    ax.set_xlabel(f"state size per row (bytes, measured after a row at this {where.split()[0]})")
    ax.set_ylabel(f"test accuracy at {where}")
    ax.set_title("accuracy vs state size")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(f"{out}_state.png", dpi=120)

    ds = order if by_setting else sorted({d for by_d in table.values() for d in by_d})
    md = [
        f"| model recipe | state bytes @{at} | " + " | ".join(str(d) if by_setting else f"d={d}" for d in ds) + " |",
        "|---|---|" + "---|" * len(ds),
    ]
    for lab, by_d in sorted(table.items()):
        cells = [f"{statistics.fmean(by_d[d]):.3f} ({len(by_d[d])})" if d in by_d else "-" for d in ds]
        md.append(f"| {lab} | {sizes.get(lab, 0):,} | " + " | ".join(cells) + " |")
    text = "\n".join(md) + "\n\nmean test accuracy (number of seeds)\n" + "".join(f"{n}\n" for n in notes if n)
    print(text)
    Path(f"{out}.md").write_text(text)
    Path(f"{out}.json").write_text(
        json.dumps(
            {
                f"by_{'setting' if by_setting else 'distance'}": {
                    k: {str(d): v for d, v in b.items()} for k, b in table.items()
                },
                "state": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}_{'setting' if by_setting else 'distance'}.png, {out}_state.png, {out}.md, {out}.json")


if __name__ == "__main__":
    try:
        main()
    except RecurformerError as e:
        sys.exit(f"memory_plots.py: error: {e}")
