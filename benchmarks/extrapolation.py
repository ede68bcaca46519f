"""Tables 1 and 2 of Liang, *Block-wise Recurrent Transformer* (§5.1, §5.2) at CPU scale: train every configuration at length 256 on the same
data with the same token budget (configs/repro/base.yaml), then evaluate loss on the last 256
tokens at lengths 256..16384 (``evaluate.evaluate_checkpoints``, what ``recurformer eval`` runs).

Table 1 rows: Memory Attention (full stateful training), cold and warm start, Llama/RoPE, the same
Llama evaluated with a 256 window, a trained sliding-window model, plus Transformer-XL and
Block-Recurrent at the same budget. Table 2 rows: the four training strategies of Memory Attention.
Every row scores the same windows (``--windows K`` evenly spaced ones, or all of them), so each
table holds the mean loss with its 95% bootstrap interval and the paired difference from its first
row; ``<tag>-claims.md/json`` the paired differences the results page rests on (CLAIMS), each
with whether its interval excludes 0.

    python benchmarks/extrapolation.py train --dataset tinystories-sample --jobs 2
    python benchmarks/extrapolation.py eval  --dataset tinystories-sample [--eval-data warpeace]

``--scale paper`` trains the paper's model size instead (dim 288, 6 layers, 6 heads; 32 x 256
tokens per step), for a GPU; ``--steps`` sets the budget of either scale:

    python benchmarks/extrapolation.py train --scale paper --dataset tinystories-repeat --steps 20000 --jobs 2 --device cuda
    python benchmarks/extrapolation.py eval  --scale paper --dataset tinystories-repeat --windows 128 --device cuda

Runs go to runs/repro/<dataset>/<run> (runs/repro-paper/... at paper scale); evaluation
JSON/markdown/PNG to out/repro/ (out/repro-paper/; ``--out`` elsewhere). Training runs are skipped when their final
checkpoint exists.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np

from recurformer.checkpoint import resolve
from recurformer.evaluate.results import LengthResult, paired_differences
from recurformer.files import atomic_write

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "configs" / "repro" / "base.yaml"

WARM = 1024  # tokens read before each window in the warm-start row
MA = ["model.name=memory_attention", "model.chunk_size=32", "model.memory_qkv=shared"]
RUNS: dict[str, list[str]] = {
    "llama": ["model.name=llama", "train.state=reset"],  # a dense model: independent 256-token windows
    "sliding_window": ["model.name=sliding_window", "model.window=64"],
    "memory_attention": MA + ["train.state=carry", "train.data_order=contiguous"],  # Full Stateful
    "ma_no_stateful": MA + ["train.state=reset", "train.data_order=shuffled"],
    "ma_only_data": MA + ["train.state=reset", "train.data_order=contiguous"],
    "ma_only_model": MA + ["train.state=carry", "train.data_order=shuffled"],
    "transformer_xl": ["model.name=transformer_xl", "model.segment_len=32"],
    "block_recurrent": ["model.name=block_recurrent", "model.block_size=32"],
}
# (row label, run, extra options of evaluate.evaluate_checkpoints); the reference row first: the paired
# differences of each table are taken from it
TABLE1: list[tuple[str, str, dict[str, int]]] = [
    ("Memory Attention", "memory_attention", {}),
    ("Memory Attention, warm start", "memory_attention", {"warm_state": WARM}),
    ("Llama (RoPE)", "llama", {}),
    ("Llama, 256 window", "llama", {"window": 256}),
    ("Sliding window 64 (trained)", "sliding_window", {}),
    ("Transformer-XL", "transformer_xl", {}),
    ("Block-Recurrent", "block_recurrent", {}),
]
TABLE2 = [
    ("Mem (Full Stateful)", "memory_attention"),
    ("Mem (No Stateful)", "ma_no_stateful"),
    ("Mem (Infinity Only Data)", "ma_only_data"),
    ("Mem (Infinity Only Model)", "ma_only_model"),
]
# the paired differences the page's claims rest on: (model, reference, length; None: the longest both measured)
CLAIMS: list[tuple[str, str, int | None]] = [
    *((label, "Memory Attention", None) for label, _, _ in TABLE1[2:]),
    ("Llama (RoPE)", "Llama, 256 window", 4096),
    ("Memory Attention", "Memory Attention, warm start", 256),
    *((label, "Mem (Full Stateful)", None) for label, _ in TABLE2[1:]),
]

# every run of a scale gets these on top of configs/repro/base.yaml (CPU scale: dim 128, 4 layers, 8 x 256)
SCALES: dict[str, list[str]] = {
    "cpu": [],
    "paper": [
        "model.dim=288",
        "model.n_layers=6",
        "model.n_heads=6",
        "train.batch_size=32",
        "train.eval_every=1000",
        "train.save_every=1000",
        "train.keep_last=2",
    ],
}


def repro_name(scale: str) -> str:
    """The folder name of a scale's runs and results: repro (cpu), repro-paper, ..."""
    return "repro" if scale == "cpu" else f"repro-{scale}"


