"""Every GPU check and measurement in one command, planned within a time budget.

    PYTHONPATH=$PWD python3 benchmarks/gpu_suite.py                  # all stages, 25 minutes
    PYTHONPATH=$PWD python3 benchmarks/gpu_suite.py --dry-run        # toy sizes on the CPU (~1 minute; a CI test)

The dry run checks the plumbing, not the models one by one: its ``graphs`` stage measures one model
per way of carrying the state (``DRY_GRAPH_MODELS``) and records the CUDA-only rows (fla's kernel,
the micro-batch search) as skipped with why, and its ``throughput`` rows share one process.

Stages, in this order (``--stages`` picks some; each writes ``<stage>.json`` atomically as soon as
it finishes, so a run that is cut off keeps what it finished, and a later run in the same output
folder skips the stages already there unless ``--redo``):

* ``graphs`` (first: what is new): every registered model (Gated DeltaNet twice: fla's kernel where
  it imports, else that row skipped with why, and ours), ``benchmarks/graphs_bench.py`` in one
  process per row: training tokens/s and fraction of the bf16 peak eager, graphed
  (``capture.StepGraphs``) and, where the share allows, compiled + graphed; a gradient check
  graphed vs eager under accumulation 2; one profiled step of each (kernels, launches, GPU busy);
  batch-1 generation tokens/s eager vs graphed (``capture.DecodeGraphs``), at 16 rows per
  micro-batch; then each model's training at the largest of 128 / 64 / 32 rows that fits in GPU
  memory (largest first, a try that runs out of memory ending its own process), and which
  micro-batch is better. Models never measured (in this folder or an earlier suite's) run first;
  ``graphs.json`` is rewritten after every row (status ``partial``), so a call cut off keeps its
  rows and the next call into the folder measures the rest.
* ``env``: GPU name, memory, driver, torch / CUDA / Triton versions; the best bf16 and fp32
  n x n matmul (``recurformer.flops.matmul_peak``), device-to-device and pinned host-to-device
  copy bandwidth.
* ``tests``: the test suite's CUDA rows (``pytest -k cuda``), counted from its JUnit XML.
* ``throughput``: training tokens/s, fraction of the measured bf16 peak and step memory of every
  registered model at the ~125M-parameter config (dim 768, 12 layers, batch 16 x 1024, bf16),
  eager, then compiled in the time the eager rows leave (``benchmarks/throughput.py``, one
  process per model and row, so a slow model or compile, or one out of memory, costs only its
  own row).
* ``tiling``: one Recurrent Transformer layer, naive vs tiled, forward (N = 1k..16k) and forward +
  backward (time, bytes saved for backward), ``benchmarks/recurrent_tiling.py``.
* ``streaming``: per model, the allocator's peak while reading 64k tokens in calls of 1024 (the
  streaming evaluation) and while generating token by token to 1k..64k tokens (the generation
  child of ``benchmarks/generation.py``; a model that runs out of its time share keeps the marks
  it reached).
* ``paper``: the minutes left train Memory Attention at its paper's size (dim 288, 6 layers, 6 heads,
  chunk 32, shared memory Q/K/V, stateful carry over contiguous streams: the ``--scale paper``
  runs of ``benchmarks/extrapolation.py``) on tinystories-repeat; with at least 6 minutes, the
  Llama and sliding-window baselines train beside it to the same step count; then ``recurformer
  eval`` at 256..4096 tokens. A run is stopped by SIGTERM at its time (the trainer saves).

Planning: each stage has an estimated cost and a smallest useful cost (minutes); stages that do not
fit shrink (fewer compiled rows, shorter generation, a shorter training run) or are skipped, and
every stage is stopped at the deadline. ``summary.md`` is rewritten from every stage JSON in the
output folder after each run (``--summarize DIR`` only rewrites it).

Output: ``docs/results/data/gpu/suite_<gpu>_<date>/`` (``--out`` to choose). A device that allows at
most 10 minutes per command: run the stages in calls of ``--budget-min 9`` into one folder (the
``graphs`` call again if its JSON says ``partial``),

    python3 benchmarks/gpu_suite.py --stages graphs --budget-min 9 --out DIR
    python3 benchmarks/gpu_suite.py --stages env,tests,throughput --budget-min 9 --out DIR
    python3 benchmarks/gpu_suite.py --stages tiling,streaming --budget-min 9 --out DIR
    python3 benchmarks/gpu_suite.py --stages paper --budget-min 9 --out DIR

(with the files of each call copied back into one folder, ``--summarize DIR`` writes the summary).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

from recurformer.flops import matmul_peak  # noqa: E402
from recurformer.models import model_names  # noqa: E402

PY = sys.executable
RESULTS = ROOT / "docs" / "results" / "data" / "gpu"
PAPER_RUNS = ("memory_attention", "llama", "sliding_window")  # extrapolation.py's RUNS
EVAL_LENGTHS = "256,512,1024,2048,4096"
GEN_MARKS = (1024, 4096, 16384, 65536)
TOY = dict(vocab_size=256, dim=32, n_layers=3, n_heads=2)  # 3 layers: Block-Recurrent's recurrent layer is -3


class Budget:
    """The run's deadline; a stage gets ``min(its plan, what is left)`` seconds."""

    def __init__(self, minutes: float) -> None:
        self.end = time.monotonic() + 60 * minutes

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


@dataclass
class Ctx:
    out: Path
    dry: bool
    device: torch.device
    seconds: float  # this stage's allowance
    scratch: Path  # runs and prepared data

    def deadline(self) -> float:
        return time.monotonic() + self.seconds


def write_json(path: Path, obj: Any) -> None:
    """Atomic: a temporary file in the same folder, then renamed over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(obj, indent=1) if path.suffix == ".json" else obj)
    os.replace(tmp, path)


def run(cmd: list[str], timeout: float, log: Path | None = None, env: dict | None = None) -> dict:
    """A child process with a time limit: its exit code, whether it timed out, its output's tail
    (everything it printed before a timeout is kept)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        **(env or {}),
    )
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        out, rc, timed_out = done.stdout + done.stderr, done.returncode, False
    except subprocess.TimeoutExpired as e:
        parts = [p.decode() if isinstance(p, bytes) else (p or "") for p in (e.stdout, e.stderr)]
        out, rc, timed_out = "".join(parts), None, True
    if log is not None:
        log.write_text(out)
    return dict(rc=rc, timed_out=timed_out, tail=out[-1500:])


