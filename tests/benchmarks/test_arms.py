"""benchmarks/arms.py: training tok/s of an experiment's arms side by side, from their configs."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import arms  # noqa: E402


def arm_config(path: Path, corpus: Path, tmp: Path, model: str, state: str) -> Path:
    path.write_text(
        f"model: {{{model}, dim: 32, n_layers: 1, n_heads: 2}}\n"
        f"data: {{dataset: null, text_files: [{corpus}], tokenizer: byte, dir: {tmp / 'prepared'}}}\n"
        f"train: {{out_dir: {tmp / 'run'}, batch_size: 2, seq_len: 16, grad_accum: 2, truncation: 2, "
        f"precision: fp32, steps: 100, state: {state}}}\n"
    )
    return path


def test_arms_side_by_side(tmp_path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("<|endoftext|>".join("the cat sat on the mat " * 20 for _ in range(20)))
    a = arm_config(tmp_path / "ctrl.yaml", corpus, tmp_path, "name: llama", "reset")
    b = arm_config(tmp_path / "ma.yaml", corpus, tmp_path, "name: memory_attention, chunk_size: 8", "carry")
    out = tmp_path / "arms.json"
    assert arms.main([str(a), str(b), "--rounds", "3", "--steps", "1", "--warmup", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["arms"]
    assert [r["arm"] for r in rows] == ["ctrl", "ma"] and [r["model"] for r in rows] == ["llama", "memory_attention"]
    tokens = 2 * 2 * 16  # grad_accum x batch x seq_len per optimizer step
    for r in rows:
        assert len(r["seconds"]) == 3 and r["batch"] == "2 x 2 x 16"
        assert abs(r["tokens_per_s"] - statistics.median(tokens / s for s in r["seconds"])) <= 0.5
    ratios = [s0 / s for s0, s in zip(rows[0]["seconds"], rows[1]["seconds"])]
    assert rows[0]["ratio_to_first"] == 1.0 and abs(rows[1]["ratio_to_first"] - statistics.median(ratios)) < 1e-3
    assert not (tmp_path / "run").exists()  # the configured run folder is never written


def test_a_missing_config_is_one_line(tmp_path, capsys) -> None:
    assert arms.main([str(tmp_path / "nope.yaml"), str(tmp_path / "nope2.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "nope.yaml" in err and "\n" not in err