def run_dir(dataset: str, run: str, scale: str = "cpu") -> Path:
    return ROOT / "runs" / repro_name(scale) / dataset / run


def trained_length(run: Path) -> int:
    """The training segment length (train.seq_len) of a run's latest checkpoint."""
    return json.loads((resolve(run) / "config.json").read_text())["train"]["seq_len"]


def train_one(args: argparse.Namespace, run: str) -> str:
    out = run_dir(args.dataset, run, args.scale)
    if (out / "latest").is_file():
        return f"{run}: exists, skipped"
    cmd = [
        sys.executable,
        "-m",
        "recurformer.cli",
        "train",
        "--config",
        str(BASE),
        "--set",
        f"data.dataset={args.dataset}",
        "--set",
        f"train.out_dir={out}",
        "--device",
        args.device,
    ]
    for o in SCALES[args.scale] + RUNS[run] + ([f"train.steps={args.steps}"] if args.steps else []):
        cmd += ["--set", o]
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    t0 = time.time()
    with open(out / "train.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return f"{run}: rc={rc} in {time.time() - t0:.0f}s"


def cmd_train(args: argparse.Namespace) -> None:
    runs = args.runs.split(",") if args.runs else list(RUNS)
    # prepare once, before parallel runs race to do it
    subprocess.check_call(
        [sys.executable, "-m", "recurformer.cli", "prepare", "--dataset", args.dataset],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    ) if not (ROOT / "prepared" / f"{args.dataset}-bpe4096" / "meta.json").is_file() else None
    with ThreadPoolExecutor(args.jobs) as ex:
        for msg in ex.map(lambda r: train_one(args, r), runs):
            print(msg, flush=True)


def claims(results: dict[str, list[LengthResult]]) -> list[dict]:
    """The paired differences of CLAIMS among ``results`` (label -> LengthResults, per-document losses
    kept), each with its 95% interval and whether that interval excludes 0."""
    out = []
    for model, ref, length in CLAIMS:
        if model not in results or ref not in results:
            continue
        diffs = {d.length: d for d in paired_differences(results[model], results[ref])}
        d = diffs.get(max(diffs) if length is None else length)
        if d is not None:
            out.append(dict(model=model, reference=ref, **vars(d), excludes_0=bool(d.low > 0 or d.high < 0)))
    return out


def claims_table(rows: list[dict]) -> str:
    head = "| model − reference | length | difference [95% interval] | excludes 0 |\n|---|---|---|---|"
    return "\n".join(
        [head]
        + [
            f"| {r['model']} − {r['reference']} | {r['length']} | {r['diff']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}] "
            f"| {'yes' if r['excludes_0'] else 'no'} |"
            for r in rows
        ]
    )


def save_results(path: Path, what: dict, results: list[LengthResult]) -> list[LengthResult]:
    """``results`` with their per-document losses, and ``what`` produced them, to ``path`` (.npz)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                what=json.dumps(what),
                results=json.dumps([r.to_dict() for r in results]),
                doc_loss=np.stack([r.doc_loss for r in results]),
                doc_tokens=results[0].doc_tokens,
            )

    atomic_write(path, write)
    return results


def load_results(path: Path, what: dict) -> list[LengthResult] | None:
    """The results ``save_results`` wrote to ``path``, or None when there are none or other settings
    or another checkpoint produced them."""
    if not path.is_file():
        return None
    with np.load(path) as z:
        if json.loads(str(z["what"])) != what:
            return None
        return [
            LengthResult(**r, doc_loss=loss, doc_tokens=z["doc_tokens"])
            for r, loss in zip(json.loads(str(z["results"])), z["doc_loss"])
        ]


def cmd_eval(args: argparse.Namespace) -> None:
    import torch

    from recurformer.evaluate.command import evaluate_checkpoints
    from recurformer.evaluate.results import markdown_table, plot, save_json

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out) if args.out else ROOT / "out" / repro_name(args.scale)
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    tag = args.dataset + (f"-on-{args.eval_data}" if args.eval_data else "")
    context = max(int(x) for x in args.lengths.split(",")) + WARM  # every row scores the same tokens
    meta = dict(command=" ".join(sys.argv), windows=args.windows, context=context, last=256, torch=torch.__version__)
    done: dict[tuple, list[LengthResult]] = {}  # (run, options) -> results with their per-document losses
    for label, run, extra in [*TABLE1, *((label, run, {}) for label, run in TABLE2)]:
        key = (run, tuple(extra.items()))
        if key in done or not (run_dir(args.dataset, run, args.scale) / "latest").is_file():
            continue
        lengths = [int(x) for x in (args.dense_lengths if run == "llama" and not extra else args.lengths).split(",")]
        raw = out_dir / "raw" / f"{tag}-{run}{''.join(f'-{k}{v}' for k, v in extra.items())}.json"
        ckpt = resolve(run_dir(args.dataset, run, args.scale))
        what = dict(  # what the results depend on: reused from an earlier call when all of it agrees
            checkpoint=str(ckpt),
            saved=(ckpt / "model.safetensors").stat().st_mtime_ns,
            eval_data=args.eval_data,
            lengths=lengths,
            windows=args.windows,
            context=context,
            **extra,
        )
        done[key] = load_results(raw.with_suffix(".npz"), what) or save_results(
            raw.with_suffix(".npz"),
            what,
            *evaluate_checkpoints(
                [str(ckpt)],
                lengths,
                raw,
                last=256,
                windows=args.windows,
                context=context,
                dataset=args.eval_data,
                device=args.device,
                meta=meta,
                **extra,
            ).values(),
        )
    if not done:
        raise SystemExit(f"no finished run in {run_dir(args.dataset, '', args.scale)}")
    tables = {
        "table1": {label: done[(run, tuple(x.items()))] for label, run, x in TABLE1 if (run, tuple(x.items())) in done},
        "table2": {label: done[(run, ())] for label, run in TABLE2 if (run, ()) in done},
    }
    runs = {label: run for label, run, _ in TABLE1} | dict(TABLE2)
    warm = {label: x.get("warm_state", 0) for label, _, x in TABLE1}
    for name, res in tables.items():
        md = markdown_table(res)
        (out_dir / f"{tag}-{name}.md").write_text(md + "\n")
        save_json(res, out_dir / f"{tag}-{name}.json", meta)
        trained = {label: trained_length(run_dir(args.dataset, runs[label], args.scale)) for label in res}
        title = f"{name.replace('table', 'Table ')}: trained on {args.dataset}" + (
            f", evaluated on {args.eval_data}" if args.eval_data else ""
        )
        plot(res, out_dir / f"{tag}-{name}.png", title, 256, trained, warm)
        print(f"\n{name} ({tag}):\n{md}")
    rows = claims(tables["table1"] | tables["table2"])
    md = claims_table(rows)
    (out_dir / f"{tag}-claims.md").write_text(md + "\n")
    (out_dir / f"{tag}-claims.json").write_text(json.dumps({"meta": meta, "claims": rows}, indent=2) + "\n")
    print(
        f"\npaired differences ({tag}):\n{md}\nwrote {out_dir}/{tag}-{{table1,table2,claims}}.{{md,json}}, table1/2 .png"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train")
    p.add_argument(
        "--scale",
        choices=list(SCALES),
        default="cpu",
        help="model size: cpu (dim 128, 4 layers) or paper (dim 288, 6 layers)",
    )
    p.add_argument("--dataset", default="tinystories-sample")
    p.add_argument("--runs", help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: base.yaml's 1000)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p = sub.add_parser("eval")
    p.add_argument("--scale", choices=list(SCALES), default="cpu", help="which runs: cpu or paper scale")
    p.add_argument("--out", help="folder for tables, plots and raw JSON (default: out/repro, out/repro-paper)")
    p.add_argument("--dataset", default="tinystories-sample", help="the training dataset of the runs")
    p.add_argument("--eval-data", help="evaluate on another prepared dataset (e.g. warpeace)")
    p.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384")
    p.add_argument("--dense-lengths", default="256,512,1024,2048,4096", help="lengths for the full-attention Llama")
    p.add_argument(
        "--windows", type=int, help="windows per length, evenly spaced over the evaluation text (default: all of them)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    args = ap.parse_args()
    {"train": cmd_train, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    main()