def device_kw(ctx: Ctx) -> list[str]:
    return ["--device", str(ctx.device)]


# -- stages --------------------------------------------------------------------------------------
def stage_env(ctx: Ctx) -> dict:
    dev = ctx.device
    info: dict[str, Any] = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        host=platform.node(),
    )
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
        )
        if shutil.which("nvidia-smi"):
            q = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,power.limit,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            info["nvidia_smi"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
            info["driver"] = info["nvidia_smi"].split(",")[0].strip() if info["nvidia_smi"] else None
    else:
        info.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    n = 256 if ctx.dry else None
    secs = 0.1 if ctx.dry else 1.0
    # 4 significant digits: a CPU's emulated bf16 under load can be far below 0.001 TFLOP/s, not 0
    info["bf16_matmul_tflops"] = float(f"{matmul_peak.__wrapped__(torch.bfloat16, str(dev), n, secs) / 1e12:.4g}")
    info["fp32_matmul_tflops"] = float(f"{matmul_peak.__wrapped__(torch.float32, str(dev), n, secs) / 1e12:.4g}")
    nbytes = (8 if ctx.dry else 1024) * 2**20
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    info["d2d_copy_gb_s"] = round(2 * nbytes / best_time(lambda: b.copy_(a), dev) / 1e9, 1)  # read + write
    if dev.type == "cuda":
        h = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        info["h2d_pinned_gb_s"] = round(nbytes / best_time(lambda: a.copy_(h, non_blocking=True), dev) / 1e9, 1)
    return info


def best_time(fn: Callable[[], Any], dev: torch.device, reps: int = 10) -> float:
    from recurformer.device import synchronize

    fn()
    best = float("inf")
    for _ in range(reps):
        synchronize(dev)
        t0 = time.perf_counter()
        fn()
        synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def stage_tests(ctx: Ctx, target: list[str] | None = None) -> dict:
    """``pytest -k cuda`` over ``target`` (the test suite; one file in the dry run), counted from
    its JUnit XML: passed, failed (errors included) and skipped rows."""
    xml = ctx.scratch / "tests.xml"
    target = target or (["tests/test_devices.py"] if ctx.dry else ["tests"])
    # -o addopts=: the ini's -q would cancel -v, whose one line per row names a row cut off before the summary
    cmd = [PY, "-m", "pytest", *"-o addopts= -v -p no:cacheprovider -k cuda".split(), f"--junitxml={xml}", *target]
    log = ctx.out / "tests.log"
    r = run(cmd, ctx.seconds - 5, log=log)
    res: dict[str, Any] = dict(command=" ".join(cmd[1:]), rc=r["rc"], timed_out=r["timed_out"])
    if not xml.is_file():  # cut off: count the rows pytest reported before it was stopped
        seen = re.findall(r"^(\S+::.+?) (PASSED|FAILED|SKIPPED|ERROR)", log.read_text(), flags=re.M)
        counts = {
            k: sum(1 for _, v in seen if v in vs)
            for k, vs in (("passed", ("PASSED",)), ("failed", ("FAILED", "ERROR")), ("skipped", ("SKIPPED",)))
        }
        return dict(
            res,
            **counts,
            failures=[t for t, v in seen if v in ("FAILED", "ERROR")],
            note="cut off: the rows before the stop",
        )
    cases = ET.parse(xml).getroot().iter("testcase")
    counts = dict(passed=0, failed=0, skipped=0)
    failures = []
    for c in cases:
        kind = next((ch.tag for ch in c if ch.tag in ("failure", "error", "skipped")), None)
        if kind == "skipped":
            counts["skipped"] += 1
        elif kind:
            counts["failed"] += 1
            msg = (c.find(kind).get("message") or "").splitlines()  # type: ignore[union-attr]
            failures.append(f"{c.get('classname')}::{c.get('name')}: {msg[0][:200] if msg else kind}")
        else:
            counts["passed"] += 1
    return dict(res, **counts, failures=failures)


# every registered model, Gated DeltaNet once per delta-rule kernel (fla's where it runs, ours)
DRY_GRAPH_MODELS = ("gated_deltanet", "llama")
# the dry run's: one model per way graphs_bench.py carries the state (a bounded state carried, a
# KV cache read from a fresh state each step), Gated DeltaNet for its two delta-rule rows; every
# model's captured step is held to its plain one by tests/test_capture.py, so more processes here
# would test imports, not the protocol
BASE_BATCH, FIT_BATCHES = 16, (128, 64, 32)  # rows per micro-batch: 16, then the largest that fits
DRY_BASE_BATCH = 2
FIT_ON_CPU = "skipped: the micro-batch search needs a GPU's memory to run out of (a CPU's never does)"
ROW_S = dict(base=75.0, fit=45.0)  # seconds a row is planned for on a GPU; rows left over wait for the next call
OOM_EXIT = 3  # a --graphs-row child that ran out of GPU memory


@dataclass(frozen=True)
class GraphRow:
    """One row of the graphs stage: a model (``impl``: Gated DeltaNet's ``model.impl``) at 16 rows
    per micro-batch (``base``) or at the largest of ``FIT_BATCHES`` that fits (``fit``)."""

    model: str
    impl: str | None
    kind: str  # "base" or "fit"

    @property
    def label(self) -> str:
        return self.model + (f"[{self.impl}]" if self.impl else "")

    @property
    def key(self) -> str:
        return f"{self.label}/{self.kind}"


def row_key(x: dict) -> str:
    """A measured row's ``GraphRow.key`` (rows written before there were keys: a base row)."""
    return x.get("key") or x["model"] + (f"[{x['impl']}]" if x.get("impl") else "") + "/base"


def row_done(x: dict) -> bool:
    """Whether a measured row is complete: a base row reached generation, a fit row its search's end."""
    return bool(x.get("fit", {}).get("done")) if row_key(x).endswith("/fit") else "generate" in x


def fla_skip(device: torch.device) -> str | None:
    """Why Gated DeltaNet's fla row cannot run here (None: it can)."""
    if device.type != "cuda":
        return "skipped: flash-linear-attention's Triton kernel runs on CUDA only"
    from recurformer.ops.delta_rule.fla import INSTALL, fla_kernel

    return None if fla_kernel() is not None else f"skipped: flash-linear-attention does not import here ({INSTALL})"


def measured_labels(out: Path) -> set[str]:
    """Models (``GraphRow.label``) with a complete base row in ``out``'s graphs.json or in an earlier
    GPU suite's under ``docs/results/data/gpu/``: the rows already measured, which run last."""
    seen = set()
    for path in [out / "graphs.json", *RESULTS.glob("suite_*/graphs.json")]:
        rec = json.loads(path.read_text()) if path.is_file() else {}
        if path.parent != out and rec.get("dry_run", True):
            continue
        seen |= {row_key(x).split("/")[0] for x in (rec.get("result") or {}).get("rows", []) if row_done(x)}
    return seen


def graph_rows(names: list[str], fla: str | None, measured: set[str]) -> tuple[list[GraphRow], dict[str, str]]:
    """The stage's rows, those of models never measured first, and the rows skipped with why
    (``fla``: why the fla row cannot run, None where it can)."""
    variants = [
        GraphRow(n, impl, "base")
        for n in names
        for impl in ((["fla"] if fla is None else []) + ["chunked"] if n == "gated_deltanet" else [None])
    ]
    variants.sort(key=lambda v: v.label in measured)  # stable: registration order within each group
    skipped = {"gated_deltanet[fla]": fla} if fla is not None and "gated_deltanet" in names else {}
    return [GraphRow(v.model, v.impl, kind) for v in variants for kind in ("base", "fit")], skipped


def micro_batches(rows: list[dict]) -> dict[str, dict]:
    """Per model, graphed training (eager where graphed is missing) at 16 rows and at the largest
    that fitted: tokens/s, fraction of the peak, and the better micro-batch (by tokens/s)."""
    got: dict[str, dict] = {}
    for x in rows:
        train = x.get("train", {})
        best = train.get("graphed") or train.get("eager")
        if not best or (row_key(x).endswith("/fit") and not x.get("fit", {}).get("batch")):
            continue
        label, kind = row_key(x).split("/")
        got.setdefault(label, {})[kind] = dict(
            batch=x["batch"], tokens_per_s=best["tokens_per_s"], fraction_of_peak=best["fraction_of_peak"]
        )
    for v in got.values():
        if "base" in v and "fit" in v:
            v["better"] = max((v["base"], v["fit"]), key=lambda r: r["tokens_per_s"])["batch"]
    return got


def graphs_child(argv: list[str]) -> None:
    """``gpu_suite.py --graphs-row [--impl IMPL] GRAPHS_BENCH_ARGS``: ``benchmarks/graphs_bench.py``
    with Gated DeltaNet's ``model.impl`` set, exiting with ``OOM_EXIT`` where the GPU runs out of
    memory (its JSON keeps what it measured before)."""
    import graphs_bench

    ap = argparse.ArgumentParser(prog="gpu_suite.py --graphs-row")
    ap.add_argument("--impl")
    own, rest = ap.parse_known_args(argv)
    if own.impl:
        base = graphs_bench.model_config
        graphs_bench.model_config = lambda name, config: dict(base(name, config), impl=own.impl)
    sys.argv = ["graphs_bench.py", *rest]
    try:
        graphs_bench.main()
    except torch.cuda.OutOfMemoryError as e:
        sys.exit(print(f"out of memory: {str(e).splitlines()[0][:200]}", file=sys.stderr) or OOM_EXIT)
    except RuntimeError as e:  # a capture that runs out can raise the plain CUDA error
        if "out of memory" not in str(e):
            raise
        sys.exit(print(f"out of memory: {str(e).splitlines()[0][:200]}", file=sys.stderr) or OOM_EXIT)


def stage_graphs(ctx: Ctx) -> dict:
    """``benchmarks/graphs_bench.py`` for every registered model (dry run: ``DRY_GRAPH_MODELS``; Gated
    DeltaNet with fla's kernel and with ours), each row its own process (compiled + graphed too
    when its share is long enough): eager against graphed training and decoding at 16 rows per
    micro-batch, then eager against graphed training at the largest of ``FIT_BATCHES`` that fits
    (largest first; a try that runs out of memory ends its process, and the next smaller one
    starts in a fresh one). Models never measured (in this folder or an earlier suite's) run
    first; ``graphs.json`` is rewritten after every row with status ``partial``, and a later run
    into the same folder measures only the rows it lacks."""
    path = ctx.out / "graphs.json"
    before = json.loads(path.read_text()) if path.is_file() else {}
    res: dict[str, Any] = dict(rows=[], failed={}, skipped={}, micro_batch={})
    if before.get("status") == "partial":
        res["rows"] = [x for x in before["result"]["rows"] if row_done(x)]  # a row cut off is measured again
    done = {row_key(x) for x in res["rows"]}
    names = [n for n in model_names() if not ctx.dry or n in DRY_GRAPH_MODELS]
    rows, res["skipped"] = graph_rows(names, fla_skip(ctx.device), measured_labels(ctx.out))
    if ctx.device.type != "cuda":
        res["skipped"].update({r.key: FIT_ON_CPU for r in rows if r.kind == "fit"})
    todo = [r for r in rows if r.key not in done and r.key not in res["skipped"]]
    # toy sizes: the protocol with the eager backend, calls of one chunk / segment / block
    size = (
        ["--config", "toy", "--seq", "0", "--steps", "1", "--gen-tokens", "8", "--backend", "eager"]
        if ctx.dry
        else ["--config", "125m", "--seq", "1024", "--steps", "5"]
    )
    end = ctx.deadline()
    for i, r in enumerate(todo):
        left = end - time.monotonic()
        share = max(min(left, 5.0 if ctx.dry else ROW_S[r.kind]), left / (len(todo) - i))
        if left < (5 if ctx.dry else 30):
            res["failed"].update({x.key: "skipped: the budget ran out (a next call measures it)" for x in todo[i:]})
            break
        cmd = [PY, "benchmarks/gpu_suite.py", "--graphs-row", *(["--impl", r.impl] if r.impl else [])]
        cmd += ["--model", r.model, *size, *device_kw(ctx)]
        row, why = (graphs_base if r.kind == "base" else graphs_fit)(ctx, r, cmd, share)
        if row is not None:
            res["rows"].append(row)
        if why is not None:
            res["failed"][r.key] = why
        res["micro_batch"] = micro_batches(res["rows"])
        write_json(path, dict(stage="graphs", status="partial", device=str(ctx.device), dry_run=ctx.dry, result=res))
    return res


def graphs_base(ctx: Ctx, r: GraphRow, cmd: list[str], share: float) -> tuple[dict | None, str | None]:
    """One model at 16 rows per micro-batch (the dry run: 2): its row (cut off: with why), or why not."""
    out = ctx.scratch / f"graphs_{r.label}_base.json"
    out.unlink(missing_ok=True)
    more = ["--batch", str(DRY_BASE_BATCH if ctx.dry else BASE_BATCH)]
    more += [] if ctx.dry else ["--gen-tokens", "256", *(["--compile"] if share >= 90 else [])]
    got = run([*cmd, *more, "--out", str(out)], share, log=ctx.out / f"graphs_{r.label}.log")
    return graphs_got(r, out, got)


def graphs_fit(ctx: Ctx, r: GraphRow, cmd: list[str], share: float) -> tuple[dict | None, str | None]:
    """One model at the largest of ``FIT_BATCHES`` rows per micro-batch
    that fits, largest first, each try a process of its own (one that runs out of GPU memory exits
    with ``OOM_EXIT`` and frees it all): the row of the first that fits, with ``fit`` saying what
    each try did; none fitting is a finished row too. A try cut off otherwise: None and why."""
    end = time.monotonic() + share
    tried: dict[str, str] = {}
    for b in FIT_BATCHES:
        out = ctx.scratch / f"graphs_{r.label}_fit{b}.json"
        out.unlink(missing_ok=True)
        more = ["--batch", str(b), "--gen-tokens", "8", "--out", str(out)]  # decoding is batch 1: the base row's
        got = run([*cmd, *more], end - time.monotonic(), log=ctx.out / f"graphs_{r.label}_{b}.log")
        if got["rc"] == OOM_EXIT:
            tried[str(b)] = "out of memory"
            continue
        row, why = graphs_got(r, out, got)
        if row is None:
            return None, f"{b} rows: {why} (tried: {tried})"
        if "graphed" not in row["train"]:
            tried[str(b)] = row.get("cut_off", "no graphed step")
            return None, f"{b} rows: {tried[str(b)]} (tried: {tried})"
        tried[str(b)] = "fitted"
        return dict(row, fit=dict(tried=tried, batch=b, done=True)), None
    sizes = "/".join(tried)
    return dict(key=r.key, model=r.model, impl=r.impl, fit=dict(tried=tried, batch=None, done=True)), (
        f"none of {sizes} rows fitted in GPU memory"
    )


def graphs_got(r: GraphRow, out: Path, got: dict) -> tuple[dict | None, str | None]:
    """A row's JSON as its process left it, keyed, with ``cut_off`` where the process did not finish;
    or None and why, where it wrote nothing."""
    last = (got["tail"].strip().splitlines() or ["?"])[-1][:200]
    if not out.is_file():
        return None, "timed out" if got["timed_out"] else f"failed: {last}"
    row = dict(json.loads(out.read_text()), key=r.key, impl=r.impl)
    if got["rc"] != 0:
        row["cut_off"] = "timed out" if got["timed_out"] else last
    return row, None


def stage_throughput(ctx: Ctx) -> dict:
    names = model_names()
    size = (
        ["--config", "toy", "--batch", "2", "--seq", "64", "--eval-len", "128", "--repeats", "1"]
        if ctx.dry
        else ["--config", "125m", "--batch", "16", "--seq", "1024", "--eval-len", "4096", "--repeats", "3"]
    )
    end = ctx.deadline()  # eager rows share the whole stage; compiled rows get what they leave
    res: dict[str, Any] = dict(rows=[], failed={})
    compiled: dict[str, Any] = {}
    if ctx.dry:
        compiled["all"] = "skipped in --dry-run (a CPU compile of every model takes minutes)"
    # one process per model and row kind, so a model that is slow (or runs out of memory) costs only
    # its own row; the dry run's toy rows in one process (nine imports of torch would cost more than the rows)
    for precision in ("bf16", "bf16+compile"):
        todo = names if precision == "bf16" or not ctx.dry else []
        todo = [",".join(todo)] if ctx.dry and todo else todo
        for i, n in enumerate(todo):
            share = (end - time.monotonic()) / (len(todo) - i)
            if share < (5 if ctx.dry else 20):
                (compiled if precision != "bf16" else res["failed"])[n] = "skipped: the budget ran out"
                continue
            out = ctx.scratch / f"throughput_{n}_{precision}.json"
            cmd = [
                PY,
                "benchmarks/throughput.py",
                "--models",
                n,
                "--precisions",
                precision,
                *size,
                *device_kw(ctx),
                "--out",
                str(out),
            ]
            r = run(cmd, share, log=ctx.out / f"throughput_{n}_{precision}.log")
            if out.is_file():
                got = json.loads(out.read_text())
                res["rows"] += got["results"]
                res.setdefault("meta", got["meta"])
                if precision != "bf16":
                    compiled[n] = "ok"
            else:
                why = (
                    "timed out"
                    if r["timed_out"]
                    else f"failed: {(r['tail'].strip().splitlines() or [str(r['rc'])])[-1][:200]}"
                )
                (compiled if precision != "bf16" else res["failed"])[n] = why
    res["compiled"] = compiled
    return res


def stage_tiling(ctx: Ctx) -> dict:
    if ctx.dry:
        fwd = [
            "--dim",
            "32",
            "--heads",
            "2",
            "--batch",
            "1",
            "--min-n",
            "32",
            "--max-n",
            "64",
            "--naive-max-n",
            "64",
            "--blocks",
            "4",
            "--reps",
            "1",
        ]
        train = ["--dim", "32", "--heads", "2", "--blocks", "4", "--train-ns", "32", "64", "--naive-train-max-n", "64"]
    else:  # naive training saves O(N^2 d): ~18 GB at N = 4096, dim 256
        fwd = ["--min-n", "1024", "--max-n", "16384", "--naive-max-n", "16384", "--blocks", "16", "--reps", "3"]
        train = ["--blocks", "16", "--train-ns", "1024", "2048", "4096", "8192", "16384", "--naive-train-max-n", "4096"]
    end, res = ctx.deadline(), {}
    for part, args, share in (("forward", fwd, 0.5), ("train", train, 1.0)):
        out = ctx.scratch / f"tiling_{part}"
        cmd = [PY, "benchmarks/recurrent_tiling.py", "--parts", part, *args, *device_kw(ctx), "--out", str(out)]
        r = run(cmd, (end - time.monotonic()) * share, log=ctx.out / f"tiling_{part}.log")
        js = out.with_suffix(".json")
        res[part] = json.loads(js.read_text()) if js.is_file() else dict(r, command=" ".join(cmd[1:]))
    return res


STREAM_CHILD = (
    """
import json, sys, torch
from recurformer import build_model
from recurformer.generate import new_session, read, stream
name, marks, cfg, mode = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], json.loads(sys.argv[3]), sys.argv[4]
"""
    + "{device_code}"
    + """
torch.manual_seed(0)
model = build_model(name, cfg).eval().to(dev)
s = new_session(model, 1, seed=0)
if mode == "eval":  # the streaming evaluation: calls of up to 1024 tokens, the state carried
    step = min(1024, marks[0])
    tokens = torch.randint(0, cfg["vocab_size"], (1, marks[-1]))
    for a in range(0, marks[-1], step):
        read(model, s, tokens[:, a : a + step])
        if a + step in marks:
            sync()
            print(json.dumps(dict(tokens=a + step, mem_mb=round(mem_mb(), 1))), flush=True)
else:
    for n, _ in enumerate(stream(model, [1, 2, 3], marks[-1], temperature=0.0, session=s), 1):
        if n in marks:
            sync()
            print(json.dumps(dict(tokens=n, mem_mb=round(mem_mb(), 1))), flush=True)
"""
)


def stage_streaming(ctx: Ctx) -> dict:
    import generation

    child = STREAM_CHILD.replace("{device_code}", generation.DEVICE_CODE)
    names = ["llama", "memory_attention"] if ctx.dry else model_names()  # dry: two models, 4 processes
    end = ctx.deadline()
    res: dict[str, Any] = {"note": "mem_mb: CUDA allocator peak since the start (CPU: resident set)", "models": {}}
    for i, name in enumerate(names):
        cfg = {**(TOY if ctx.dry else generation.SMALL), **generation.EXTRA.get(name, {})}
        if ctx.dry:
            cfg = {k: (16 if k in ("chunk_size", "segment_len", "block_size", "window") else v) for k, v in cfg.items()}
        row: dict[str, Any] = {"config": cfg}
        slot = (end - time.monotonic()) / (
            len(names) - i
        )  # this model's time: reading (64 calls) a quarter, generating the rest
        slot_end = time.monotonic() + slot
        for mode, marks in (("eval", (1024, 4096, 16384, 65536)), ("generate", GEN_MARKS)):
            marks = (64, 128, 256) if ctx.dry else marks
            share = slot / 4 if mode == "eval" else slot_end - time.monotonic()
            r = run([PY, "-c", child, name, ",".join(map(str, marks)), json.dumps(cfg), mode, str(ctx.device)], share)
            lines = [json.loads(x) for x in r["tail"].splitlines() if x.startswith("{")] if r["rc"] in (0, None) else []
            row[mode] = lines
            if r["timed_out"]:
                row[f"{mode}_note"] = f"stopped after {share:.0f} s (its share of the budget)"
            elif r["rc"] != 0:
                row[f"{mode}_note"] = "failed: " + (r["tail"].strip().splitlines() or [""])[-1][:200]
        res["models"][name] = row
    return res


def stage_paper(ctx: Ctx) -> dict:
    import extrapolation

    dataset = "tinystories-sample" if ctx.dry else "tinystories-repeat"
    runs_dir = ctx.scratch / "runs"
    base = [
        PY,
        "-m",
        "recurformer.cli",
        "train",
        "--config",
        str(extrapolation.BASE),
        *device_kw(ctx),
        "--set",
        f"data.dataset={dataset}",
    ]
    if ctx.dry:
        sets = [
            "model.dim=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.vocab_size=512",
            "data.tokenizer=byte",
            f"data.dir={ctx.scratch / 'prepared'}",
            "train.batch_size=2",
            "train.seq_len=64",
            "train.steps=2",
            "train.eval_every=2",
            "train.eval_batches=1",
            "train.save_every=2",
            "train.log_every=1",
        ]
    else:  # "the minutes left": a step count no run reaches, stopped by SIGTERM at its time
        sets = extrapolation.SCALES["paper"] + [
            "train.steps=100000",
            "train.save_every=500",
            "train.eval_every=1000",
            "train.log_every=50",
        ]
    eval_reserve = 20 if ctx.dry else 75
    train_s = ctx.seconds - eval_reserve
    with_baselines = ctx.dry or train_s >= 5 * 60
    res: dict[str, Any] = dict(dataset=dataset, sets=sets, runs={})

    def train(run_name: str, extra: list[str], seconds: float) -> subprocess.Popen:
        out = runs_dir / run_name
        out.mkdir(parents=True, exist_ok=True)
        cmd = base + [
            a for s in sets + extrapolation.RUNS[run_name] + extra + [f"train.out_dir={out}"] for a in ("--set", s)
        ]
        log = open(out / "train.log", "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        p.deadline = time.monotonic() + seconds  # type: ignore[attr-defined]
        return p

    def finish(procs: dict[str, subprocess.Popen]) -> None:
        for name, p in procs.items():
            stopped = False
            try:
                p.wait(timeout=max(0.0, p.deadline - time.monotonic()))  # type: ignore[attr-defined]
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)  # the trainer finishes its step and saves
                stopped = True
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            res["runs"][name] = dict(rc=p.returncode, stopped_at_time=stopped, **last_metrics(runs_dir / name))
            res["runs"][name]["checkpoint_step"] = saved_step(runs_dir / name)

    end = ctx.deadline()
    finish(
        {"memory_attention": train("memory_attention", [], train_s / 2 if with_baselines and not ctx.dry else train_s)}
    )
    steps = res["runs"]["memory_attention"].get("checkpoint_step")
    if with_baselines and steps:  # to the same step count, side by side, in the training time left
        left = max(30.0, end - eval_reserve - time.monotonic())
        finish({n: train(n, [f"train.steps={steps}"], left) for n in PAPER_RUNS[1:]})
    elif not with_baselines:
        res["baselines"] = f"skipped: {train_s / 60:.1f} minutes of training time (they need 5)"
    ckpts = [str(runs_dir / n) for n in PAPER_RUNS if res["runs"].get(n, {}).get("checkpoint_step")]
    if ckpts:
        js = ctx.out / "paper_eval.json"
        lengths, last, windows = ("64,128", "32", "2") if ctx.dry else (EVAL_LENGTHS, "256", "16")
        cmd = [
            PY,
            "-m",
            "recurformer.cli",
            "eval",
            "--checkpoint",
            *ckpts,
            "--lengths",
            lengths,
            "--last",
            last,
            "--windows",
            windows,
            "--json",
            str(js),
            *device_kw(ctx),
        ]
        r = run(cmd, max(10.0, eval_reserve - 5), log=ctx.out / "paper_eval.log")
        res["eval"] = json.loads(js.read_text()) if js.is_file() else r
    return res


def saved_step(run_dir: Path) -> int | None:
    """The step of a run's newest checkpoint (None without one)."""
    from recurformer.checkpoint import step_of

    steps = [s for c in run_dir.glob("step_*") if (s := step_of(c)) is not None]
    return max(steps, default=None)


def last_metrics(run_dir: Path) -> dict:
    """The last training and validation rows of a run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    out = dict(train[-1]) if train else {}
    if val:
        out["val_loss"] = val[-1]["val_loss"]
        out["val_step"] = val[-1]["step"]
    return out


@dataclass
class Stage:
    fn: Callable[[Ctx], dict]
    cost: float  # minutes it is planned for on a GPU
    least: float  # the fewest minutes it is worth starting with
    dry: float  # minutes at toy size on a CPU


STAGES: dict[str, Stage] = {
    "graphs": Stage(stage_graphs, 5.0, 2.0, 1.0),  # what is new runs first
    "env": Stage(stage_env, 0.5, 0.25, 0.05),
    "tests": Stage(stage_tests, 4.0, 2.0, 0.15),
    "throughput": Stage(stage_throughput, 6.0, 2.5, 0.3),
    "tiling": Stage(stage_tiling, 2.5, 1.0, 0.2),
    "streaming": Stage(stage_streaming, 4.0, 1.5, 0.2),
    "paper": Stage(stage_paper, 3.0, 3.0, 0.3),  # then every minute left
}


def plan(names: list[str], budget: float, dry: bool) -> dict[str, float]:
    """Minutes per stage: its cost, shrunk towards its least when the budget is short (stages in
    order; ``paper`` takes what is left); a stage whose least does not fit gets 0 (skipped)."""
    cost = {n: STAGES[n].dry if dry else STAGES[n].cost for n in names}
    least = {n: STAGES[n].dry if dry else STAGES[n].least for n in names}
    out, left = {}, budget
    for i, n in enumerate(names):
        later = sum(least[m] for m in names[i + 1 :])  # what the stages after this one need at least
        give = min(cost[n], max(least[n], left - later)) if n != "paper" or dry else left
        out[n] = give if give <= left and give >= least[n] else 0.0
        left -= out[n]
    return out


def default_out(device: torch.device, dry: bool) -> Path:
    name = "cpu-dry-run" if dry else torch.cuda.get_device_name(device)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return RESULTS / f"suite_{slug}_{datetime.date.today().isoformat()}"


# -- summary -------------------------------------------------------------------------------------
def summarize(out: Path) -> Path:
    """summary.md from every stage JSON in ``out``."""
    got = {n: json.loads((out / f"{n}.json").read_text()) for n in STAGES if (out / f"{n}.json").is_file()}
    lines = [
        f"# GPU suite: {out.name}",
        "",
        "Written by `benchmarks/gpu_suite.py` from the stage JSON files beside it.",
        "",
    ]
    for name, s in got.items():
        r = s.get("result") or {}
        lines += [
            f"## {name}",
            "",
            f"status: {s.get('status')} in {s.get('seconds', 0):.0f} s (planned {s.get('planned_s', 0):.0f} s)"
            + (f": {s['error']}" if s.get("error") else ""),
            "",
        ]
        lines += SUMMARIES[name](r) if s.get("status") == "ok" else []
        lines.append("")
    path = out / "summary.md"
    write_json(path, "\n".join(lines))
    return path


def sum_graphs(r: dict) -> list[str]:
    out = [
        "training tokens/s and fraction of the measured peak, eager | graphed | compiled + graphed; the gradient "
        "check (graphed vs eager, accumulation 2: largest difference / largest gradient); kernels (or operators) "
        "and GPU busy per step, eager -> graphed; generation tokens/s at batch 1 (and at 16, every row's tokens), "
        "eager -> graphed step -> graphed blocks (sampling in the graph, the host reading every 16 tokens)",
        "",
        "| model | micro-batch | eager tok/s | graphed tok/s | compiled+graphed tok/s | grad check | kernels / step | GPU busy | generate tok/s |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for x in r.get("rows", []):
        if not x.get("batch"):  # a micro-batch search that nothing passed: below
            continue
        tr, pr, gen = x.get("train", {}), x.get("profile", {}), x.get("generate", {})
        cell = lambda k: (  # noqa: E731
            f"{tr[k]['tokens_per_s']:,.0f} ({tr[k]['fraction_of_peak']:.1%})" if k in tr else "-"
        )
        count = lambda p: p.get("kernels", p.get("operators", "-"))  # noqa: E731
        busy = lambda p: f"{p['gpu_busy']:.0%}" if "gpu_busy" in p else "-"  # noqa: E731
        g = x.get("grad_check", {})
        out.append(
            f"| {row_key(x).split('/')[0]} | {x['batch']} | {cell('eager')} | {cell('graphed')} | {cell('compiled+graphed')} | "
            f"{'ok' if g.get('ok') else 'FAILED' if g else '-'} {g.get('max_diff_over_max_grad', float('nan')):.1e} | "
            f"{count(pr.get('eager', {}))} -> {count(pr.get('graphed', {}))} | "
            f"{busy(pr.get('eager', {}))} -> {busy(pr.get('graphed', {}))} | "
            + " -> ".join(
                f"{gen.get(k, {}).get('tokens_per_s', float('nan')):,.0f}" for k in ("eager", "graphed", "blocks")
            )
            + " ("
            + " -> ".join(
                f"{gen.get(k, {}).get('tokens_per_s_16', float('nan')):,.0f}" for k in ("eager", "graphed", "blocks")
            )
            + ") |"
            + (f" ({x['cut_off']})" if x.get("cut_off") else "")
        )
        notes = dict.fromkeys(n for k in ("graphed", "blocks") for n in gen.get(k, {}).get("notes", []))
        out += [f"  - {row_key(x).split('/')[0]} generation: {n}" for n in notes]
    out += [f"- {k}: {v}" for k, v in {**r.get("skipped", {}), **r.get("failed", {})}.items()]
    mb = r.get("micro_batch", {})
    if mb:
        out += [
            "",
            "micro-batch: graphed training (eager where graphed is missing) at 16 rows of 1,024 tokens and at the "
            "largest of 32 / 64 / 128 rows that fitted in GPU memory",
            "",
            "| model | 16 rows tok/s | largest fitting | its tok/s | better |",
            "|---|---:|---:|---:|---:|",
        ]
        cell = lambda v: f"{v['tokens_per_s']:,.0f} ({v['fraction_of_peak']:.1%})" if v else "-"  # noqa: E731
        for label, v in mb.items():
            base, fit = v.get("base"), v.get("fit")
            out.append(
                f"| {label} | {cell(base)} | {fit['batch'] if fit else '-'} | {cell(fit)} | {v.get('better', '-')} |"
            )
    return out


def sum_env(r: dict) -> list[str]:
    keys = (
        "gpu",
        "gpu_memory_gib",
        "driver",
        "capability",
        "cpu",
        "torch",
        "cuda",
        "triton",
        "python",
        "bf16_matmul_tflops",
        "fp32_matmul_tflops",
        "d2d_copy_gb_s",
        "h2d_pinned_gb_s",
    )
    return ["| | |", "|---|---|"] + [f"| {k} | {r[k]} |" for k in keys if r.get(k) is not None]


def sum_tests(r: dict) -> list[str]:
    return [
        f"`{r.get('command')}`: {r.get('passed')} passed, {r.get('failed')} failed, {r.get('skipped')} skipped"
        + (" (timed out)" if r.get("timed_out") else "")
    ] + [f"- {f}" for f in r.get("failures", [])]


def sum_throughput(r: dict) -> list[str]:
    target = {"llama": 0.45}
    out = [
        f"config {r.get('meta', {}).get('config')}, batch {r.get('meta', {}).get('batch')} x {r.get('meta', {}).get('seq')}; "
        "target: Llama >= 45% of the bf16 peak, recurrent models >= 30%",
        "",
        "| model | precision | train tok/s | of bf16 peak | target | step memory MB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for x in r.get("rows", []):
        t = target.get(x["model"], 0.30)
        out.append(
            f"| {x['model']} | {x['precision']} | {x['train_tokens_per_s']:,} | {x['train_fraction_of_peak']:.1%} | "
            f"{t:.0%} {'met' if x['train_fraction_of_peak'] >= t else 'missed'} | {x.get('train_step_mem_mb')} |"
        )
    out += [f"- eager {k}: {v}" for k, v in r.get("failed", {}).items()]
    out += [f"- compiled {k}: {v}" for k, v in r.get("compiled", {}).items() if v != "ok"]
    return out


def sum_tiling(r: dict) -> list[str]:
    out = []
    if isinstance(r.get("forward"), dict) and "rows" in r["forward"]:
        out += ["| N | naive ms | tiled ms | naive / tiled |", "|---:|---:|---:|---:|"]
        for x in r["forward"]["rows"]:
            ratio = x["naive_ms"] / x["tiled_ms"] if "naive_ms" in x else float("nan")
            out.append(f"| {x['N']} | {x.get('naive_ms', float('nan')):.1f} | {x['tiled_ms']:.1f} | {ratio:.2f} |")
        out.append("")
    if isinstance(r.get("train"), dict) and "training" in r["train"]:
        out += [
            "| N | naive fwd+bwd ms | tiled fwd+bwd ms | naive saved MB | tiled saved MB |",
            "|---:|---:|---:|---:|---:|",
        ]
        for x in r["train"]["training"]:
            g = lambda k, d=1.0: x.get(k, float("nan")) / d  # noqa: E731
            out.append(
                f"| {x['N']} | {g('naive_fwd_bwd_ms'):.0f} | {g('tiled_fwd_bwd_ms'):.0f} | {g('naive_saved_bytes', 1e6):.1f} | {g('tiled_saved_bytes', 1e6):.1f} |"
            )
    return out


def sum_streaming(r: dict) -> list[str]:
    out = [r.get("note", ""), "", "| model | eval MB at tokens | generation MB at tokens |", "|---|---|---|"]
    for name, x in r.get("models", {}).items():
        cell = lambda rows: ", ".join(f"{m['mem_mb']:.0f}@{m['tokens']}" for m in rows) or "-"  # noqa: E731
        out.append(f"| {name} | {cell(x.get('eval', []))} | {cell(x.get('generate', []))} |")
    return out


def sum_paper(r: dict) -> list[str]:
    out = [
        f"dataset {r.get('dataset')}",
        "",
        "| run | checkpoint step | last logged step | tokens | train loss | val loss | tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, x in r.get("runs", {}).items():
        out.append(
            f"| {name} | {x.get('checkpoint_step')} | {x.get('step')} | {x.get('tokens')} | {x.get('loss', float('nan')):.3f} | "
            f"{x.get('val_loss', float('nan')):.3f} | {x.get('tok_per_s', float('nan')):,.0f} |"
        )
    ev = r.get("eval", {})
    if "results" in ev:
        out += ["", "loss on the last tokens of each window, by window length:", ""]
        for label, rows in ev["results"].items():
            out.append(f"- {label}: " + ", ".join(f"{x['length']}: {x['loss']:.3f}" for x in rows))
    if r.get("baselines"):
        out.append(f"- baselines {r['baselines']}")
    return out


SUMMARIES: dict[str, Callable[[dict], list[str]]] = dict(
    graphs=sum_graphs,
    env=sum_env,
    tests=sum_tests,
    throughput=sum_throughput,
    tiling=sum_tiling,
    streaming=sum_streaming,
    paper=sum_paper,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-min", type=float, default=25.0, help="minutes the whole run may take (default 25)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {','.join(STAGES)}")
    ap.add_argument("--dry-run", action="store_true", help="every stage at toy sizes on the CPU (about a minute)")
    ap.add_argument("--out", help="output folder (default: docs/results/data/gpu/suite_<gpu>_<date>)")
    ap.add_argument("--redo", action="store_true", help="run stages whose JSON the output folder already holds")
    ap.add_argument("--summarize", metavar="DIR", help="only rewrite DIR/summary.md from its stage JSON files")
    args = ap.parse_args()
    err = lambda msg: sys.exit(f"gpu_suite.py: error: {msg}")  # noqa: E731
    if args.summarize:
        if not Path(args.summarize).is_dir():
            err(f"--summarize {args.summarize} is not a folder")
        print(f"wrote {summarize(Path(args.summarize))}")
        return
    names = [n.strip() for n in args.stages.split(",") if n.strip()]
    bad = [n for n in names if n not in STAGES]
    if bad or not names:
        err(f"--stages: unknown stage '{bad[0] if bad else args.stages}'; choose from {', '.join(STAGES)}")
    names = [n for n in STAGES if n in names]  # the suite's order
    if not args.dry_run and not torch.cuda.is_available():
        err("no CUDA device; run on a GPU machine, or use --dry-run for toy sizes on the CPU")
    least = min(STAGES[n].dry if args.dry_run else STAGES[n].least for n in names)
    if args.budget_min < least:
        err(f"--budget-min {args.budget_min:g} is below what the cheapest chosen stage needs ({least:g} minutes)")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda")
    out = Path(args.out) if args.out else default_out(device, args.dry_run)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_min)
    minutes = plan(names, args.budget_min, args.dry_run)
    print(f"gpu_suite: {device}, budget {args.budget_min:g} min, writing to {out}")
    print("plan: " + ", ".join(f"{n} {m:.1f} min" if m else f"{n} skipped" for n, m in minutes.items()), flush=True)
    scratch = (
        Path(tempfile.mkdtemp(prefix="gpu_suite_"))
        if args.dry_run
        else ROOT / "runs" / "gpu-suite" / f"{out.name}-{time.strftime('%H%M%S')}"
    )
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        for n in names:
            path = out / f"{n}.json"
            finished = path.is_file() and json.loads(path.read_text()).get("status") != "partial"
            if finished and not args.redo:
                print(f"{n}: {path} exists, skipped (--redo runs it again)")
                continue
            # a stage's plan, or, at toy sizes (fixed work) and for paper, whatever is left
            seconds = budget.left() if args.dry_run or n == "paper" else min(60 * minutes[n], budget.left())
            least_s = 60 * (STAGES[n].dry if args.dry_run else STAGES[n].least)
            if not minutes[n] or seconds < least_s * 0.9:
                print(f"{n}: skipped, {seconds / 60:.1f} of the {least_s / 60:g} minutes it needs are left", flush=True)
                continue
            print(f"{n}: {seconds / 60:.1f} min ...", flush=True)
            t0 = time.monotonic()
            record: dict[str, Any] = dict(
                stage=n,
                device=str(device),
                dry_run=args.dry_run,
                planned_s=round(seconds),
                started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            )
            try:
                record.update(status="ok", result=STAGES[n].fn(Ctx(out, args.dry_run, device, seconds, scratch)))
            except Exception as e:  # one failing stage (e.g. out of memory) leaves the others running
                record.update(
                    status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                )
            record["seconds"] = round(time.monotonic() - t0, 1)
            write_json(path, record)
            print(f"{n}: {record['status']} in {record['seconds']:.0f} s -> {path}", flush=True)
    finally:
        if args.dry_run:
            shutil.rmtree(scratch, ignore_errors=True)
        print(f"wrote {summarize(out)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--graphs-row"]:  # the graphs stage's child process
        graphs_child(sys.argv[2:])
    else:
        main()
