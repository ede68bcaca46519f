"""Eager against graphed training and decoding of one model (``recurformer.capture``): the GPU
suite's ``graphs`` stage runs it once per model, in its own process.

Measured, each written to ``--out`` as soon as it is done (a run cut off keeps what it measured):

* ``train``: tokens/s of a training step (forward + backward with the state carried, then AdamW)
  eager, graphed (``StepGraphs``: the model's call captured once per shape and replayed, the
  optimizer eager) and, with ``--compile``, compiled + graphed (``compile_layers`` first); each as
  a fraction of the measured matmul peak, as the trainer reports it (``train.Throughput``).
  The step is the trainer's parts: its optimizer (``optim.make_optimizer``, ``tbptt.Update``), its
  backward pass (``tbptt.backprop``) and its autocast (``device.autocast_context``).
* ``grad_check``: two calls with the carried state and gradient accumulation 2, graphed against
  eager from the same weights: the largest gradient difference over the largest gradient.
* ``profile``: one training step of each kind under ``torch.profiler``: GPU kernels and kernel
  launches per step and the fraction of the step's wall time the GPU was busy (on a CPU: the
  operators per step).
* ``generate``: greedy decoding tokens/s after a 16-token prompt at batch 1 (``tokens_per_s``)
  and 16 (``tokens_per_s_16``, every row's tokens), eager, graphed (the model's step captured,
  ``DecodeGraphs``: the host samples and reads every token) and blocks (the sampling inside the
  captured step, the host reading the tokens every ``--decode-block``: ``DecodeGraphs.sampler``;
  a model the graphs cannot hold says why and decodes eagerly).

    python benchmarks/graphs_bench.py --model memory_attention --config 125m --batch 16 --seq 1024 --out row.json
    python benchmarks/graphs_bench.py --model rmt --config toy --batch 2 --seq 64 --device cpu --backend trace --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from throughput import CONFIGS, model_config

from recurformer.capture import DecodeGraphs, StepGraphs
from recurformer.config import RecurformerError
from recurformer.device import autocast_context, synchronize
from recurformer.generate import new_session, stream
from recurformer.models import build_model
from recurformer.nn import State, StreamingLM
from recurformer.optim import make_optimizer
from recurformer.tbptt import Update, backprop
from recurformer.training.meter import Throughput

Step = Callable[[torch.Tensor, torch.Tensor, State], State]


def finite(model: StreamingLM) -> bool:
    """Whether every parameter of ``model`` is finite (a training run that went nan shows here)."""
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def write(path: Path, obj: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.dev = args, torch.device(args.device)
        self.bf16 = self.dev.type == "cuda"
        self.amp = lambda: autocast_context("bf16" if self.bf16 else "fp32", self.dev)

    def meter(self, model: StreamingLM) -> Throughput:
        """The trainer's FLOP count and matmul peak (one process)."""
        return Throughput(model, self.args.seq, self.dev, "bf16" if self.bf16 else "fp32", 1)

    def model(self) -> StreamingLM:
        torch.manual_seed(0)
        return build_model(self.args.model, model_config(self.args.model, self.args.config)).to(self.dev)

    def batch(self, model: StreamingLM, B: int, g: torch.Generator | None = None) -> list[torch.Tensor]:
        """Tokens and targets [B, --seq], from ``g`` (default: seed 1)."""
        g = g or torch.Generator().manual_seed(1)
        V, T = model.config.vocab_size, self.args.seq
        return [torch.randint(0, V, (B, T), generator=g).to(self.dev) for _ in range(2)]

    def eager(self, model: StreamingLM, grad_accum: int = 1) -> Step:
        """One call backpropagated as the trainer does (``tbptt.backprop``: loss / ``grad_accum``)."""

        def step(x: torch.Tensor, y: torch.Tensor, state: State) -> State:
            def forward(i: int, state: State | None) -> tuple[torch.Tensor, State]:
                with self.amp():
                    out = model(x, state=state, targets=y)
                assert out.loss is not None
                return out.loss, out.state

            return backprop(forward, [1], state, grad_accum)[1]

        return step

    def graphed(self, model: StreamingLM, grad_accum: int = 1) -> Step:
        graphs = StepGraphs(model, grad_accum, self.args.backend)

        def step(x: torch.Tensor, y: torch.Tensor, state: State) -> State:
            with self.amp():
                return graphs(x, y, state)[1]

        return step

    def carry(self, model: StreamingLM, state: State) -> State:
        """The state the next step reads: carried where the model trains so (a bounded state and
        layers that do not read absolute positions, one graph for every step), else a fresh one
        (``train.state=reset``)."""
        if model.bounded_state and all(layer.shift_invariant for layer in model.layers):
            return state
        return model.init_state(self.args.batch, self.dev)

    def train_rate(self, model: StreamingLM, step: Step, meter: Throughput) -> dict[str, float]:
        """Training tokens/s over ``--steps`` steps, after two (the graphs' capture among them), and
        its fraction of the matmul peak (``Throughput.fraction``); the trainer's AdamW, unclipped."""
        update = Update(model, make_optimizer(model, 1e-4, 0.01, (0.9, 0.999)), 1e-4, 1e-4, 0, 1, 0.0)
        x, y = self.batch(model, self.args.batch)
        state = model.init_state(self.args.batch, self.dev)
        model.check_tokens = False
        for i in range(2 + self.args.steps):
            if i == 2:
                synchronize(self.dev)
                t0 = time.perf_counter()
            state = self.carry(model, step(x, y, state))
            update.finish()
        synchronize(self.dev)
        rate = self.args.batch * self.args.seq * self.args.steps / (time.perf_counter() - t0)
        return dict(tokens_per_s=rate, fraction_of_peak=meter.fraction(rate), weights_finite=finite(model))

    def grad_check(self) -> dict[str, Any]:
        """Two calls, accumulation 2, the state carried: graphed against eager from the same weights."""
        grads = []
        for graphed in (False, True):
            model = self.model()
            model.check_tokens = False
            step = self.graphed(model, 2) if graphed else self.eager(model, 2)
            state, g = model.init_state(2, self.dev), torch.Generator().manual_seed(3)
            for _ in range(2):
                x, y = self.batch(model, 2, g)
                state = step(x, y, state)
            grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]))
        diff = float((grads[0] - grads[1]).abs().max() / grads[0].abs().max().clamp(min=1e-30))
        return dict(max_diff_over_max_grad=diff, ok=diff <= (1e-2 if self.bf16 else 1e-5), precision=self.precision)

    @property
    def precision(self) -> str:
        return "bf16 autocast" if self.bf16 else "fp32"

    def profile(self, model: StreamingLM, step: Step) -> dict[str, Any]:
        """One step (after two) under the profiler: kernels, launches, GPU busy fraction; operators on a CPU."""
        from torch.profiler import ProfilerActivity, profile

        x, y = self.batch(model, self.args.batch)
        state = model.init_state(self.args.batch, self.dev)
        model.check_tokens = False
        for _ in range(2):
            state = self.carry(model, step(x, y, state))
        model.zero_grad(set_to_none=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev.type == "cuda" else [])
        synchronize(self.dev)
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            step(x, y, state)
            synchronize(self.dev)
        wall = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        events = prof.key_averages()
        out: dict[str, Any] = dict(
            operators=sum(e.count for e in events if e.key.startswith("aten::")), wall_ms=1e3 * wall
        )
        if self.dev.type == "cuda":
            gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.self_device_time_total for e in gpu) / 1e6
            out.update(
                kernels=sum(e.count for e in gpu),
                launches=sum(
                    e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel")
                ),
                graph_launches=sum(e.count for e in events if e.key == "cudaGraphLaunch"),
                gpu_busy=busy / wall,
            )
        return out

    def generate_rate(self, model: StreamingLM, kind: str) -> dict[str, Any]:
        """Greedy decoding tokens/s of ``kind`` (eager, graphed, blocks) at batch 1 and 16: the
        second of two runs (graphs captured in the first)."""
        model.eval()
        notes: list[str] = []
        note = lambda s: notes.append(s) if s not in notes else None  # noqa: E731
        graphs = DecodeGraphs(model, self.args.backend) if kind != "eager" else None
        how: dict[str, Any] = dict(step=graphs.or_eager(note)) if kind == "graphed" and graphs else {}
        if kind == "blocks":
            how = dict(graphs=graphs, block=self.args.decode_block, note=note)
        n, out = self.args.gen_tokens, dict(notes=notes)
        for B in (1, 16):
            g = torch.Generator().manual_seed(2)
            prompt = torch.randint(0, model.config.vocab_size, (B, 16), generator=g)
            rate = 0.0
            try:
                for _ in range(2):
                    session = new_session(model, B)
                    synchronize(self.dev)
                    t0 = time.perf_counter()
                    with self.amp():
                        for _tok in stream(model, prompt, n, 0.0, session=session, **how):
                            pass
                    synchronize(self.dev)
                    rate = B * n / (time.perf_counter() - t0)
            except RecurformerError as e:  # non-finite logits: say whether the weights themselves are
                note(f"{e} (weights finite: {finite(model)})")
                rate = float("nan")
            out["tokens_per_s" if B == 1 else f"tokens_per_s_{B}"] = rate
        model.train()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="125m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--seq", type=int, default=1024, help="tokens per call; 0: one chunk/segment/block (32 if token-wise)"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed training steps per kind")
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--decode-block", type=int, default=16, help="tokens per host read when decoding in blocks")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", choices=["cuda", "trace", "eager"], help="capture backend (default: cuda on CUDA)")
    ap.add_argument("--compile", action="store_true", help="also compiled + graphed training")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.backend = args.backend or ("cuda" if args.device.startswith("cuda") else "trace")
    b = Bench(args)
    row: dict[str, Any] = dict(
        model=args.model,
        config=args.config,
        batch=args.batch,
        seq=args.seq,
        precision=b.precision,
        backend=args.backend,
    )
    model = b.model()
    P = model.reset_boundary
    args.seq = args.seq or (P if P > 1 else 32)
    if args.seq % P:
        raise SystemExit(f"graphs_bench.py: error: --seq {args.seq} is not a multiple of {args.model}'s chunk ({P})")
    row["seq"] = args.seq
    meter = b.meter(model)

    def peak() -> dict[str, Any]:  # re-measured where a fraction came out above 1 (Throughput.fraction)
        return dict(
            train_flops_per_token=meter.flops_per_token, peak_flops=meter.peak_flops, peak_source=meter.peak_source
        )

    row.update(peak(), train={})
    write(args.out, row)
    kinds: list[tuple[str, Callable[[StreamingLM], Step]]] = [("eager", b.eager), ("graphed", b.graphed)]
    for kind, make in kinds:
        row["train"][kind] = b.train_rate(model, make(model), meter)
        row.update(peak())
        write(args.out, row)
    row["grad_check"] = b.grad_check()
    write(args.out, row)
    row["profile"] = {kind: b.profile(model, make(model)) for kind, make in kinds}
    write(args.out, row)
    row["generate"] = {}
    for kind in ("eager", "graphed", "blocks"):
        row["generate"][kind] = b.generate_rate(model, kind)
        write(args.out, row)
    write(args.out, row)
    if args.compile:
        model.compile_layers()
        row["train"]["compiled+graphed"] = b.train_rate(model, b.graphed(model), meter)
        row.update(peak())
        write(args.out, row)


if __name__ == "__main__":
    main()
