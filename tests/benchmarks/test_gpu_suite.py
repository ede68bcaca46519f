"""benchmarks/gpu_suite.py: the dry run (every stage at toy sizes on the CPU), its plan, and its
one-line refusals that leave finished stages' JSON alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402


def suite(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def suite_here(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """``gpu_suite.py``'s ``main`` in this process (a process of its own costs an import of torch and
    recurformer; the dry run's test keeps one): (exit code, stdout, stderr), a message given to
    ``sys.exit`` printed on stderr with code 1, as Python does."""
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", *args])
    capsys.readouterr()
    rc = 0
    try:
        gpu_suite.main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        rc = 1 if isinstance(e.code, str) else int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow  # every stage of the suite at toy sizes: about a minute on a 2-core CPU
def test_dry_run_writes_every_stage(tmp_path: Path) -> None:
    done = suite("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    for name in gpu_suite.STAGES:
        rec = json.loads((tmp_path / f"{name}.json").read_text())
        assert rec["status"] == "ok", (name, rec)
    r = {n: json.loads((tmp_path / f"{n}.json").read_text())["result"] for n in gpu_suite.STAGES}
    assert r["env"]["bf16_matmul_tflops"] > 0 and r["env"]["d2d_copy_gb_s"] > 0
    # the CUDA-named rows ran and passed: where a GPU is, all of them; on a CPU the CUDA-only ones
    # were skipped and the others (a missing GPU's one-line error) passed, so the stage is seen
    # running rows, not only skipping them (that the count tells a pass, a failure and a skip
    # apart: test_tests_stage_counts_what_ran)
    tests = r["tests"]
    assert tests["rc"] == 0 and tests["failed"] == 0 and tests["passed"] > 0, tests
    assert torch.cuda.is_available() or tests["skipped"] > 0, tests
    assert {x["model"] for x in r["throughput"]["rows"]} == set(gpu_suite.model_names())
    assert all(x["train_tokens_per_s"] > 0 for x in r["throughput"]["rows"])
    assert [x["N"] for x in r["tiling"]["forward"]["rows"]] == [32, 64] and len(r["tiling"]["train"]["training"]) == 2
    for row in r["streaming"]["models"].values():
        assert [m["tokens"] for m in row["eval"]] == [64, 128, 256] and [m["tokens"] for m in row["generate"]] == [
            64,
            128,
            256,
        ]
    assert {n: x["checkpoint_step"] for n, x in r["paper"]["runs"].items()} == dict.fromkeys(gpu_suite.PAPER_RUNS, 2)
    assert set(r["paper"]["eval"]["results"]) == set(gpu_suite.PAPER_RUNS)
    # graphed training and decoding: the capture protocol's gradients equal eager ones under
    # accumulation 2 for each way of carrying the state (every model: tests/test_capture.py), and
    # every row measured both kinds; Gated DeltaNet's fla row and the micro-batch search (CUDA
    # only) recorded as skipped with why
    graphs = {x["key"]: x for x in r["graphs"]["rows"]}
    assert set(graphs) == {"gated_deltanet[chunked]/base", "llama/base"} and not r["graphs"]["failed"], r["graphs"]
    assert set(r["graphs"]["skipped"]) == {"gated_deltanet[fla]", "gated_deltanet[chunked]/fit", "llama/fit"}
    assert "CUDA only" in r["graphs"]["skipped"]["gated_deltanet[fla]"]
    for x in graphs.values():
        assert x["grad_check"]["ok"] and x["grad_check"]["max_diff_over_max_grad"] == 0.0, x
        assert all(
            x["train"][k]["tokens_per_s"] > 0 and x["generate"][k]["tokens_per_s"] > 0 for k in ("eager", "graphed")
        )
        assert all(x["profile"][k]["operators"] > 0 for k in ("eager", "graphed"))
    assert r["graphs"]["micro_batch"]["llama"]["base"]["batch"] == gpu_suite.DRY_BASE_BATCH
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"## {n}" in summary for n in gpu_suite.STAGES)


def every_row(fla: str | None = None, measured: frozenset[str] = frozenset()) -> list[str]:
    rows, _ = gpu_suite.graph_rows(gpu_suite.model_names(), fla, set(measured))
    return [r.key for r in rows]


def test_graphs_stage_plans_every_model_at_both_micro_batches() -> None:
    """Every registered model, Gated DeltaNet with fla's kernel and with ours where fla runs (ours
    alone, the fla row skipped with why, where it does not), each at 16 rows and at the largest
    that fits; models without a measured row first, in registration order."""
    names = gpu_suite.model_names()
    labels = [n for n in names if n != "gated_deltanet"] + ["gated_deltanet[fla]", "gated_deltanet[chunked]"]
    assert sorted(every_row()) == sorted(f"{lab}/{k}" for lab in labels for k in ("base", "fit"))
    rows, skipped = gpu_suite.graph_rows(names, "skipped: no fla", set())
    assert "gated_deltanet[fla]/base" not in [r.key for r in rows] and skipped == {
        "gated_deltanet[fla]": "skipped: no fla"
    }
    measured = frozenset({"llama", "rmt", "memory_attention"})
    order = every_row(measured=measured)
    assert [k.split("/")[0] for k in order[-6:]] == [n for n in names if n in measured for _ in range(2)], order
    assert order[:2] == [f"{names[0]}/base", f"{names[0]}/fit"] and names[0] not in measured


def fake_bench(measured: list[str], oom_above: int = 10**9) -> Callable[..., dict]:
    """graphs_bench.py's process stood in: a row at the asked batch, or the child's out-of-memory
    exit above ``oom_above`` rows."""

    def bench(cmd: list[str], timeout: float, log: Path | None = None) -> dict:
        model, out, batch = (
            cmd[cmd.index("--model") + 1],
            Path(cmd[cmd.index("--out") + 1]),
            int(cmd[cmd.index("--batch") + 1]),
        )
        impl = cmd[cmd.index("--impl") + 1] if "--impl" in cmd else None
        measured.append(f"{model}[{impl}]@{batch}" if impl else f"{model}@{batch}")
        if batch > oom_above:
            return dict(rc=gpu_suite.OOM_EXIT, timed_out=False, tail="out of memory: CUDA out of memory")
        rate = dict(tokens_per_s=1000.0 * (1 + batch / 100), fraction_of_peak=0.1)
        out.write_text(
            json.dumps(dict(model=model, batch=batch, train={"eager": rate, "graphed": rate}, generate={"eager": {}}))
        )
        return dict(rc=0, timed_out=False, tail="")

    return bench


def test_micro_batch_search_takes_the_largest_that_fits(tmp_path: Path, monkeypatch) -> None:
    """128 rows run out of memory, 64 fit: the fit row is at 64, the tries recorded, 32 never tried,
    and the better micro-batch read off both rows."""
    measured: list[str] = []
    monkeypatch.setattr(gpu_suite, "run", fake_bench(measured, oom_above=64))
    ctx = gpu_suite.Ctx(out=tmp_path, dry=False, device=torch.device("cuda"), seconds=600, scratch=tmp_path)
    r = gpu_suite.GraphRow("llama", None, "fit")
    row, why = gpu_suite.graphs_fit(ctx, r, ["gpu_suite.py", "--model", "llama"], 100)
    assert measured == ["llama@128", "llama@64"] and why is None
    assert row is not None and row["fit"] == dict(tried={"128": "out of memory", "64": "fitted"}, batch=64, done=True)
    base = dict(
        key="llama/base", model="llama", batch=16, train={"graphed": dict(tokens_per_s=900.0, fraction_of_peak=0.2)}
    )
    mb = gpu_suite.micro_batches([base, row])["llama"]
    assert mb["base"]["batch"] == 16 and mb["fit"]["batch"] == 64 and mb["better"] == 64, mb
    measured.clear()
    monkeypatch.setattr(gpu_suite, "run", fake_bench(measured, oom_above=16))
    row, why = gpu_suite.graphs_fit(ctx, r, ["gpu_suite.py", "--model", "llama"], 100)
    assert measured == ["llama@128", "llama@64", "llama@32"] and why and "none of 128/64/32" in why
    assert row is not None and row["fit"]["done"] and row["fit"]["batch"] is None
    assert "llama" not in gpu_suite.micro_batches([row])


def test_graphs_child_exits_with_oom_exit(monkeypatch, capsys) -> None:
    """The child process: an out-of-memory error from graphs_bench.py is one line and ``OOM_EXIT``
    (the stage then tries a smaller micro-batch); ``--impl`` reaches the model's config."""
    import graphs_bench

    seen = {}

    def main() -> None:
        seen["config"] = graphs_bench.model_config("gated_deltanet", "toy")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(graphs_bench, "main", main)
    monkeypatch.setattr(graphs_bench, "model_config", graphs_bench.model_config)  # restored after
    with pytest.raises(SystemExit) as e:
        gpu_suite.graphs_child(["--impl", "fla", "--model", "gated_deltanet"])
    assert e.value.code == gpu_suite.OOM_EXIT and seen["config"]["impl"] == "fla"
    assert capsys.readouterr().err.strip().startswith("out of memory: CUDA out of memory")


