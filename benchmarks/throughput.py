"""Training and evaluation throughput of every model, as tokens/s and as a fraction of this
machine's matmul peak measured in the same run (machines differ by ~40%, so only ratios and
fractions of a peak measured side by side mean anything).

Configurations: ``paper`` (dim 288, 6 layers, 6 heads, vocab 4096; Memory Attention chunk 32 with
shared memory Q/K/V: the TinyStories model of Liang, *Block-wise Recurrent Transformer*, §5; RMT
segments of 128 with 16 memory slots), ``125m`` (dim 768, 12 layers, 12 heads, vocab 50304: ~124M
parameters, for GPUs) and ``toy`` (a smoke test). On CUDA each row also reports
``train_step_mem_mb``: the allocator's peak over its two warm-up training steps above what was
allocated before them (the row's activations, gradients and optimizer state; the weights of every
row are built beforehand).

Training: forward + backward + AdamW step on B x T tokens (default 8 x 256). Evaluation: one
no-grad forward at T = 4096 (batch 1). Each row in fp32 and under bf16 autocast; "+compile"
compiles the model's layers (``StreamingLM.compile_layers``, the trainer's ``--compile``; compile
time excluded by the warm-up; no eval for these rows). Rows are measured side by side in one run,
interleaved over repeats, and the median is reported; CUDA work is synchronised before each clock
read.

FLOP/token is counted on the model (``recurformer.flops``: every matmul, attention by the pairs its
mask shows; training = 3 forwards), and "of peak" divides the achieved FLOP/s by the best n x n
matmul of the row's precision measured at the start and the end of this run. Two baseline rows
carry Memory Attention's FLOP count, so extra work they do shows as a lower fraction:
``algorithm-1`` (``reference.algorithm_1``: the paper's Algorithm 1 (§3.3) read literally, the
tests' reference) and, with ``--peer PATH``, the authors' code (siyuanseever/llama2Rnn, a checkout
outside this repository: its ``model.py`` and imports, run as they are, nothing copied).

    python benchmarks/throughput.py [--models memory_attention,llama] [--precisions fp32,bf16,bf16+compile]
    python benchmarks/throughput.py --peer /path/to/llama2Rnn --out out/throughput.json
    python benchmarks/throughput.py --device cuda --config 125m --batch 16 --seq 1024
    python benchmarks/throughput.py --processes 1,2 --steps 25 --out out/ddp_throughput.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recurformer import build_model
from recurformer.device import pick_device, slow_bf16_warning, synchronize
from recurformer.flops import forward_flops_per_token, matmul_peak, train_flops_per_token
from recurformer.models import model_names
from recurformer.reference import algorithm_1

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "paper": dict(vocab_size=4096, dim=288, n_layers=6, n_heads=6),
    "125m": dict(vocab_size=50304, dim=768, n_layers=12, n_heads=12),
    "toy": dict(vocab_size=256, dim=32, n_layers=3, n_heads=2),  # gpu_suite.py --dry-run
}
EXTRA = {
    "memory_attention": dict(chunk_size=32, memory_qkv="shared"),
    "sliding_window": dict(window=256),
    "rmt": dict(segment_len=128, memory_size=16),
}
BASELINES = ("algorithm-1",)  # rows beside the models; "llama2Rnn (authors)" comes with --peer


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    return (
        torch.autocast(device.type, dtype=torch.bfloat16) if precision.startswith("bf16") else contextlib.nullcontext()
    )


@dataclass
class Row:
    label: str
    precision: str
    train: Callable[[], None]
    eval: Callable[[], None] | None
    train_flops: float  # per token
    eval_flops: float | None  # per token at the eval length


def model_config(name: str, config: str) -> dict:
    return dict(CONFIGS[config], **EXTRA.get(name, {}))


def ours(name: str, precision: str, args: argparse.Namespace, device: torch.device) -> Row:
    torch.manual_seed(0)
    model = build_model(name, model_config(name, args.config)).to(device)
    flops = train_flops_per_token(model, args.seq, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the trainer (optim.make_optimizer)
    if precision.endswith("+compile"):
        model.compile_layers()
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    state = None

    def step() -> None:
        nonlocal state
        with autocast(precision, device):
            out = model(x, state=state, targets=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = out.state.detach() if model.bounded_state else None  # a full KV cache would grow

    if precision.endswith("+compile"):  # a compiled layer unrolls its chunk loop: T/C steps to compile
        return Row(name, precision, step, None, flops, None)
    emodel = build_model(name, model_config(name, args.config)).to(device).eval()
    xe = torch.randint(0, emodel.config.vocab_size, (1, args.eval_len), device=device)
    key = (name, args.config, args.eval_len)
    if key not in EVAL_FLOPS:  # counted once per model, whatever the precision
        EVAL_FLOPS[key] = forward_flops_per_token(emodel, args.eval_len, device)

    def run_eval() -> None:
        with torch.no_grad(), autocast(precision, device):
            emodel(xe)

    return Row(name, precision, step, run_eval, flops, EVAL_FLOPS[key])


EVAL_FLOPS: dict[tuple[str, str, int], float] = {}


def algorithm_1_row(precision: str, args: argparse.Namespace, device: torch.device, flops: float) -> Row:
    """The literal reference: whole chunks, memory queries computed and discarded, square causal
    mask; a fresh state each step (it keeps none)."""
    torch.manual_seed(0)
    model = build_model("memory_attention", model_config("memory_attention", args.config)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the trainer (optim.make_optimizer)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)

    def step() -> None:
        with autocast(precision, device):
            logits = algorithm_1(model, x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Row("algorithm-1", precision, step, None, flops, None)


def peer_row(path: str, precision: str, args: argparse.Namespace, device: torch.device, flops: float) -> Row:
    """The authors' Memory Attention (llama2Rnn's ``Transformer``) in the paper's configuration:
    memseqlen 32, projection FFN + norm, reused Q/K/V, learned initial memory; plain RoPE
    ("extrapolation"); their forward computes the loss itself."""
    if not (Path(path) / "model.py").is_file():
        sys.exit(f"throughput.py: error: --peer {path} has no model.py (a checkout of siyuanseever/llama2Rnn)")
    sys.path.insert(0, str(Path(path).resolve()))
    from model import Transformer  # type: ignore[import-not-found]
    from modelargs import ModelArgs  # type: ignore[import-not-found]

    c = CONFIGS[args.config]
    margs = ModelArgs(
        dim=c["dim"],
        n_layers=c["n_layers"],
        n_heads=c["n_heads"],
        vocab_size=c["vocab_size"],
        multiple_of=32,
        max_seq_len=args.seq,
        extend_seq_len=args.seq,
        extend_method="extrapolation",
        dropout=0.0,
        attention_type="memory_attention",
        memseqlen=32,
        do_memory_ffn=True,
        memory_norm=True,
        reuse_kv=True,
        train_orimem=True,
    )
    torch.manual_seed(0)
    with contextlib.redirect_stdout(sys.stderr):
        model = Transformer(margs).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the trainer (optim.make_optimizer)
    x = torch.randint(0, c["vocab_size"], (args.batch, args.seq), device=device)

    def step() -> None:
        with autocast(precision, device):
            model(x, x)
        model.last_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Row("llama2Rnn (authors)", precision, step, None, flops, None)


def timed(fn: Callable[[], None] | None, device: torch.device) -> float:
    if fn is None:
        return float("nan")
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def trainer_tokens_per_s(
    nproc: int, threads: int, batch: int, seq: int, steps: int, precision: str, out: Path
) -> float:
    """Median tokens/s of ``recurformer train`` on ``nproc`` processes (torchrun when > 1)."""
    sets = [
        "model.name=memory_attention",
        "model.dim=288",
        "model.n_layers=6",
        "model.n_heads=6",
        "model.chunk_size=32",
        f"train.out_dir={out}",
        f"train.batch_size={batch}",
        f"train.seq_len={seq}",
        f"train.steps={steps}",
        f"train.precision={precision}",
        "train.log_every=5",
        f"train.eval_every={steps}",
        "train.eval_batches=1",
        f"train.save_every={steps}",
        "data.dataset=tinystories-sample",
    ]
    launcher = [sys.executable, "-m", "recurformer.cli"]
    if nproc > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            "--master_port=29517",
            "-m",
            "recurformer.cli",
        ]
    cmd = (
        launcher
        + ["train", "--config", str(ROOT / "configs" / "repro" / "base.yaml")]
        + [a for x in sets for a in ("--set", x)]
    )
    done = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"throughput.py: error: the {nproc}-process training run failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["tok_per_s"] for r in rows if "tok_per_s" in r][1:])


def compare_processes(args: argparse.Namespace) -> None:
    cores, precision = os.cpu_count() or 1, args.precisions.split(",")[0]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.processes.split(",")):
            if args.batch % n or cores % n:
                sys.exit(
                    f"throughput.py: error: {n} processes must divide the batch ({args.batch}) and the cores ({cores})"
                )
            label = f"{n} process{'es' if n > 1 else ''} x {cores // n} thread{'s' if cores // n > 1 else ''}"
            tps = trainer_tokens_per_s(
                n, cores // n, args.batch // n, args.seq, args.steps, precision, Path(tmp) / str(n)
            )
            results.append(dict(processes=n, threads_per_process=cores // n, train_tokens_per_s=round(tps)))
            print(f"{label:<32}{tps:>10,.0f} tok/s", flush=True)
    meta = dict(torch=torch.__version__, precision=precision, global_batch=args.batch, seq=args.seq, steps=args.steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(f"wrote {args.out}")


def peaks(device: torch.device) -> dict[str, float]:
    return {
        "fp32": matmul_peak.__wrapped__(torch.float32, str(device)),
        "bf16": matmul_peak.__wrapped__(torch.bfloat16, str(device)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", default=",".join(model_names() + list(BASELINES)), help="models and baseline rows (algorithm-1)"
    )
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="paper")
    ap.add_argument(
        "--peer", metavar="PATH", help="a checkout of siyuanseever/llama2Rnn: adds the authors' code as a row"
    )
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--eval-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--processes", help="compare the trainer on these process counts (e.g. 1,2), in the first of --precisions"
    )
    ap.add_argument("--steps", type=int, default=30, help="training steps per run of --processes")
    ap.add_argument("--out", default="out/throughput.json")
    args = ap.parse_args()
    if args.processes:
        return compare_processes(args)
    device = pick_device(args.device)
    names = args.models.split(",")
    unknown = [n for n in names if n not in model_names() and n not in BASELINES]
    if unknown:
        sys.exit(
            f"throughput.py: error: unknown model {unknown[0]}; choose from {', '.join(model_names() + list(BASELINES))}"
        )
    for p in {p.split("+")[0] for p in args.precisions.split(",")}:
        if warning := slow_bf16_warning(p, device):
            print(f"throughput.py: {warning}", file=sys.stderr)
    peak0 = peaks(device)
    ma_flops = train_flops_per_token(
        build_model("memory_attention", model_config("memory_attention", args.config)), args.seq
    )
    rows: list[Row] = []
    for p in args.precisions.split(","):
        for n in names:
            if n == "algorithm-1":
                if not p.endswith("+compile"):
                    rows.append(algorithm_1_row(p, args, device, ma_flops))
            else:
                rows.append(ours(n, p, args, device))
        if args.peer and not p.endswith("+compile"):
            rows.append(peer_row(args.peer, p, args, device, ma_flops))
    peak_mem: list[float | None] = []
    for r in rows:  # warm-up: two training steps, the first without a state and the second with one
        base = 0
        if device.type == "cuda":  # (a compiled layer compiles once for each), so no timed step compiles
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        timed(r.train, device)
        timed(r.train, device)
        peak_mem.append((torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None)
        timed(r.eval, device)
    times: dict[int, dict[str, list[float]]] = {i: {"train": [], "eval": []} for i in range(len(rows))}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every row alike
        for i, r in enumerate(rows):
            times[i]["train"].append(timed(r.train, device))
            times[i]["eval"].append(timed(r.eval, device))
    peak1 = peaks(device)
    peak = {k: max(peak0[k], peak1[k]) for k in peak0}
    print(
        f"matmul peak on {device} ({torch.get_num_threads()} threads): fp32 {peak['fp32'] / 1e9:,.0f} GFLOP/s, "
        f"bf16 {peak['bf16'] / 1e9:,.0f} GFLOP/s (best of start and end: fp32 {peak0['fp32'] / 1e9:,.0f}/{peak1['fp32'] / 1e9:,.0f}, "
        f"bf16 {peak0['bf16'] / 1e9:,.0f}/{peak1['bf16'] / 1e9:,.0f})"
    )
    print(
        f"{'model':<22}{'prec':<14}{'MFLOP/tok':>10}{'train tok/s':>13}{'of peak':>9}{'eval tok/s':>12}{'of peak':>9}"
    )
    results = []
    for i, r in enumerate(rows):
        pk = peak["bf16" if r.precision.startswith("bf16") else "fp32"]
        tps = args.batch * args.seq / statistics.median(times[i]["train"])
        ev = statistics.median(times[i]["eval"])
        etps = args.eval_len / ev if ev == ev else None
        frac = tps * r.train_flops / pk
        efrac = etps * r.eval_flops / pk if etps and r.eval_flops else None
        results.append(
            dict(
                model=r.label,
                precision=r.precision,
                train_mflop_per_token=round(r.train_flops / 1e6, 2),
                train_tokens_per_s=round(tps),
                train_fraction_of_peak=round(frac, 4),
                eval_tokens_per_s=None if etps is None else round(etps),
                eval_seconds=None if ev != ev else round(ev, 3),
                eval_fraction_of_peak=None if efrac is None else round(efrac, 4),
                train_step_mem_mb=None if peak_mem[i] is None else round(peak_mem[i], 1),
            )
        )
        cells = f"{etps:>12,.0f}{efrac:>9.1%}" if efrac is not None else f"{'-':>12}{'-':>9}"
        print(f"{r.label:<22}{r.precision:<14}{r.train_flops / 1e6:>10.1f}{tps:>13,.0f}{frac:>9.1%}{cells}")
    meta = dict(
        torch=torch.__version__,
        device=str(device),
        device_name=torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        config=args.config,
        model_config=CONFIGS[args.config],
        batch=args.batch,
        seq=args.seq,
        eval_len=args.eval_len,
        repeats=args.repeats,
        peak_flops=peak,
        peer=args.peer,
        command=" ".join(sys.argv),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
