"""benchmarks/memory_plots.py: the table by distance (passkey / MQAR results) as before, and by
a setting of ``synth.eval_settings`` (``--setting``), with full attention as the ceiling and
earlier results beside where they were tested at that setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_plots  # noqa: E402

TINY = {"vocab_size": 64, "dim": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32}
HARD, EASY = "seq_len=128,num_pairs=32", "seq_len=16,num_pairs=2"


def fake(tmp: Path, name: str, model: str, task: str, params: dict, **by: dict) -> str:
    r = {"task": task, "model": model, "task_params": params, "model_config": TINY, "by_length": {}, **by}
    (tmp / name).write_text(json.dumps(r))
    return str(tmp / name)


def plots(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_plots.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def test_the_table_at_a_setting_with_the_ceiling_and_earlier_results(tmp_path: Path) -> None:
    zoo = {"vocab_size": 64, "seq_len": 32, "num_pairs": 4, "power_a": 0.01}
    runs = [
        fake(tmp_path, "llama.fixed-w16.seed0.json", "llama", "mqar_zoology", zoo, by_setting={HARD: 0.9, EASY: 1.0}),
        fake(tmp_path, "rmt.fixed-w16.seed0.json", "rmt", "mqar_zoology", zoo, by_setting={HARD: 0.25, EASY: 0.75}),
        fake(tmp_path, "rmt.fixed-w16.seed1.json", "rmt", "mqar_zoology", zoo, by_setting={HARD: 0.35, EASY: 0.85}),
    ]
    mqar = {"vocab_size": 64, "key_vocab": 24, "value_vocab": 24, "num_pairs": 8, "num_queries": 8, "distance": 0}
    old = fake(tmp_path, "old.json", "rmt", "mqar", mqar, by_length={"0": 0.5})
    same = fake(tmp_path, "same.json", "rmt", "mqar_zoology", zoo, by_setting={HARD: 0.1})
    out = tmp_path / "zoo"
    p = plots(*runs, "--setting", HARD, "--out", str(out), "--extra", old, same)
    assert p.returncode == 0, p.stderr
    table = (tmp_path / "zoo.md").read_text().splitlines()
    assert table[0] == f"| model recipe | state bytes @{HARD} | {HARD} | {EASY} |"
    llama, rmt = table[2].split(" | "), table[3].split(" | ")
    assert llama[0] == "| llama fixed-w16" and llama[2:] == ["0.900 (1)", "1.000 (1) |"]
    assert rmt[0] == "| rmt fixed-w16" and rmt[2:] == ["0.300 (2)", "0.800 (2) |"]
    # llama's KV cache measured after a row of the setting (128 tokens), not of the task's own (32)
    assert (
        llama[1]
        == f"{memory_plots.state_bytes('llama', TINY, 128):,}"
        != f"{memory_plots.state_bytes('llama', TINY, 32):,}"
    )
    assert f"note: --extra {old} skipped: no result at {HARD} on mqar_zoology" in p.stdout
    assert "same.json skipped" not in p.stdout
    assert table[-2:] == [
        "ceiling: full attention (llama fixed-w16) 0.900",
        f"earlier: rmt 0.100 ({rmt[1]} state bytes)",
    ]
    assert {f.name for f in tmp_path.glob("zoo*")} == {"zoo_setting.png", "zoo_state.png", "zoo.md", "zoo.json"}
    assert json.loads((tmp_path / "zoo.json").read_text())["by_setting"]["rmt fixed-w16"][EASY] == [0.75, 0.85]


def test_the_table_by_distance_is_unchanged(tmp_path: Path) -> None:
    params = {"vocab_size": 32, "length": 16, "key_len": 4, "key_vocab": 16, "key_span": 0.0}
    a = fake(tmp_path, "llama.fixed.seed0.json", "llama", "passkey", params, by_length={"16": 1.0, "64": 0.5})
    b = fake(tmp_path, "rmt.mixed.seed0.json", "rmt", "passkey", params, by_length={"16": 0.75})
    p = plots(a, b, "--distance", "16", "--out", str(tmp_path / "pk"))
    assert p.returncode == 0, p.stderr
    table = (tmp_path / "pk.md").read_text().splitlines()
    assert table[0] == "| model recipe | state bytes @16 | d=16 | d=64 |"
    assert table[2].endswith("| 1.000 (1) | 0.500 (1) |") and table[3].endswith("| 0.750 (1) | - |")
    assert (tmp_path / "pk_distance.png").exists() and (tmp_path / "pk_state.png").exists()
    assert plots(a, "--out", str(tmp_path / "x")).returncode == 2  # one of --distance / --setting