def test_graphs_stage_measures_only_the_rows_a_partial_json_lacks(tmp_path: Path, monkeypatch) -> None:
    """A first call cut off after every base row but Memory Attention's (cut off during it): the
    second call keeps those rows, measures Memory Attention's again first (never measured), then
    the fit rows, and rewrites graphs.json after each. (graphs_bench.py's process stood in: the dry
    run's test runs it.)"""
    base = [k for k in every_row() if k.endswith("/base") and k != "memory_attention/base"]
    kept = [dict(key=k, model=k.split("[")[0].split("/")[0], train={}, generate={"eager": {}}) for k in base]
    cut = dict(key="memory_attention/base", model="memory_attention", train={})  # no generate: cut off
    (tmp_path / "graphs.json").write_text(json.dumps(dict(status="partial", result=dict(rows=[*kept, cut]))))
    measured: list[str] = []
    monkeypatch.setattr(gpu_suite, "run", fake_bench(measured))
    monkeypatch.setattr(gpu_suite, "fla_skip", lambda device: None)
    ctx = gpu_suite.Ctx(out=tmp_path, dry=False, device=torch.device("cuda"), seconds=3000, scratch=tmp_path)
    r = gpu_suite.stage_graphs(ctx)
    assert measured[0] == "memory_attention@16" and len(measured) == 1 + len(base) + 1, measured
    assert all(m.endswith("@128") for m in measured[1:]), measured
    assert r["rows"][: len(kept)] == kept and r["rows"][len(kept)]["key"] == "memory_attention/base", r
    assert json.loads((tmp_path / "graphs.json").read_text())["result"]["rows"] == r["rows"]


