"""benchmarks/recall_frontier.py: one table row per run, with the model, recipe and seed its file
names, its state bytes (recorded or measured), its accuracy by distance and its own test's exact
match; a bad file is one clear error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import recall_frontier  # noqa: E402

from recurformer.config import RecurformerError  # noqa: E402

TINY = {"vocab_size": 64, "dim": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32}
PARAMS = {"vocab_size": 64, "key_vocab": 24, "value_vocab": 24, "num_pairs": 8, "num_queries": 8, "distance": 0}


def fake(tmp: Path, name: str, model: str, by_length: dict[str, float], exact: float, **extra: object) -> str:
    r = {
        "task": "mqar",
        "model": model,
        "by_length": by_length,
        "test": {"exact_match": exact},
        "task_params": PARAMS,
        "model_config": {**TINY, **extra.pop("config", {})},  # type: ignore[dict-item]
        "bounded_state": extra.pop("bounded", True),
        **extra,
    }
    (tmp / name).write_text(json.dumps(r))
    return str(tmp / name)


def test_rows_are_runs_sorted_by_state_with_their_own_numbers(tmp_path: Path) -> None:
    a = fake(
        tmp_path,
        "rmt.mixed.seed2.json",
        "rmt",
        {"0": 0.9, "128": 0.8},
        0.25,
        state_bytes=500,
        config={"associative": True},
    )
    b = fake(
        tmp_path,
        "gated_deltanet.mixed.seed0.json",
        "gated_deltanet",
        {"0": 1.0, "128": 0.95, "512": 0.5},
        0.75,
        state_bytes=100,
    )
    c = fake(tmp_path, "rmt.recall-first.seed1.json", "rmt", {"128": 0.3}, 0.0, state_bytes=500)
    rows = recall_frontier.cells([a, b, c], 128)
    assert [(r["model"], r["recipe"], r["seed"]) for r in rows] == [
        ("gated_deltanet", "mixed", 0),
        ("armt", "mixed", 2),
        ("rmt", "recall-first", 1),
    ]
    assert [r["state_bytes"] for r in rows] == [100, 500, 500]
    assert [r["accuracy"] for r in rows] == [0.95, 0.8, 0.3]
    assert [r["exact"] for r in rows] == [0.75, 0.25, 0.0]
    md = recall_frontier.table(rows, 128).splitlines()
    assert md[0] == "| model | recipe | seed | state bytes per row | d = 0 | d = 128 | d = 512 | exact (own test) |"
    assert md[2] == "| gated_deltanet | mixed | 0 | 100 | 1.000 | 0.950 | 0.500 | 0.750 |"
    assert md[4] == "| rmt | recall-first | 1 | 500 | – | 0.300 | – | 0.000 |"


def test_measured_state_marks_the_growing_control(tmp_path: Path) -> None:
    """Without a recorded size the state is measured after a row at the distance: full attention's
    KV cache (2 numbers x dim per token per layer) grows with the distance, a bounded state does not."""
    p = [
        fake(tmp_path, "llama.x.seed0.json", "llama", {"64": 1.0, "128": 1.0}, 1.0, bounded=False),
        fake(tmp_path, "rmt.x.seed0.json", "rmt", {"64": 1.0, "128": 1.0}, 1.0),
    ]
    near, far = recall_frontier.cells(p, 64), recall_frontier.cells(p, 128)
    llama = {d: next(r for r in rows if r["model"] == "llama") for d, rows in ((64, near), (128, far))}
    rmt = {d: next(r for r in rows if r["model"] == "rmt") for d, rows in ((64, near), (128, far))}
    assert llama[128]["state_bytes"] - llama[64]["state_bytes"] == 64 * 2 * TINY["dim"] * TINY["n_layers"] * 4
    assert rmt[128]["state_bytes"] == rmt[64]["state_bytes"] > 0
    assert "(grows; at d = 128)" in recall_frontier.table(far, 128)


@pytest.mark.parametrize(
    "name, by_length, match",
    [
        ("rmt.mixed.json", {"128": 0.5}, "MODEL.RECIPE.seedN.json"),
        ("rmt.mixed.seed0.json", {"32": 0.5}, "no test at distance 128"),
    ],
)
def test_bad_results_are_one_clear_error(tmp_path: Path, name: str, by_length: dict[str, float], match: str) -> None:
    p = fake(tmp_path, name, "rmt", by_length, 0.0, state_bytes=1)
    with pytest.raises(RecurformerError, match=match):
        recall_frontier.cells([p], 128)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    p = fake(tmp_path, "llama.x.seed0.json", "llama", {"128": 1.0}, 1.0, bounded=False, state_bytes=9)
    recall_frontier.plot(recall_frontier.cells([p], 128), 128, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 0
