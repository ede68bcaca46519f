"""Recall against state size, one point per run (Arora et al., "Zoology: Measuring and Improving
Recall in Efficient Language Models", 2023, §4 and Fig. 2): multi-query associative recall at one
distance against the bytes of state a model carries per row, from ``recurformer synth --json``
results named ``MODEL.RECIPE.seedN.json``.

The state is measured as ``recurformer info`` does (``statesize.measure``, fp32) after a row at that
distance, unless the result records ``state_bytes``; a model whose state grows with the text (full
attention: its KV cache) is marked as such, its size being that of the row read. Writes
``<out>.png`` (accuracy at the distance vs state bytes per row, log x), ``<out>.md`` (one row per run:
state, accuracy by distance, exact match of the run's own test) and ``<out>.json`` (the same rows).

    python benchmarks/recall_frontier.py DIR/*.json --distance 128 --out DIR/frontier
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from memory_plots import row_length, state_bytes  # noqa: E402

from recurformer.config import RecurformerError  # noqa: E402

NAME = re.compile(r"^(?P<model>[^.]+)\.(?P<recipe>[^.]+)\.seed(?P<seed>\d+)\.json$")


def model_label(r: dict[str, Any]) -> str:
    """The model's name, ``rmt`` with ``associative: true`` as ``armt`` (Rodkin et al., "Associative
    Recurrent Memory Transformer", §3)."""
    return "armt" if r["model"] == "rmt" and r["model_config"].get("associative") else r["model"]


def measured_bytes(r: dict[str, Any], distance: int) -> int:
    """State bytes per row after a row of ``r``'s task at ``distance`` (``statesize.measure``, fp32)."""
    return state_bytes(r["model"], r["model_config"], row_length(r["task"], r["task_params"], distance))


def cell(path: str, r: dict[str, Any], distance: int, size: int) -> dict[str, Any]:
    """One run as a table row: model, recipe and seed (from the file's name), its state bytes per row,
    test accuracy by distance, the exact match of its own test (``test.exact_match``)."""
    m = NAME.match(Path(path).name)
    if m is None:
        raise RecurformerError(f"{path}: name it MODEL.RECIPE.seedN.json (the seed is not in the result)")
    if r.get("task") != "mqar" or "by_length" not in r:
        raise RecurformerError(f"{path} is not a `recurformer synth --task mqar --json` result")
    by = {int(d): float(a) for d, a in r["by_length"].items()}
    if distance not in by:
        raise RecurformerError(f"{path} has no test at distance {distance} (synth.eval_lengths: {sorted(by)})")
    return {
        "model": model_label(r),
        "recipe": m["recipe"],
        "seed": int(m["seed"]),
        "state_bytes": int(size),
        "bounded": bool(r["bounded_state"]),
        "accuracy": by[distance],
        "by_distance": by,
        "exact": float(r["test"]["exact_match"]),
        "file": Path(path).name,
    }


def cells(paths: list[str], distance: int) -> list[dict[str, Any]]:
    """Every run of ``paths`` as a row, sorted by state size, model, recipe and seed."""
    out = []
    for p in paths:
        if not Path(p).is_file():
            raise RecurformerError(f"{p}: no such file")
        r = json.loads(Path(p).read_text())
        out.append(cell(p, r, distance, r["state_bytes"] if "state_bytes" in r else measured_bytes(r, distance)))
    return sorted(out, key=lambda c: (c["state_bytes"], c["model"], c["recipe"], c["seed"]))


def table(rows: list[dict[str, Any]], distance: int) -> str:
    """The markdown table: one line per run; distances every run was tested at, '–' where it was not."""
    ds = sorted({d for c in rows for d in c["by_distance"]})
    head = ["model", "recipe", "seed", "state bytes per row", *(f"d = {d:,}" for d in ds), "exact (own test)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in rows:
        size = f"{c['state_bytes']:,}" + ("" if c["bounded"] else f" (grows; at d = {distance:,})")
        accs = [f"{c['by_distance'][d]:.3f}" if d in c["by_distance"] else "–" for d in ds]
        lines.append(
            "| " + " | ".join([c["model"], c["recipe"], str(c["seed"]), size, *accs, f"{c['exact']:.3f}"]) + " |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], distance: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = sorted({f"{c['model']} {c['recipe']}" for c in rows})
    colors = plt.get_cmap("tab20")  # 20 colours, and a marker per model: no two series look alike
    shapes = dict(zip(sorted({c["model"] for c in rows}), "os^vPX*<>ph8", strict=False))
    for i, lab in enumerate(labels):
        mine = [c for c in rows if f"{c['model']} {c['recipe']}" == lab]
        grows = not mine[0]["bounded"]
        color = colors(i % 20)
        ax.scatter(
            [c["state_bytes"] for c in mine],
            [c["accuracy"] for c in mine],
            s=60 if grows else 40,
            marker="D" if grows else shapes.get(mine[0]["model"], "o"),
            facecolors="none" if grows else color,
            edgecolors=color,
            alpha=0.85,
            label=lab + (" (control: state grows with the row)" if grows else ""),
        )
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.axhline(1 / 24, color="grey", lw=0.8, ls=":", label="chance (1/24)")
    ax.set_xlabel(f"state bytes per row (fp32, measured after a row at distance {distance})")
    ax.set_ylabel(f"MQAR test accuracy at distance {distance}")
    ax.set_title("recall vs state size, one point per run")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="synth --json files named MODEL.RECIPE.seedN.json")
    ap.add_argument("--distance", type=int, default=128, help="the distance plotted (one of the runs' eval_lengths)")
    ap.add_argument("--out", required=True, help="output prefix: <out>.png, <out>.md, <out>.json")
    args = ap.parse_args()
    rows = cells(args.results, args.distance)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.distance, f"{out}.png")
    text = table(rows, args.distance)
    print(text)
    Path(f"{out}.md").write_text(text)
    Path(f"{out}.json").write_text(json.dumps({"distance": args.distance, "runs": rows}, indent=2) + "\n")
    print(f"wrote {out}.png, {out}.md, {out}.json")


if __name__ == "__main__":
    try:
        main()
    except RecurformerError as e:
        sys.exit(f"recall_frontier.py: error: {e}")