def test_tests_stage_counts_what_ran(tmp_path: Path) -> None:
    """The tests stage on a file of one passing, one failing and one skipped CUDA-named row and one
    other row: three selected, each counted as what it did, the failure named."""
    rows = tmp_path / "test_rows.py"
    rows.write_text(
        "import pytest\n"
        "def test_cuda_passes(): pass\n"
        "def test_cuda_fails(): assert False\n"
        "@pytest.mark.skip(reason='no CUDA GPU')\n"
        "def test_cuda_skipped(): pass\n"
        "def test_other(): pass\n"
    )
    ctx = gpu_suite.Ctx(out=tmp_path, dry=True, device=torch.device("cpu"), seconds=120, scratch=tmp_path)
    r = gpu_suite.stage_tests(ctx, target=[str(rows)])
    assert (r["passed"], r["failed"], r["skipped"]) == (1, 1, 1), r
    assert len(r["failures"]) == 1 and "test_cuda_fails" in r["failures"][0]


def test_budget_runs_out_cleanly(tmp_path: Path, capsys, monkeypatch) -> None:
    """A 6-second budget: env finishes, throughput is stopped at the deadline, paper is skipped."""
    rc, out, err = suite_here(
        capsys,
        monkeypatch,
        "--dry-run",
        "--budget-min",
        "0.1",
        "--stages",
        "env,throughput,paper",
        "--out",
        str(tmp_path),
    )
    assert rc == 0, err[-2000:]
    assert json.loads((tmp_path / "env.json").read_text())["status"] == "ok"
    assert not (tmp_path / "paper.json").exists() and "paper: skipped" in out
    assert (tmp_path / "summary.md").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dry-run", "--stages", "env,warp"], "--stages: unknown stage 'warp'"),
        (["--dry-run", "--budget-min", "0.01"], "--budget-min 0.01 is below"),
        (["--stages", "env"], "no CUDA device"),
    ],
)
def test_bad_input_is_one_line_and_keeps_finished_json(
    tmp_path: Path, args: list[str], message: str, capsys, monkeypatch
) -> None:
    if message == "no CUDA device" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    finished = tmp_path / "env.json"
    finished.write_text('{"stage": "env", "status": "ok"}')
    rc, _, err = suite_here(capsys, monkeypatch, *args, "--out", str(tmp_path))
    assert rc != 0
    assert err.strip().count("\n") == 0 and message in err, err
    assert finished.read_text() == '{"stage": "env", "status": "ok"}'


def test_finished_stage_is_kept_unless_redo(tmp_path: Path, capsys, monkeypatch) -> None:
    finished = tmp_path / "env.json"
    finished.write_text(json.dumps(dict(stage="env", status="ok", seconds=1, planned_s=1, result={"torch": "x"})))
    rc, out, _ = suite_here(capsys, monkeypatch, "--dry-run", "--stages", "env", "--out", str(tmp_path))
    assert rc == 0 and "exists, skipped" in out
    assert json.loads(finished.read_text())["result"] == {"torch": "x"}


def test_plan_shrinks_then_skips() -> None:
    every = list(gpu_suite.STAGES)
    full = gpu_suite.plan(every, 25, dry=False)
    fixed = sum(gpu_suite.STAGES[n].cost for n in every if n != "paper")
    assert full == {**{n: gpu_suite.STAGES[n].cost for n in every if n != "paper"}, "paper": pytest.approx(25 - fixed)}
    short = gpu_suite.plan(
        ["env", "tests", "throughput"], 6, dry=False
    )  # 9.5 planned: tests shrinks to leave throughput its least
    assert short == {"env": 0.5, "tests": 3.0, "throughput": 2.5}
    tight = gpu_suite.plan(["env", "tests", "paper"], 4, dry=False)  # tests shrinks to its least, paper does not fit
    assert tight["tests"] == gpu_suite.STAGES["tests"].least and tight["paper"] == 0.0
    assert sum(gpu_suite.plan(every, 9, dry=False).values()) <= 9
